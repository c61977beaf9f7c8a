//! Block checksums of device memory, taken on the GPU (verify mode).
//!
//! A block in G1 cannot be read by the host without copying it; reading it
//! on the GPU costs a pass over HBM, a small fraction of moving the same
//! bytes over PCIe. [`DeviceChecksums`] sums blocks of a layout in this
//! device's memory with the `block_sums` kernel (`kernels/block_sums.cu`),
//! to the same values [`crate::checksum`] gives on the host.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUfunction};
use parking_lot::Mutex;

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult, check};
use super::handles::Stream;
use super::kernel::Module;
use super::memory::{CudaRegion, DeviceBuffer};
use crate::checksum;
use crate::memory::MemoryKind;
use crate::physical::PhysicalLayout;

/// The fatbin built from `kernels/block_sums.cu`.
static FATBIN: &[u8] = include_bytes!("../../kernels/block_sums.fatbin");
/// Name of the kernel entry point in the fatbin.
const ENTRY: &std::ffi::CStr = c"kvbm_block_sums";
/// Threads per CTA (eight warps; a warp sums one chunk at a time).
const THREADS: u32 = 256;
/// CTAs per SM at most.
const CTAS_PER_SM: u32 = 4;

/// One chunk to sum: the kernel's `SumChunk`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SumChunk {
    addr: u64,
    len: u64,
    block: u32,
    chunk: u32,
}

const _: () = assert!(std::mem::size_of::<SumChunk>() == 24);

/// Device scratch: the chunk table and the per-block sums.
struct Scratch {
    chunks: Option<DeviceBuffer>,
    sums: Option<DeviceBuffer>,
}

/// The chunks of some blocks of a device layout, ready to be summed: one
/// entry per chunk, in layer, K/V order within each block. It holds the
/// layout, and so its memory, alive.
#[derive(Debug, Clone)]
pub struct ChunkTable {
    chunks: Vec<SumChunk>,
    blocks: usize,
    block_bytes: u64,
    _memory: PhysicalLayout,
}

/// Sums blocks of device memory on one GPU; one call at a time.
pub struct DeviceChecksums {
    device: CudaDevice,
    func: CUfunction,
    stream: Stream,
    scratch: Mutex<Scratch>,
    _module: Module,
}

// SAFETY: the function handle stays valid while `_module` (owned here) is
// loaded; driver handles are usable from any thread with the context
// current; the scratch buffers are behind a mutex.
unsafe impl Send for DeviceChecksums {}
// SAFETY: as above.
unsafe impl Sync for DeviceChecksums {}

impl std::fmt::Debug for DeviceChecksums {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceChecksums")
            .field("device", &self.device.ordinal())
            .finish()
    }
}

impl DeviceChecksums {
    /// Loads the kernel on `device` and makes its stream.
    pub fn new(device: &CudaDevice) -> CudaResult<Self> {
        let module = Module::load(device.context(), FATBIN)?;
        let func = module.function(ENTRY)?;
        let (least, _) = Stream::priority_range(device)?;
        Ok(DeviceChecksums {
            device: device.clone(),
            func,
            stream: Stream::new(device, least)?,
            scratch: Mutex::new(Scratch {
                chunks: None,
                sums: None,
            }),
            _module: module,
        })
    }

    /// The checksums of `blocks` of `layout` (memory of this device), in
    /// order, as [`crate::checksum::BlockChecksum`] defines them. Waits for
    /// the GPU. The blocks must not be written while this runs.
    pub fn block_sums(&self, layout: &PhysicalLayout, blocks: &[usize]) -> CudaResult<Vec<u64>> {
        self.sums(&self.table(layout, blocks)?)
    }

    /// What [`DeviceChecksums::sums`] needs to sum `blocks` of `layout`,
    /// worked out on the host (ahead of time: before a copy into the
    /// blocks has ended, say).
    pub fn table(&self, layout: &PhysicalLayout, blocks: &[usize]) -> CudaResult<ChunkTable> {
        let mine = MemoryKind::Device(self.device.ordinal() as u32);
        if layout.kind() != mine {
            return Err(CudaError::InvalidCopy(format!(
                "{:?} memory cannot be summed on device {}",
                layout.kind(),
                self.device.ordinal()
            )));
        }
        let c = *layout.layout().config();
        let mut chunks = Vec::with_capacity(blocks.len() * c.chunks_per_block());
        for (i, &block) in blocks.iter().enumerate() {
            let mut index = 0u32;
            for layer in 0..c.num_layers() {
                for outer in 0..c.outer_dim() {
                    let chunk = layout
                        .layout()
                        .chunk(block, layer, outer)
                        .map_err(|e| CudaError::InvalidCopy(e.to_string()))?;
                    let base = layout
                        .regions()
                        .get(chunk.region)
                        .and_then(|r| r.addr())
                        .ok_or_else(|| {
                            CudaError::InvalidCopy(format!(
                                "no region {} in the layout",
                                chunk.region
                            ))
                        })?;
                    chunks.push(SumChunk {
                        addr: base + chunk.offset,
                        len: chunk.len,
                        block: i as u32,
                        chunk: index,
                    });
                    index += 1;
                }
            }
        }
        Ok(ChunkTable {
            chunks,
            blocks: blocks.len(),
            block_bytes: c.block_bytes(),
            _memory: layout.clone(),
        })
    }

    /// The checksums of the blocks of `table`, in order. Waits for the GPU.
    /// The blocks must not be written while this runs.
    pub fn sums(&self, table: &ChunkTable) -> CudaResult<Vec<u64>> {
        let ChunkTable {
            chunks: table,
            blocks,
            block_bytes,
            ..
        } = table;
        if *blocks == 0 {
            return Ok(Vec::new());
        }
        let n = u32::try_from(table.len())
            .map_err(|_| CudaError::InvalidCopy(format!("{} chunks in one call", table.len())))?;
        let mut terms = vec![0u64; *blocks];
        let mut guard = self.scratch.lock();
        let scratch = &mut *guard;
        let chunks = grown(
            &mut scratch.chunks,
            &self.device,
            std::mem::size_of_val(table.as_slice()),
        )?;
        let sums = grown(
            &mut scratch.sums,
            &self.device,
            std::mem::size_of_val(&*terms),
        )?;
        self.device.bind()?;
        let stream = self.stream.raw();
        // SAFETY: `chunks` and `sums` hold at least the bytes copied (grown
        // above) and stay alive (the scratch lock is held) until the
        // stream synchronizes below; `table` and `terms` live as long.
        unsafe {
            check(
                "cuMemcpyHtoDAsync",
                sys::cuMemcpyHtoDAsync_v2(
                    chunks.ptr(),
                    table.as_ptr().cast::<c_void>(),
                    std::mem::size_of_val(table.as_slice()),
                    stream,
                ),
            )?;
            check(
                "cuMemsetD8Async",
                sys::cuMemsetD8Async(sums.ptr(), 0, std::mem::size_of_val(&*terms), stream),
            )?;
        }
        // SAFETY: `stream` is this device's, its context bound above;
        // `chunks` holds the `n` chunks of `table`, whose addresses
        // lie in this device's memory of the table's layout (checked when
        // the table was made), which the table keeps allocated; `sums`
        // holds one term per block; all stay alive (the scratch lock is
        // held) until the synchronize below.
        unsafe { self.launch(stream, chunks.ptr(), n, sums.ptr()) }?;
        // SAFETY: `terms` is valid for writes of the bytes copied; the
        // stream is synchronized before it is read.
        unsafe {
            check(
                "cuMemcpyDtoHAsync",
                sys::cuMemcpyDtoHAsync_v2(
                    terms.as_mut_ptr().cast::<c_void>(),
                    sums.ptr(),
                    std::mem::size_of_val(&*terms),
                    stream,
                ),
            )?;
            check("cuStreamSynchronize", sys::cuStreamSynchronize(stream))?;
        }
        Ok(terms
            .into_iter()
            .map(|t| checksum::finish(t, *block_bytes))
            .collect())
    }

    /// Enqueues the `block_sums` kernel on `stream`: it reads the `n`
    /// chunks of the device table at `chunks` and adds each block's term
    /// into the zeroed per-block sums at `sums`, with as many CTAs as keep
    /// this device's SMs busy.
    ///
    /// # Safety
    /// `stream` must belong to this device, with its context bound;
    /// `chunks` must hold `n` [`SumChunk`]s whose addresses lie in memory of
    /// this device, and `sums` one `u64` per block they name; all must stay
    /// allocated, and the chunks unwritten, until the stream synchronizes.
    unsafe fn launch(
        &self,
        stream: sys::CUstream,
        chunks: u64,
        n: u32,
        sums: u64,
    ) -> CudaResult<()> {
        let mut chunks_ptr = chunks;
        let mut n_chunks = n;
        let mut sums_ptr = sums;
        let mut params: [*mut c_void; 3] = [
            (&mut chunks_ptr as *mut u64).cast(),
            (&mut n_chunks as *mut u32).cast(),
            (&mut sums_ptr as *mut u64).cast(),
        ];
        let ctas = n
            .div_ceil(THREADS / 32)
            .clamp(1, self.device.sm_count().max(1) * CTAS_PER_SM);
        // SAFETY: `params` matches the kernel's signature (pointer, u32,
        // pointer) and lives across the call; the caller keeps the chunk
        // table, the memory its addresses name and the sums alive until the
        // stream synchronizes; the kernel only reads the chunks.
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.func,
                ctas,
                1,
                1,
                THREADS,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })?;
        Ok(())
    }
}

/// `buf`, reallocated when it holds fewer than `len` bytes.
fn grown<'a>(
    buf: &'a mut Option<DeviceBuffer>,
    device: &CudaDevice,
    len: usize,
) -> CudaResult<&'a DeviceBuffer> {
    if buf.as_ref().is_none_or(|b| b.len() < len) {
        *buf = None;
        *buf = Some(DeviceBuffer::new(device, len.next_power_of_two())?);
    }
    buf.as_ref()
        .ok_or_else(|| CudaError::InvalidCopy("no scratch buffer".into()))
}

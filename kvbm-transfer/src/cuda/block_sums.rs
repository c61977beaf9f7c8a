//! Block checksums of device memory, taken on the GPU (verify mode).
//!
//! A block in G1 cannot be read by the host without copying it; reading it
//! on the GPU costs a pass over HBM, a small fraction of moving the same
//! bytes over PCIe. [`DeviceChecksums`] sums blocks of a layout in this
//! device's memory with the `block_sums` kernel (`kernels/block_sums.cu`),
//! to the same values [`crate::checksum`] gives on the host.
//!
//! A call waits for the GPU, so its latency is what a caller pays: the
//! chunk table goes up and the sums come back through pinned memory (a
//! copy from or into pageable memory is staged by the driver and waited
//! for in its own, sleeping way), and the caller polls an event after the
//! download rather than sleeping until the driver wakes it, which on a
//! virtual machine costs more than the whole pass over a lone block.

use std::ffi::c_void;
use std::time::{Duration, Instant};

use cudarc::driver::sys::{self, CUfunction};
use parking_lot::Mutex;

use super::device::CudaDevice;
use super::error::{CudaError, CudaResult, check};
use super::handles::{Event, EventKind, HostAlloc, Stream};
use super::kernel::Module;
use super::memory::{CudaRegion, DeviceBuffer};
use crate::checksum;
use crate::memory::MemoryKind;
use crate::physical::PhysicalLayout;

/// The fatbin built from `kernels/block_sums.cu`.
static FATBIN: &[u8] = include_bytes!("../../kernels/block_sums.fatbin");
/// Name of the kernel entry point in the fatbin.
const ENTRY: &std::ffi::CStr = c"kvbm_block_sums";
/// Threads per CTA (eight warps; a warp sums one piece at a time).
const THREADS: u32 = 256;
/// CTAs per SM at most.
const CTAS_PER_SM: u32 = 4;
/// The smallest piece a chunk is cut into (a warp's one pass of loads).
const MIN_PIECE: u64 = 4 << 10;
/// The largest piece: a chunk of any size fits the kernel's 32-bit
/// lengths once cut.
const MAX_PIECE: u64 = 1 << 20;
/// How long a call polls its event busily before it naps between polls.
const SPIN: Duration = Duration::from_millis(1);
/// The nap between polls after that.
const NAP: Duration = Duration::from_micros(20);

/// One piece of a chunk to sum: the kernel's `SumChunk`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
struct SumChunk {
    /// The piece's first byte.
    addr: u64,
    /// Bytes in the piece.
    len: u32,
    /// Words of the chunk before the piece.
    first: u32,
    block: u32,
    chunk: u32,
}

const _: () = assert!(std::mem::size_of::<SumChunk>() == 24);

/// Scratch: the chunk table and the per-block sums on the device, and the
/// pinned host memory both pass through (the table on its way up, then
/// the sums on their way back: the stream orders the two).
struct Scratch {
    chunks: Option<DeviceBuffer>,
    sums: Option<DeviceBuffer>,
    host: Option<HostAlloc>,
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
    /// Recorded after a call's download; polled.
    done: Event,
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
            done: Event::new(device, EventKind::Order)?,
            scratch: Mutex::new(Scratch {
                chunks: None,
                sums: None,
                host: None,
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
        let piece = piece_bytes(
            blocks.len() as u64 * c.block_bytes(),
            u64::from(self.device.sm_count().max(1) * CTAS_PER_SM * (THREADS / 32)),
        );
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
                    cut(
                        &mut chunks,
                        base + chunk.offset,
                        chunk.len,
                        piece,
                        (i as u32, index),
                    )?;
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
        let table_bytes = std::mem::size_of_val(table.as_slice());
        let sums_bytes = *blocks * std::mem::size_of::<u64>();
        let mut guard = self.scratch.lock();
        let scratch = &mut *guard;
        let device = &self.device;
        let on_device = |n| DeviceBuffer::new(device, n);
        let chunks = grown(
            &mut scratch.chunks,
            table_bytes,
            DeviceBuffer::len,
            on_device,
        )?;
        let sums = grown(&mut scratch.sums, sums_bytes, DeviceBuffer::len, on_device)?;
        let host = grown(
            &mut scratch.host,
            table_bytes.max(sums_bytes),
            HostAlloc::len,
            |n| HostAlloc::new(device, n),
        )?;
        // SAFETY: `host` holds at least `table_bytes` bytes (grown above)
        // and no copy uses it now (the last call waited for its own).
        unsafe {
            std::ptr::copy_nonoverlapping(table.as_ptr().cast::<u8>(), host.host_ptr(), table_bytes)
        };
        // An error after the first copy was queued drains the stream
        // before the scratch is let go: nothing queued still reads or
        // writes it when the next call fills it.
        let queued = self.queue(chunks, sums, host, n, table_bytes, sums_bytes);
        if queued.is_err() {
            self.stream.drain();
        }
        queued?;
        let mut terms = vec![0u64; *blocks];
        // SAFETY: the download of `sums_bytes` into `host` ended (the
        // event fired without error); `terms` holds as many bytes.
        unsafe {
            std::ptr::copy_nonoverlapping(
                host.host_ptr(),
                terms.as_mut_ptr().cast::<u8>(),
                sums_bytes,
            )
        };
        Ok(terms
            .into_iter()
            .map(|t| checksum::finish(t, *block_bytes))
            .collect())
    }

    /// Queues one call's upload of the table from `host`, the zeroing of
    /// `sums`, the kernel and the download of the sums into `host`, and
    /// waits for them (see [`DeviceChecksums::sums`]).
    fn queue(
        &self,
        chunks: &DeviceBuffer,
        sums: &DeviceBuffer,
        host: &HostAlloc,
        n: u32,
        table_bytes: usize,
        sums_bytes: usize,
    ) -> CudaResult<()> {
        self.device.bind()?;
        let stream = self.stream.raw();
        // SAFETY: `chunks`, `sums` and `host` hold at least the bytes
        // copied (the caller grew them) and stay alive (the caller holds
        // the scratch lock) until the event below fired, or the caller
        // drained the stream; the download into `host` is queued behind
        // the upload from it.
        unsafe {
            check(
                "cuMemcpyHtoDAsync",
                sys::cuMemcpyHtoDAsync_v2(
                    chunks.ptr(),
                    host.host_ptr().cast::<c_void>(),
                    table_bytes,
                    stream,
                ),
            )?;
            check(
                "cuMemsetD8Async",
                sys::cuMemsetD8Async(sums.ptr(), 0, sums_bytes, stream),
            )?;
        }
        // SAFETY: `stream` is this device's, its context bound above;
        // `chunks` receives the `n` chunks of the caller's table (uploaded
        // above), whose addresses lie in this device's memory of the
        // table's layout (checked when the table was made), which the
        // table keeps allocated; `sums` holds one term per block; all stay
        // alive (the caller holds the scratch lock) until the event below
        // fired.
        unsafe { self.launch(stream, chunks.ptr(), n, sums.ptr()) }?;
        // SAFETY: as above.
        unsafe {
            check(
                "cuMemcpyDtoHAsync",
                sys::cuMemcpyDtoHAsync_v2(
                    host.host_ptr().cast::<c_void>(),
                    sums.ptr(),
                    sums_bytes,
                    stream,
                ),
            )?;
        }
        self.done.record(&self.stream)?;
        wait_for(&self.done)
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

/// Bytes per piece when `total` bytes are summed by at most `warps` warps
/// at once: enough pieces to give every warp one, none below
/// [`MIN_PIECE`] or above [`MAX_PIECE`], a multiple of 16 so every piece
/// keeps its chunk's alignment.
fn piece_bytes(total: u64, warps: u64) -> u64 {
    total
        .div_ceil(warps.max(1))
        .clamp(MIN_PIECE, MAX_PIECE)
        .next_multiple_of(16)
}

/// Appends the pieces of the chunk of `len` bytes at `addr`, `(block,
/// chunk)` of the table, each of at most `piece` bytes (a multiple of 16,
/// so every piece but the last holds whole words).
fn cut(
    out: &mut Vec<SumChunk>,
    addr: u64,
    len: u64,
    piece: u64,
    (block, chunk): (u32, u32),
) -> CudaResult<()> {
    let too_long = || CudaError::InvalidCopy(format!("a chunk of {len} bytes"));
    // An empty chunk adds no term: it needs no piece.
    let mut at = 0;
    while at < len {
        let n = piece.min(len - at);
        out.push(SumChunk {
            addr: addr + at,
            len: u32::try_from(n).map_err(|_| too_long())?,
            first: u32::try_from(at / 8).map_err(|_| too_long())?,
            block,
            chunk,
        });
        at += n;
    }
    Ok(())
}

/// Waits until the work before `event`'s last recording ended: polls it,
/// busily for [`SPIN`], then with [`NAP`]s between polls; its error if the
/// work failed.
fn wait_for(event: &Event) -> CudaResult<()> {
    let start = Instant::now();
    while event.is_pending() {
        if start.elapsed() < SPIN {
            std::hint::spin_loop();
        } else {
            std::thread::sleep(NAP);
        }
    }
    // Returns at once now, with the stream's error if it failed.
    event.synchronize()
}

/// `buf`, replaced by `make(len)` (`len` rounded up to a power of two)
/// when it holds fewer than `len` bytes (`held` says how many it holds).
fn grown<B>(
    buf: &mut Option<B>,
    len: usize,
    held: fn(&B) -> usize,
    make: impl FnOnce(usize) -> CudaResult<B>,
) -> CudaResult<&B> {
    if buf.as_ref().is_none_or(|b| held(b) < len) {
        *buf = None;
        *buf = Some(make(len.next_power_of_two())?);
    }
    buf.as_ref()
        .ok_or_else(|| CudaError::InvalidCopy("no scratch buffer".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_give_every_warp_work_within_their_bounds() {
        // A lone 2 MiB block on 132 SMs: pieces of the smallest size.
        assert_eq!(piece_bytes(2 << 20, 132 * 32), MIN_PIECE);
        // A large batch: about one piece per warp, a multiple of 16.
        let p = piece_bytes(512 << 20, 4224);
        assert!(
            p.is_multiple_of(16) && (512u64 << 20).div_ceil(p) <= 4224,
            "{p}"
        );
        assert_eq!(piece_bytes(1 << 40, 1), MAX_PIECE);
        assert_eq!(piece_bytes(0, 0), MIN_PIECE);
    }

    #[test]
    fn a_chunk_is_cut_into_pieces_that_cover_it_in_order() {
        for len in [0u64, 7, 16, 4096, 4100, 10_000, 65_536] {
            let mut out = Vec::new();
            cut(&mut out, 0x1000, len, 4096, (3, 5)).unwrap();
            assert_eq!(out.iter().map(|p| u64::from(p.len)).sum::<u64>(), len);
            let mut at = 0;
            for p in &out {
                assert_eq!((p.addr, p.block, p.chunk), (0x1000 + at, 3, 5));
                assert_eq!(u64::from(p.first) * 8, at, "a piece starts on a word");
                at += u64::from(p.len);
            }
            // Every piece but the last is whole words and keeps alignment.
            let whole = out.len().saturating_sub(1);
            assert!(out[..whole].iter().all(|p| p.len.is_multiple_of(16)));
        }
    }
}

//! Enqueuing DMA on the copy engines: flat spans and strided families.
//!
//! Each copy-engine descriptor costs the driver and the engine about the
//! same whatever its size, so the copy-engine path hands over as few as it
//! can: affine families of runs (see [`super::strided`]) as pitched copies,
//! all of them in one `cuMemcpy3DBatchAsync_v2` per batch where the driver
//! has it, a `cuMemcpy2DAsync` each otherwise; lone spans in one
//! `cuMemcpyBatchAsync_v2` per batch, or a `cuMemcpyAsync` each.

use std::ffi::c_void;

use cudarc::driver::sys::{self, CUdeviceptr};

use super::device::CudaDevice;
use super::error::{CudaResult, check};
use super::handles::Stream;
use super::memory::Location;
use super::pinned::registration_bounds;
use super::plan::{Span, split_at_bounds};
use super::strided::Strided;

/// Copies per batch call. Several calls per copy let the engines start on
/// the first batch while the later ones are being built.
const MAX_BATCH: usize = 1024;

/// Pitched families per 3D batch call; small, so the first bytes move soon.
const MAX_BATCH_3D: usize = 64;

fn mem_location(device: &CudaDevice, l: Location) -> sys::CUmemLocation {
    match l {
        Location::Device => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE,
            id: device.ordinal() as i32,
        },
        Location::PinnedHost => sys::CUmemLocation {
            type_: sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_HOST,
            id: 0,
        },
    }
}

/// Enqueues DMA copies of `spans` on `stream`: one batch call per
/// `MAX_BATCH` where the driver has it. Spans are split at host
/// registration boundaries first.
///
/// # Safety
/// Every span must lie inside memory of `src_loc` / `dst_loc` (device
/// memory of the stream's context, or registered host memory) that stays
/// allocated, and is not otherwise written, until the copy completed.
pub(crate) unsafe fn enqueue_spans(
    device: &CudaDevice,
    batch: bool,
    stream: &Stream,
    spans: &[Span],
    src_loc: Location,
    dst_loc: Location,
) -> CudaResult<()> {
    let split;
    let spans = if src_loc == Location::PinnedHost || dst_loc == Location::PinnedHost {
        split = split_at_bounds(spans, &registration_bounds());
        &split[..]
    } else {
        spans
    };
    if spans.len() > 1 && batch {
        let mut attrs = [sys::CUmemcpyAttributes {
            srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
            srcLocHint: mem_location(device, src_loc),
            dstLocHint: mem_location(device, dst_loc),
            flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
        }];
        let mut attr_idx = [0usize];
        for batch in spans.chunks(MAX_BATCH) {
            let mut dsts: Vec<CUdeviceptr> = batch.iter().map(|s| s.dst).collect();
            let mut srcs: Vec<CUdeviceptr> = batch.iter().map(|s| s.src).collect();
            let mut sizes: Vec<usize> = batch.iter().map(|s| s.len as usize).collect();
            // SAFETY: the three arrays hold `batch.len()` entries; the
            // attribute array holds one entry applying from index 0; the
            // driver reads them during the call. Addresses were
            // bounds-checked by the caller and stay alive until completion.
            check("cuMemcpyBatchAsync_v2", unsafe {
                sys::cuMemcpyBatchAsync_v2(
                    dsts.as_mut_ptr(),
                    srcs.as_mut_ptr(),
                    sizes.as_mut_ptr(),
                    batch.len(),
                    attrs.as_mut_ptr(),
                    attr_idx.as_mut_ptr(),
                    1,
                    stream.raw(),
                )
            })?;
        }
        return Ok(());
    }
    for s in spans {
        // SAFETY: unified addressing makes both addresses valid for
        // cuMemcpyAsync; ranges were bounds-checked and stay alive.
        check("cuMemcpyAsync", unsafe {
            sys::cuMemcpyAsync(s.dst, s.src, s.len as usize, stream.raw())
        })?;
    }
    Ok(())
}

/// Enqueues strided families on `stream`: pitched ones as pitched copies,
/// single lines through [`enqueue_spans`]. The families must already
/// respect registration and allocation boundaries (as
/// [`super::strided::strided_copies`] makes them).
///
/// # Safety
/// As [`enqueue_spans`], for every line of every family.
pub(crate) unsafe fn enqueue_strided(
    device: &CudaDevice,
    batch: bool,
    stream: &Stream,
    copies: &[Strided],
    src_loc: Location,
    dst_loc: Location,
) -> CudaResult<()> {
    let (pitched, singles): (Vec<&Strided>, Vec<&Strided>) =
        copies.iter().partition(|c| c.height > 1);
    if batch && device.has_batch_copy_3d() && pitched.len() > 1 {
        // SAFETY: the pitched families are the caller's, under its contract.
        unsafe { enqueue_pitched_batched(device, stream, &pitched, src_loc, dst_loc) }?;
    } else {
        // SAFETY: the pitched families are the caller's, under its contract.
        unsafe { enqueue_pitched_each(stream, &pitched) }?;
    }
    let singles: Vec<Span> = singles
        .iter()
        .map(|c| Span {
            src: c.src,
            dst: c.dst,
            len: c.width,
        })
        .collect();
    // SAFETY: the single lines are lines of the caller's families.
    unsafe { enqueue_spans(device, batch, stream, &singles, src_loc, dst_loc) }
}

/// Enqueues pitched families (more than one line each) on `stream` through
/// `cuMemcpy3DBatchAsync_v2`, [`MAX_BATCH_3D`] families per call.
///
/// # Safety
/// As [`enqueue_spans`], for every line of every family.
unsafe fn enqueue_pitched_batched(
    device: &CudaDevice,
    stream: &Stream,
    pitched: &[&Strided],
    src_loc: Location,
    dst_loc: Location,
) -> CudaResult<()> {
    let operand = |ptr: u64, pitch: u64, height: u64, loc: Location| sys::CUmemcpy3DOperand {
        type_: sys::CUmemcpy3DOperandType::CU_MEMCPY_OPERAND_TYPE_POINTER,
        op: sys::CUmemcpy3DOperand_st__bindgen_ty_1 {
            ptr: sys::CUmemcpy3DOperand_st__bindgen_ty_1__bindgen_ty_1 {
                ptr,
                rowLength: pitch as usize,
                layerHeight: height as usize,
                locHint: mem_location(device, loc),
            },
        },
    };
    for part in pitched.chunks(MAX_BATCH_3D) {
        let mut ops: Vec<sys::CUDA_MEMCPY3D_BATCH_OP> = part
            .iter()
            .map(|c| sys::CUDA_MEMCPY3D_BATCH_OP {
                src: operand(c.src, c.src_pitch, c.height, src_loc),
                dst: operand(c.dst, c.dst_pitch, c.height, dst_loc),
                extent: sys::CUextent3D {
                    width: c.width as usize,
                    height: c.height as usize,
                    depth: 1,
                },
                srcAccessOrder: sys::CUmemcpySrcAccessOrder::CU_MEMCPY_SRC_ACCESS_ORDER_STREAM,
                flags: sys::CUmemcpyFlags::CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE as u32,
            })
            .collect();
        // SAFETY: `ops` holds `part.len()` fully initialised pointer
        // operations the driver reads during the call; every line of
        // every family lies inside a bounds-checked run whose memory
        // stays alive until completion.
        check("cuMemcpy3DBatchAsync_v2", unsafe {
            sys::cuMemcpy3DBatchAsync_v2(ops.len(), ops.as_mut_ptr(), 0, stream.raw())
        })?;
    }
    Ok(())
}

/// Enqueues pitched families on `stream` one `cuMemcpy2DAsync` each.
///
/// # Safety
/// As [`enqueue_spans`], for every line of every family.
unsafe fn enqueue_pitched_each(stream: &Stream, pitched: &[&Strided]) -> CudaResult<()> {
    for c in pitched {
        let p = sys::CUDA_MEMCPY2D {
            srcXInBytes: 0,
            srcY: 0,
            srcMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            srcHost: std::ptr::null(),
            srcDevice: c.src,
            srcArray: std::ptr::null_mut(),
            srcPitch: c.src_pitch as usize,
            dstXInBytes: 0,
            dstY: 0,
            dstMemoryType: sys::CUmemorytype::CU_MEMORYTYPE_UNIFIED,
            dstHost: std::ptr::null_mut::<c_void>(),
            dstDevice: c.dst,
            dstArray: std::ptr::null_mut(),
            dstPitch: c.dst_pitch as usize,
            WidthInBytes: c.width as usize,
            Height: c.height as usize,
        };
        // SAFETY: `p` describes `height` lines of `width` bytes inside
        // bounds-checked runs, alive until completion; the driver reads
        // `p` during the call.
        check("cuMemcpy2DAsync", unsafe {
            sys::cuMemcpy2DAsync_v2(&p, stream.raw())
        })?;
    }
    Ok(())
}

//! The CUDA backend behind the executor: kvbm-layout plans, the strategy
//! table, `TransferBackend::submit`, every chunk checked.
//!
//! Without a GPU each test prints `skipped: no CUDA device` and passes; with
//! `KVBM_REQUIRE_GPU=1` a missing GPU fails.

mod cuda_common;

use std::sync::Arc;

use cuda_common::{device_or_skip, random_blocks, random_bytes};
use kvbm_layout::{BlockOrder, Layout, LayoutConfig, LayoutKind};
use kvbm_transfer::backend::{TransferBackend, TransferJob};
use kvbm_transfer::cuda::{
    CopierConfig, CopyPath, CudaBackend, CudaCopier, CudaDevice, DeviceBuffer, GpuLoad,
    PinnedMemory, PinnedOptions,
};
use kvbm_transfer::{
    CancelToken, Executor, MemoryKind, MemoryRegion, PhysicalLayout, TransferError,
};

/// A layout's regions as pinned or device memory, filled with random bytes.
struct Placed {
    phys: PhysicalLayout,
    pinned: Vec<Arc<PinnedMemory>>,
    device: Vec<Arc<DeviceBuffer>>,
}

impl Placed {
    fn new(dev: &CudaDevice, layout: Layout, on_device: bool, seed: u64) -> Placed {
        let mut pinned = Vec::new();
        let mut device = Vec::new();
        let mut regions: Vec<MemoryRegion> = Vec::new();
        for r in 0..layout.num_regions() {
            let size = layout.region_size(r).unwrap() as usize;
            let data = random_bytes(size, seed + r as u64);
            if on_device {
                let b = Arc::new(DeviceBuffer::new(dev, size).unwrap());
                b.write(0, &data).unwrap();
                regions.push(b.region());
                device.push(b);
            } else {
                let m = Arc::new(
                    PinnedMemory::allocate(dev, size, PinnedOptions::for_device(dev)).unwrap(),
                );
                m.write(0, &data).unwrap();
                regions.push(m.region());
                pinned.push(m);
            }
        }
        Placed {
            phys: PhysicalLayout::new(layout, regions).unwrap(),
            pinned,
            device,
        }
    }

    fn image(&self) -> Vec<Vec<u8>> {
        let layout = self.phys.layout();
        (0..layout.num_regions())
            .map(|r| {
                let mut out = vec![0u8; layout.region_size(r).unwrap() as usize];
                if let Some(b) = self.device.get(r) {
                    b.read(0, &mut out).unwrap();
                } else {
                    self.pinned[r].read(0, &mut out).unwrap();
                }
                out
            })
            .collect()
    }
}

fn chunk_bytes<'a>(layout: &Layout, img: &'a [Vec<u8>], b: usize, l: usize, o: usize) -> &'a [u8] {
    let c = layout.chunk(b, l, o).unwrap();
    &img[c.region][c.offset as usize..][..c.len as usize]
}

fn layouts(blocks: usize) -> (Layout, Layout) {
    let cfg = LayoutConfig::new(blocks, 4, 2, 16, 8 * 128, 2).unwrap();
    (
        Layout::new(cfg, LayoutKind::LayerSeparate(BlockOrder::OuterFirst)).unwrap(),
        Layout::new(cfg, LayoutKind::FullyContiguous).unwrap(),
    )
}

#[test]
fn executor_onboards_and_offloads_through_the_cuda_backend() {
    let Some(dev) = device_or_skip() else { return };
    let copier = Arc::new(CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap());
    for path in [
        None,
        Some(CopyPath::CopyEngine),
        Some(CopyPath::Kernel),
        Some(CopyPath::Staged),
    ] {
        let mut backend = CudaBackend::new(Arc::clone(&copier));
        if let Some(p) = path {
            backend = backend.with_path(p);
        }
        backend.set_gpu_load(GpuLoad::Busy);
        let exec = Executor::builder()
            .backend(Arc::new(backend))
            .build()
            .unwrap();
        let pool = 64;
        let (gpu_l, host_l) = layouts(pool);
        let host = Placed::new(&dev, host_l.clone(), false, 1);
        let gpu = Placed::new(&dev, gpu_l.clone(), true, 2);
        let back = Placed::new(&dev, host_l.clone(), false, 3);
        let a = random_blocks(24, pool, 4);
        let b = random_blocks(24, pool, 5);
        let c = random_blocks(24, pool, 6);
        let on: Vec<_> = a.iter().copied().zip(b.iter().copied()).collect();
        let off: Vec<_> = b.iter().copied().zip(c.iter().copied()).collect();
        let h_img = host.image();
        let report = exec.transfer(&host.phys, &gpu.phys, &on).wait().unwrap();
        assert_eq!(report.blocks, 24);
        exec.transfer(&gpu.phys, &back.phys, &off).wait().unwrap();
        let (g_img, b_img) = (gpu.image(), back.image());
        for i in 0..24 {
            for l in 0..4 {
                for o in 0..2 {
                    let want = chunk_bytes(&host_l, &h_img, a[i], l, o);
                    assert_eq!(
                        chunk_bytes(&gpu_l, &g_img, b[i], l, o),
                        want,
                        "{path:?} onboard"
                    );
                    assert_eq!(
                        chunk_bytes(&host_l, &b_img, c[i], l, o),
                        want,
                        "{path:?} offload"
                    );
                }
            }
        }
    }
}

#[test]
fn backend_refuses_what_it_cannot_move() {
    let Some(dev) = device_or_skip() else { return };
    let copier = Arc::new(CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap());
    let backend = CudaBackend::new(copier);
    let me = MemoryKind::Device(dev.ordinal() as u32);
    assert!(backend.supports(MemoryKind::Pinned, me));
    assert!(backend.supports(me, MemoryKind::Pinned));
    assert!(backend.supports(me, me));
    assert!(!backend.supports(MemoryKind::System, me));
    assert!(!backend.supports(MemoryKind::Pinned, MemoryKind::Pinned));
    assert!(!backend.supports(me, MemoryKind::Device(dev.ordinal() as u32 + 1)));

    let gpu = Arc::new(DeviceBuffer::new(&dev, 4096).unwrap());
    let host =
        Arc::new(PinnedMemory::allocate(&dev, 4096, PinnedOptions::for_device(&dev)).unwrap());
    let run = |len| kvbm_transfer::CopyRun {
        src_region: 0,
        src_offset: 0,
        dst_region: 0,
        dst_offset: 0,
        len,
    };
    let job = |len, cancel: CancelToken| {
        TransferJob::new(
            Arc::from(vec![host.region()]),
            Arc::from(vec![gpu.region()]),
            Arc::from(vec![run(len)]),
            cancel,
        )
    };
    // Out of bounds: a typed error, nothing moved.
    assert!(matches!(
        backend.submit(job(8192, CancelToken::new())).wait(),
        Err(TransferError::OutOfBounds { .. })
    ));
    // Cancelled before submission.
    let cancel = CancelToken::new();
    cancel.cancel();
    assert!(matches!(
        backend.submit(job(16, cancel)).wait(),
        Err(TransferError::Cancelled)
    ));
    // A good job completes.
    backend
        .submit(job(4096, CancelToken::new()))
        .wait()
        .unwrap();
}

#[test]
fn engine_tensors_wrapped_in_place_take_an_onboard() {
    // Four per-layer tensors in vLLM's flash-attention shape
    // [2, blocks, 16 tokens, 8 heads, 128], bf16, allocated as a stand-in for
    // an engine's cache and wrapped without copying.
    let Some(dev) = device_or_skip() else { return };
    let (layers, blocks) = (4usize, 32usize);
    let shape = [2, blocks, 16, 8, 128];
    let strides = [blocks * 16 * 8 * 128, 16 * 8 * 128, 8 * 128, 128, 1];
    let bytes = 2 * blocks * 16 * 8 * 128 * 2;
    let engine: Vec<Arc<DeviceBuffer>> = (0..layers)
        .map(|_| Arc::new(DeviceBuffer::new(&dev, bytes).unwrap()))
        .collect();
    let views: Vec<kvbm_layout::TensorView<'_>> = (0..layers)
        .map(|_| kvbm_layout::TensorView {
            shape: &shape,
            strides: &strides,
        })
        .collect();
    let recognised =
        kvbm_layout::recognise_kv_tensors(&kvbm_layout::KvTensorFormat::FlashAttn, &views, 2)
            .unwrap();
    let tensors: Vec<(u64, usize)> = engine.iter().map(|b| (b.ptr(), bytes)).collect();
    // SAFETY: `engine` keeps the buffers allocated for the whole test.
    let wrapped =
        unsafe { kvbm_transfer::cuda::ExternalDeviceMemory::wrap_all(&dev, &tensors) }.unwrap();
    let mut regions = vec![None; layers];
    for (t, r) in wrapped.into_iter().enumerate() {
        regions[recognised.tensor_regions[t]] = Some(r);
    }
    let gpu_l = recognised.layout.clone();
    let gpu = PhysicalLayout::new(
        gpu_l.clone(),
        regions.into_iter().map(Option::unwrap).collect(),
    )
    .unwrap();

    let copier = Arc::new(CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap());
    let exec = Executor::builder()
        .backend(Arc::new(CudaBackend::new(copier)))
        .build()
        .unwrap();
    let host_l = Layout::new(*gpu_l.config(), LayoutKind::FullyContiguous).unwrap();
    let host = Placed::new(&dev, host_l.clone(), false, 9);
    let pairs: Vec<_> = random_blocks(8, blocks, 10)
        .into_iter()
        .zip(random_blocks(8, blocks, 11))
        .collect();
    exec.transfer(&host.phys, &gpu, &pairs).wait().unwrap();
    let h_img = host.image();
    for &(h, g) in &pairs {
        for l in 0..layers {
            for o in 0..2 {
                let c = gpu_l.chunk(g, l, o).unwrap();
                let mut got = vec![0u8; c.len as usize];
                engine[c.region].read(c.offset as usize, &mut got).unwrap();
                assert_eq!(got, chunk_bytes(&host_l, &h_img, h, l, o));
            }
        }
    }
}

#[test]
fn a_layout_is_released_once_its_copies_ended_and_a_new_one_is_copied_right() {
    let Some(dev) = device_or_skip() else { return };
    let copier = Arc::new(CudaCopier::new(&dev, CopierConfig::for_device(&dev)).unwrap());
    let exec = Executor::builder()
        .backend(Arc::new(CudaBackend::new(copier)))
        .build()
        .unwrap();
    let pool = 8;
    let (gpu_l, host_l) = layouts(pool);
    let host = Placed::new(&dev, host_l.clone(), false, 11);
    // Each round a new device layout takes a lone block (the backend
    // remembers the tables it saw): its bytes are the host's, and once the
    // copy ended and the layout is dropped nothing holds its memory.
    for round in 0..3u64 {
        let gpu = Placed::new(&dev, gpu_l.clone(), true, 20 + round);
        let (s, d) = (round as usize, pool - 1 - round as usize);
        exec.transfer(&host.phys, &gpu.phys, &[(s, d)])
            .wait()
            .unwrap();
        let (h_img, g_img) = (host.image(), gpu.image());
        for l in 0..4 {
            for o in 0..2 {
                assert_eq!(
                    chunk_bytes(&gpu_l, &g_img, d, l, o),
                    chunk_bytes(&host_l, &h_img, s, l, o),
                    "round {round}"
                );
            }
        }
        let Placed { phys, device, .. } = gpu;
        drop(phys);
        // (The threads that resolved the copy let go of it just after the
        // waiter woke.)
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while device.iter().any(|b| Arc::strong_count(b) > 1) {
            assert!(
                std::time::Instant::now() < deadline,
                "round {round}: memory still held"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }
}

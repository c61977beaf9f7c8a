//! `cuda_bench lone`: one block alone, the shape vLLM hands a connector
//! (32 layers, each its own allocation, one page per layer per block; a
//! FullyContiguous pinned slot on the host), at block sizes from 256 KiB
//! to 4 MiB: the copy plus its wait through each path that can take it
//! (the kernel reading or writing pinned memory, the copy engines with a
//! descriptor per page, and the copier's own pick), against the block's
//! bytes at the large copy's rate and one DMA of its bytes, contiguous on
//! both sides, plus its wait, measured in the same run; then how long the
//! copy call itself takes on each path (the copy is waited for after).

use super::*;

/// Copies timed per row, after warm-up; the median is reported.
const REPS: usize = 101;

/// Copy calls timed per path.
const CALL_REPS: usize = 51;

pub(crate) fn run(dev: &CudaDevice) {
    let copier = CudaCopier::new(dev, CopierConfig::for_device(dev)).expect("copier");
    let refs = references(dev, &copier, 5);
    let arena = filled_arena(dev, 64 << 20);
    let idle = GpuLoad::Idle;
    let engines = opts(Some(CopyPath::CopyEngine), idle);
    let rows = [
        ("kernel", opts(Some(CopyPath::Kernel), idle)),
        ("engines", engines),
        ("auto", opts(None, idle)),
    ];
    println!(
        "page KiB | block KiB | dir | path | median µs | × its bytes at line rate | × one DMA + wait"
    );
    for page_kib in [8usize, 16, 32, 64, 128] {
        let dl = Layout {
            kind: Kind::LayerSeparate,
            blocks: 16,
            layers: 32,
            outer: 1,
            run_bytes: page_kib << 10,
        };
        let hl = Layout {
            kind: Kind::FullyContiguous,
            ..dl
        };
        let dev_regions: Vec<Arc<dyn CudaRegion>> = dl
            .region_sizes()
            .into_iter()
            .map(|s| Arc::new(DeviceBuffer::new(dev, s).expect("layer")) as Arc<dyn CudaRegion>)
            .collect();
        let host_regions = vec![window(&arena, 0, hl.region_sizes()[0])];
        let flat = Arc::new(DeviceBuffer::new(dev, dl.block_bytes()).expect("flat"));
        let flat_r: Vec<Arc<dyn CudaRegion>> = vec![flat];
        for d in [Direction::HostToDevice, Direction::DeviceToHost] {
            // Host and device sides, in the copy's order.
            let to_dev = d == Direction::HostToDevice;
            let ordered = |host: &Vec<Arc<dyn CudaRegion>>, device: &Vec<Arc<dyn CudaRegion>>| {
                if to_dev {
                    (host.clone(), device.clone())
                } else {
                    (device.clone(), host.clone())
                }
            };
            let (src, dst) = ordered(&host_regions, &dev_regions);
            let (from, to, pair) = if to_dev {
                (&hl, &dl, (3, 9))
            } else {
                (&dl, &hl, (9, 3))
            };
            let case = Case::new(plan(from, to, &[pair]), src, dst);
            let (src, dst) = ordered(&host_regions, &flat_r);
            let dma = Case::new(one_run(dl.block_bytes() as u64), src, dst);
            let line = if to_dev { refs.h2d } else { refs.d2h };
            let at_line = case.bytes as f64 / (line * 1e9) * 1e6;
            // Taking turns: each round times every row once.
            let mut times = vec![Vec::with_capacity(REPS); rows.len() + 1];
            for round in 0..REPS + 10 {
                for (i, (_, o)) in rows.iter().enumerate() {
                    let t = Instant::now();
                    case.run(&copier, *o);
                    if round >= 10 {
                        times[i].push(t.elapsed().as_secs_f64() * 1e6);
                    }
                }
                let t = Instant::now();
                dma.run(&copier, engines);
                if round >= 10 {
                    times[rows.len()].push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            let (one_dma, _, _) = median(times[rows.len()].clone());
            println!(
                "{page_kib} | {} | {d:?} | one DMA | {one_dma:.1} | {:.2} | 1.00",
                case.bytes >> 10,
                one_dma / at_line
            );
            for (i, (name, _)) in rows.iter().enumerate() {
                let (us, lo, hi) = median(times[i].clone());
                let picked = if *name == "auto" {
                    format!(" ({:?})", copier.choose(d, case.runs.len(), case.bytes))
                } else {
                    String::new()
                };
                println!(
                    "{page_kib} | {} | {d:?} | {name}{picked} | {us:.1} [{lo:.1}-{hi:.1}] | {:.2} | {:.2}",
                    case.bytes >> 10,
                    us / at_line,
                    us / one_dma
                );
            }
            for (name, o) in &rows[..2] {
                let calls: Vec<f64> = (0..CALL_REPS)
                    .map(|_| case.submit_us(&copier, *o, false))
                    .collect();
                let (us, lo, hi) = median(calls);
                println!(
                    "{page_kib} | {} | {d:?} | {name}: the copy call alone | {us:.1} [{lo:.1}-{hi:.1}] | |",
                    case.bytes >> 10
                );
            }
        }
    }
}

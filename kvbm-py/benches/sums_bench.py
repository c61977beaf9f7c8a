"""What checksums cost the spec's worker (``kvbm_py._kvbm.PageWorker``):
store jobs (pages into slots, + wait) and load jobs (slots into pages, +
wait) of ``--blocks`` blocks, plain, with ``verify``, and with the slots
kept across restarts (``cpu_cache_keep``: slots in ``/dev/shm``, every
store recorded with its sum, every load checked), the three workers
taking turns in each repetition. Pages on the host (``--device cpu``) or
on the GPU (``--device cuda``, slots pinned). Prints GB/s (medians) and
each mode's ratio to the plain worker in the same run.

    python kvbm-py/benches/sums_bench.py [--device cpu] [--blocks 96] [--page-kib 64] [--reps 9]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from kvbm_py import _kvbm

LAYERS = 8
MODES = ("plain", "verify", "kept")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--blocks", type=int, default=96)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    page = a.page_kib << 10
    n = a.blocks
    pages = [torch.randint(-128, 127, (n, page), dtype=torch.int8, device=a.device) for _ in range(LAYERS)]
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    times: dict[str, tuple[list[float], list[float]]] = {m: ([], []) for m in MODES}
    with tempfile.TemporaryDirectory(dir=shm) as d:
        workers = {
            m: _kvbm.PageWorker(
                [(pages, page)],
                n,
                n,
                page * LAYERS,
                verify=m == "verify",
                host_kept=(os.path.join(d, "g2"), "sums bench") if m == "kept" else None,
            )
            for m in MODES
        }
        copies = [(0, b, b) for b in range(n)]
        job = 0
        for _ in range(a.reps):
            for m, w in workers.items():
                for k, kind in enumerate(("store", "load")):
                    job += 1
                    t0 = time.perf_counter()
                    if kind == "store":
                        w.store(job, copies, keys=list(range(n)) if m == "kept" else None)
                    else:
                        w.load(job, copies)
                    w.wait([job])
                    times[m][k].append(time.perf_counter() - t0)
                    for r in w.finished():
                        assert r[1], f"{m}: job {r[0]} failed: {r[5]}"
    gb = n * page * LAYERS / 1e9
    plain = [statistics.median(t) for t in times["plain"]]
    print(f"{n} blocks of {LAYERS} x {a.page_kib} KiB, pages on {a.device}, median of {a.reps}")
    for m in MODES:
        store, load = (statistics.median(t) for t in times[m])
        print(
            f"{m:6}: store {gb / store:6.2f} GB/s ({plain[0] / store:.2f} of plain), "
            f"load {gb / load:6.2f} GB/s ({plain[1] / load:.2f} of plain)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

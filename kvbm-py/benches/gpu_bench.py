"""kvbm_py on a GPU: a Llama-3.1-8B-shaped KV cache (32 layers, 8 KV heads
of 128, bf16) in vLLM's layout registered through the worker API: by
default vLLM 0.32's `[blocks, heads, 16, 2 * 128]` view of its default
(NHD) KV cache layout, each block's K|V bytes of a layer one 64 KiB run;
`--layout split` the older flash-attn `[2, blocks, 16, 8, 128]`, two
32 KiB runs per block and layer. 256 random 16-token blocks offloaded to pinned G2
and onboarded into 256 other blocks through the scheduler API, every byte
checked. References from the same run: one large pinned <-> device copy
of the same bytes each way, timed in every repetition right before kvbm's
transfer (the ratio is the median of the repetitions' ratios, so a drift
of the link's rate during the run cancels), and a per-block, per-layer
`Tensor.copy_` loop (what a swap-blocks offload amounts to). G2 holds four times the blocks
moved, as a deployment's host cache holds many requests: offload batches
in flight are capped at a quarter of G2. `--verify` measures kvbm a second
time with block checksums on (the connector's `verify`), in the same run,
and prints what they cost. `--device cpu` runs the same on host memory
(G1 a host tensor, the references host memcpys), for machines without a GPU.

    python kvbm-py/benches/gpu_bench.py [--blocks 256] [--reps 9] [--layout packed|split]
        [--verify] [--device cuda|cpu]
"""

import argparse
import hashlib
import random
import statistics
import sys
import tempfile
import time

import torch

import kvbm_py
from kvbm_py.config import SchedulerConfig, WorkerConfig

LAYERS, BLOCK, HEADS, HEAD = 32, 16, 8, 128
BLOCK_BYTES = LAYERS * 2 * BLOCK * HEADS * HEAD * 2


def gbps(nbytes: int, secs: float) -> float:
    return nbytes / secs / 1e9


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--capacity", type=int, default=1024, help="G1 blocks")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--layout", choices=["packed", "split"], default="packed")
    ap.add_argument("--verify", action="store_true", help="also measure with checksums on")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    device = a.device
    pinned = device == "cuda"
    n = a.blocks
    nbytes = n * BLOCK_BYTES
    if a.layout == "packed":
        # Memory [blocks, tokens, heads, K|V], viewed [blocks, heads, tokens, K|V].
        layers = [
            torch.randn(a.capacity, BLOCK, HEADS, 2 * HEAD, device=device).to(torch.bfloat16).permute(0, 2, 1, 3)
            for _ in range(LAYERS)
        ]

        def of(t, b):
            return t[b]
    else:
        layers = [
            torch.randn(2, a.capacity, BLOCK, HEADS, HEAD, device=device).to(torch.bfloat16) for _ in range(LAYERS)
        ]

        def of(t, b):
            return t[:, b]

    # References: one large copy each way (timed again beside every kvbm
    # transfer below), and the per-block copy_ loop.
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)

    def big_d2h():
        return timed(lambda: host.copy_(dev, non_blocking=True))

    def big_h2d():
        return timed(lambda: dev.copy_(host, non_blocking=True))

    big_d2h(), big_h2d()  # warm-up
    rng = random.Random(7)
    ids = list(range(a.capacity))
    rng.shuffle(ids)
    src, dst = ids[:n], ids[n : 2 * n]
    block_shape = tuple(of(layers[0], 0).shape)
    stage = torch.empty((n, LAYERS) + block_shape, dtype=torch.bfloat16, pin_memory=pinned)

    def loop_out():
        for i, b in enumerate(src):
            for l, t in enumerate(layers):
                stage[i, l].copy_(of(t, b), non_blocking=True)

    def loop_in():
        for i, b in enumerate(dst):
            for l, t in enumerate(layers):
                of(t, b).copy_(stage[i, l], non_blocking=True)

    loop_d2h = statistics.median(timed(loop_out) for _ in range(a.reps))
    loop_h2d = statistics.median(timed(loop_in) for _ in range(a.reps))
    stage = None  # the staging copy is freed; the loops above are done

    def measure(verify: bool) -> tuple[list, list, list, list]:
        """kvbm's offload and onboard times over the repetitions (the first
        a warm-up), each with the large copy timed right before it."""
        out_s, in_s, ref_out, ref_in = [], [], [], []
        with tempfile.TemporaryDirectory() as tmp:
            endpoint = f"ipc://{tmp}/leader.sock"
            config = WorkerConfig(endpoint, 0, 1, f"{tmp}/instance.secret")
            worker = kvbm_py.Worker(config, layers, a.capacity)
            sched = kvbm_py.Scheduler(
                SchedulerConfig(
                    endpoint=endpoint,
                    world_size=1,
                    block_size=BLOCK,
                    secret_file=f"{tmp}/instance.secret",
                    g2_bytes=4 * n * BLOCK_BYTES,
                    admission="all",
                    verify=verify,
                )
            )
            try:
                for rep in range(a.reps + 1):
                    hashes, parent = [], None
                    for i in range(n):
                        h = hashlib.sha256(f"{verify}:{rep}:{i}".encode() + (parent or b"")).digest()
                        hashes.append(h)
                        parent = h
                    req = f"r{rep}"
                    r_out = big_d2h()
                    t_out = timed(lambda: (sched.offload(req, src, hashes, None), sched.flush()))
                    sched.release(req)
                    m = sched.match_prefix(req + "b", hashes, n * BLOCK + 1, 0)
                    assert m.g2_blocks == n, m

                    def onboard():
                        sched.onboard(req + "b", dst)
                        sched.wait_onboard(req + "b")

                    r_in = big_h2d()
                    t_in = timed(onboard)
                    for t in layers:
                        assert torch.equal(of(t, src), of(t, dst)), "an onboarded block differs"
                    sched.release(req + "b")
                    # New bytes for the next rep, so nothing is served stale.
                    for t in layers:
                        fresh = torch.randn_like(of(t, src))
                        if a.layout == "packed":
                            t[src] = fresh
                        else:
                            t[:, src] = fresh
                    if rep:
                        out_s.append(t_out)
                        in_s.append(t_in)
                        ref_out.append(r_out)
                        ref_in.append(r_in)
                assert sched.stats()["verify_mismatches"] == 0
            finally:
                sched.shutdown()
                worker.join(10.0)
        return out_s, in_s, ref_out, ref_in

    out_s, in_s, ref_out, ref_in = measure(False)
    med = statistics.median
    out, inn = med(out_s), med(in_s)
    d2h, h2d = med(ref_out), med(ref_in)
    # Each repetition's kvbm time against the reference timed just before it.
    ratio_out = med(r / t for r, t in zip(ref_out, out_s))
    ratio_in = med(r / t for r, t in zip(ref_in, in_s))
    print(
        f"{n} blocks of {BLOCK_BYTES >> 10} KiB ({nbytes / 2**20:.0f} MiB), layout {a.layout}, medians of {a.reps}; every byte checked"
    )
    print(f"{'path':<28}{'G1->G2 GB/s':>12}{'G2->G1 GB/s':>12}")
    rows = [
        ("one large copy (reference)", gbps(nbytes, d2h), gbps(nbytes, h2d)),
        ("kvbm_py offload / onboard", gbps(nbytes, out), gbps(nbytes, inn)),
        ("per-block copy_ loop", gbps(nbytes, loop_d2h), gbps(nbytes, loop_h2d)),
    ]
    for name, o, i in rows:
        print(f"{name:<28}{o:>12.2f}{i:>12.2f}")
    print(f"kvbm / one large copy (median of paired ratios): {ratio_out:.3f} / {ratio_in:.3f}")
    print(f"kvbm / copy_ loop:     {rows[1][1] / rows[2][1]:.1f}x / {rows[1][2] / rows[2][2]:.1f}x")
    if a.verify:
        v_out, v_in, v_ref_out, v_ref_in = measure(True)
        v_ratio_out = med(r / t for r, t in zip(v_ref_out, v_out))
        v_ratio_in = med(r / t for r, t in zip(v_ref_in, v_in))
        print(f"{'kvbm_py, verify on':<28}{gbps(nbytes, med(v_out)):>12.2f}{gbps(nbytes, med(v_in)):>12.2f}")
        print(f"verify on / one large copy: {v_ratio_out:.3f} / {v_ratio_in:.3f}")
        print(
            f"verify cost (1 - on/off of the ratios): {1 - v_ratio_out / ratio_out:.3f} / "
            f"{1 - v_ratio_in / ratio_in:.3f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

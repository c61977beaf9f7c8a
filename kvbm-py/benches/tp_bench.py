"""kvbm_py across tensor-parallel ranks: one scheduler-side object (the
leader, in this process) and one worker process per rank, each
registering its KV tensors in vLLM's flash-attn layout
(``[2, blocks, 16, heads, head_dim]`` per layer) with pinned G2 and a G3
file of its own. The default shape is one rank's share of a
Llama-3.1-70B split over two ranks (80 layers, 4 KV heads x 128, bf16).

What it does, every byte checked on every rank:

1. the same-run references: one large pinned <-> device copy of a rank's
   bytes per direction, each rank alone and all ranks at once;
2. offload ``--blocks`` random blocks per rank through the leader, then
   onboard them into other blocks (G2 -> G1), timed;
3. offload as many again, which pushes the first set to G3, and onboard
   the first set back (G3 -> G1);
4. the leader's latency for a 1-block and a 64-block onboard from G2;
5. kill one rank's process in the middle of an onboard: the onboard fails
   naming the rank and nothing is counted as loaded; a new process takes
   the rank, rejoins, and the next offload and onboard succeed.

Ranks go round-robin over the visible GPUs (two ranks share one GPU on a
one-GPU machine); ``--device cpu`` runs the same on host tensors.

    python kvbm-py/benches/tp_bench.py [--ranks 2] [--blocks 1000]

``--transfer-delay-ms`` (the test suite's, so a kill lands mid-transfer)
needs a wheel built with feature ``test-hooks``, as ``cargo xtask ci``
builds it: ``maturin build --features test-hooks``. A wheel for users has
no such hook, and the bench refuses the flag with it.
"""

import argparse
import hashlib
import multiprocessing as mp
import os
import signal
import statistics
import sys
import tempfile
import time

BLOCK = 16


def gbps(nbytes: float, secs: float) -> float:
    return nbytes / secs / 1e9


# --------------------------------------------------------------------------
# Worker processes


def rank_main(rank, a, endpoint, secret, g3_dir, conn, barrier):
    """One rank: its KV tensors, its kvbm worker, and a command loop."""
    import torch

    import kvbm_py

    if a.device == "cpu":
        dev, ordinal = torch.device("cpu"), None
    else:
        ordinal = rank % torch.cuda.device_count()
        torch.cuda.set_device(ordinal)
        dev = torch.device("cuda", ordinal)
    dtype = torch.bfloat16
    layers = [torch.zeros(2, a.capacity, BLOCK, a.heads, a.head_dim, dtype=dtype, device=dev) for _ in range(a.layers)]
    from kvbm_py.config import WorkerConfig

    config = WorkerConfig(endpoint, rank, a.ranks, secret, g3_dir=g3_dir, transfer_delay_ms=a.transfer_delay_ms)
    worker = kvbm_py.Worker(config, layers, a.capacity)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def fill(ids, seed):
        g = torch.Generator(device=dev).manual_seed(seed * 131 + rank)
        idx = torch.tensor(ids, device=dev)
        for t in layers:
            t[:, idx] = torch.randn(t[:, idx].shape, generator=g, device=dev, dtype=torch.float32).to(dtype)
        sync()
        return True

    def check(pairs):
        src = torch.tensor([s for s, _ in pairs], device=dev)
        dst = torch.tensor([d for _, d in pairs], device=dev)
        bad = torch.zeros(len(pairs), dtype=torch.bool, device=dev)
        for t in layers:
            bad |= (t[:, src] != t[:, dst]).flatten(2).any(dim=2).any(dim=0)
        return int(bad.sum())

    def one_copy(nbytes, together):
        """Seconds of one pinned <-> device copy of `nbytes`, each way
        (median of 3)."""
        if dev.type == "cpu":
            return None
        d = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        out = []
        for direction in ("d2h", "h2d"):
            times = []
            for _ in range(3):
                if together:
                    barrier.wait()
                sync()
                t0 = time.perf_counter()
                if direction == "d2h":
                    h.copy_(d, non_blocking=True)
                else:
                    d.copy_(h, non_blocking=True)
                sync()
                times.append(time.perf_counter() - t0)
            out.append(statistics.median(times))
        del d, h
        return out

    handlers = {"fill": fill, "check": check, "one_copy": one_copy, "block_bytes": lambda: worker.block_bytes}
    conn.send(("ready", rank))
    while True:
        cmd, args = conn.recv()
        if cmd == "exit":
            break
        try:
            conn.send(("ok", handlers[cmd](*args)))
        except Exception as e:  # reported to the leader's process
            conn.send(("error", f"{type(e).__name__}: {e}"))
    worker.join(30.0)


class Rank:
    """The leader's handle on one rank's process."""

    def __init__(self, ctx, rank, a, endpoint, secret, g3_dir, barrier):
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=rank_main, args=(rank, a, endpoint, secret, g3_dir, child, barrier), daemon=True)
        self.proc.start()

    def ready(self, timeout=300):
        if not self.conn.poll(timeout):
            raise RuntimeError(f"rank {self.rank} did not start")
        self.conn.recv()

    def send(self, cmd, *args):
        self.conn.send((cmd, args))

    def result(self):
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"rank {self.rank}: {value}")
        return value

    def call(self, cmd, *args):
        self.send(cmd, *args)
        return self.result()


def on_all(ranks, cmd, *args):
    for r in ranks:
        r.send(cmd, *args)
    return [r.result() for r in ranks]


# --------------------------------------------------------------------------
# The leader


def chain(tag, n):
    out, parent = [], b""
    for i in range(n):
        parent = hashlib.sha256(f"{tag}:{i}".encode() + parent).digest()
        out.append(parent)
    return out


def offload_set(sched, ranks, name, src, seed):
    """Fills `src` with fresh bytes on every rank and offloads them under
    chain `name`; returns (seconds, hashes)."""
    hashes = chain(name, len(src))
    on_all(ranks, "fill", src, seed)
    t0 = time.perf_counter()
    sched.offload(name, src, hashes, None)
    sched.flush()
    took = time.perf_counter() - t0
    sched.release(name)
    return took, hashes


def onboard(sched, req, hashes, dst):
    m = sched.match_prefix(req, hashes, len(hashes) * BLOCK + 1, 0)
    t0 = time.perf_counter()
    sched.onboard(req, dst[: m.g2_blocks + m.g3_blocks])
    err = wait_onboard(sched, req)
    took = time.perf_counter() - t0
    return m, err, took


def wait_onboard(sched, req):
    """The error the request's onboard failed with; None when every block
    landed."""
    import kvbm_py

    try:
        sched.wait_onboard(req)
    except kvbm_py.KvbmError as e:
        return e
    return None


def wait_live(sched, timeout=120.0):
    deadline = time.monotonic() + timeout
    while True:
        states = sched.ranks()
        if all(s == "live" for s in states):
            return states
        if time.monotonic() > deadline:
            raise RuntimeError(f"ranks never all live again: {states}")
        time.sleep(0.05)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--blocks", type=int, default=1000, help="blocks per rank per transfer")
    ap.add_argument("--layers", type=int, default=80)
    ap.add_argument("--heads", type=int, default=4, help="KV heads per rank")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--kill-after-ms", type=float, default=10.0, help="how long into an onboard a rank is killed")
    ap.add_argument("--dir", default=None, help="where the G3 files go (default: a temp dir)")
    ap.add_argument("--reps", type=int, default=20, help="onboards per latency figure")
    ap.add_argument(
        "--transfer-delay-ms",
        type=int,
        default=0,
        help="hold every copy back this long (needs a wheel built with "
        "feature test-hooks; tests use it so the kill lands mid-transfer)",
    )
    a = ap.parse_args()
    n = a.blocks
    a.capacity = 2 * n + 64
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device; use --device cpu")
            return 1
    import kvbm_py
    from kvbm_py.config import SchedulerConfig

    if a.transfer_delay_ms and not kvbm_py._kvbm.TEST_HOOKS:
        ap.error("--transfer-delay-ms needs a wheel built with feature test-hooks")
    ctx = mp.get_context("spawn")
    tmp = tempfile.mkdtemp(prefix="kvbm-tp-", dir=a.dir)
    endpoint = f"ipc://{tmp}/leader.sock"
    secret = f"{tmp}/instance.secret"
    barrier = ctx.Barrier(a.ranks)
    g3_dirs = [f"{tmp}/g3-{r}" for r in range(a.ranks)]
    ranks = [Rank(ctx, r, a, endpoint, secret, g3_dirs[r], barrier) for r in range(a.ranks)]
    for r in ranks:
        r.ready()
    block_bytes = ranks[0].call("block_bytes")
    g2_blocks = n + n // 4
    sched = kvbm_py.Scheduler(
        SchedulerConfig(
            endpoint=endpoint,
            world_size=a.ranks,
            block_size=BLOCK,
            secret_file=secret,
            g2_bytes=a.ranks * g2_blocks * block_bytes,
            g3_bytes=a.ranks * 2 * n * block_bytes,
            admission="all",
            handshake_timeout_s=300,
        )
    )
    rank_bytes = n * block_bytes
    total = rank_bytes * a.ranks
    print(
        f"{a.ranks} ranks on {a.device}, {n} blocks of {block_bytes / 2**20:.2f} MiB per rank "
        f"({rank_bytes / 2**30:.2f} GiB per rank per transfer); capacity {sched.capacity()}"
    )
    failures = []
    try:
        # 1. References.
        alone = [r.call("one_copy", rank_bytes, False) for r in ranks]
        together = on_all(ranks, "one_copy", rank_bytes, True)
        if alone[0] is not None:
            for r, (d2h, h2d) in enumerate(alone):
                print(
                    f"rank {r} one large copy alone: G1->G2 {gbps(rank_bytes, d2h):.2f} GB/s, "
                    f"G2->G1 {gbps(rank_bytes, h2d):.2f} GB/s"
                )
            ref_out = gbps(total, max(t[0] for t in together))
            ref_in = gbps(total, max(t[1] for t in together))
            print(
                f"all ranks at once, one large copy each: G1->G2 {ref_out:.2f} GB/s, G2->G1 {ref_in:.2f} GB/s aggregate"
            )
        else:
            ref_out = ref_in = None

        import random

        ids = list(range(a.capacity))
        random.Random(7).shuffle(ids)
        src, dst = ids[:n], ids[n : 2 * n]

        # 2. G2 round trip.
        t_out, hashes_a = offload_set(sched, ranks, "a", src, seed=1)
        m, err, t_in = onboard(sched, "a-in", hashes_a, dst)
        bad = on_all(ranks, "check", list(zip(src, dst)))
        sched.release("a-in")
        print(
            f"G2 round trip: match {m.g2_blocks} in G2, {m.g3_blocks} in G3; error {err}; "
            f"mismatched blocks per rank {bad}"
        )
        if err or any(bad) or m.g2_blocks + m.g3_blocks < n - 1:
            failures.append("G2 round trip")

        def row(label, secs, ref):
            agg = gbps(total, secs)
            ratio = f"{agg / ref:.3f}" if ref else "-"
            print(
                f"  {label:<34} {agg:8.2f} GB/s aggregate, {gbps(rank_bytes, secs):8.2f} per rank,"
                f" ratio to all ranks' one large copy {ratio}"
            )

        row("offload G1->G2 (through the leader)", t_out, ref_out)
        row("onboard G2->G1 (through the leader)", t_in, ref_in)

        # 3. A second set pushes the first to G3; the first set's bytes are
        # then written to `src` again (same seed, same bytes) and `dst` is
        # scrambled before the onboard.
        _, hashes_b = offload_set(sched, ranks, "b", src, seed=2)
        on_all(ranks, "fill", src, 1)
        on_all(ranks, "fill", dst, 99)
        m, err, t_g3 = onboard(sched, "a-g3", hashes_a, dst)
        bad = on_all(ranks, "check", list(zip(src, dst))[: m.g2_blocks + m.g3_blocks])
        sched.release("a-g3")
        print(
            f"G3 round trip: match {m.g2_blocks} in G2, {m.g3_blocks} in G3; error {err}; "
            f"mismatched blocks per rank {bad}"
        )
        if err or any(bad) or m.g3_blocks == 0:
            failures.append("G3 round trip")
        row("onboard G2+G3->G1 (through the leader)", t_g3, ref_in)

        # 4. Leader latency: 1 and 64 blocks from G2.
        k = min(64, n)
        _, hashes_c = offload_set(sched, ranks, "c", src[:k], seed=5)
        for blocks in (1, k):
            times = []
            for i in range(a.reps):
                req = f"lat-{blocks}-{i}"
                m = sched.match_prefix(req, hashes_c[:blocks], blocks * BLOCK + 1, 0)
                t0 = time.perf_counter()
                sched.onboard(req, dst[:blocks])
                err = wait_onboard(sched, req)
                times.append(time.perf_counter() - t0)
                sched.release(req)
                if err or m.g2_blocks != blocks:
                    failures.append(f"latency onboard of {blocks}")
                    break
            times.sort()
            wire = blocks * block_bytes * a.ranks / (ref_in * 1e9) if ref_in else 0.0
            print(
                f"onboard of {blocks} block(s) per rank: p50 {times[len(times) // 2] * 1e6:.0f} us, "
                f"max {times[-1] * 1e6:.0f} us; the bytes at the reference rate "
                f"{wire * 1e6:.0f} us; added by kvbm p50 {(times[len(times) // 2] - wire) * 1e6:.0f} us"
            )
        bad = on_all(ranks, "check", list(zip(src[:k], dst[:k])))
        if any(bad):
            failures.append("latency onboards' bytes")

        # 5. Kill a rank mid-onboard.
        victim = ranks[-1]
        before = sched.stats()
        m = sched.match_prefix("kill", hashes_b, n * BLOCK + 1, 0)
        found = m.g2_blocks + m.g3_blocks
        sched.onboard("kill", dst[:found])
        time.sleep(a.kill_after_ms / 1e3)
        os.kill(victim.proc.pid, signal.SIGKILL)
        err = wait_onboard(sched, "kill")
        after = sched.stats()
        sched.release("kill")
        loaded = sum(after[f"{p}_blocks"] - before[f"{p}_blocks"] for p in ("g2_to_g1", "g3_to_g1"))
        print(
            f"killed rank {victim.rank} {a.kill_after_ms:.0f} ms into an onboard of {found} blocks: "
            f"error {err!r}; blocks counted loaded {loaded}; onboard failures "
            f"{after['onboard_failures'] - before['onboard_failures']}; ranks {sched.ranks()}"
        )
        if err is None:
            print("  (the onboard finished before the kill: raise --blocks or lower --kill-after-ms)")
            failures.append("kill landed after the onboard")
        elif f"rank {victim.rank}" not in str(err) or loaded:
            failures.append("failed onboard report")
        victim.proc.join(10)
        ranks[-1] = Rank(ctx, victim.rank, a, endpoint, secret, g3_dirs[victim.rank], barrier)
        ranks[-1].ready()
        t0 = time.perf_counter()
        states = wait_live(sched)
        print(f"rank {victim.rank} rejoined in {time.perf_counter() - t0:.2f} s: {states}")
        t_out, hashes_d = offload_set(sched, ranks, "d", src, seed=7)
        m, err, t_in = onboard(sched, "d-in", hashes_d, dst)
        bad = on_all(ranks, "check", list(zip(src, dst))[: m.g2_blocks + m.g3_blocks])
        sched.release("d-in")
        print(
            f"after the rejoin: {m.g2_blocks + m.g3_blocks} blocks onboarded, error {err}, "
            f"mismatched blocks per rank {bad}"
        )
        if err or any(bad) or m.g2_blocks + m.g3_blocks < n - 1:
            failures.append("transfer after the rejoin")
        row("offload after the rejoin", t_out, ref_out)
        row("onboard after the rejoin", t_in, ref_in)
    finally:
        sched.shutdown()
        for r in ranks:
            if r.proc.is_alive():
                r.send("exit")
                r.proc.join(30)
    print("every byte checked on every rank" if not failures else f"FAILED: {failures}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

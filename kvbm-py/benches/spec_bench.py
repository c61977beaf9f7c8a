"""kvbm behind vLLM's offloading connector, on a GPU: the spec's worker
(``kvbm_py._kvbm.PageWorker``) copying the pages of a Llama-3.1-8B-shaped
KV cache (32 layers, 16-token blocks, bf16) between device memory and its
pinned slots, on page tensors laid out as vLLM 0.32 hands them to an
offloading backend: per layer an int8 ``(blocks, page bytes)`` view, one
page per block. ``--heads 8`` gives 64 KiB pages (the 8B model at TP = 1),
``--heads 2`` 16 KiB pages (2 KV heads per rank).

Measured in one run, each against a reference timed right before it (the
ratio is the median of the repetitions' ratios):
- vLLM 0.32's own copy path over the same pages, as a ratio to the same
  large copy: one ``cuMemcpyBatchAsync`` over every page, as its CPU
  offloading worker issues it; and, for pages under 28 KiB host to device
  (the path vLLM takes there), its Triton kernel re-created: 12 programs,
  each copying whole pages one after another in 8-byte words, the page
  address arrays moved to the GPU with every call (needs ``triton``);
- offload (store job + wait) and onboard (load job + wait) of ``--blocks``
  random blocks, against one large pinned <-> device copy of the same
  bytes each way;
- both directions at once (a store of one batch while another loads),
  against two large copies at once on two streams;
- one block alone each way (job + wait), against its bytes at the large
  copy's rate and, taking turns, one copy of its bytes contiguous on both
  sides, plus its wait; vLLM's batch copy of its pages against the same.
Every loaded byte is checked against what was stored.

    python kvbm-py/benches/spec_bench.py [--heads 8] [--blocks 256] [--reps 9]
"""

from __future__ import annotations

import argparse
import ctypes
import random
import statistics
import time

import torch

from kvbm_py import _kvbm

LAYERS, TOKENS, HEAD = 32, 16, 128

# Turns timed for one block alone, after warm-up.
LONE_REPS = 41


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CopyAttributes(ctypes.Structure):
    _fields_ = [
        ("src_access_order", ctypes.c_int),
        ("src_hint", _Location),
        ("dst_hint", _Location),
        ("flags", ctypes.c_uint),
    ]


class BatchCopy:
    """vLLM 0.32's own offloading copy, re-created with the driver API: one
    ``cuMemcpyBatchAsync`` over every (block, layer) page on a stream of
    its own, source access in stream order, location hints set."""

    STREAM_ORDER, DEVICE, HOST = 1, 1, 2

    def __init__(self):
        self.fn = ctypes.CDLL("libcuda.so.1").cuMemcpyBatchAsync_v2
        self.stream = torch.cuda.Stream()

    def prepare(self, dsts: list[int], srcs: list[int], size: int, to_host: bool) -> tuple:
        """The call's arguments, built before it is timed (vLLM keeps its
        address arrays ready too)."""
        n = len(dsts)
        dev, host = _Location(self.DEVICE, 0), _Location(self.HOST, 0)
        attrs = _CopyAttributes(self.STREAM_ORDER, dev if to_host else host, host if to_host else dev, 0)
        return (
            (ctypes.c_uint64 * n)(*dsts),
            (ctypes.c_uint64 * n)(*srcs),
            (ctypes.c_size_t * n)(*([size] * n)),
            ctypes.c_size_t(n),
            ctypes.byref(attrs),
            (ctypes.c_size_t * 1)(0),
            ctypes.c_size_t(1),
            ctypes.c_void_p(self.stream.cuda_stream),
            attrs,
        )

    def __call__(self, args: tuple) -> None:
        rc = self.fn(*args[:-1])
        if rc != 0:
            raise RuntimeError(f"cuMemcpyBatchAsync: CUresult {rc}")
        self.stream.synchronize()


class TritonPages:
    """vLLM 0.32's host-to-device path for pages under 28 KiB, re-created:
    a Triton kernel on 12 programs, each taking every 12th page and
    copying it in 8-byte words, in chunks of the page size rounded up to a
    power of two (at most 8 KiB); the address and size arrays go to the
    GPU with every call, as vLLM sends them."""

    PROGRAMS, MAX_CHUNK, MAX_PAGE = 12, 8192, 28 * 1024

    def __init__(self):
        import triton
        import triton.language as tl

        @triton.jit
        def pages(src, dst, sizes, n, CHUNK: tl.constexpr):
            words = tl.arange(0, CHUNK // 8)
            page = tl.program_id(0)
            while page < n:
                s = tl.load(src + page).to(tl.pointer_type(tl.int64))
                d = tl.load(dst + page).to(tl.pointer_type(tl.int64))
                count = tl.load(sizes + page) // 8
                for at in range(0, count, CHUNK // 8):
                    i = at + words
                    tl.store(d + i, tl.load(s + i, mask=i < count, other=0), mask=i < count)
                page += tl.num_programs(0)

        self.kernel, self.next_pow2 = pages, triton.next_power_of_2

    def prepare(self, dsts: list[int], srcs: list[int], size: int) -> tuple:
        """The call's arguments, on the host as vLLM keeps them."""
        n = len(dsts)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64).pin_memory()  # noqa: E731
        return as_tensor(srcs), as_tensor(dsts), as_tensor([size] * n), n, min(self.next_pow2(size), self.MAX_CHUNK)

    def __call__(self, args: tuple) -> None:
        src, dst, sizes, n, chunk = args
        on_gpu = [t.to("cuda", non_blocking=True) for t in (src, dst, sizes)]
        self.kernel[(min(self.PROGRAMS, n),)](*on_gpu, n, CHUNK=chunk)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=8, help="KV heads per rank")
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--capacity", type=int, default=1024, help="engine blocks")
    ap.add_argument("--reps", type=int, default=9)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 1
    page = TOKENS * a.heads * HEAD * 2 * 2  # K and V, bf16
    slot_bytes = page * LAYERS
    n = a.blocks
    nbytes = n * slot_bytes
    layers = [torch.randint(-128, 127, (a.capacity, page), dtype=torch.int8, device="cuda") for _ in range(LAYERS)]
    slots = 4 * n + 2
    worker = _kvbm.PageWorker([(layers, page)], a.capacity, slots, slot_bytes)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev2 = torch.empty_like(dev)
    host2 = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def big_d2h() -> float:
        return timed(lambda: host.copy_(dev, non_blocking=True))

    def big_h2d() -> float:
        return timed(lambda: dev.copy_(host, non_blocking=True))

    def big_both() -> float:
        def go():
            with torch.cuda.stream(s1):
                host.copy_(dev, non_blocking=True)
            with torch.cuda.stream(s2):
                dev2.copy_(host2, non_blocking=True)

        return timed(go)

    job = iter(range(1, 1 << 40))

    def run(kind: str, copies) -> float:
        j = next(job)
        t0 = time.perf_counter()
        (worker.store if kind == "store" else worker.load)(j, copies)
        worker.wait([j])
        dt = time.perf_counter() - t0
        for r in worker.finished():
            assert r[1], f"job {r[0]} failed: {r[5]}"
        return dt

    def both(store_copies, load_copies) -> float:
        js, jl = next(job), next(job)
        t0 = time.perf_counter()
        worker.store(js, store_copies)
        worker.load(jl, load_copies)
        worker.wait([js, jl])
        dt = time.perf_counter() - t0
        for r in worker.finished():
            assert r[1], f"job {r[0]} failed: {r[5]}"
        return dt

    rng = random.Random(7)
    ids = list(range(a.capacity))
    rng.shuffle(ids)
    src, dst = ids[:n], ids[n : 2 * n]
    out_slots = list(range(n))
    big_d2h(), big_h2d(), big_both()  # warm-up

    ratios_out, ratios_in, ratios_both, rates_out, rates_in = [], [], [], [], []
    for rep in range(a.reps + 1):
        ref = big_d2h()
        t = run("store", [(0, b, s) for b, s in zip(src, out_slots)])
        ref_in = big_h2d()
        t_in = run("load", [(0, b, s) for b, s in zip(dst, out_slots)])
        # Both at once: store the loaded batch into other slots while the
        # first batch loads into the source blocks' places again.
        ref_both = big_both()
        t_both = both(
            [(0, b, s) for b, s in zip(dst, range(n, 2 * n))],
            [(0, b, s) for b, s in zip(ids[2 * n : 3 * n], out_slots)],
        )
        if rep:
            ratios_out.append(ref / t)
            ratios_in.append(ref_in / t_in)
            ratios_both.append(ref_both / t_both)
            rates_out.append(nbytes / t / 1e9)
            rates_in.append(nbytes / t_in / 1e9)
    for l in layers:
        got = l[torch.tensor(dst, device="cuda")]
        want = l[torch.tensor(src, device="cuda")]
        assert torch.equal(got, want), "an onboarded page differs from the offloaded one"
        assert torch.equal(l[torch.tensor(ids[2 * n : 3 * n], device="cuda")], want)

    # vLLM's copy path over the same pages, into a pinned buffer laid out
    # as its host cache ([block][layer][page]) and back.
    batch = BatchCopy()
    pages_dev = lambda blocks: [t.data_ptr() + b * page for b in blocks for t in layers]  # noqa: E731
    pages_host = [host.data_ptr() + i * page for i in range(n * LAYERS)]
    out_args = batch.prepare(pages_host, pages_dev(src), page, True)
    in_args = batch.prepare(pages_dev(dst), pages_host, page, False)
    batch(out_args), batch(in_args)  # warm-up
    vllm_out, vllm_in = [], []
    for _ in range(a.reps):
        ref = big_d2h()
        vllm_out.append(ref / timed(lambda: batch(out_args)))
        ref = big_h2d()
        vllm_in.append(ref / timed(lambda: batch(in_args)))
    # Its Triton path onboards pages under 28 KiB.
    triton_in: list[float] = []
    if page < TritonPages.MAX_PAGE:
        try:
            pages = TritonPages()
        except ImportError:
            pages = None
        if pages is not None:
            tri_args = pages.prepare(pages_dev(dst), pages_host, page)
            pages(tri_args)  # compile and warm up
            for _ in range(a.reps):
                ref = big_h2d()
                triton_in.append(ref / timed(lambda: pages(tri_args)))
            # Its pages land where they belong: the destination blocks,
            # cleared, hold the source blocks' bytes again.
            to, back = torch.tensor(dst, device="cuda"), torch.tensor(src, device="cuda")
            for l in layers:
                l[to] = 0
            timed(lambda: pages(tri_args))
            for l in layers:
                assert torch.equal(l[to], l[back]), "vLLM's Triton path loaded other bytes"

    # One block alone, taking turns with one copy of its bytes (contiguous
    # on both sides, the way `gpu_bench.py --blocks 1` times its
    # reference) and vLLM's batch copy of its pages.
    line_out = nbytes / statistics.median(big_d2h() for _ in range(5))
    line_in = nbytes / statistics.median(big_h2d() for _ in range(5))
    one_dev, one_host = dev[:slot_bytes], host[:slot_bytes]
    lone_args = {
        "store": batch.prepare(pages_host[:LAYERS], pages_dev(src[:1]), page, True),
        "load": batch.prepare(pages_dev(dst[:1]), pages_host[:LAYERS], page, False),
    }
    lone: dict[str, list[tuple[float, float, float]]] = {"store": [], "load": []}
    for rep in range(LONE_REPS + 5):
        for kind, block in (("store", src[0]), ("load", dst[0])):
            if kind == "store":
                one = timed(lambda: one_host.copy_(one_dev, non_blocking=True))
            else:
                one = timed(lambda: one_dev.copy_(one_host, non_blocking=True))
            t = run(kind, [(0, block, 3 * n)])
            args = lone_args[kind]
            theirs = timed(lambda: batch(args))
            if rep >= 5:
                lone[kind].append((t, one, theirs))

    med = statistics.median
    print(f"pages of {page // 1024} KiB, {n} blocks of {slot_bytes >> 10} KiB, every loaded byte checked")
    print(f"offload: {med(rates_out):.1f} GB/s, {med(ratios_out):.2f} of one large copy")
    print(f"onboard: {med(rates_in):.1f} GB/s, {med(ratios_in):.2f} of one large copy")
    print(f"both at once: {med(ratios_both):.2f} of two large copies at once")
    print(
        f"vLLM's batch copy: offload {med(vllm_out):.2f}, onboard {med(vllm_in):.2f} of one large copy; "
        f"kvbm is {med(ratios_out) / med(vllm_out):.2f}x / {med(ratios_in) / med(vllm_in):.2f}x"
    )
    if triton_in:
        print(
            f"vLLM's Triton path (onboard, pages under 28 KiB): {med(triton_in):.2f} of one large copy; "
            f"kvbm is {med(ratios_in) / med(triton_in):.2f}x"
        )
    for kind, name, line in (("store", "offload", line_out), ("load", "onboard", line_in)):
        t = med(x[0] for x in lone[kind])
        one = med(x[0] / x[1] for x in lone[kind])
        theirs = med(x[2] / x[1] for x in lone[kind])
        print(
            f"one block, {name} + wait: {t * 1e3:.3f} ms, {t * line / slot_bytes:.2f}x its bytes at the large "
            f"copy's rate, {one:.2f}x one copy of its bytes (vLLM's batch copy of its pages: {theirs:.2f}x)"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

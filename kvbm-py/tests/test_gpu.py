"""kvbm_py over GPU KV tensors (skipped without CUDA or without a wheel
built with feature `cuda`): vLLM's layouts on the device (vLLM 0.32's
packed `[blocks, heads, tokens, 2 * head_size]` view of its NHD layout,
and the older flash-attn `[2, blocks, tokens, heads, head_size]`), G2
pinned host memory, G3 disk; blocks offloaded through G2 into G3 come back
into other device blocks byte for byte; the offloading spec's worker
moves device pages of two KV cache groups through pinned slots. Runs as
a script too:
``python test_gpu.py``."""

import hashlib
import os
import sys
import tempfile
import time

import pytest

# KVBM_REQUIRE_GPU=1 (the GPU machine) turns every skip below into a failure.
REQUIRED = os.environ.get("KVBM_REQUIRE_GPU") == "1"


def _skip(reason: str):
    if REQUIRED:
        pytest.fail(f"{reason}, and KVBM_REQUIRE_GPU=1")
    pytest.skip(reason)


try:
    import torch
except ImportError:
    if REQUIRED:
        raise
    pytest.skip("torch is not installed", allow_module_level=True)

import kvbm_py  # noqa: E402
from kvbm_py.config import SchedulerConfig, WorkerConfig  # noqa: E402

BLOCKS, BLOCK, HEADS, HEAD = 32, 16, 8, 128
# One rank's block: 2 layers x K/V x 16 tokens x 8 heads x 128 x bf16.
BLOCK_BYTES = 2 * 2 * BLOCK * HEADS * HEAD * 2


def _cuda_or_skip():
    if not torch.cuda.is_available():
        _skip("no CUDA device")


def device_layers(layout: str):
    """Two layers of KV tensors on the GPU, and how to index a block."""
    if layout == "packed":
        # Memory [blocks, tokens, heads, K|V], viewed [blocks, heads, tokens, K|V].
        layers = [
            torch.randn(BLOCKS, BLOCK, HEADS, 2 * HEAD, device="cuda").to(torch.bfloat16).permute(0, 2, 1, 3)
            for _ in range(2)
        ]
        return layers, lambda t, b: t[b]
    # flash-attn before vLLM 0.32: [2, num_blocks, block_size, heads, head_size].
    layers = [torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD, device="cuda").to(torch.bfloat16) for _ in range(2)]
    return layers, lambda t, b: t[:, b]


def run_round_trip(tmp: str, layout: str) -> None:
    endpoint = f"ipc://{tmp}/leader.sock"
    layers, of = device_layers(layout)
    config = WorkerConfig(endpoint, 0, 1, f"{tmp}/instance.secret", g3_dir=f"{tmp}/g3")
    try:
        worker = kvbm_py.Worker(config, layers, BLOCKS)
    except kvbm_py.KvbmError as e:
        if "no CUDA support" in str(e):
            _skip("kvbm_py built without feature `cuda`")
        raise
    sched = kvbm_py.Scheduler(
        SchedulerConfig(
            endpoint=endpoint,
            world_size=1,
            block_size=BLOCK,
            secret_file=f"{tmp}/instance.secret",
            g2_bytes=2 * BLOCK_BYTES,
            g3_bytes=8 * BLOCK_BYTES,
            admission="all",
        )
    )
    try:
        hashes = [hashlib.sha256(bytes([i])).digest() for i in range(4)]
        for b in range(4):  # one at a time: G2 (2 blocks) spills to G3
            sched.offload("a", [b], [hashes[b]], hashes[b - 1] if b else None)
            sched.flush()
        sched.release("a")
        m = sched.match_prefix("b", hashes, 4 * BLOCK + 1, 0)
        assert (m.g2_blocks, m.g3_blocks) == (2, 2), m
        targets = [20, 21, 22, 23]
        t0 = time.perf_counter()
        sched.onboard("b", targets)
        sched.wait_onboard("b")
        ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        for t in layers:
            for src, dst in zip(range(4), targets):
                assert torch.equal(of(t, src), of(t, dst)), f"block {dst} differs from {src}"
        s = sched.stats()
        assert (s["g2_to_g1_blocks"], s["g3_to_g1_blocks"]) == (2, 2), s
        sched.release("b")
        print(f"GPU round trip OK ({layout}): 4 blocks of {BLOCK_BYTES} bytes back in {ms:.1f} ms; {s}")
    finally:
        sched.shutdown()
        assert worker.join(10.0) and worker.exception() is None, worker.exception()


@pytest.mark.parametrize("layout", ["packed", "split"])
def test_gpu_tensors_round_trip_through_pinned_g2_and_g3(tmp_path, layout):
    _cuda_or_skip()
    run_round_trip(str(tmp_path), layout)


def run_spec_round_trip(verify: bool, disk_dir: str | None = None) -> None:
    """The offloading spec's worker on device pages of two KV cache groups
    (different page sizes): stored into pinned slots, wiped, loaded back
    into other blocks byte for byte; with ``verify``, a slot changed at
    rest fails its load (when the build has the test hooks). With
    ``disk_dir`` the stored blocks move to disk slots first and are loaded
    from there."""
    groups = [(3, 16 << 10), (2, 32 << 10)]  # (layers, page bytes)
    pages = [
        [torch.randint(-128, 127, (BLOCKS, page), dtype=torch.int8, device="cuda") for _ in range(n)]
        for n, page in groups
    ]
    slot_bytes = max(n * page for n, page in groups)
    try:
        worker = kvbm_py._kvbm.PageWorker(
            [(g, page) for g, (_, page) in zip(pages, groups)],
            BLOCKS,
            8,
            slot_bytes,
            verify=verify,
            disk_dir=disk_dir,
            disk_slots=8 if disk_dir else 0,
        )
    except kvbm_py.KvbmError as e:
        if "feature `cuda`" in str(e):
            _skip("kvbm_py built without feature `cuda`")
        raise
    before = [[t[[1, 2]].clone() for t in g] for g in pages]
    worker.store(1, [(0, 1, 0), (0, 2, 1), (1, 1, 2), (1, 2, 3)])
    worker.wait([1])
    assert all(r[1] for r in worker.finished())
    for g in pages:
        for t in g:
            t.zero_()
    loads = [(0, 5, 0), (0, 6, 1), (1, 5, 2), (1, 6, 3)]
    if disk_dir:
        # Slot i (group i // 2) moves to disk slot 7 - i under key 100 + i;
        # the blocks come back from disk.
        worker.store(10, [], [(i, 7 - i, i // 2, 100 + i) for i in range(4)])
        worker.wait([10])
        assert all(r[1] for r in worker.finished())
        worker.load(2, [], [(g, b, 7 - s) for g, b, s in loads])
    else:
        worker.load(2, loads)
    worker.wait([2])
    (job,) = worker.finished()
    assert job[1], job
    for g, want in zip(pages, before):
        for t, w in zip(g, want):
            assert torch.equal(t[[5, 6]], w)
    if verify and kvbm_py._kvbm.TEST_HOOKS:
        if disk_dir:
            worker.corrupt_disk_slot(4)
            worker.load(3, [], [(1, 7, 4)])
        else:
            worker.corrupt_slot(3)
            worker.load(3, [(1, 7, 3)])
        worker.wait([3])
        (job,) = worker.finished()
        assert not job[1] and job[4] == [(1, 7)], job
        assert isinstance(job[5], kvbm_py.TransferError), job


@pytest.mark.parametrize("verify", [False, True])
@pytest.mark.parametrize("disk", [False, True])
def test_spec_worker_round_trips_device_pages_of_two_groups(tmp_path, verify, disk):
    _cuda_or_skip()
    run_spec_round_trip(verify, str(tmp_path) if disk else None)


def run_spec_kept_host_round_trip(directory: str) -> None:
    """The spec's worker with its pinned slots kept in ``directory`` (a
    file mapped and registered with the GPU in place): blocks stored from
    device pages by one worker are reported by the next over the same
    directory and loaded back byte for byte; a slot changed at rest fails
    its load (when the build has the test hooks)."""
    import gc
    import struct

    page = 16 << 10
    pages = [torch.randint(-128, 127, (BLOCKS, page), dtype=torch.int8, device="cuda") for _ in range(2)]
    before = [t[[1, 2, 3]].clone() for t in pages]

    def worker(tensors: list[torch.Tensor]) -> kvbm_py._kvbm.PageWorker:
        try:
            return kvbm_py._kvbm.PageWorker([(tensors, page)], BLOCKS, 8, 2 * page, host_kept=(directory, "gpu test"))
        except kvbm_py.KvbmError as e:
            if "feature `cuda`" in str(e):
                _skip("kvbm_py built without feature `cuda`")
            raise

    a = worker(pages)
    a.store(1, [(0, 1, 4), (0, 2, 5), (0, 3, 6)], keys=[101, 102, 103])
    a.wait([1])
    assert all(r[1] for r in a.finished())
    del a
    gc.collect()
    for t in pages:
        t.zero_()
    b = worker(pages)
    found = b.kept_host()
    assert found is not None and found[3] is None, found
    entries = sorted(struct.iter_unpack("<IQ", found[1]))
    assert entries == [(4, 101), (5, 102), (6, 103)], entries
    b.load(2, [(0, 5, 4), (0, 6, 5), (0, 7, 6)])
    b.wait([2])
    (job,) = b.finished()
    assert job[1], job
    for t, want in zip(pages, before):
        assert torch.equal(t[[5, 6, 7]], want)
    if kvbm_py._kvbm.TEST_HOOKS:
        # A kept slot changed at rest: its load is checked on the GPU
        # against the sum the first worker recorded, and fails.
        b.corrupt_slot(6)
        b.load(3, [(0, 8, 5), (0, 9, 6)])
        b.wait([3])
        (job,) = b.finished()
        assert not job[1] and job[4] == [(0, 9)], job
        for t, want in zip(pages, before):
            assert torch.equal(t[8], want[1])


def test_spec_worker_keeps_pinned_slots_across_a_restart(tmp_path):
    _cuda_or_skip()
    shm = "/dev/shm"
    with tempfile.TemporaryDirectory(dir=shm if os.path.isdir(shm) else None) as d:
        run_spec_kept_host_round_trip(os.path.join(d, "g2"))


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("no CUDA device")
        sys.exit(1)
    for layout in ["packed", "split"]:
        with tempfile.TemporaryDirectory() as d:
            run_round_trip(d, layout)
    for verify in (False, True):
        run_spec_round_trip(verify)
        with tempfile.TemporaryDirectory() as d:
            run_spec_round_trip(verify, d)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        run_spec_kept_host_round_trip(os.path.join(d, "g2"))
    print("spec worker round trips OK")

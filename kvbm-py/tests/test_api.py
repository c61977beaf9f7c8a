"""kvbm_py's Scheduler and Worker without vLLM: one scheduler-side object
and two worker-side objects (tensor-parallel ranks 0 and 1) in this
process, over host tensors; every byte that comes back is checked on both
ranks."""

import hashlib
import time

import pytest
import torch

import kvbm_py
from kvbm_py.config import SchedulerConfig, WorkerConfig

BLOCKS, BLOCK, INNER = 16, 16, 128
# Bytes of one block on one rank: 2 layers x K/V x 16 tokens x 128 x fp16
# (each layer's K or V of a block is 4 KiB: G3 needs disk-sized chunks).
RANK_BLOCK_BYTES = 2 * 2 * BLOCK * INNER * 2


def block_hashes(n, salt=b""):
    return [hashlib.sha256(salt + bytes([i])).digest() for i in range(n)]


class Rank:
    """One rank's KV tensors (CPU attention's shape) and kvbm worker."""

    def __init__(self, endpoint, rank, g3_dir, secret_file):
        self.rank = rank
        self.layers = [torch.zeros(BLOCKS, 2, BLOCK, INNER, dtype=torch.float16) for _ in range(2)]
        config = WorkerConfig(endpoint, rank, 2, str(secret_file), g3_dir=str(g3_dir))
        self.worker = kvbm_py.Worker(config, self.layers, BLOCKS)

    def fill(self, block, seed):
        for layer, t in enumerate(self.layers):
            g = torch.Generator().manual_seed(seed * 1000 + layer * 10 + self.rank)
            t[block].copy_(torch.randn(t[block].shape, generator=g, dtype=torch.float32).half())

    def same(self, a, b):
        return all(torch.equal(t[a], t[b]) for t in self.layers)


@pytest.fixture
def node(tmp_path):
    endpoint = f"ipc://{tmp_path}/leader.sock"
    secret = tmp_path / "instance.secret"
    ranks = [Rank(endpoint, r, tmp_path / f"g3-{r}", secret) for r in range(2)]
    sched = kvbm_py.Scheduler(
        SchedulerConfig(
            endpoint=endpoint,
            world_size=2,
            block_size=BLOCK,
            secret_file=str(secret),
            g2_bytes=2 * RANK_BLOCK_BYTES * 2,  # 2 blocks per rank
            g3_bytes=8 * RANK_BLOCK_BYTES * 2,  # 8 blocks per rank
            admission="all",
            handshake_timeout_s=30,
        )
    )
    yield sched, ranks
    sched.shutdown()
    with pytest.raises(kvbm_py.ClosedError):
        sched.live_requests()
    for r in ranks:
        assert r.worker.join(10.0), "a worker did not stop"
        assert r.worker.exception() is None


def test_two_ranks_round_trip_through_g2_and_g3(node):
    sched, ranks = node
    assert sched.capacity() == {"g1": BLOCKS, "g2": 2, "g3": 8}
    assert all(r.worker.block_bytes == RANK_BLOCK_BYTES for r in ranks)
    hashes = block_hashes(4)
    for b in range(4):
        for r in ranks:
            r.fill(b, seed=b)
    assert sched.match_prefix("a", hashes, 4 * BLOCK + 1, 0).external_tokens == 0
    # One block at a time, so each pushes the oldest from G2 to G3.
    for b in range(4):
        sched.offload("a", [b], [hashes[b]], hashes[b - 1] if b else None)
        sched.flush()
    sched.release_after_offloads("a")
    deadline = time.monotonic() + 30
    while "a" not in sched.poll_released():
        assert time.monotonic() < deadline, "the release never finished"
        time.sleep(0.01)
    s = sched.stats()
    assert (s["g1_to_g2_blocks"], s["g2_to_g3_blocks"]) == (4, 2), s

    # The engine holds block 0; kvbm has the other three, in G3 then G2.
    m = sched.match_prefix("b", hashes, 4 * BLOCK + 1, 1)
    assert (m.engine_blocks, m.g2_blocks, m.g3_blocks, m.gave_back) == (1, 2, 1, False), m
    assert m.external_tokens == 3 * BLOCK
    sched.onboard("b", [9, 10, 11])
    sched.wait_onboard("b")
    for r in ranks:
        for src, dst in [(1, 9), (2, 10), (3, 11)]:
            assert r.same(src, dst), f"rank {r.rank}: block {dst} differs from {src}"
    assert sched.release("b")
    assert sched.live_requests() == 0


def test_full_prompt_hit_gives_one_block_back(node):
    sched, ranks = node
    hashes = block_hashes(2, b"full")
    for r in ranks:
        r.fill(0, 1)
        r.fill(1, 2)
    sched.offload("a", [0, 1], hashes)
    sched.flush()
    assert sched.release("a")
    m = sched.match_prefix("b", hashes, 2 * BLOCK, 0)
    assert m.gave_back and m.external_tokens == BLOCK, m
    sched.release("b")


def test_a_failed_onboard_reports_and_counts_nothing(node):
    sched, ranks = node
    hashes = block_hashes(2, b"fail")
    for r in ranks:
        r.fill(0, 5)
        r.fill(1, 6)
    sched.offload("a", [0, 1], hashes)
    sched.flush()
    sched.release("a")
    assert sched.match_prefix("b", hashes, 3 * BLOCK, 0).external_tokens == 2 * BLOCK
    sched.onboard("b", [12, BLOCKS + 100])  # the second target is outside G1
    with pytest.raises(kvbm_py.TransferError, match="outside"):
        sched.wait_onboard("b")
    assert sched.stats()["onboard_failures"] == 1
    assert sched.release("b")
    # A polled failure is the exception, not its text.
    assert sched.match_prefix("c", hashes, 3 * BLOCK, 0).external_tokens == 2 * BLOCK
    sched.onboard("c", [BLOCKS + 100, 12])
    deadline = time.monotonic() + 30
    while not (polled := sched.poll_onboards())[1]:
        assert polled == ([], []) and time.monotonic() < deadline, polled
        time.sleep(0.01)
    ((rid, err),) = polled[1]
    assert rid == "c" and isinstance(err, kvbm_py.TransferError) and "outside" in str(err), err
    assert sched.release("c")
    # Polling finds nothing more, and bad arguments are errors, not crashes.
    assert sched.poll_onboards() == ([], [])
    with pytest.raises(kvbm_py.InvalidArgumentError):
        sched.wait_onboard("never-matched")
    with pytest.raises(kvbm_py.InvalidArgumentError):
        sched.offload("c", [1, 2], [hashes[0]])
    # Still a ValueError, for callers that catch that.
    with pytest.raises(ValueError):
        kvbm_py.Scheduler(SchedulerConfig("ipc:///tmp/x", 1, 16, 0, admission="sometimes"))


def test_a_g2_that_cannot_be_allocated_fails_start_up(tmp_path):
    # Each worker allocates G2 on its own thread once the leader sized it;
    # one that cannot says so, and the scheduler's start-up fails with it.
    endpoint = f"ipc://{tmp_path}/leader.sock"
    secret = tmp_path / "instance.secret"
    ranks = [Rank(endpoint, r, tmp_path / f"g3-{r}", secret) for r in range(2)]
    # The most blocks a tier indexes (2^32 - 1), 64 TiB per rank: more
    # than this machine can map.
    with pytest.raises(kvbm_py.KvbmError) as err:
        kvbm_py.Scheduler(
            SchedulerConfig(
                endpoint=endpoint,
                world_size=2,
                block_size=BLOCK,
                secret_file=str(secret),
                g2_bytes=((1 << 32) - 1) * RANK_BLOCK_BYTES * 2,
                handshake_timeout_s=30,
            )
        )
    assert "G2" in str(err.value) or "alloc" in str(err.value).lower(), err.value
    for r in ranks:
        assert r.worker.join(30.0), "a worker did not stop"


def test_g3_blocks_are_read_into_staging_at_match(tmp_path):
    # G2 of 4 blocks and 2 staging blocks beyond it: a match that finds G3
    # blocks starts their read at once and holds staging slots until the
    # onboard.
    endpoint = f"ipc://{tmp_path}/leader.sock"
    secret = tmp_path / "instance.secret"
    ranks = [Rank(endpoint, r, tmp_path / f"g3-{r}", secret) for r in range(2)]
    sched = kvbm_py.Scheduler(
        SchedulerConfig(
            endpoint=endpoint,
            world_size=2,
            block_size=BLOCK,
            secret_file=str(secret),
            g2_bytes=4 * RANK_BLOCK_BYTES * 2,
            g3_bytes=8 * RANK_BLOCK_BYTES * 2,
            admission="all",
            handshake_timeout_s=30,
            g3_staging_bytes=2 * RANK_BLOCK_BYTES * 2,
            offload_in_flight=1,
        )
    )
    try:
        assert sched.capacity()["g2"] == 6
        assert sched.g3_staging_blocks == 2 and sched.staging_free_blocks() == 2
        hashes = block_hashes(6, b"stage")
        for b in range(6):
            for r in ranks:
                r.fill(b, seed=100 + b)
            sched.offload("a", [b], [hashes[b]], hashes[b - 1] if b else None)
            sched.flush()
        assert sched.release("a")
        s = sched.stats()
        assert s["g2_to_g3_blocks"] == 2, s  # G2's pool holds 4 of the 6
        m = sched.match_prefix("b", hashes, 6 * BLOCK + 1, 0)
        assert (m.g2_blocks, m.g3_blocks) == (4, 2), m
        # The two G3 blocks took the two staging slots.
        assert sched.staging_free_blocks() == 0
        targets = list(range(8, 14))
        sched.onboard("b", targets)
        sched.wait_onboard("b")
        for r in ranks:
            for src, dst in zip(range(6), targets):
                assert r.same(src, dst), f"rank {r.rank}: block {dst} differs from {src}"
        assert sched.release("b")
        deadline = time.monotonic() + 10
        while sched.staging_free_blocks() != 2:
            assert time.monotonic() < deadline, "staging slots were never returned"
            time.sleep(0.01)
    finally:
        sched.shutdown()
        for r in ranks:
            assert r.worker.join(10.0)

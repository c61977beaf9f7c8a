"""vLLM's real Scheduler driving kvbm's connector, with a fabricated model
that writes a known pattern into every block it computes: loads are
checked byte for byte, and the awkward moments are forced (an abort while
loading, a failed load, a request finishing while its offloads run, a
prefix-cache reset)."""

import logging
import time

import pytest

import kvbm_py
from sched_harness import BLOCK, build

needs_hooks = pytest.mark.skipif(not kvbm_py._kvbm.TEST_HOOKS, reason="a wheel built without feature test-hooks")

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PREFIX = list(range(100, 100 + 4 * BLOCK))  # 4 full blocks


def offloaded(h, req_id):
    """Runs until `req_id` finished and vLLM freed its blocks."""
    h.run_until(lambda: req_id in h.finished and req_id not in h.sched.requests)


@pytest.fixture
def harness(tmp_path, request):
    extra = {"cpu_cache_gb": 0.01, "admission": "all"}
    extra.update(getattr(request, "param", {}))
    h = build(tmp_path, extra)
    yield h
    h.close()


def load_again(h, req_id, max_tokens=2):
    """Drops vLLM's prefix cache and schedules PREFIX again: kvbm must load
    it (the last block is given back: the prompt is exactly PREFIX + 3)."""
    assert h.sched.reset_prefix_cache(), "vLLM's prefix cache did not reset"
    return h.request(req_id, PREFIX + [1, 2, 3], max_tokens)


@pytest.mark.parametrize("harness", [{"load_async": True}, {"load_async": False}], indirect=True)
def test_loaded_blocks_hold_the_computed_bytes(harness):
    h = harness
    a = h.request("A", PREFIX + [5, 6, 7], 3)
    offloaded(h, "A")
    assert h.kvbm.stats()["g1_to_g2_blocks"] == 4
    c = load_again(h, "C")
    h.run_until(lambda: h.scheduled.get("C", 0) > 0)
    # Only the tail was computed: 4 blocks came from kvbm.
    assert h.scheduled["C"] == len(PREFIX) + 3 - 4 * BLOCK
    ids = h.block_ids("C")
    for b in range(4):
        assert h.holds_pattern(ids[b], c.block_hashes[b]), f"block {b} differs"
    offloaded(h, "C")
    assert h.kvbm.stats()["g2_to_g1_blocks"] == 4
    assert a.block_hashes[:4] == c.block_hashes[:4]


class _CheckedOffloads:
    """Stands for the kvbm Scheduler under the connector and checks, as
    each offload is handed over, that every block it reads was already
    written by the fabricated forward (holds its hash's pattern)."""

    def __init__(self, h):
        self._h, self._kvbm, self.calls = h, h.kvbm, []

    def offload(self, rid, block_ids, hashes, parent=None):
        for b, key in zip(block_ids, hashes):
            assert self._h.holds_pattern(b, key), (
                f"{rid}: block {b} handed to kvbm before its forward wrote it\n" + "\n".join(self._h.log[-5:])
            )
        self.calls.append((rid, list(block_ids)))
        return self._kvbm.offload(rid, block_ids, hashes, parent)

    def __getattr__(self, name):
        return getattr(self._kvbm, name)


@pytest.mark.parametrize("batches", [1, 2])
@pytest.mark.parametrize(
    "harness",
    [{"load_async": True}, {"load_async": False}, {"offload": "finish"}],
    indirect=True,
)
def test_offloads_wait_for_the_forwards_that_write_their_blocks(harness, batches):
    """Requests sharing a prefix scheduled in one step: vLLM caches the
    blocks the first computes when it allocates them, and the others hit
    them before the forward wrote a byte. Whoever asks, kvbm gets a block
    only once the forward writing it ran: at once with synchronous
    scheduling (batches = 1), a step later with two batches in flight
    (asynchronous scheduling, whose accounting the fence follows)."""
    h = harness
    side = h.connector._scheduler
    side.fence.batches = batches
    checked = side.kvbm = _CheckedOffloads(h)
    h.request("A", PREFIX + [5, 6, 7], 3)
    h.request("B", PREFIX + [8] * BLOCK + [9], 2)
    h.request("D", PREFIX[: 2 * BLOCK] + [4] * 5, 2)
    h.step()
    # One step scheduled all three; B and D hit A's blocks in vLLM's
    # prefix cache (A computes them in this very step).
    assert h.scheduled["A"] == len(PREFIX) + 3 and h.scheduled["B"] == BLOCK + 1, h.log
    for rid in ("A", "B", "D"):
        offloaded(h, rid)
    side.kvbm = checked._kvbm
    assert checked.calls, h.log
    assert h.kvbm.stats()["g1_to_g2_blocks"] == 5, h.kvbm.stats()
    c = load_again(h, "C")
    h.run_until(lambda: h.scheduled.get("C", 0) > 0)
    ids = h.block_ids("C")
    for b in range(4):
        assert h.holds_pattern(ids[b], c.block_hashes[b]), f"block {b} differs"
    offloaded(h, "C")


@needs_hooks
@pytest.mark.parametrize("harness", [{"test_transfer_delay_ms": 400}], indirect=True)
def test_request_finished_while_offloads_run_keeps_its_blocks(harness):
    h = harness
    h.request("A", PREFIX + [5], 1)
    h.run_until(lambda: "A" in h.finished)
    # The offloads are held back on the worker: vLLM must keep A's blocks.
    assert "A" in h.sched.requests, "A's blocks were freed while kvbm read them"
    assert not h.sched.reset_prefix_cache()
    h.run_until(lambda: "A" not in h.sched.requests)
    assert h.kvbm.stats()["g1_to_g2_blocks"] == 4
    assert h.sched.reset_prefix_cache()
    assert h.kvbm.live_requests() == 0


@needs_hooks
@pytest.mark.parametrize("harness", [{"test_transfer_delay_ms": 500}], indirect=True)
def test_abort_while_loading(harness):
    from vllm.v1.request import RequestStatus

    h = harness
    h.request("A", PREFIX + [5], 1)
    offloaded(h, "A")
    load_again(h, "C")
    h.step()  # C is scheduled for an asynchronous load
    assert h.sched.requests["C"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
    h.sched.finish_requests("C", RequestStatus.FINISHED_ABORTED)
    # The release cancelled the copy and waited for it; vLLM frees C's
    # blocks when the next step reports C's load over.
    assert h.kvbm.live_requests() == 0
    assert h.kvbm.stats()["g2_to_g1_blocks"] == 0
    h.step()
    assert "C" not in h.sched.requests, h.log
    for _ in range(3):
        h.step()
    # The prefix is still in kvbm and loads correctly afterwards.
    d = load_again(h, "D", 3)
    h.run_until(lambda: h.scheduled.get("D", 0) > 0)
    ids = h.block_ids("D")
    assert all(h.holds_pattern(ids[b], d.block_hashes[b]) for b in range(4))
    offloaded(h, "D")


@pytest.mark.parametrize(
    "harness",
    [{"test_fail_onboards": 1, "load_async": True}, {"test_fail_onboards": 1, "load_async": False}],
    indirect=True,
)
def test_a_failed_load_is_recomputed(harness):
    h = harness
    h.request("A", PREFIX + [5], 1)
    offloaded(h, "A")
    c = load_again(h, "C", 4)
    h.run_until(lambda: c.num_output_tokens >= 1)
    s = h.kvbm.stats()
    assert s["onboard_failures"] == 1, s
    if h.connector._scheduler.config.load_async:
        # vLLM rescheduled the request from scratch and matched it again:
        # the second load landed.
        assert s["g2_to_g1_blocks"] == 4, s
    else:
        # vLLM recomputed the blocks that failed.
        assert s["g2_to_g1_blocks"] == 0, s
        assert h.scheduled["C"] >= len(PREFIX) + 3, h.log
    ids = h.block_ids("C")
    assert all(h.holds_pattern(ids[b], c.block_hashes[b]) for b in range(4))
    offloaded(h, "C")


def test_reset_prefix_cache_with_kvbm_holding_nothing(harness):
    h = harness
    # Nothing ever ran: kvbm holds no vLLM block.
    assert h.sched.reset_prefix_cache(reset_connector=True)
    h.request("A", PREFIX + [5], 2)
    offloaded(h, "A")
    assert h.kvbm.live_requests() == 0
    assert h.kvbm.stats()["g2_used_blocks"] == 4
    # kvbm read everything and let go: both caches reset, G2 emptied too.
    assert h.sched.reset_prefix_cache(reset_connector=True)
    assert h.kvbm.stats()["g2_used_blocks"] == 0
    h.request("B", PREFIX + [6], 1)
    h.run_until(lambda: "B" in h.finished)
    assert h.scheduled["B"] == len(PREFIX) + 1  # nothing left to load


def _kept_g3(tmp_path) -> dict:
    """A G2 of two 16 KiB blocks in front of a G3 kept in `tmp_path` (the
    rest goes there), every block admitted."""
    block_bytes = 16384
    return {
        "cpu_cache_gb": 2.5 * block_bytes / 2**30,
        "disk_cache_gb": 64.5 * block_bytes / 2**30,
        "disk_cache_dir": str(tmp_path / "g3"),
        "admission": "all",
    }


def test_a_reset_stops_the_kept_disk_tier(tmp_path, monkeypatch):
    """A ``reset_prefix_cache(reset_connector=True)`` empties a kept G3's
    records and keeps nothing stored after it (the engine's weights may
    change around a reset): a restarted engine loads none of the blocks,
    stored before the reset or after it."""
    import gc

    from conftest import kept_slots

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    extra = _kept_g3(tmp_path)
    model_dir = str(tmp_path / "model")
    prompt = {n: [n] * (4 * BLOCK) + [1] for n in (7, 8, 9, 10)}

    def start():
        return build(tmp_path, extra, model_dir=model_dir)

    def serve(h, rid, n):
        h.request(rid, prompt[n], 1)
        offloaded(h, rid)

    def stop(h):
        h.close()
        gc.collect()

    a = start()
    try:
        serve(a, "before-1", 7)
        serve(a, "before-2", 8)
        kept = a.kvbm.stats()["g2_to_g3_blocks"]
        (kept_dir,) = (tmp_path / "g3").glob("kept-*-rank0")
        # Keeping works: every block moved to G3 is recorded.
        assert kept >= 4 and len(kept_slots(kept_dir)) == kept, (kept, kept_slots(kept_dir))
        assert a.sched.reset_prefix_cache(reset_connector=True)
        # The workers empty their records as the reset reaches them.
        deadline = time.monotonic() + 30
        while kept_slots(kept_dir) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not kept_slots(kept_dir), "the reset left records"
        serve(a, "after-1", 9)
        serve(a, "after-2", 10)
        assert a.kvbm.stats()["g2_to_g3_blocks"] >= kept + 4, a.kvbm.stats()
    finally:
        stop(a)
    b = start()
    try:
        assert b.kvbm.stats()["g3_recovered_blocks"] == 0, b.kvbm.stats()
        # Every prompt is computed whole: none of their blocks was kept.
        for n in (7, 8, 9, 10):
            serve(b, f"again-{n}", n)
            assert b.scheduled[f"again-{n}"] == len(prompt[n]), b.log
        assert b.kvbm.stats()["g3_to_g1_blocks"] == 0, b.kvbm.stats()
    finally:
        stop(b)


def test_an_engine_laying_kv_out_otherwise_reuses_no_kept_block(tmp_path, monkeypatch):
    """The same model, weights and block size, but KV tensors that lay a
    block's bytes out otherwise (another attention backend): a kept G3's
    blocks would be read as other values, so a restart with such tensors
    starts G3 afresh and computes every prompt, while a restart with the
    same layout serves them."""
    import gc

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    extra = _kept_g3(tmp_path)
    model_dir = str(tmp_path / "model")
    prompt = {n: [n] * (4 * BLOCK) + [1] for n in (7, 8)}

    def run(heads_outer: bool) -> dict:
        h = build(tmp_path, extra, model_dir=model_dir, heads_outer=heads_outer)
        try:
            recovered = h.kvbm.stats()["g3_recovered_blocks"]
            for n, p in prompt.items():
                h.request(f"p{n}", p, 1)
                offloaded(h, f"p{n}")
            return {"recovered": recovered, "scheduled": dict(h.scheduled), "stats": h.kvbm.stats()}
        finally:
            h.close()
            gc.collect()

    first = run(False)
    assert first["stats"]["g2_to_g3_blocks"] >= 4, first
    same = run(False)
    assert same["recovered"] > 0, same
    other = run(True)
    assert other["recovered"] == 0, other
    assert other["scheduled"] == {f"p{n}": len(p) for n, p in prompt.items()}, other
    assert other["stats"]["g3_to_g1_blocks"] == 0, other


def test_two_requests_sharing_a_prefix_load_it_once(harness):
    h = harness
    h.request("A", PREFIX + [5], 1)
    offloaded(h, "A")
    assert h.sched.reset_prefix_cache()
    b = h.request("B", PREFIX + [1, 2, 3], 2)
    c = h.request("C", PREFIX + [4, 5, 6], 2)
    h.run_until(lambda: b.num_output_tokens >= 1 and c.num_output_tokens >= 1)
    # B loaded the prefix; C waited for that load and then found the
    # blocks in vLLM's own prefix cache.
    assert h.kvbm.stats()["g2_to_g1_blocks"] == 4, h.log
    assert h.scheduled["C"] == 3, h.log
    for r in (b, c):
        ids = h.block_ids(r.request_id)
        assert all(h.holds_pattern(ids[i], r.block_hashes[i]) for i in range(4))
    offloaded(h, "B")
    offloaded(h, "C")
    assert h.connector._scheduler.loading_hashes == {}


@needs_hooks
@pytest.mark.parametrize("harness", [{"test_transfer_delay_ms": 300}], indirect=True)
def test_preempted_while_its_copies_run(harness):
    # vLLM never preempts a request while its load runs (it is not running
    # then); the moment that matters is a preemption while kvbm still
    # copies the request's blocks: here the offload of a block it just
    # filled, on blocks that came from a load.
    h = harness
    h.request("A", PREFIX + [5], 1)
    offloaded(h, "A")
    c = load_again(h, "C", 40)
    h.run_until(lambda: c.num_computed_tokens >= 5 * BLOCK + 1)
    assert h.kvbm.stats()["g2_to_g1_blocks"] == 4
    # Its fifth block is queued or copying (each copy is held back).
    assert h.sched.reset_prefix_cache(reset_running_requests=True)
    assert c.num_preemptions == 1
    h.run_until(lambda: c.num_output_tokens >= 30)
    done = c.num_computed_tokens // BLOCK
    ids = h.block_ids("C")
    assert all(h.holds_pattern(ids[i], c.block_hashes[i]) for i in range(done)), h.log
    offloaded(h, "C")
    assert h.kvbm.live_requests() == 0


class _Lines(logging.Handler):
    """Collects the connector's log lines."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


#: A G2 of four of the harness's 16 KiB blocks.
SMALL_G2 = {"cpu_cache_gb": 4.5 * 16384 / 2**30, "offload_in_flight": 1}


@pytest.mark.parametrize(
    "harness",
    [{"admission": "reuse_score", **SMALL_G2}, {"admission": "all", **SMALL_G2}],
    indirect=True,
)
def test_g2_turning_first_time_blocks_down_is_explained_once(harness):
    h = harness
    lines = _Lines()
    logger = logging.getLogger("vllm.kvbm_py")
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        # A's prefix comes back (from G2): its blocks outrank new ones,
        # and G2 is full of them.
        h.request("A", PREFIX + [5], 1)
        offloaded(h, "A")
        load_again(h, "A2")
        offloaded(h, "A2")
        # New prompts: G2 turns their blocks down, which the next finished
        # request finds.
        for i, rid in enumerate("BCD"):
            h.request(rid, [7 + i] * (4 * BLOCK) + [5], 1)
            offloaded(h, rid)
    finally:
        logger.removeHandler(lines)
        logger.setLevel(level)
    said = [line for line in lines.lines if "turned down" in line]
    refused = h.kvbm.stats()["offloads_not_admitted"]
    if h.connector._scheduler.config.admission == "all":
        assert refused == 0 and said == [], (refused, said)
    else:
        # Blocks seen once are held back, and the log says why, once.
        assert refused > 0, dict(h.kvbm.stats())
        assert len(said) == 1 and "admission=all admits every block" in said[0], said


#: A G2 of nine of the harness's 16 KiB blocks, and five 4-block prompts.
NINE_BLOCK_G2 = {"cpu_cache_gb": 9.5 * 16384 / 2**30, "offload_in_flight": 1}
FIVE_PROMPTS = [[10 + p] * (4 * BLOCK) + [5] for p in range(5)]


@pytest.mark.parametrize("newest_first", [False, True])
@pytest.mark.parametrize("hint_s", [None, 30])
def test_what_a_hint_every_request_carries_costs(tmp_path, hint_s, newest_first):
    # The table in docs/vllm.md ("A hint can cost hits"): hinted alike, G2
    # keeps the first requests' blocks; unhinted, the most recent ones.
    h = build(tmp_path, dict(NINE_BLOCK_G2))
    try:
        loaded = 0
        for rnd in range(2):
            order = list(enumerate(FIVE_PROMPTS))
            if rnd == 1 and newest_first:
                order.reverse()
            before = h.kvbm.stats()["g2_to_g1_blocks"]
            for i, prompt in order:
                r = h.new_request(f"r{rnd}-{i}", prompt, 1)
                if hint_s is not None:
                    r.kv_transfer_params = {"kvbm_retention": {"returns_within_s": hint_s}}
                h.sched.add_request(r)
                offloaded(h, r.request_id)
            loaded = h.kvbm.stats()["g2_to_g1_blocks"] - before
            if rnd == 0:
                assert loaded == 0 and h.sched.reset_prefix_cache()
    finally:
        h.close()
    if hint_s is None:
        # G2 holds the newest blocks: all of them or none come back.
        assert loaded == (9 if newest_first else 0), (newest_first, loaded)
    else:
        # G2 holds the first hinted blocks: some come back either way (how
        # many depends on when each hint arrived against each offload).
        assert 1 <= loaded <= 8, (newest_first, loaded)

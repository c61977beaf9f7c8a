"""kvbm's batched steps in the scheduler half of vLLM's offloading
connector (``kvbm_py.vllm.offload_lookup``) give what vLLM's own steps
give, on randomized requests: the same offload keys for every group
(several groups, several hashes per chunk, keys added as a request
grows); the same prefix hits and sliding-window ends, through the
scheduler vLLM built, as asking the books key by key; and, for a model of
a full-attention and a sliding-window group, the same matched tokens as
vLLM's own scheduler half. A failing case names its seed."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from sched_harness import build

SEEDS = range(20)


def _state(cls, groups, hashes: list[bytes]):
    from vllm.v1.kv_offload.base import ReqContext

    req = SimpleNamespace(block_hashes=hashes, kv_transfer_params=None)
    config = SimpleNamespace(kv_group_configs=groups)
    return cls(config=config, req=req, req_context=ReqContext("r"), offloading_context=None)


@pytest.mark.parametrize("seed", SEEDS)
def test_offload_keys_are_vllms_keys_for_every_group(seed):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
        GroupOffloadConfig,
        RequestOffloadState,
    )

    from kvbm_py.vllm.offload_lookup import KvbmRequestState

    rng = random.Random(seed)
    groups = []
    for idx in rng.sample(range(6), rng.randint(1, 4)):
        per_chunk = rng.choice([1, 1, 2, 4])
        groups.append(
            GroupOffloadConfig(
                group_idx=idx,
                tokens_per_block=16,
                tokens_per_chunk=16 * per_chunk,
                hashes_per_chunk=per_chunk,
                kv_event_group_spec=None,
                sliding_window_size_in_chunks=None,
                kv_cache_spec=None,
                manager_cls=None,
            )
        )
    hashes: list[bytes] = []
    ours, theirs = _state(KvbmRequestState, groups, hashes), _state(RequestOffloadState, groups, hashes)
    for _ in range(rng.randint(1, 6)):
        # The request grows by some blocks between calls (a prompt, then
        # decoded tokens); both states read the same hashes.
        hashes.extend(rng.randbytes(32) for _ in range(rng.randint(0, 40)))
        ours.update_offload_keys()
        theirs.update_offload_keys()
        for g, (a, b) in enumerate(zip(ours.group_states, theirs.group_states, strict=True)):
            assert a.offload_keys == b.offload_keys, f"seed {seed}: group {g} keys differ"


@pytest.mark.parametrize("seed", SEEDS)
def test_offload_keys_behave_as_vllms_list_of_them(seed):
    """Every way vLLM's scheduler reads a request's keys (length, indexes,
    slices of slices, iteration, a key appended to a slice) gives what its
    list of ``bytes`` gives, as the keys grow."""
    from vllm.v1.kv_offload.base import make_offload_key

    from kvbm_py import _kvbm

    rng = random.Random(seed)
    group = rng.randrange(8)
    keys = _kvbm.OffloadKeys(group)
    hashes: list[bytes] = []
    step = rng.choice([1, 2, 4])
    for _ in range(rng.randint(1, 5)):
        hashes.extend(rng.randbytes(32) for _ in range(rng.randint(0, 30)))
        keys.extend_hashes(hashes, step * len(keys) + step - 1, step)
        model = [make_offload_key(h, group) for h in hashes[step - 1 :: step]]
        assert len(keys) == len(model) and list(keys) == model and keys == model, f"seed {seed}"
        n = len(model)
        for _ in range(20):
            i = rng.randrange(-n - 2, n + 2)
            if -n <= i < n:
                assert keys[i] == model[i], f"seed {seed}: key {i}"
                assert keys[i] is keys[i], f"seed {seed}: key {i} made twice"
            else:
                with pytest.raises(IndexError):
                    keys[i]
            a, b = rng.randrange(-n - 2, n + 3), rng.randrange(-n - 2, n + 3)
            view, want = keys[a:b], model[a:b]
            assert list(view) == want and len(view) == len(want), f"seed {seed}: [{a}:{b}]"
            c, d = rng.randrange(-3, 4), rng.randrange(-3, 4)
            assert list(view[c:d]) == want[c:d] and list(view[::-1]) == want[::-1], f"seed {seed}"
            tail = rng.randbytes(36)
            view.append(tail)
            want.append(tail)
            assert list(view) == want and view[-1] == tail and len(view) == len(want), f"seed {seed}"
        assert list(keys) == model, f"seed {seed}: a slice's append reached the list"


def test_offload_keys_refuse_bad_input():
    from kvbm_py import InvalidArgumentError, _kvbm

    keys = _kvbm.OffloadKeys(0)
    with pytest.raises(InvalidArgumentError):
        keys.extend_hashes([bytes(32)], 0, 0)
    with pytest.raises(TypeError):
        keys.extend_hashes(["not bytes"], 0, 1)
    with pytest.raises(InvalidArgumentError):
        keys.extend_hashes([bytes(8), bytes(4)], 0, 1)  # kvbm reads a key from 8 bytes
    assert len(keys) == 0, "a refused extend adds no key"
    keys.extend_hashes([bytes(8)], 0, 1)
    with pytest.raises(InvalidArgumentError):
        keys.append(bytes(12))  # the list grows from block hashes only
    with pytest.raises(InvalidArgumentError):
        keys[0:1].extend_hashes([bytes(8)], 0, 1)
    assert len(keys) == 1


@pytest.mark.parametrize("seed", SEEDS)
def test_lookups_in_one_call_find_what_key_by_key_finds(tmp_path, seed):
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from kvbm_py.vllm.offload_lookup import KvbmConnectorScheduler, KvbmRequestState

    rng = random.Random(seed)
    h = build(tmp_path, {"cpu_cache_gb": 64 * 16384 / 2**30, "admission": "all"}, connector="KvbmOffloadingConnector")
    try:
        sched = h.connector.connector_scheduler
        assert isinstance(sched, KvbmConnectorScheduler)
        # A request's state builds its keys as vLLM does.
        r = h.new_request("r", [rng.randrange(1, 1000) for _ in range(rng.randrange(16, 400))], 1)
        h.connector.on_new_request(r)
        h.connector.get_num_new_matched_tokens(r, 0)
        state = sched._req_status["r"]
        assert isinstance(state, KvbmRequestState)
        assert state.group_states[0].offload_keys == [make_offload_key(b, 0) for b in r.block_hashes]
        manager = sched.manager
        keys = [make_offload_key(rng.randbytes(32), 0) for _ in range(48)]
        # Some blocks stored, some with their store still in flight (a
        # miss until it completes), the rest never stored.
        stored = [k for k in keys if rng.random() < 0.8]
        ctx = ReqContext("writer")
        out = manager.prepare_store(stored, ctx)
        done = [k for k in out.keys_to_store if rng.random() < 0.9]
        if done:
            manager.complete_store(done, ctx)
        group = sched.config.kv_group_configs[0]
        for start in (0, rng.randrange(len(keys))):
            run = keys[start:]
            ours = sched._maximal_prefix_lookup(run, ReqContext("a"), None, group, start)
            theirs = OffloadingConnectorScheduler._maximal_prefix_lookup(
                sched, run, ReqContext("b"), None, group, start
            )
            assert ours == theirs, f"seed {seed}: {ours} hits in one call, {theirs} key by key"
        # A sliding-window group's scan from the end, over windows shorter
        # and longer than the runs of hits.
        for _ in range(8):
            run = keys[rng.randrange(len(keys)) :]
            window = rng.randint(1, 6)
            first = rng.choice([None, window, window + rng.randint(1, 3)])
            ours = sched._sliding_window_lookup(run, window, ReqContext("a"), first)
            theirs = OffloadingConnectorScheduler._sliding_window_lookup(sched, run, window, ReqContext("b"), first)
            assert ours == theirs, f"seed {seed}: window {window}/{first}: {ours} in one call, {theirs} key by key"
    finally:
        h.close()


@pytest.mark.parametrize("seed", range(12))
def test_a_hybrid_request_matches_as_vllm_matches_it(tmp_path, seed):
    """A full-attention and a sliding-window group (vLLM's hybrid manager
    on), blocks of either group stored with gaps: a request's matched
    tokens are what vLLM's own scheduler half finds for the same prompt."""
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
    from vllm.v1.kv_offload.base import ReqContext, make_offload_key

    from kvbm_py.vllm.offload_lookup import KvbmConnectorScheduler

    rng = random.Random(seed)
    window = rng.choice([32, 64, 128])
    h = build(
        tmp_path,
        {"cpu_cache_gb": 256 * 16384 / 2**30, "admission": "all"},
        num_blocks=128,
        connector="KvbmOffloadingConnector",
        sliding_window=window,
    )
    try:
        conn = h.connector
        sched = conn.connector_scheduler
        groups = [g.group_idx for g in sched.config.kv_group_configs]
        assert len(groups) == 2 and isinstance(sched, KvbmConnectorScheduler)
        prompt = [rng.randrange(3, 1000) for _ in range(16 * rng.randint(2, 40) + rng.randrange(16))]
        seed_req = h.new_request("seed", prompt, 1)
        gap = rng.random() * 0.3
        keys = [make_offload_key(b, g) for g in groups for b in seed_req.block_hashes if rng.random() >= gap]
        manager = sched.manager
        out = manager.prepare_store(keys, ReqContext("seed"))
        manager.complete_store(out.keys_to_store, ReqContext("seed"))
        for i in range(3):
            computed = 16 * rng.randrange(len(prompt) // 16)
            got = []
            for half in (KvbmConnectorScheduler, OffloadingConnectorScheduler):
                sched.__class__ = half
                r = h.new_request(f"{half.__name__}-{i}", prompt, 1)
                conn.on_new_request(r)
                got.append(conn.get_num_new_matched_tokens(r, computed))
                conn.request_finished(r, [])
            sched.__class__ = KvbmConnectorScheduler
            assert got[0] == got[1], f"seed {seed}: {computed} computed, window {window}: kvbm {got[0]}, vLLM {got[1]}"
    finally:
        h.close()

"""kvbm's manager behind vLLM's offloading connector, driven key by key
through the manager vLLM's scheduler built (the harness's).

Retention hints on the offloading spec route: a request's
``kvbm_retention`` (in its ``kv_transfer_params``) reaches kvbm's books
for the blocks it asked for, as it does through ``KvbmConnector``. The
``"done"`` hint is the one whose effect does not depend on the request
rate (how a ``returns_within_s`` hint ranks against other blocks does:
kvbm-pool's ledger tests hold that on a fixed clock)."""

from __future__ import annotations

import pytest

from sched_harness import build

#: A G2 of two of the harness's 16 KiB blocks.
TWO_SLOTS = {"cpu_cache_gb": 2.5 * 16384 / 2**30, "admission": "reuse_score"}


def _key(n: int) -> bytes:
    from vllm.v1.kv_offload.base import make_offload_key

    return make_offload_key(bytes([n]) * 32, 0)


def _stored(manager, req: str, n: int, params: dict | None = None):
    """Request `req` stores block `n` and finishes, with `params` as its
    kv_transfer_params."""
    from vllm.v1.kv_offload.base import ReqContext

    ctx = ReqContext(req, kv_transfer_params=params)
    out = manager.prepare_store([_key(n)], ctx)
    manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    return out


@pytest.mark.parametrize("hint, first_to_go", [(None, 1), ("done", 2)])
def test_a_hinted_request_ranks_its_blocks(tmp_path, hint, first_to_go):
    h = build(tmp_path, dict(TWO_SLOTS), connector="KvbmOffloadingConnector")
    try:
        manager = h.connector.connector_scheduler.manager
        assert manager.books.slots == 2
        params = None if hint is None else {"kvbm_retention": hint}
        _stored(manager, "a", 1)
        _stored(manager, "b", 2, params)
        # Block 1 is the older: it goes first unless block 2's request said
        # it is done.
        out = _stored(manager, "c", 3)
        assert out.keys_to_store == [_key(3)]
        assert out.evicted_keys == [_key(first_to_go)], (hint, out)
    finally:
        h.close()


def test_kv_events_name_the_tier_a_block_enters_and_leaves(tmp_path):
    """A G2 of one slot before a G3 of one: block 1 moves to disk when
    block 2 takes its slot, and leaves the disk when block 2 moves there."""
    from vllm.v1.kv_offload.base import Medium

    one_slot = 1.5 * 16384 / 2**30
    extra = {"cpu_cache_gb": one_slot, "disk_cache_gb": one_slot, "disk_cache_dir": str(tmp_path / "g3")}
    h = build(tmp_path, {**extra, "admission": "all"}, kv_events=True, connector="KvbmOffloadingConnector")
    try:
        manager = h.connector.connector_scheduler.manager
        assert (manager.books.slots, manager.books.disk_slots) == (1, 1)
        for n in (1, 2, 3):
            _stored(manager, f"r{n}", n)
        got = [(e.medium, e.removed, e.keys) for e in manager.take_events()]
    finally:
        h.close()
    cpu, disk = Medium.CPU, Medium.STORAGE
    assert got == [
        (cpu, False, [_key(1)]),
        (cpu, True, [_key(1)]),
        (cpu, False, [_key(2)]),
        (disk, False, [_key(1)]),
        (cpu, True, [_key(2)]),
        (disk, True, [_key(1)]),
        (cpu, False, [_key(3)]),
        (disk, False, [_key(2)]),
    ], got

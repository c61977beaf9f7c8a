"""The tiers behind vLLM's offloading connector, kept across a restart:
driven through vLLM's real Scheduler and worker-side connector (the
harness's fabricated forward writes each block's pattern), with the
ranks' reports handed to the scheduler as vLLM's engine core hands them
(the connector handshake)."""

from __future__ import annotations

import gc
import random
import struct

import pytest

from sched_harness import BLOCK, build

BLOCK_BYTES = 16384
#: A G2 of two blocks in front of a disk tier of 32.
KEPT = {
    "cpu_cache_gb": 2.5 * BLOCK_BYTES / 2**30,
    "disk_cache_gb": 32.5 * BLOCK_BYTES / 2**30,
    "admission": "all",
}


def _start(tmp_path, model_dir, heads_outer=False, **more):
    """A harness over the kept disk tier in `tmp_path` (and `more` config),
    and what its worker found there, handed to its scheduler as the engine
    core hands it; its KV tensors pack K and V per head with
    `heads_outer`."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    extra = {**KEPT, "disk_cache_dir": str(tmp_path / "g3"), **more}
    h = build(
        tmp_path,
        extra,
        kv_events=True,
        connector="KvbmOffloadingConnector",
        model_dir=model_dir,
        heads_outer=heads_outer,
    )
    found = get_kv_transfer_group().get_handshake_metadata()
    h.connector.set_xfer_handshake_metadata_pp_aware({(0, 0): found})
    return h, found


def _stop(h) -> None:
    h.close()
    # The worker lets go of its directory once it is collected.
    gc.collect()


def _run(h, prompts: dict[str, list[int]]) -> None:
    for rid, prompt in prompts.items():
        h.request(rid, prompt, 1)
    manager = h.connector.connector_scheduler.manager
    h.run_until(lambda: h.idle() and manager.books.counts()["writing"] == 0)


def _reset_then_store(h) -> None:
    """Resets the connector, then stores a new prompt: the reset empties
    the kept records once the next step reached the workers, and the
    tiers keep nothing stored after it (the engine's weights may have
    changed): those blocks are served, not kept."""
    manager = h.connector.connector_scheduler.manager
    assert h.sched.reset_prefix_cache(reset_connector=True)
    stored = manager.stats["stored"]
    _run(h, {"after": [5] * (4 * BLOCK + 1)})
    assert manager.stats["stored"] > stored, manager.stats


def _announced(manager, medium) -> int:
    """Blocks the manager's events since the last call say are stored on
    ``medium``."""
    return sum(len(e.keys) for e in manager.take_events() if e.medium == medium and not e.removed)


def _ready(h, rid: str, prompt: list[int]) -> None:
    """Runs `rid` again and checks every full block of it holds its bytes."""
    r = h.request(rid, prompt, 1)
    hashes = list(r.block_hashes)
    blocks: list[int] = []

    def held() -> bool:
        if rid in h.sched.requests:
            blocks[:] = h.block_ids(rid)
        return rid in h.finished

    h.run_until(held)
    for b, block_hash in zip(blocks, hashes, strict=False):
        assert h.holds_pattern(b, block_hash), f"block {b} of {rid} holds other bytes"


def test_a_restarted_engine_serves_its_kept_disk_tier_and_a_reset_empties_it(tmp_path, monkeypatch):
    from vllm.v1.kv_offload.base import Medium

    from kvbm_py.vllm.offload_kept import KEPT_ENTRY_BYTES

    # Block hashes are the same in every engine only with a fixed seed.
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    model_dir = str(tmp_path / "model")
    rng = random.Random(3)
    prompts = {f"p{i}": [rng.randrange(1, 1000) for _ in range(4 * BLOCK + 3)] for i in range(4)}

    a, found = _start(tmp_path, model_dir)
    try:
        assert found is not None and found.host is None
        found = found.disk
        assert found is not None and found.blocks == b"" and found.started_fresh is not None
        # One after another: each store finds the slots the last one filled
        # ready, and moves their blocks to disk.
        for rid, prompt in prompts.items():
            _run(a, {rid: prompt})
        demoted = a.connector.connector_scheduler.manager.stats["demoted"]
        assert demoted > 0, a.connector.connector_scheduler.manager.stats
    finally:
        _stop(a)
    # The engine wrote its use history beside the kept tier when it stopped.
    uses = list((tmp_path / "g3").glob("*.uses"))
    assert len(uses) == 1 and uses[0].stat().st_size > 0, list((tmp_path / "g3").iterdir())
    # The store's own reader finds every kept block sound.
    from kvbm_py import _kvbm

    seen = _kvbm.inspect_g3(found.directory, True)
    assert seen["verified"] and seen["blocks"] > 0 and seen["bad_blocks"] == [], seen

    b, found = _start(tmp_path, model_dir)
    try:
        manager = b.connector.connector_scheduler.manager
        found = found.disk
        assert found is not None and found.started_fresh is None
        kept = len(found.blocks) // KEPT_ENTRY_BYTES
        assert manager.stats["recovered"] == kept > 0
        # The blocks found are announced as on disk, by their offload keys.
        assert _announced(manager, Medium.STORAGE) == kept
        # The first prompt's blocks come back from disk, byte for byte.
        _ready(b, "again", prompts["p0"])
        assert manager.stats["loaded_from_disk"] > 0, manager.stats
        _reset_then_store(b)
    finally:
        _stop(b)

    c, found = _start(tmp_path, model_dir)
    try:
        assert found is not None and found.disk is not None and found.disk.blocks == b"", found
        assert c.connector.connector_scheduler.manager.stats["recovered"] == 0
    finally:
        _stop(c)


def test_an_engine_laying_kv_out_otherwise_reuses_no_kept_block(tmp_path, monkeypatch):
    """The same model, weights and block size, but KV tensors that lay a
    block's bytes out otherwise (another attention backend): the kept disk
    tier's blocks would be read as other values, so a restart with such
    tensors starts the tier afresh and computes every prompt, while a
    restart with the same layout serves the blocks."""
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    model_dir = str(tmp_path / "model")
    prompts = {f"p{i}": [i + 1] * (4 * BLOCK + 3) for i in range(4)}
    a, _ = _start(tmp_path, model_dir)
    try:
        for rid, prompt in prompts.items():
            _run(a, {rid: prompt})
        assert a.connector.connector_scheduler.manager.stats["demoted"] > 0
    finally:
        _stop(a)
    same, found = _start(tmp_path, model_dir)
    try:
        assert found.disk.started_fresh is None and found.disk.blocks
    finally:
        _stop(same)
    other, found = _start(tmp_path, model_dir, heads_outer=True)
    try:
        assert found.disk.started_fresh is not None and found.disk.blocks == b"", found.disk
        _run(other, {"again": prompts["p0"]})
        assert other.scheduled["again"] == len(prompts["p0"]), other.log
    finally:
        _stop(other)


def test_blocks_not_every_rank_holds_are_left_out(tmp_path):
    from vllm.v1.kv_offload.base import make_offload_key

    from kvbm_py import InvalidArgumentError, _kvbm
    from kvbm_py.vllm.offload_kept import KeptFound, KeptNames, KeptTier, common_blocks, reports_of

    key = [make_offload_key(bytes([n]) * 32, 0) for n in range(4)]
    k = [_kvbm.OffloadBooks.key(x) for x in key]

    def packed(*entries: tuple[int, int]) -> bytes:
        return b"".join(struct.pack("<IQ", slot, kvbm) for slot, kvbm in entries)

    rank0 = KeptTier(str(tmp_path / "r0"), packed((2, k[2]), (0, k[0]), (1, k[1])), 1, None)
    rank1 = KeptTier(str(tmp_path / "r1"), packed((0, k[0]), (1, k[3]), (2, k[2])), 0, None)
    blocks, rejected = common_blocks([rank0, rank1])
    assert blocks == packed((0, k[0]), (2, k[2]))
    # One torn record, and slot 1 names two blocks.
    assert rejected == 1 + 2
    # Rank 0's report comes first whatever order vLLM hands them in.
    found = {1: KeptFound(host=None, disk=rank1), 0: KeptFound(host=rank0, disk=rank0)}
    assert reports_of(found, 2, "disk") == ([rank0, rank1], "")
    reports, why = reports_of(found, 2, "host")
    assert reports == [] and "1 of 2 ranks reported a kept host tier" in why
    reports, why = reports_of({0: found[0], 1: None}, 2, "disk")
    assert reports == [] and "1 of 2" in why
    with pytest.raises(InvalidArgumentError, match="whole 12-byte entries"):
        _kvbm.kept_common([b"\0" * 13])

    # The names file: appended, read back (a torn last entry ignored),
    # written anew, and removed when the records started afresh.
    (tmp_path / "r0").mkdir()
    names = KeptNames(str(tmp_path / "r0"), fresh=False)
    names.append([(k[0], key[0]), (k[1], key[1])])
    names.close()
    with open(names.path, "ab") as f:
        f.write(k[2].to_bytes(8, "little") + bytes([36]) + key[2][:10])
    assert names.read() == {k[0]: key[0], k[1]: key[1]}
    names.rewrite({k[1]: key[1]})
    assert names.read() == {k[1]: key[1]}
    assert KeptNames(str(tmp_path / "r0"), fresh=True).read() == {}


def test_the_disk_tier_is_not_kept_without_a_fixed_hash_seed(tmp_path, monkeypatch):
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    extra = {**KEPT, "disk_cache_dir": str(tmp_path / "g3")}
    h = build(tmp_path, extra, connector="KvbmOffloadingConnector")
    try:
        assert get_kv_transfer_group().get_handshake_metadata() is None
    finally:
        _stop(h)
    # Nor when the user says so.
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    h = build(tmp_path, {**extra, "disk_cache_keep": False}, connector="KvbmOffloadingConnector")
    try:
        assert get_kv_transfer_group().get_handshake_metadata() is None
    finally:
        _stop(h)


def test_vllms_own_connector_name_keeps_no_tier(tmp_path, monkeypatch):
    """Behind vLLM's own ``OffloadingConnector`` (``"spec_name": "kvbm"``)
    nothing takes kept tiers up, so none is kept: the worker's G3 is a file
    of its own, removed at exit, and its G2 is plain memory."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    from conftest import kept_g2_removed
    from kvbm_py.vllm.plugin import register_spec

    # What the wheel's vLLM plugin does in an engine.
    register_spec()
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    extra = {**KEPT, "disk_cache_dir": str(tmp_path / "g3"), "spec_name": "kvbm", "cpu_cache_keep": True}
    with kept_g2_removed() as (base, before):
        h = build(tmp_path, extra, connector="OffloadingConnector")
        try:
            worker = get_kv_transfer_group().connector_worker.worker
            assert worker.kept is None and worker.pages.kept() is None and worker.pages.kept_host() is None
        finally:
            _stop(h)
        assert not (set(base.iterdir()) if base.is_dir() else set()) - before
    assert not [p for p in (tmp_path / "g3").iterdir() if p.name.startswith("kept-")]


def test_a_restarted_engine_serves_its_kept_host_tier_and_a_reset_empties_it(tmp_path, monkeypatch):
    """With ``cpu_cache_keep`` the host slots live in ``/dev/shm``: a
    restarted engine takes up what every rank's host records name (before
    its disk tier), announces it, and loads it byte for byte; blocks moved
    to disk come back from there; a reset empties both."""
    from vllm.v1.kv_offload.base import Medium

    from conftest import kept_g2_removed
    from kvbm_py.vllm.offload_kept import KEPT_ENTRY_BYTES

    monkeypatch.setenv("PYTHONHASHSEED", "0")
    model_dir = str(tmp_path / "model")
    rng = random.Random(5)
    prompts = {f"p{i}": [rng.randrange(1, 1000) for _ in range(4 * BLOCK + 3)] for i in range(4)}
    # A host tier of six blocks: the last prompts stay there, the first
    # ones move to disk.
    more = {"cpu_cache_keep": True, "cpu_cache_gb": 6.5 * BLOCK_BYTES / 2**30}
    with kept_g2_removed():
        a, found = _start(tmp_path, model_dir, **more)
        try:
            assert found is not None and found.host is not None and found.disk is not None
            assert found.host.blocks == b"" and found.host.started_fresh is not None
            assert found.host.directory.startswith("/dev/shm") or not __import__("os").path.isdir("/dev/shm")
            for rid, prompt in prompts.items():
                _run(a, {rid: prompt})
            stats = a.connector.connector_scheduler.manager.stats
            assert stats["stored"] > 6 and stats["demoted"] > 0, stats
        finally:
            _stop(a)

        b, found = _start(tmp_path, model_dir, **more)
        try:
            manager = b.connector.connector_scheduler.manager
            assert found is not None and found.host is not None and found.host.started_fresh is None
            host = len(found.host.blocks) // KEPT_ENTRY_BYTES
            assert manager.stats["recovered_host"] == host > 0, manager.stats
            assert manager.stats["recovered"] > host, manager.stats
            # The blocks found in the host tier are announced as there.
            assert _announced(manager, Medium.CPU) == host
            # The last prompt's blocks come back from the host tier, byte
            # for byte (read from memory the last engine wrote), the first
            # one's from disk.
            _ready(b, "last", prompts["p3"])
            loaded = manager.stats["loaded"] - manager.stats["loaded_from_disk"]
            assert loaded > 0, manager.stats
            _ready(b, "first", prompts["p0"])
            assert manager.stats["loaded_from_disk"] > 0, manager.stats
            _reset_then_store(b)
        finally:
            _stop(b)

        c, found = _start(tmp_path, model_dir, **more)
        try:
            assert found is not None and found.host is not None and found.host.blocks == b"", found
            assert found.disk is not None and found.disk.blocks == b"", found
            assert c.connector.connector_scheduler.manager.stats["recovered"] == 0
        finally:
            _stop(c)

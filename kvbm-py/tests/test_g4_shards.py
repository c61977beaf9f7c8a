"""Blocks shared between engines of different tensor-parallel sizes
(``kvbm_py.vllm.g4_shards``).

- The plan a reader builds its pages with, against vLLM's own page
  mappings, for every physical layout vLLM relates to a canonical page (K
  and V packed or split, NHD or HND) and every pair of tensor-parallel
  sizes over 4 KV heads: the pages a reader builds from another split's
  shards are, byte for byte, the pages its own engine would hold.
- Through a real store (a ``mooncake_master`` on loopback) and real page
  workers: a block whose two shards two ranks published is assembled whole
  by the one rank of an engine without tensor parallelism, each rank of a
  two-rank engine takes its half of a block one rank published, the
  scheduler finds which split holds a block, and a shard damaged on the
  way fails the load instead of reaching the engine.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import _layer_mapping, _RankContext
from vllm.v1.kv_cache_interface import FullAttentionSpec

from kvbm_py import _kvbm
from kvbm_py.g4 import SUM_BYTES
from kvbm_py.vllm.g4_shards import G4Parts, PageLayout, plan
from test_g4_identity import _config

HEADS, TOKENS, HEAD = 4, 16, 8
LAYERS = 2
#: Canonical page bytes of one layer: K and V of every head, bf16.
CANONICAL = HEADS * TOKENS * 2 * HEAD * 2
FORMS = ["packed-nhd", "packed-hnd", "split-nhd", "split-hnd"]


def mapping(form: str, tp: int, rank: int):
    """vLLM's mapping of rank ``rank``'s page of one layer at ``tp`` ranks,
    for pages laid out as ``form`` says."""
    heads = max(1, HEADS // tp)
    spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=heads, head_size=HEAD, dtype=torch.bfloat16)
    page = heads * TOKENS * 2 * HEAD
    if form.startswith("packed"):
        shape = (2, heads, TOKENS, 2 * HEAD)
        nhd = (page, 2 * HEAD, heads * 2 * HEAD, 1)
        hnd = (page, TOKENS * 2 * HEAD, 2 * HEAD, 1)
    else:
        shape = (2, 2, TOKENS, heads, HEAD)
        half = TOKENS * heads * HEAD
        nhd = (page, half, heads * HEAD, HEAD, 1)
        hnd = (page, half, HEAD, TOKENS * HEAD, 1)
    strides = nhd if form.endswith("nhd") else hnd
    tensor = torch.empty_strided(shape, strides, dtype=torch.bfloat16, device="meta")
    ctx = _RankContext(tp_size=tp, dcp_size=1, pcp_size=1, interleave=1, total_kv_heads=HEADS, rank=rank)
    found = _layer_mapping(spec, tensor, 2, ctx)
    assert found is not None, (form, tp, rank)
    return found


def layout(form: str, tp: int, rank: int) -> PageLayout:
    m = mapping(form, tp, rank)
    refs = [SimpleNamespace(mapping=m, page_size_bytes=m.local_page_size_bytes)] * LAYERS
    found = PageLayout.of_refs(refs, min(tp, HEADS))
    assert found is not None
    return found


def local(lay: PageLayout, canonical: bytes) -> bytes:
    """A rank's block (its layers' pages, one after another) of the block
    whose canonical pages are ``canonical``."""
    out = bytearray(lay.page * LAYERS)
    for layer in range(LAYERS):
        for lo, co, size in lay.fragments(layer):
            at = layer * CANONICAL + co
            out[layer * lay.page + lo : layer * lay.page + lo + size] = canonical[at : at + size]
    return bytes(out)


def ranks(split: int) -> list[int]:
    """One rank holding each share of ``split`` (at ``split`` ranks)."""
    return list(range(split))


@pytest.mark.parametrize("form", FORMS)
def test_a_reader_of_any_split_builds_its_pages_from_any_other_split(form):
    canonical = random.Random(form).randbytes(CANONICAL * LAYERS)
    for write_tp in (1, 2, 4):
        writers = {h: layout(form, write_tp, h) for h in ranks(min(write_tp, HEADS))}
        for read_tp in (1, 2, 4, 8):
            for rank in range(read_tp):
                reader = layout(form, read_tp, rank)
                p = plan(reader, writers, SUM_BYTES)
                assert p is not None, (form, write_tp, read_tp, rank)
                bundle = b"".join(local(writers[h], canonical) + b"\0" * SUM_BYTES for h in p.shares)
                assert p.shard_bytes == writers[0].page * LAYERS
                built = bytearray(reader.page * LAYERS)
                written = 0
                for src, dst, n in p.pieces:
                    built[dst : dst + n] = bundle[src : src + n]
                    written += n
                assert written == len(built), "every byte once"
                assert bytes(built) == local(reader, canonical), (form, write_tp, read_tp, rank)
                # A reader reads only the shards holding its share.
                assert len(p.shares) == max(1, min(write_tp, HEADS) // min(read_tp, HEADS))


def test_plans_refuse_layouts_of_another_page_or_missing_shares():
    reader = layout("split-nhd", 1, 0)
    halves = {h: layout("split-nhd", 2, h) for h in (0, 1)}
    assert plan(reader, {0: halves[0]}, SUM_BYTES) is None, "a share missing"
    other = dataclasses.replace(halves[1], canonical=halves[1].canonical * 2)
    assert plan(reader, {0: halves[0], 1: other}, SUM_BYTES) is None, "another canonical page"
    assert plan(reader, {}, SUM_BYTES) is None
    assert PageLayout.from_bytes(b"not json") is None
    assert PageLayout.from_bytes(halves[0].to_bytes()) == halves[0]
    # vLLM could not relate a page: no layout.
    refs = [SimpleNamespace(mapping=None, page_size_bytes=4096)]
    assert PageLayout.of_refs(refs, 1) is None


if os.environ.get("KVBM_REQUIRE_G4") == "1":
    import mooncake.store  # noqa: F401
else:
    pytest.importorskip("mooncake.store")

from kvbm_py.g4_local import LocalMaster  # noqa: E402
from kvbm_py.vllm.offload_g4 import G4Lookups, G4Mover  # noqa: E402

FORM = "split-nhd"


def shards_info(tp: int) -> dict:
    return {0: {"shards": min(tp, HEADS), "splits": [1, 2, 4], "page": CANONICAL}}


class Rank:
    """One rank of an engine at ``tp`` ranks: its pages (block 1 holds
    its share of ``canonical``), its page worker (checksums salted with
    ``salt``, as its attention backends say) and its G4 traffic."""

    def __init__(self, master: LocalMaster, tp: int, rank: int, canonical: bytes | None, salt: int = 0) -> None:
        self.layout = layout(FORM, tp, rank)
        page = self.layout.page
        self.layers = [torch.zeros((2, page), dtype=torch.int8) for _ in range(LAYERS)]
        if canonical is not None:
            mine = local(self.layout, canonical)
            for i, t in enumerate(self.layers):
                t[1] = torch.frombuffer(bytearray(mine[i * page : (i + 1) * page]), dtype=torch.int8)
        self.pages = _kvbm.PageWorker(
            [(self.layers, page)], 2, 4, page * LAYERS, verify=True, sum_tail=True, tail_salt=salt
        )
        self.parts = G4Parts.of(_config("m", tp=tp), shards_info(tp), rank)
        from kvbm_py.g4 import G4Client

        self.client = G4Client(master.config, "shards-test")
        self.mover = G4Mover(self.client, self.pages, self.parts, [self.layout], [0])

    def block(self, i: int) -> bytes:
        return b"".join(bytes(t[i].numpy().tobytes()) for t in self.layers)

    def settle(self) -> None:
        deadline = time.monotonic() + 30
        while not self.mover.idle():
            assert time.monotonic() < deadline, "the G4 thread never went idle"
            time.sleep(0.01)

    def publish(self, key: bytes) -> None:
        self.pages.store(1, [(0, 1, 0)], [])
        self.pages.wait([1])
        assert self.pages.finished()[0][1]
        self.mover.publish([(0, 0, key)])
        self.settle()

    def load(self, key: bytes, split: int) -> tuple[bool, list]:
        """Fetches ``key`` from split ``split`` into slot 2 and loads it into
        block 0: whether the load ended well, and the jobs G4 failed."""
        self.mover.fetch(7, [(0, 2, key, split)], lambda: self.pages.load(7, [(0, 0, 2)]))
        self.settle()
        failed = self.mover.take_failed()
        if failed:
            return False, failed
        self.pages.wait([7])
        return self.pages.finished()[0][1], failed

    def close(self) -> None:
        self.mover.close()
        self.client.close()


@pytest.fixture
def master(tmp_path) -> LocalMaster:
    with LocalMaster(segment_bytes=32 << 20, local_buffer_bytes=4 << 20, log=tmp_path / "master.log") as m:
        yield m


def test_shards_of_one_split_are_assembled_by_ranks_of_another(master):
    canonical = random.Random(7).randbytes(CANONICAL * LAYERS)
    key = b"k" * 32 + (0).to_bytes(4, "big")
    other = b"o" * 32 + (0).to_bytes(4, "big")
    writers = [Rank(master, 2, r, canonical) for r in range(2)]
    single = Rank(master, 1, 0, canonical)
    readers = [Rank(master, 2, r, None) for r in range(2)]
    reader_one = Rank(master, 1, 0, None)
    everyone = [*writers, single, *readers, reader_one]
    try:
        for w in writers:
            w.publish(key)
        single.publish(other)
        # The scheduler of an engine without tensor parallelism finds the
        # block in the two-rank engine's split, and the other in its own.
        lookups = G4Lookups(reader_one.client, reader_one.parts, {0: 0})
        try:
            for k in (key, other, b"x" * 32 + bytes(4)):
                assert lookups.held(k) is None
            lookups.flush()
            deadline = time.monotonic() + 10
            while lookups.pending():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            assert lookups.held(key) is True and lookups.split(key) == 2
            assert lookups.held(other) is True and lookups.split(other) == 0
            assert lookups.held(b"x" * 32 + bytes(4)) is False
        finally:
            lookups.close()
        # Two shards make one block; one block makes two halves.
        ok, failed = reader_one.load(key, 2)
        assert ok and not failed
        assert reader_one.block(0) == canonical
        for r in readers:
            ok, failed = r.load(other, 1)
            assert ok and not failed
            assert r.block(0) == local(r.layout, canonical)
            assert r.mover.assembled == 1
        # A shard damaged on the way: the job fails, the pages stay zero.
        readers[0].layers[0][0].zero_()
        readers[0].mover.test_corrupt = lambda slot: None
        ok, failed = readers[0].load(other, 1)
        assert not ok and failed and failed[0][1] == 1, failed
        assert readers[0].mover.damaged == 1
        assert not any(readers[0].block(0)[: len(readers[0].layers[0][0])])
    finally:
        for r in everyone:
            r.close()


def test_blocks_of_an_engine_laying_kv_out_otherwise_are_refused(master):
    """Engines whose attention backends lay pages out otherwise salt their
    checksums otherwise: a block one published fails the other's checks,
    read in its own split or assembled from another, and its pages stay
    zero, while a reader of the same backends takes it."""
    canonical = random.Random(8).randbytes(CANONICAL * LAYERS)
    key = b"s" * 32 + (0).to_bytes(4, "big")
    writers = [Rank(master, 2, r, canonical, salt=11) for r in range(2)]
    same = Rank(master, 1, 0, None, salt=11)
    others = [Rank(master, 1, 0, None, salt=12), Rank(master, 2, 0, None, salt=12)]
    try:
        for w in writers:
            w.publish(key)
        ok, failed = same.load(key, 2)
        assert ok and not failed and same.block(0) == canonical
        for reader, split in zip(others, (2, 0), strict=True):
            ok, failed = reader.load(key, split)
            assert not ok and failed and failed[0][1] >= 1, failed
            assert reader.mover.damaged >= 1
            assert not any(reader.block(0))
    finally:
        for r in [*writers, same, *others]:
            r.close()

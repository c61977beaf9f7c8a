"""The identity G4 shares blocks under, and the parts each block is kept
in: engines whose blocks are interchangeable get the same identity and
parts, anything that changes a block's bytes or its name gives another,
engines of another parallelism share the shards of every group vLLM
relates to a canonical page and nothing else, and without a fixed hash
seed there is no identity."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvbm_py.vllm.g4_shards import G4Parts
from kvbm_py.vllm.offload_g4 import g4_identity


def ident(config: OffloadingConfig, shards: dict | None = None) -> str | None:
    return g4_identity(config, G4Parts.of(config, shards, 0))[0]


def sharded(shards: int, page: int = 4096) -> dict:
    """:func:`shards_of`'s answer for one attention group of 4 KV heads."""
    return {0: {"shards": shards, "splits": [1, 2, 4], "page": page}}


def _config(model: str, tp: int = 1, dtype: str = "bfloat16", tokens: int = 16) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=tokens, layer_names=("l0", "l1"), group_id=0),),
        worker_kv_bytes_per_block=65536,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="e",
        model=OffloadingModelConfig(name=model, dtype=dtype),
        cache=OffloadingCacheConfig(tokens_per_hash=tokens, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=tp,
            tp_size=tp,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


def test_identities_follow_what_makes_blocks_interchangeable(tmp_path, monkeypatch):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"w" * 64)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    base = ident(_config(str(model)))
    assert base is not None
    # Another engine (its own engine id, its own rank) of the same model.
    other = dataclasses.replace(_config(str(model)), engine_id="another")
    assert ident(other) == base
    differ = [
        _config(str(model), dtype="float16"),
        _config(str(model), tokens=32),
        _config(str(tmp_path / "elsewhere")),
    ]
    assert all(ident(c) not in (None, base) for c in differ)
    # New weights under the same path.
    (model / "model.safetensors").write_bytes(b"v" * 65)
    assert ident(_config(str(model))) != base
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    assert ident(_config(str(model))) not in (None, base)


def test_engines_of_another_parallelism_share_shards_and_only_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    one, two = _config("m"), _config("m", tp=2)
    # A group published per rank: the parts name the parallelism.
    per_rank = [G4Parts.of(c, None, 0) for c in (one, two)]
    assert per_rank[0].own == (("w1t1p1c1d1.r0",),)
    assert per_rank[1].own == (("w2t2p1c1d1.r0", "w2t2p1c1d1.r1"),)
    assert per_rank[0].others == per_rank[1].others == ((),)
    # A sharded group: one identity, the shards of each split, and each
    # engine looks for the other splits.
    assert ident(one, sharded(1)) == ident(two, sharded(2)) is not None
    assert ident(one, sharded(1)) != ident(one, sharded(1, page=8192)), "another canonical page"
    assert ident(one, sharded(1)) != ident(one), "per-rank groups are not canonical pages"
    p1, p2 = G4Parts.of(one, sharded(1), 0), G4Parts.of(two, sharded(2), 1)
    assert p1.own == (("c1.0",),) and p1.others == ((2, 4),)
    assert p2.own == (("c2.0", "c2.1"),) and p2.mine == ("c2.1",) and p2.others == ((1, 4),)
    # More ranks than shares (replicated heads): ranks 0 and 1 hold share 0,
    # and only rank 0 publishes it.
    four = _config("m", tp=4)
    replicated = [G4Parts.of(four, sharded(2), r) for r in range(4)]
    assert [p.mine[0] for p in replicated] == ["c2.0", "c2.0", "c2.1", "c2.1"]
    assert [p.publishes[0] for p in replicated] == [True, False, True, False]


@pytest.mark.parametrize("seed", [None, "random"])
def test_no_identity_without_a_fixed_hash_seed(monkeypatch, seed):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    identity, why = g4_identity(_config("m"), G4Parts.of(_config("m"), None, 0))
    assert identity is None and "PYTHONHASHSEED" in why

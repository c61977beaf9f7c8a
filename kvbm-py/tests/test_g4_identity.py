"""The identity G4 shares blocks under: engines whose blocks are
interchangeable get the same one, anything that changes a block's bytes
or its name gives another, and without a fixed hash seed there is none."""

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

from kvbm_py.vllm.offload_g4 import g4_identity


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
    base, _ = g4_identity(_config(str(model)))
    assert base is not None
    # Another engine (its own engine id, its own rank) of the same model.
    other = dataclasses.replace(_config(str(model)), engine_id="another")
    assert g4_identity(other)[0] == base
    differ = [
        _config(str(model), tp=2),
        _config(str(model), dtype="float16"),
        _config(str(model), tokens=32),
        _config(str(tmp_path / "elsewhere")),
    ]
    assert all(g4_identity(c)[0] not in (None, base) for c in differ)
    # New weights under the same path.
    (model / "model.safetensors").write_bytes(b"v" * 65)
    assert g4_identity(_config(str(model)))[0] != base
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    assert g4_identity(_config(str(model)))[0] not in (None, base)


@pytest.mark.parametrize("seed", [None, "random"])
def test_no_identity_without_a_fixed_hash_seed(monkeypatch, seed):
    if seed is None:
        monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    else:
        monkeypatch.setenv("PYTHONHASHSEED", seed)
    identity, why = g4_identity(_config("m"))
    assert identity is None and "PYTHONHASHSEED" in why

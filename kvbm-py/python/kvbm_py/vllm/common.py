"""What both roles derive from vLLM's configuration."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


def engine_id(vllm_config: "VllmConfig") -> str:
    """The engine instance's id, the same in every process of it."""
    kv = vllm_config.kv_transfer_config
    return str(getattr(kv, "engine_id", None) or "default")


def instance_of(engine: str) -> int:
    """kvbm's 64-bit instance id for an engine id."""
    return int.from_bytes(hashlib.sha256(engine.encode()).digest()[:8], "little")


def world_size(vllm_config: "VllmConfig") -> int:
    """Worker processes holding a slice of every block (TP x PP ranks)."""
    p = vllm_config.parallel_config
    return int(p.tensor_parallel_size) * int(p.pipeline_parallel_size)

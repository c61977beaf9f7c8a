"""What both roles derive from vLLM's configuration."""

from __future__ import annotations

import hashlib
import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: The connector's log lines. A child of vLLM's ``vllm`` logger, so they
#: appear where vLLM's own do, at the level and in the format vLLM's logging
#: configuration (``VLLM_LOGGING_LEVEL``, ``VLLM_LOGGING_CONFIG_PATH``) sets.
log = logging.getLogger("vllm.kvbm_py")


def engine_id(vllm_config: VllmConfig) -> str:
    """The engine instance's id, the same in every process of it."""
    kv = vllm_config.kv_transfer_config
    return str(getattr(kv, "engine_id", None) or "default")


def instance_of(engine: str) -> int:
    """kvbm's 64-bit instance id for an engine id."""
    return int.from_bytes(hashlib.sha256(engine.encode()).digest()[:8], "little")


def world_size(vllm_config: VllmConfig) -> int:
    """Worker processes holding a slice of every block (TP x PP ranks)."""
    p = vllm_config.parallel_config
    return int(p.tensor_parallel_size) * int(p.pipeline_parallel_size)

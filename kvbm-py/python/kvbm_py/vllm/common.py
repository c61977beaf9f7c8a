"""What both roles derive from vLLM's configuration."""

from __future__ import annotations

import dataclasses
import hashlib
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

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
    return digest64(engine)


def digest64(text: str) -> int:
    """A 64-bit digest of ``text``, the same in every process."""
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def world_size(vllm_config: VllmConfig) -> int:
    """Worker processes holding a slice of every block (TP x PP ranks)."""
    p = vllm_config.parallel_config
    return int(p.tensor_parallel_size) * int(p.pipeline_parallel_size)


@dataclasses.dataclass(frozen=True)
class KvEncoding:
    """How the engine's KV tensors lay a block's bytes out (see
    :func:`kv_encoding`)."""

    #: The attention backends vLLM built for the layers (empty: unknown).
    backends: tuple[str, ...]
    #: Per kind of tensor: its shape with the block axis named ``B``, the
    #: order of its axes in memory (outermost first) and its element type.
    tensors: tuple[str, ...]

    def __str__(self) -> str:
        return f"backends {','.join(self.backends) or 'unknown'}; tensors {'; '.join(self.tensors)}"

    def salt(self) -> int:
        """What the checksums of blocks shared with other engines are
        salted with: the backends, which lay the canonical pages out the
        same way at any parallelism; 0 where they are unknown."""
        if not self.backends:
            return 0
        return digest64(",".join(self.backends)) or 1


def kv_encoding(kv_caches: Mapping[str, Any], num_blocks: int, vllm_config: Any) -> KvEncoding:
    """How the engine's KV tensors ``kv_caches`` (vLLM's, by layer) lay a
    block's bytes out. What the weights, dtype and block size leave open: a
    backend that lays K and V, heads or tokens out otherwise reads other
    values from the same bytes (two layouts can share a shape), so blocks
    are reused across a restart, or taken from another engine, only under
    the same encoding."""
    context = getattr(getattr(vllm_config, "compilation_config", None), "static_forward_context", None) or {}
    backends: set[str] = set()
    for layer in kv_caches:
        get_name = getattr(getattr(context.get(layer), "attn_backend", None), "get_name", None)
        if callable(get_name):
            backends.add(str(get_name()))
    kinds: set[str] = set()
    stack = list(kv_caches.values())
    while stack:
        t = stack.pop()
        if isinstance(t, (list, tuple)):
            stack.extend(t)
            continue
        shape, strides = tuple(t.shape), tuple(t.stride())
        block_axis = shape.index(num_blocks) if num_blocks in shape else -1
        dims = ["B" if i == block_axis else str(d) for i, d in enumerate(shape)]
        # Ties (axes of one element) keep their place.
        order = sorted(range(len(shape)), key=lambda i: (-strides[i], i))
        kinds.add(f"{'x'.join(dims)} order {','.join(map(str, order))} {t.dtype}")
    return KvEncoding(tuple(sorted(backends)), tuple(sorted(kinds)))


def with_encoding(identity: str, encoding: KvEncoding | None) -> str:
    """``identity`` with the engine's KV encoding as one more line, where
    it is known."""
    return identity if encoding is None else f"{identity}\nkv_encoding: {encoding}"

"""kvbm's tier events as vLLM KV events (``BlockStored``/``BlockRemoved``).

kvbm's event stream names a block by its 64-bit key; vLLM's events carry
the block's full hash, its parent's, its tokens and LoRA. The scheduler
side notes those when it queues a block for offload, and this tracker
turns kvbm's events into vLLM's with them: G2 is medium ``CPU``, G3
``STORAGE`` (vLLM's own names for its offloading tiers).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
)
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

#: kvbm tier -> vLLM event medium.
MEDIUM = {"g2": MEDIUM_CPU, "g3": MEDIUM_STORAGE}
#: Descriptions kept of blocks no tier holds: just noted (their store
#: event not yet seen, or their offload skipped) or gone (events of
#: different tiers may arrive out of order: G2's removal before G3's store).
KEEP_GONE = 4096


def key_of(block_hash: bytes) -> int:
    """kvbm's key of a vLLM block hash (first 8 bytes, little-endian)."""
    return int.from_bytes(block_hash[:8], "little")


@dataclass(frozen=True)
class _Block:
    block_hash: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None


class EventTracker:
    """Describes the blocks the scheduler side offloads, and turns kvbm's
    raw events (``Scheduler.take_events()``) into vLLM KV events."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._blocks: dict[int, _Block] = {}
        self._tiers: dict[int, set[str]] = {}
        self._gone: deque[int] = deque()

    def note(self, request: Any, start: int, end: int) -> None:
        """Remembers blocks ``start..end`` of ``request`` (about to be
        offloaded)."""
        hashes = request.block_hashes
        lora = request.lora_request
        bs = self.block_size
        for i in range(start, end):
            key = key_of(hashes[i])
            if key in self._blocks:
                continue
            self._blocks[key] = _Block(
                block_hash=hashes[i],
                parent=hashes[i - 1] if i > 0 else None,
                token_ids=tuple(request.all_token_ids[i * bs : (i + 1) * bs]),
                lora_id=lora.adapter_id if lora else None,
                lora_name=lora.name if lora else None,
            )
            # Dropped after a while unless a tier stores it (its offload
            # may be skipped).
            self._forget_later(key)

    def convert(self, raw: Iterable[tuple[bool, str, int, int | None]]) -> list[KVCacheEvent]:
        """vLLM events for kvbm's ``(stored, tier, key, parent)`` events;
        blocks kvbm holds that no request described are left out."""
        out: list[KVCacheEvent] = []
        for stored, tier, key, _parent in raw:
            block = self._blocks.get(key)
            medium = MEDIUM.get(tier)
            if block is None or medium is None:
                continue
            if stored:
                self._tiers.setdefault(key, set()).add(tier)
                out.append(
                    BlockStored(
                        block_hashes=[maybe_convert_block_hash(BlockHash(block.block_hash))],
                        parent_block_hash=(
                            maybe_convert_block_hash(BlockHash(block.parent)) if block.parent is not None else None
                        ),
                        token_ids=list(block.token_ids),
                        block_size=self.block_size,
                        lora_id=block.lora_id,
                        medium=medium,
                        lora_name=block.lora_name,
                        group_idx=0,
                    )
                )
            else:
                tiers = self._tiers.get(key)
                if tiers is not None:
                    tiers.discard(tier)
                    if not tiers:
                        del self._tiers[key]
                        self._forget_later(key)
                out.append(
                    BlockRemoved(
                        block_hashes=[maybe_convert_block_hash(BlockHash(block.block_hash))],
                        medium=medium,
                        group_idx=0,
                    )
                )
        return out

    def _forget_later(self, key: int) -> None:
        self._gone.append(key)
        while len(self._gone) > KEEP_GONE:
            old = self._gone.popleft()
            if old not in self._tiers:
                self._blocks.pop(old, None)

    def described(self) -> int:
        """Blocks described now (for tests)."""
        return len(self._blocks)

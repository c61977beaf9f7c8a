"""The scheduler half of vLLM's offloading connector, with kvbm's books
asked for a run of keys at once.

vLLM's ``OffloadingConnectorScheduler`` builds a request's offload keys
one Python call at a time, records each key's token position for its own
managers, and asks its manager about the keys one by one, every step a
request waits: a cost of the scheduler's that grows with the prompt
(``docs/benchmarks.md`` has it against vLLM's own offloading). Behind
``KvbmOffloadingConnector`` vLLM's group logic stays, and three of its
steps are kvbm's, with the same results:

- a request's keys of each group are a :class:`kvbm_py._kvbm.OffloadKeys`
  in place of vLLM's list: extended from the request's block hashes in
  one call, its slices views of the same keys, each key a ``bytes``
  object only once vLLM reads it (the lookups below read none). Their
  token positions are not recorded, as kvbm's books never read them (they
  order a request's keys by the request's list of them);
- the prefix lookup of a full-attention group, and the scan from the end
  of a sliding-window group, are one call into the books each
  (``OffloadBooks.lookup_prefix``, ``OffloadBooks.lookup_window``), which
  note the keys asked for as the per-key lookups do. With G4 behind the
  books (whose lookups may answer ``RETRY``), the keys after the books'
  prefix and the sliding-window scans are asked key by key.

How the groups' answers combine, partial tails and the eagle groups'
volatile tail are vLLM's own.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, cast

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
    GroupOffloadConfig,
    OffloadingConnectorScheduler,
    RequestOffloadState,
)
from vllm.v1.kv_offload.base import OffloadKey, ReqContext

from kvbm_py import _kvbm


class KvbmRequestState(RequestOffloadState):
    """vLLM's offloading state of one request, its offload keys of each
    group an :class:`~kvbm_py._kvbm.OffloadKeys` extended in one call."""

    __slots__ = ()

    def update_offload_keys(self) -> None:
        """Appends the keys of the request's blocks hashed since the last
        call, each group's as vLLM builds them: the block hash of every
        chunk's last block and the group index."""
        # vLLM's block hashes are bytes; its offload keys too.
        hashes = cast(list[bytes], self.req.block_hashes)
        for config, group in zip(self.config.kv_group_configs, self.group_states, strict=True):
            # vLLM types the keys as its list; they are an OffloadKeys
            # once this class made them.
            held: object = group.offload_keys
            if isinstance(held, _kvbm.OffloadKeys):
                keys = held
            else:
                # vLLM's own list (empty, or made before this class took
                # over): the same keys, rebuilt from the first hash.
                keys = _kvbm.OffloadKeys(config.group_idx)
                group.offload_keys = cast(list[OffloadKey], cast(object, keys))
            step = config.hashes_per_chunk
            start = step * len(keys) + step - 1
            if start < len(hashes):
                keys.extend_hashes(hashes, start, step)


class KvbmConnectorScheduler(OffloadingConnectorScheduler):
    """vLLM's scheduler half with kvbm's key building and lookups.
    It holds no state of its own: the instance vLLM built takes this
    class, and each request's state takes :class:`KvbmRequestState`."""

    def on_new_request(self, request: Any) -> None:
        super().on_new_request(request)
        self._req_status[request.request_id].__class__ = KvbmRequestState

    def _maximal_prefix_lookup(
        self,
        keys: Iterable[OffloadKey],
        req_context: ReqContext,
        req: Any,
        group_config: GroupOffloadConfig,
        start_chunk_idx: int,
    ) -> int | None:
        lookup_prefix = getattr(self.manager, "lookup_prefix", None)
        if lookup_prefix is None:
            return super()._maximal_prefix_lookup(keys, req_context, req, group_config, start_chunk_idx)
        keys = keys if isinstance(keys, list | _kvbm.OffloadKeys) else list(keys)
        hits: int = lookup_prefix(keys, req_context.req_id)
        tracker = self._events_tracker
        if tracker.self_describing_enabled:
            for i in range(hits):
                tracker.record_lookup(req, group_config, start_chunk_idx + i, keys[i])
        if hits == len(keys) or getattr(self.manager, "g4", None) is None:
            return hits
        # Behind G2 and G3, G4 may hold the keys that follow: vLLM's loop
        # goes on from the first key the books do not hold, as it would.
        rest = super()._maximal_prefix_lookup(keys[hits:], req_context, req, group_config, start_chunk_idx + hits)
        return None if rest is None else hits + rest

    def _sliding_window_lookup(
        self,
        keys: Sequence[OffloadKey],
        sliding_window_size: int,
        req_context: ReqContext,
        initial_window_size: int | None = None,
    ) -> int | None:
        lookup_window = getattr(self.manager, "lookup_window", None)
        if lookup_window is None:
            return super()._sliding_window_lookup(keys, sliding_window_size, req_context, initial_window_size)
        keys = keys if isinstance(keys, list | _kvbm.OffloadKeys) else list(keys)
        end: int = lookup_window(
            keys, req_context.req_id, sliding_window_size, initial_window_size or sliding_window_size
        )
        return end

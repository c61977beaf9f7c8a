"""kvbm as the backend of vLLM's ``OffloadingConnector``: every model vLLM
serves, hybrid ones included.

vLLM's offloading connector holds the KV-cache-group logic (which blocks
of a sliding-window group are worth keeping, Mamba state alignment, which
prefix every group can serve) and asks a pluggable *spec* for the rest:

- a manager in the scheduler (:class:`KvbmOffloadingManager`): kvbm's
  books of the host tier and of a disk tier behind it (``OffloadBooks``):
  one slot per (block, group), ranked and admitted by kvbm's default
  policy, a slot loadable only once its store completed and never reused
  while a load reads it. A block the host tier evicts moves to disk (when
  there is one and its policy admits the block) with the store that takes
  its slot;
- a worker in each rank (:class:`KvbmOffloadingWorker`): kvbm's copy
  engine (``PageWorker``) between the engine's page tensors of every group
  and that rank's slots, pinned next to a GPU, and that rank's file of
  disk slots, with a checksum of every slot in verify mode.

Turn it on with::

    {"kv_connector": "KvbmOffloadingConnector", "kv_role": "kv_both",
     "kv_load_failure_policy": "recompute",
     "kv_connector_extra_config": {"cpu_cache_gb": 8, "disk_cache_gb": 64}}

``KvbmOffloadingConnector`` is vLLM's ``OffloadingConnector`` with kvbm's
spec and one addition: a load that fails (a copy error, or a slot that
fails its checksum) is reported as a failed load of its request, so the
engine recomputes the request (with ``kv_load_failure_policy:
"recompute"``), and its keys are never loaded again. vLLM's own name works too
(``"kv_connector": "OffloadingConnector"`` with ``"spec_name": "kvbm"``),
but vLLM 0.32's connector takes no failed job: there a failed load stops
the engine rather than serve wrong bytes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadingSpec,
    OffloadingWorker,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvbm_py import InvalidArgumentError, _kvbm
from kvbm_py.config import GIB, KvbmConfig
from kvbm_py.g4 import SUM_BYTES
from kvbm_py.vllm.common import log as logger
from kvbm_py.vllm.offload_g4 import G4Lookups, G4Mover, connect, g4_identity, lookup_stats
from kvbm_py.vllm.offload_lookup import KvbmConnectorScheduler
from kvbm_py.vllm.plugin import SPEC_NAME, register_spec
from kvbm_py.vllm.retention import retention_of

#: Keys of ``kv_connector_extra_config`` that belong to vLLM's offloading
#: connector, not to kvbm.
VLLM_KEYS = frozenset(
    {
        "spec_name",
        "spec_module_path",
        "blocks_per_chunk",
        "block_size",
        "offload_prompt_only",
        "self_describing_kv_events",
        "cpu_bytes_to_use",
        "num_cpu_blocks",
        "eviction_policy",
    }
)

#: kvbm keys this route does not serve, with why.
NOT_ON_THIS_ROUTE = {
    "offload": "vLLM's offloading connector decides when blocks are stored",
    "load_async": "vLLM's offloading connector always loads asynchronously",
    "cpu_cache_keep": "its tiers start empty with each engine; KvbmConnector keeps them",
}

#: Bytes a disk slot is padded to (a block moves to or from disk in one
#: ``O_DIRECT`` request).
DISK_ALIGNMENT = 4096


def _kvbm_config(extra: Mapping[str, Any]) -> KvbmConfig:
    own = {k: v for k, v in extra.items() if k not in VLLM_KEYS}
    cfg = KvbmConfig.from_sources(own)
    for key, why in NOT_ON_THIS_ROUTE.items():
        if key in own and own[key] != getattr(KvbmConfig, key):
            raise InvalidArgumentError(f"kvbm: {key}={own[key]!r} is not available with the offloading spec: {why}")
    if cfg.disk_cache_gb > 0 and "disk_cache_keep" in own and cfg.disk_cache_keep:
        raise InvalidArgumentError(
            "kvbm: disk_cache_keep=true is not available with the offloading spec: its G3 starts "
            "empty with each engine; KvbmConnector keeps G3 across restarts"
        )
    return cfg


class KvbmSlots(BlockIDsLoadStoreSpec):
    """Where a job's blocks live in kvbm's tiers: one slot per key, in the
    order of the engine's blocks in the job, with each key's KV cache group
    (its position among the offloaded groups), which the worker checks
    against the engine's blocks before it copies anything; for a load,
    whether each slot is a disk slot; for a store, the blocks to move from
    a host slot to a disk slot before any slot is written (a load that
    fetches from G4 may move some too). With G4: for a load, the blocks to
    fetch into their slot first (``(index in the job, offload key)``), or
    ``broken`` when some block found no slot (the job fails, the request is
    recomputed); for a store, each block's offload key, to publish it once
    stored; for either, ``(group, slot, offload key)`` of the blocks leaving
    the host tier, to publish before their slots are written."""

    def __init__(
        self,
        slots: list[int],
        groups: list[int],
        disk: list[bool] | None = None,
        demote: list[tuple[int, int]] | None = None,
        fetch: Sequence[tuple[int, bytes]] | None = None,
        publish: Sequence[bytes] | None = None,
        broken: bool = False,
        publish_first: Sequence[tuple[int, int, bytes]] | None = None,
    ):
        super().__init__(slots)
        self.groups = groups
        self.disk = disk or [False] * len(slots)
        self.demote = demote or []
        self.fetch = list(fetch or [])
        self.publish = list(publish or [])
        self.broken = broken
        self.publish_first = list(publish_first or [])


class KvbmOffloadingSpec(OffloadingSpec):
    """kvbm's spec: sizes the host tier from ``cpu_cache_gb`` per worker
    (or vLLM's ``cpu_bytes_to_use`` for all workers) and builds the
    manager and the worker."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        self.kvbm = _kvbm_config(self.extra_config)
        if self.blocks_per_chunk != 1:
            raise InvalidArgumentError(
                f"kvbm: blocks_per_chunk={self.blocks_per_chunk}: kvbm keeps one engine block per slot"
            )
        world = max(1, config.parallel.world_size)
        self.slot_bytes = config.worker_kv_bytes_per_block
        if self.slot_bytes <= 0:
            raise InvalidArgumentError("kvbm: the engine reported 0 KV bytes per block")
        #: G4's store and the identity blocks are shared under (None: no G4).
        self.g4 = self.kvbm.g4_store()
        self.g4_identity: str | None = None
        if self.g4 is not None:
            self.g4_identity, why = g4_identity(config)
            if self.g4_identity is None:
                logger.warning("kvbm: G4 at %s not used: %s", self.g4.master, why)
                self.g4 = None
        # With G4 each slot holds a block's checksum after it (the worker
        # pads that to a few hundred bytes).
        room = self.slot_bytes + (SUM_BYTES if self.g4 is not None else 0)
        if "cpu_bytes_to_use" in self.extra_config:
            per_worker = int(self.extra_config["cpu_bytes_to_use"]) // world
        else:
            per_worker = self.kvbm.tier_bytes("cpu_cache_gb", 1)
        self.slots = per_worker // room
        if self.slots < 1:
            raise InvalidArgumentError(
                f"kvbm: cpu_cache_gb={per_worker / GIB:g} GiB per worker holds no block of {self.slot_bytes} bytes"
            )
        #: Disk slots per worker (0: no G3), each padded to the alignment.
        self.disk_slots = 0
        if self.kvbm.disk_cache_gb > 0:
            padded = -(-room // DISK_ALIGNMENT) * DISK_ALIGNMENT
            self.disk_slots = self.kvbm.tier_bytes("disk_cache_gb", 1) // padded
            if self.disk_slots < 1:
                raise InvalidArgumentError(
                    f"kvbm: disk_cache_gb={self.kvbm.disk_cache_gb:g} GiB per worker holds no block of {padded} bytes"
                )
        self._manager: KvbmOffloadingManager | None = None
        self._worker: KvbmOffloadingWorker | None = None

    def get_manager(self) -> OffloadingManager:
        if self._manager is None:
            self._manager = KvbmOffloadingManager(self)
        return self._manager

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            self._worker = KvbmOffloadingWorker(self, kv_caches)
        return self._worker


class KvbmOffloadingManager(OffloadingManager):
    """The scheduler's half: kvbm's books of the host tier."""

    def __init__(self, spec: KvbmOffloadingSpec):
        self.books = _kvbm.OffloadBooks(spec.slots, spec.kvbm.admission, spec.disk_slots)
        #: Position among the offloaded groups of each KV cache group id.
        self.group_pos = {g.group_id: i for i, g in enumerate(spec.config.groups)}
        self.events_on = spec.kv_events_config.enable_kv_cache_events
        # Where vLLM asks key by key (every step a request waits; see
        # ``lookup_prefix`` for the runs asked at once): one call into the
        # books per key, no Python frame of kvbm's (it also notes the
        # key as asked for by the request, for the reuse ranking). A block
        # whose store is in flight is a miss: asking again later would
        # hold the request back for a copy that may fail.
        self.lookup = self.books.lookup_fn(LookupResult.HIT, LookupResult.MISS)  # type: ignore[method-assign, assignment]
        #: A run of keys asked at once (:class:`KvbmConnectorScheduler`):
        #: ``(keys, request id) -> leading hits`` in G2 and G3. With G4 the
        #: keys after those are asked key by key (they may be in G4).
        self.lookup_prefix: Callable[[list[bytes], str], int] = self.books.lookup_prefix
        #: A sliding-window group's scan from the end in one call,
        #: ``(keys, request id, window, first window) -> end``; None with
        #: G4, whose lookups may answer ``RETRY``: vLLM asks key by key.
        self.lookup_window: Callable[[list[bytes], str, int, int], int] | None = self.books.lookup_window
        #: The offload key of every key the books hold (in either tier),
        #: for evictions and moves to disk.
        self.names: dict[int, OffloadKey] = {}
        #: Blocks stored, loaded (of which from disk), moved to disk,
        #: refused by admission, left out while every slot was busy,
        #: evicted from every tier, found damaged; loads per KV cache group.
        self.stats: dict[str, Any] = {
            "stored": 0,
            "loaded": 0,
            "loaded_from_disk": 0,
            "demoted": 0,
            "refused": 0,
            "full": 0,
            "evicted": 0,
            "damaged": 0,
            "loaded_per_group": {},
        }
        #: Keys moving to disk with each store job's keys (by the first
        #: key of the job), for their events once the store is confirmed.
        self._demoting: dict[OffloadKey, list[OffloadKey]] = {}
        #: kvbm keys of the blocks on disk (an eviction from there is an
        #: event of the disk medium).
        self.on_disk: set[int] = set()
        self._events: list[OffloadingEvent] = []
        #: Keys being fetched from G4 by a load (they join the host tier
        #: when it completes).
        self._fetching: set[OffloadKey] = set()
        #: Keys of the loads that failed, while vLLM completes them.
        self.failing: set[OffloadKey] = set()
        #: Requests whose load was set to fail because a block fetched from
        #: G4 found every host slot busy: their keys are sound, and stay.
        self.unplaced: set[str] = set()
        #: Hits answered this scheduling step to requests whose load is not
        #: prepared yet: host slots their loads will pin or fill.
        self._promised: dict[str, int] = {}
        self._host_slots = spec.slots
        self.g4: G4Lookups | None = None
        if spec.g4 is not None and spec.g4_identity is not None:
            # The scheduler lends the store no memory: it only asks.
            client = connect(dataclasses.replace(spec.g4, segment_bytes=0), spec.g4_identity, "scheduler")
            if client is not None:
                self.g4 = G4Lookups(client, max(1, spec.config.parallel.world_size))
                self._books_lookup = self.lookup
                self.lookup = self._lookup_with_g4  # type: ignore[method-assign]
                self.lookup_prefix = self._prefix_with_g4
                self.lookup_window = None
                self.stats["loaded_from_g4"] = 0
                self.stats["g4_unplaced"] = 0
        #: What this engine publishes to G4: ``admissions``, ``evictions``
        #: or ``off``.
        self.publish = spec.kvbm.g4_publish if self.g4 is not None else "off"
        logger.info("kvbm: offloading spec with %d host slots of %d bytes per worker", spec.slots, spec.slot_bytes)

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        # Replaced per instance by the books' own callable (``__init__``).
        raise NotImplementedError

    def _lookup_with_g4(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """A host or disk hit, else what G4 is known to hold: ``RETRY``
        while that is being asked (see :mod:`kvbm_py.vllm.offload_g4`). A
        block G4 holds is a miss while no host slot is left for it: the
        request computes it rather than fail its whole load."""
        req = req_context.req_id
        found = self._books_lookup(key, req_context)
        if found is LookupResult.HIT or self.books.lookup(key) != 0:
            if found is LookupResult.HIT:
                self._promised[req] = self._promised.get(req, 0) + 1
            return found
        assert self.g4 is not None
        held = self.g4.held(key)
        if held is None:
            return LookupResult.RETRY
        if not held or self._free_host_slots() <= 0:
            return LookupResult.MISS
        self._promised[req] = self._promised.get(req, 0) + 1
        return LookupResult.HIT

    def _prefix_with_g4(self, keys: list[bytes], req: str) -> int:
        """The leading hits in G2 and G3, promised host slots as
        :meth:`_lookup_with_g4` promises them key by key."""
        hits = self.books.lookup_prefix(keys, req)
        if hits:
            self._promised[req] = self._promised.get(req, 0) + hits
        return hits

    def _free_host_slots(self) -> int:
        """Host slots a fetch from G4 could take now: those no store fills
        and no load reads, less those promised to this step's hits."""
        c = self.books.counts()
        return self._host_slots - c["writing"] - c["reading"] - sum(self._promised.values())

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        keys = list(keys)
        self._promised.pop(req_context.req_id, None)
        ready = [self.g4 is None or self.books.lookup(k) == 2 for k in keys]
        sources = iter(self.books.pin([k for k, r in zip(keys, ready, strict=True) if r]))
        fetched = [k for k, r in zip(keys, ready, strict=True) if not r]
        placed, demote, leaving, broken = self._reserve_fetched(fetched)
        if broken:
            self.unplaced.add(req_context.req_id)
        slots, disk, fetch = [], [], []
        for i, (key, r) in enumerate(zip(keys, ready, strict=True)):
            on_disk, slot = next(sources) if r else (False, placed.get(key, 0))
            slots.append(slot)
            disk.append(on_disk)
            if not r and key in placed:
                fetch.append((i, key))
        self.stats["loaded"] += len(keys)
        self.stats["loaded_from_disk"] += sum(disk)
        if fetched:
            self.stats["loaded_from_g4"] += len(fetched)
        per_group = self.stats["loaded_per_group"]
        groups = self._groups(keys)
        for group in groups:
            per_group[group] = per_group.get(group, 0) + 1
        return KvbmSlots(slots, groups, disk=disk, demote=demote, fetch=fetch, broken=broken, publish_first=leaving)

    def _reserve_fetched(
        self, keys: list[OffloadKey]
    ) -> tuple[dict[OffloadKey, int], list[tuple[int, int]], list[tuple[int, int, bytes]], bool]:
        """Host slots for blocks a load fetches from G4: the slot of each
        key placed, the moves to disk before they are written, the blocks
        leaving those slots to publish first, and whether some key found no
        slot (every slot busy)."""
        if not keys:
            return {}, [], [], False
        placed, demote, evicted, _, full, vacated = self.books.reserve(keys, chained=False, fetched=True)
        slot_of = {keys[i]: slot for i, slot in placed}
        self._fetching.update(slot_of)
        leaving = self._vacated(vacated)
        moved = self._evict(evicted, demote)
        if moved and placed:
            self._demoting[keys[placed[0][0]]] = moved
        self.stats["g4_unplaced"] += len(keys) - len(slot_of)
        return slot_of, [(g2, g3) for _, g2, g3 in demote], leaving, len(slot_of) < len(keys)

    def _vacated(self, vacated: list[tuple[int, int]]) -> list[tuple[int, int, bytes]]:
        """``(group, slot, offload key)`` of the blocks a reservation took
        host slots from, when this engine publishes evictions to G4."""
        if self.publish != "evictions":
            return []
        named = [(self.names[k], slot) for k, slot in vacated if k in self.names]
        return [(g, slot, key) for (key, slot), g in zip(named, self._groups([k for k, _ in named]), strict=True)]

    def _groups(self, keys: list[OffloadKey]) -> list[int]:
        return [self.group_pos[int.from_bytes(key[-4:], "big")] for key in keys]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.books.touch(list(keys))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        keys = list(keys)
        fetched = [k for k in keys if k in self._fetching]
        if fetched:
            # A block fetched from G4 stays in the host tier; one whose
            # fetch failed is doomed by the failed load's report.
            self._fetching.difference_update(fetched)
            for key in fetched:
                self.names[_kvbm.OffloadBooks.key(key)] = key
            good = [k for k in fetched if k not in self.failing]
            if good:
                self._confirm(good, True)
            if len(good) < len(fetched):
                self._confirm([k for k in fetched if k in self.failing], False)
        self.books.unpin([k for k in keys if k not in fetched])

    def prepare_store(self, keys: Collection[OffloadKey], req_context: ReqContext) -> PrepareStoreOutput | None:
        keys = list(keys)
        self.books.note(req_context.req_id, keys)
        self.books.record(req_context.req_id)
        placed, demote, evicted, refused, full, vacated = self.books.reserve(keys)
        leaving = self._vacated(vacated)
        to_store = [keys[i] for i, _ in placed]
        for key in to_store:
            self.names[_kvbm.OffloadBooks.key(key)] = key
        evicted_keys = [self.names[k] for k in evicted if k in self.names]
        demoted = self._evict(evicted, demote)
        if demoted and to_store:
            self._demoting[to_store[0]] = demoted
        self.stats["stored"] += len(to_store)
        self.stats["refused"] += refused
        self.stats["full"] += full
        spec = KvbmSlots(
            [slot for _, slot in placed],
            self._groups(to_store),
            demote=[(g2, g3) for _, g2, g3 in demote],
            publish=to_store if self.publish == "admissions" else None,
            publish_first=leaving,
        )
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=spec, evicted_keys=evicted_keys)

    def _evict(self, evicted: list[int], demote: list[tuple[int, int, int]]) -> list[OffloadKey]:
        """Books the blocks a reservation evicted from every tier and those
        it moves to disk (their events, the counters); returns the offload
        keys of the latter."""
        gone = [(k, self.names.pop(k)) for k in evicted if k in self.names]
        demoted = [self.names[k] for k, _, _ in demote if k in self.names]
        self.stats["demoted"] += len(demote)
        self.stats["evicted"] += len(gone)
        self._evicted_events([name for k, name in gone if k not in self.on_disk] + demoted)
        self._evicted_events([name for k, name in gone if k in self.on_disk], Medium.STORAGE)
        self.on_disk.difference_update(k for k, _ in gone)
        return demoted

    def complete_store(self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True) -> None:
        keys = list(keys)
        self._confirm(keys, success)
        if success and self.publish == "admissions" and self.g4 is not None:
            # Published once the workers' puts end: asked about afresh.
            self.g4.drop(keys)

    def _confirm(self, keys: list[OffloadKey], success: bool) -> None:
        """Confirms (or abandons) the writes of ``keys`` into host slots and
        the moves to disk that rode on them."""
        self.books.commit(keys, success)
        demoted = self._demoting.pop(keys[0], []) if keys else []
        if success:
            if self.events_on and keys:
                self._events.append(OffloadingEvent(keys=keys, medium=Medium.CPU, removed=False))
            if demoted:
                if self.events_on:
                    self._events.append(OffloadingEvent(keys=demoted, medium=Medium.STORAGE, removed=False))
                self.on_disk.update(_kvbm.OffloadBooks.key(k) for k in demoted)
        else:
            for key in keys + demoted:
                self.names.pop(_kvbm.OffloadBooks.key(key), None)

    def _evicted_events(self, keys: list[OffloadKey], medium: Medium = Medium.CPU) -> None:
        if self.events_on and keys:
            self._events.append(OffloadingEvent(keys=keys, medium=medium, removed=True))

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        # The retention hint a request carries (``kvbm_retention`` in its
        # kv_transfer_params) ranks every key it asked for.
        self.books.finish(req_context.req_id, retention_of(req_context.kv_transfer_params))
        self.unplaced.discard(req_context.req_id)

    def take_events(self) -> Iterable[OffloadingEvent]:
        events, self._events = self._events, []
        # The books' own record (stores confirmed, evictions) is what the
        # events above were built from; drop it so it stays bounded.
        self.books.take_events()
        return events

    def reset_cache(self) -> None:
        # vLLM discards its jobs in flight here and makes every worker wait
        # for them before its next copy, so their slots may be reused.
        self.books.clear()
        on_disk = {self.names[k] for k in self.on_disk if k in self.names}
        self._evicted_events([k for k in self.names.values() if k not in on_disk])
        self._evicted_events(list(on_disk), Medium.STORAGE)
        self.names.clear()
        self._demoting.clear()
        self._fetching.clear()
        self.on_disk.clear()
        if self.g4 is not None:
            self.g4.drop()

    def forget_damaged(self, keys: list[OffloadKey]) -> None:
        """Keys whose load failed: never loaded again (they read as
        misses, so the engine computes and stores them anew once their
        slots were reused)."""
        self.books.doom(keys)
        self.stats["damaged"] += len(keys)
        if self.g4 is not None:
            self.g4.forget(keys)

    def on_schedule_end(self, context: Any) -> None:
        # The keys asked about this step go to G4 in one query; the hits
        # promised to requests this step did not schedule lapse.
        self._promised.clear()
        if self.g4 is not None:
            self.g4.flush()

    def has_pending_work(self) -> bool:
        return self.g4 is not None and self.g4.pending()

    def g4_stats(self) -> dict[str, Any]:
        """G4's counters in the scheduler: queries, their p50, failures."""
        return lookup_stats(self.g4)

    def shutdown(self) -> None:
        self.names.clear()
        if self.g4 is not None:
            self.g4.close()


class KvbmOffloadingWorker(OffloadingWorker):
    """One rank's half: the engine's pages of every group and this rank's
    host slots and disk slots, copied by kvbm."""

    def __init__(self, spec: KvbmOffloadingSpec, kv_caches: CanonicalKVCaches):
        groups, num_blocks = _page_groups(kv_caches)
        widest = max(page * len(layers) for layers, page in groups)
        if widest > spec.slot_bytes:
            raise InvalidArgumentError(
                f"kvbm: a block of {widest} bytes exceeds the {spec.slot_bytes} bytes vLLM reported per block"
            )
        self.pages = _kvbm.PageWorker(
            groups,
            num_blocks,
            spec.slots,
            spec.slot_bytes,
            verify=spec.kvbm.verify,
            disk_dir=_disk_dir(spec.kvbm) if spec.disk_slots else None,
            disk_slots=spec.disk_slots,
            sum_tail=spec.g4 is not None,
        )
        #: Bytes of a slot, and of the largest group's block (a slot holds
        #: one block of any group).
        self.slot_bytes, self.widest_block = spec.slot_bytes, widest
        self.test_corrupt_loads = spec.kvbm.test_corrupt_onboard
        #: KV cache groups of the engine.
        self.groups = len(groups)
        #: Whether a failed load is reported as a failed request (set by
        #: :class:`KvbmOffloadingConnector`); else it fails the job.
        self.report_load_errors = False
        #: Load jobs that failed since the connector last asked.
        self.failed_loads: set[int] = set()
        self.loads: set[int] = set()
        #: Blocks whose copy, or whose check against its checksum (G4's
        #: too), failed so far; not loads failed for want of a block (G4's
        #: client counts those) or of a host slot (the manager does).
        self.failed_blocks = 0
        #: This rank's traffic with G4 (None: no G4), and the blocks of each
        #: store job to publish once it ended (the manager names them).
        self.g4: G4Mover | None = None
        self._publishing: dict[int, list[tuple[int, int, bytes]]] = {}
        #: Load jobs that fail without a copy (a block found no slot).
        self._fail_now: list[int] = []
        if spec.g4 is not None and spec.g4_identity is not None:
            rank = spec.config.parallel.rank
            client = connect(spec.g4, spec.g4_identity, f"worker of rank {rank}")
            if client is not None:
                self.g4 = G4Mover(client, self.pages, rank)
                if self.test_corrupt_loads:
                    self.g4.test_corrupt = self.pages.corrupt_slot

    @staticmethod
    def _copies(gpu: GPULoadStoreSpec, slots: LoadStoreSpec) -> list[tuple[int, int, int, bool]]:
        """``(group, engine block, slot, on disk)`` per block of a job."""
        assert isinstance(slots, KvbmSlots)
        block_ids = gpu.block_ids.tolist()
        slot_ids = slots.block_ids.tolist()
        if len(block_ids) != len(slot_ids):
            raise InvalidArgumentError(f"kvbm: a job of {len(block_ids)} engine blocks and {len(slot_ids)} slots")
        copies = []
        at = 0
        for group, size in enumerate(gpu.group_sizes):
            for i in range(at, at + size):
                copies.append((group, block_ids[i], slot_ids[i], slots.disk[i]))
            at += size
        if [c[0] for c in copies] != slots.groups:
            # Never copy a block into another key's slot.
            raise InvalidArgumentError("kvbm: a job whose engine blocks and slots belong to different KV cache groups")
        return copies

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec) -> bool:
        assert isinstance(dst_spec, KvbmSlots)
        copies = [c[:3] for c in self._copies(src_spec, dst_spec)]
        if self.g4 is not None and dst_spec.publish:
            self._publishing[job_id] = [
                (g, slot, key) for (g, _, slot), key in zip(copies, dst_spec.publish, strict=True)
            ]
        if self.g4 is not None and dst_spec.publish_first:
            # Blocks leaving these slots go to G4 before the slots are written.
            self.g4.publish(dst_spec.publish_first)
        if self.g4 is not None and self.g4.busy(slot for _, _, slot in copies):
            # A put to G4 still reads one of the slots: the copy waits for it.
            self.g4.after_puts(job_id, lambda: self.pages.store(job_id, copies, dst_spec.demote))
        else:
            self.pages.store(job_id, copies, dst_spec.demote)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec) -> bool:
        assert isinstance(src_spec, KvbmSlots)
        copies = self._copies(dst_spec, src_spec)
        self.loads.add(job_id)
        if src_spec.broken or (src_spec.fetch and self.g4 is None):
            # Some block has no slot to land in, or no G4 to come from.
            self._fail_now.append(job_id)
            return True
        if self.test_corrupt_loads and copies and not src_spec.fetch:
            _, _, slot, on_disk = copies[0]
            (self.pages.corrupt_disk_slot if on_disk else self.pages.corrupt_slot)(slot)

        def start() -> None:
            self.pages.load(job_id, [c[:3] for c in copies if not c[3]], disk_copies=[c[:3] for c in copies if c[3]])

        if not src_spec.fetch:
            start()
            return True
        assert self.g4 is not None
        # Blocks leaving the slots the fetch writes go to G4 first.
        self.g4.publish(src_spec.publish_first)
        fetch = [(copies[i][0], copies[i][2], key) for i, key in src_spec.fetch]
        demote = src_spec.demote
        # Blocks leaving the slots the fetch writes move to disk first.
        self.g4.fetch(job_id, fetch, start, before=(lambda: self.pages.move_to_disk(demote)) if demote else None)
        return True

    def get_finished(self) -> list[TransferResult]:
        # (job, ok, bytes, seconds, blocks whose copy or check failed, why)
        ended: list[tuple[int, bool, int, float, int, object]] = [
            (job, ok, nbytes, seconds, len(failed), error)
            for job, ok, nbytes, seconds, failed, error in self.pages.finished()
        ]
        fail_now, self._fail_now = self._fail_now, []
        ended += [(job, False, 0, 0.0, 0, "no host slot for a block fetched from G4") for job in fail_now]
        if self.g4 is not None:
            ended += [(job, False, 0, 0.0, damaged, why) for job, damaged, why in self.g4.take_failed()]
        results = []
        for job, ok, nbytes, seconds, failed, error in ended:
            is_load = job in self.loads
            self.loads.discard(job)
            publish = self._publishing.pop(job, None)
            if not ok:
                self.failed_blocks += failed
                logger.warning("kvbm: %s job %d failed: %s", "load" if is_load else "store", job, error)
                if is_load and self.report_load_errors:
                    self.failed_loads.add(job)
                    ok = True  # the request is reported failed: recomputed
            elif publish and self.g4 is not None:
                self.g4.publish(publish)
            results.append(TransferResult(job_id=job, success=ok, transfer_size=nbytes, transfer_time=seconds))
        return results

    def wait(self, job_ids: set[int]) -> None:
        if self.g4 is not None:
            self.g4.wait(job_ids)
        self.pages.wait(list(job_ids))


def _disk_dir(cfg: KvbmConfig) -> str:
    """The directory the worker's disk slots go in (each worker's file is
    its own, named by its process, and removed when the worker exits)."""
    path = cfg.g3_base()
    os.makedirs(path, exist_ok=True)
    return path


def _page_groups(kv_caches: CanonicalKVCaches) -> tuple[list[tuple[list[torch.Tensor], int]], int]:
    """Each KV cache group as ``(page tensor per layer, page bytes)`` (kvbm
    reads each tensor's address, block stride and device, and keeps it
    alive) and the engine's block count."""
    tensors = [t.tensor for t in kv_caches.tensors]
    if not tensors:
        raise InvalidArgumentError("kvbm: the engine registered no KV cache tensors")
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise InvalidArgumentError(f"kvbm: KV cache tensors on several devices: {sorted(map(str, devices))}")
    device = tensors[0].device
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgumentError(f"kvbm: KV cache tensors on {device}: kvbm copies host and CUDA memory")
    num_blocks = tensors[0].shape[0]
    groups = []
    for g, refs in enumerate(kv_caches.group_data_refs):
        if not refs:
            raise InvalidArgumentError(f"kvbm: KV cache group {g} has no layers")
        layers, pages, strides = [], set(), set()
        for ref in refs:
            t = tensors[ref.tensor_idx]
            if t.dtype != torch.int8 or t.dim() != 2 or t.stride(1) != 1 or t.shape[0] != num_blocks:
                raise InvalidArgumentError(f"kvbm: KV cache tensor {ref.tensor_idx} is not a (blocks, page bytes) view")
            span = t.untyped_storage().nbytes() - t.storage_offset()
            if span < num_blocks * t.stride(0):
                raise InvalidArgumentError(
                    f"kvbm: KV cache tensor {ref.tensor_idx} ends inside its last block's stride"
                )
            layers.append(t)
            pages.add(ref.page_size_bytes)
            strides.add(t.stride(0))
        if len(pages) != 1 or len(strides) != 1:
            raise InvalidArgumentError(
                f"kvbm: KV cache group {g} mixes page sizes {sorted(pages)} or block strides {sorted(strides)}"
            )
        groups.append((layers, pages.pop()))
    return groups, num_blocks


class KvbmOffloadingConnector(OffloadingConnector):
    """vLLM's ``OffloadingConnector`` over kvbm's spec, with a failed load
    reported as a failed load of its request (the engine recomputes the
    request) and its keys never loaded again."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config
        extra.setdefault("spec_name", SPEC_NAME)
        if extra["spec_name"] != SPEC_NAME:
            raise InvalidArgumentError(f"kvbm: KvbmOffloadingConnector runs kvbm's spec, not {extra['spec_name']!r}")
        extra.pop("spec_module_path", None)
        register_spec()
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None:
            # The same state; key building and lookups in batches.
            self.connector_scheduler.__class__ = KvbmConnectorScheduler

    def _kvbm_worker(self) -> KvbmOffloadingWorker | None:
        w = getattr(getattr(self, "connector_worker", None), "worker", None)
        return w if isinstance(w, KvbmOffloadingWorker) else None

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        w = self._kvbm_worker()
        if w is not None:
            w.report_load_errors = True

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's results, plus the requests whose load failed: the engine
        recomputes them whole (vLLM takes block-level load errors only
        for models of one KV cache group; a request is right for every
        model)."""
        w = self._kvbm_worker()
        cw = self.connector_worker
        jobs = dict(cw._load_jobs) if w is not None and cw is not None else {}
        results = super().get_transfer_results(finished_req_ids)
        if w is not None and w.failed_loads:
            results.failed_recving |= {jobs[j] for j in w.failed_loads if j in jobs}
            w.failed_loads.clear()
        return results

    def update_connector_output(self, connector_output: Any) -> None:
        """The scheduler's half of a failed load: the keys that request
        was loading are never loaded again, unless the load failed only
        because a block fetched from G4 found no host slot."""
        failed = connector_output.failed_recving
        failing: list[OffloadKey] = []
        damaged: list[OffloadKey] = []
        manager = getattr(self.connector_scheduler, "manager", None)
        if failed:
            sched = self.connector_scheduler
            assert sched is not None and isinstance(manager, KvbmOffloadingManager)
            for job in sched._jobs.values():
                if not job.is_store and job.req_id in failed:
                    failing.extend(job.keys)
                    # A load that failed only for want of a host slot
                    # damaged nothing: its keys are not forgotten.
                    if job.req_id not in manager.unplaced:
                        damaged.extend(job.keys)
            manager.unplaced.difference_update(failed)
        if failing:
            assert isinstance(manager, KvbmOffloadingManager)
            manager.failing.update(failing)
        super().update_connector_output(connector_output)
        if failing:
            assert isinstance(manager, KvbmOffloadingManager)
            manager.failing.clear()
        if damaged:
            assert isinstance(manager, KvbmOffloadingManager)
            manager.forget_damaged(damaged)

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
  disk slots, with a checksum of every slot in verify mode. The disk tier
  is kept across restarts (``disk_cache_keep``, on by default, with
  ``PYTHONHASHSEED`` set), and with ``cpu_cache_keep`` the host tier too:
  a restarted engine serves what it held (see
  :mod:`kvbm_py.vllm.offload_kept`).

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
the engine rather than serve wrong bytes; and its tiers start empty
with each engine (the ranks' reports of kept tiers reach only
``KvbmOffloadingConnector``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Iterable, Mapping
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
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
)
from vllm.v1.kv_offload.config import OffloadingConfig

from kvbm_py import InvalidArgumentError, _kvbm
from kvbm_py.config import GIB, KvbmConfig
from kvbm_py.g4 import SUM_BYTES
from kvbm_py.vllm.common import KvEncoding, kv_encoding
from kvbm_py.vllm.common import log as logger
from kvbm_py.vllm.g4_shards import SHARDS_KEY, G4Parts, shards_of
from kvbm_py.vllm.offload_g4 import G4Lookups, connect, g4_identity, lookup_stats
from kvbm_py.vllm.offload_kept import (
    KEPT_ENTRY_BYTES,
    KeptFound,
    KeptNames,
    KeptTier,
    common_blocks,
    kept_identity,
    reports_of,
)
from kvbm_py.vllm.offload_lookup import KvbmConnectorScheduler
from kvbm_py.vllm.offload_stats import StatsDelta, metric_definitions
from kvbm_py.vllm.offload_worker import KvbmOffloadingWorker, KvbmSlots
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

#: Set in the extra config by :class:`KvbmOffloadingConnector`, the one
#: route whose scheduler takes up kept tiers (vLLM's own
#: ``OffloadingConnector`` hands it no report of them).
TAKES_UP_KEPT = "kvbm_takes_up_kept"

#: kvbm keys this route does not serve, with why.
NOT_ON_THIS_ROUTE = {
    "offload": "vLLM's offloading connector decides when blocks are stored",
    "load_async": "vLLM's offloading connector always loads asynchronously",
}

#: Bytes a disk slot is padded to (a block moves to or from disk in one
#: ``O_DIRECT`` request).
DISK_ALIGNMENT = 4096


def _kvbm_config(extra: Mapping[str, Any]) -> KvbmConfig:
    own = {k: v for k, v in extra.items() if k not in VLLM_KEYS and k not in (TAKES_UP_KEPT, SHARDS_KEY)}
    cfg = KvbmConfig.from_sources(own)
    for key, why in NOT_ON_THIS_ROUTE.items():
        if key in own and own[key] != getattr(KvbmConfig, key):
            raise InvalidArgumentError(f"kvbm: {key}={own[key]!r} is not available with the offloading spec: {why}")
    return cfg


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
        #: Each group's shards at this parallelism (None: each group is
        #: published per rank); see :mod:`kvbm_py.vllm.g4_shards`.
        self.g4_shards = self.extra_config.get(SHARDS_KEY)
        if self.g4 is not None:
            self.g4_identity, why = g4_identity(config, self.g4_parts(0))
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
        #: The identity the kept tiers are kept across restarts under (None:
        #: every tier starts empty with each engine, for ``not_kept_why``),
        #: and which tiers are kept.
        self.kept_identity: str | None = None
        self.not_kept_why = ""
        if (self.disk_slots and self.kvbm.disk_cache_keep) or self.kvbm.cpu_cache_keep:
            if self.extra_config.get(TAKES_UP_KEPT):
                self.kept_identity, self.not_kept_why = kept_identity(config)
            else:
                self.not_kept_why = (
                    "vLLM's own OffloadingConnector hands kvbm no report of kept tiers; "
                    "use KvbmOffloadingConnector to keep them"
                )
        kept = self.kept_identity is not None
        self.keeps_disk = kept and bool(self.disk_slots) and self.kvbm.disk_cache_keep
        self.keeps_host = kept and self.kvbm.cpu_cache_keep
        #: How the rank's KV tensors lay a block out (kept tiers and G4 check it; None: unknown).
        self.kv_encoding: KvEncoding | None = None
        self._manager: KvbmOffloadingManager | None = None
        self._worker: KvbmOffloadingWorker | None = None

    def g4_parts(self, rank: int) -> G4Parts:
        """The names of rank ``rank``'s parts of each group's blocks in G4."""
        return G4Parts.of(self.config, self.g4_shards, rank)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """kvbm's counters, which vLLM registers with its offloading
        metrics (see :mod:`kvbm_py.vllm.offload_stats`)."""
        return dict(metric_definitions())

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
            "recovered": 0,
            "recovered_host": 0,
            "recovered_rejected": 0,
            "loaded_per_group": {},
        }
        #: Ranks of the engine (each reports its kept tiers).
        self.world = max(1, spec.config.parallel.world_size)
        #: The offload keys of the blocks on a kept disk tier and in a kept
        #: host tier (None: that tier is not kept, or no longer: the cache
        #: was reset), and whether the ranks must empty their records and
        #: stop keeping with the next step.
        self.kept_names: KeptNames | None = None
        self.kept_host_names: KeptNames | None = None
        self._stop_keeping = False
        self._disk_slots, self._host_slots = spec.disk_slots, spec.slots
        #: Whether stores name their blocks for a kept host tier's records.
        self._keep_host = spec.keeps_host
        #: The file the use history is kept in beside the kept tiers.
        self._history_path = spec.kvbm.kept_history_path(spec.kept_identity) if spec.kept_identity else None
        self._stats_delta = StatsDelta()
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
                self.g4 = G4Lookups(client, spec.g4_parts(0), self.group_pos)
                self._books_lookup = self.lookup
                self.lookup = self._lookup_with_g4  # type: ignore[method-assign]
                self.lookup_prefix = self._prefix_with_g4
                self.lookup_window = None
                self.stats["loaded_from_g4"] = 0
                self.stats["g4_from_other_splits"] = 0
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
                fetch.append((i, key, self.g4.split(key) if self.g4 is not None else 0))
        self.stats["loaded"] += len(keys)
        self.stats["loaded_from_disk"] += sum(disk)
        if fetched:
            self.stats["loaded_from_g4"] += len(fetched)
            self.stats["g4_from_other_splits"] += sum(1 for f in fetch if f[2])
        per_group = self.stats["loaded_per_group"]
        groups = self._groups(keys)
        for group in groups:
            per_group[group] = per_group.get(group, 0) + 1
        return KvbmSlots(slots, groups, disk=disk, demote=demote, fetch=fetch, broken=broken, publish_first=leaving)

    def _reserve_fetched(
        self, keys: list[OffloadKey]
    ) -> tuple[dict[OffloadKey, int], list[tuple[int, int, int, int]], list[tuple[int, int, bytes]], bool]:
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
        return slot_of, self._moves(demote), leaving, len(slot_of) < len(keys)

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
        kvbm_keys = [_kvbm.OffloadBooks.key(key) for key in to_store]
        self.names.update(zip(kvbm_keys, to_store, strict=True))
        if self.kept_host_names is not None and to_store:
            self._name_host(list(zip(kvbm_keys, to_store, strict=True)))
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
            demote=self._moves(demote),
            publish=to_store if self.publish == "admissions" else None,
            publish_first=leaving,
            keys=kvbm_keys if self._keep_host else None,
        )
        return PrepareStoreOutput(keys_to_store=to_store, store_spec=spec, evicted_keys=evicted_keys)

    def _moves(self, demote: list[tuple[int, int, int]]) -> list[tuple[int, int, int, int]]:
        """``(host slot, disk slot, group, kvbm key)`` of each block a
        reservation moves to disk."""
        names = [self.names.get(k) for k, _, _ in demote]
        groups = iter(self._groups([n for n in names if n is not None]))
        return [(g2, g3, next(groups) if n is not None else 0, k) for (k, g2, g3), n in zip(demote, names, strict=True)]

    def _evict(self, evicted: list[int], demote: list[tuple[int, int, int]]) -> list[OffloadKey]:
        """Books the blocks a reservation evicted from every tier and those
        it moves to disk (their events, the counters; the names of the
        latter beside a kept disk tier); returns the offload keys of the
        latter."""
        gone = [(k, self.names.pop(k)) for k in evicted if k in self.names]
        demoted = [self.names[k] for k, _, _ in demote if k in self.names]
        if self.kept_names is not None and demote:
            self._name_kept([(k, self.names[k]) for k, _, _ in demote if k in self.names])
        self.stats["demoted"] += len(demote)
        self.stats["evicted"] += len(gone)
        self._evicted_events([name for k, name in gone if k not in self.on_disk] + demoted)
        self._evicted_events([name for k, name in gone if k in self.on_disk], Medium.STORAGE)
        self.on_disk.difference_update(k for k, _ in gone)
        return demoted

    def _name_kept(self, moved: list[tuple[int, bytes]]) -> None:
        """Writes the names of blocks moving to the kept disk tier; the
        file is written anew with just the blocks on disk once it holds
        many more entries than the tier has slots."""
        assert self.kept_names is not None
        self.kept_names.append(moved)
        if self.kept_names.appended > 4 * self._disk_slots + 1024:
            held = set(self.on_disk) | {k for k, _ in moved}
            held.update(self.books.key(k) for keys in self._demoting.values() for k in keys)
            self.kept_names.rewrite({k: self.names[k] for k in held if k in self.names})

    def _name_host(self, stored: list[tuple[int, bytes]]) -> None:
        """Writes the names of blocks stored in the kept host tier; the
        file is written anew with just the blocks in the host tier once it
        holds many more entries than the tier has slots."""
        assert self.kept_host_names is not None
        self.kept_host_names.append(stored)
        if self.kept_host_names.appended > 4 * self._host_slots + 1024:
            self.kept_host_names.rewrite({k: n for k, n in self.names.items() if k not in self.on_disk})

    def restore_kept(self, found: Mapping[Any, KeptFound | None]) -> None:
        """Takes up the blocks every rank's kept tiers hold in the same
        slot, reported by the ranks' workers at start (see
        :mod:`kvbm_py.vllm.offload_kept`), host tier first; call it before
        the first request."""
        host, host_why = reports_of(found, self.world, "host")
        disk, disk_why = reports_of(found, self.world, "disk")
        for reports, why, tier in ((host, host_why, "host"), (disk, disk_why, "disk")):
            if not reports and any(getattr(f, tier, None) is not None for f in found.values()):
                logger.warning("kvbm: the kept %s tier is not taken up: %s", tier, why)
        if not host and not disk:
            return
        remembered = 0
        if self._history_path is not None:
            # Before the blocks are registered: they rank by their past uses.
            remembered = self.books.keep_history(self._history_path)
        if host:
            self.kept_host_names = self._take_up(host, self.books.restore_host, on_disk=False)
        if disk:
            self.kept_names = self._take_up(disk, self.books.restore_disk, on_disk=True)
        logger.info(
            "kvbm: took up %d blocks of the kept tiers (%d left out; a use history of %d blocks)",
            self.stats["recovered"],
            self.stats["recovered_rejected"],
            remembered,
        )

    def _take_up(self, reports: list[KeptTier], restore: Callable[[bytes], list[int]], on_disk: bool) -> KeptNames:
        """Registers the blocks every rank's kept tier of ``reports`` holds
        in the same slot (``restore``), names and announces those whose
        offload keys rank 0's names file holds; returns that file."""
        blocks, rejected = common_blocks(reports)
        taken = restore(blocks)
        names = KeptNames(reports[0].directory, fresh=reports[0].started_fresh is not None)
        known = names.read()
        named = {k: OffloadKey(known[k]) for k in taken if k in known}
        names.rewrite(named)
        self.names.update(named)
        if on_disk:
            self.on_disk.update(taken)
        else:
            self.stats["recovered_host"] += len(taken)
        self.stats["recovered"] += len(taken)
        self.stats["recovered_rejected"] += rejected + len(blocks) // KEPT_ENTRY_BYTES - len(taken)
        if self.events_on and named:
            medium = Medium.STORAGE if on_disk else Medium.CPU
            self._events.append(OffloadingEvent(keys=list(named.values()), medium=medium, removed=False))
        logger.info(
            "kvbm: took up %d blocks of the kept %s tier in %s (%d without a name)",
            len(taken),
            "disk" if on_disk else "host",
            reports[0].directory,
            len(taken) - len(named),
        )
        return names

    def take_stop_keeping(self) -> bool:
        """Whether the ranks must empty their kept records and keep nothing
        more, with the next step (once: the cache was reset since the last
        call)."""
        stop, self._stop_keeping = self._stop_keeping, False
        return stop

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
        if self.kept_names is not None or self.kept_host_names is not None:
            # The ranks empty their records with the next step's metadata
            # and keep nothing more: vLLM resets the cache around an
            # in-place weight update, after which the blocks would come
            # from other weights than those a restarted engine loads.
            self._stop_keeping = True
            self._keep_host = False
            for names in (self.kept_names, self.kept_host_names):
                if names is not None:
                    names.rewrite({})
                    names.close()
            self.kept_names = self.kept_host_names = None
            logger.info(
                "kvbm: the cache was reset; the kept tiers keep nothing more until the engine restarts "
                "(the blocks computed from now on may come from other weights than a restart loads)"
            )
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

    def get_stats(self) -> Any:
        """What kvbm's counters moved since the last call, and the blocks
        each tier holds, as vLLM's offloading stats (None: nothing moved)."""
        return self._stats_delta.take(self.stats, self.books.counts())

    def g4_stats(self) -> dict[str, Any]:
        """G4's counters in the scheduler: queries, their p50, failures."""
        return lookup_stats(self.g4)

    def shutdown(self) -> None:
        self.names.clear()
        for names in (self.kept_names, self.kept_host_names):
            if names is not None:
                names.close()
        self.books.close_history()
        if self.g4 is not None:
            self.g4.close()


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
        extra[TAKES_UP_KEPT] = True
        if kv_cache_config is not None:
            try:
                extra[SHARDS_KEY] = shards_of(vllm_config, kv_cache_config)
            except Exception as e:  # an engine it cannot read runs without shards
                logger.warning("kvbm: G4 publishes every group per rank: %s", e)
        register_spec()
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_scheduler is not None:
            # The same state; key building and lookups in batches.
            self.connector_scheduler.__class__ = KvbmConnectorScheduler

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: Any,
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        """vLLM's offloading metrics with kvbm's spec's: the process that
        exports them (vLLM's front end) never made a connector, so its
        configuration may not name the spec yet."""
        vllm_config.kv_transfer_config.kv_connector_extra_config.setdefault("spec_name", SPEC_NAME)
        register_spec()
        return super().build_prom_metrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def _kvbm_worker(self) -> KvbmOffloadingWorker | None:
        w = getattr(getattr(self, "connector_worker", None), "worker", None)
        return w if isinstance(w, KvbmOffloadingWorker) else None

    def get_handshake_metadata(self) -> KeptFound | None:
        """What this rank's kept tiers held at start (None: none is kept):
        vLLM gathers every rank's and hands them to
        :meth:`set_xfer_handshake_metadata_pp_aware` before the first
        request."""
        w = self._kvbm_worker()
        return w.kept if w is not None else None

    def set_xfer_handshake_metadata_pp_aware(self, metadata: dict[tuple[int, int], Any]) -> None:
        """The scheduler takes up the blocks of every rank's kept
        tiers."""
        manager = getattr(self.connector_scheduler, "manager", None)
        if isinstance(manager, KvbmOffloadingManager):
            manager.restore_kept(metadata)

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """vLLM's metadata, marked for the ranks to stop keeping when the
        cache was reset since the last step."""
        meta = super().build_connector_meta(scheduler_output)
        manager = getattr(self.connector_scheduler, "manager", None)
        if isinstance(manager, KvbmOffloadingManager) and manager.take_stop_keeping():
            meta.kvbm_stop_keeping = True  # type: ignore[attr-defined]
        return meta

    def bind_connector_metadata(self, connector_metadata: Any) -> None:
        """vLLM's step metadata; a rank empties its kept records and keeps
        nothing more when the scheduler marked it so."""
        super().bind_connector_metadata(connector_metadata)
        w = self._kvbm_worker()
        if w is not None and getattr(connector_metadata, "kvbm_stop_keeping", False):
            w.pages.stop_keeping()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        cw = self.connector_worker
        if cw is not None and isinstance(cw.spec, KvbmOffloadingSpec):
            # Only the engine's own tensors show it; the worker sees pages.
            cw.spec.kv_encoding = kv_encoding(kv_caches, cw.kv_cache_config.num_blocks, self._vllm_config)
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

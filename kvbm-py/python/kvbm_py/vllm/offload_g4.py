"""G4 behind vLLM's offloading connector: blocks that other engine instances
computed, found in a store they share (Mooncake Store, :mod:`kvbm_py.g4`)
and read into this engine's host tier; blocks this engine stores,
published there.

- In the scheduler, :class:`G4Lookups` answers whether G4 holds a key.
  vLLM asks key by key while it schedules; a key not asked about yet is
  answered ``RETRY`` and queued, and the keys queued during a scheduling
  step go to the store in one existence query, on a thread of its own,
  when the step ends (with a second one for the keys this engine's own
  parts miss, in the splits engines of other parallelisms publish:
  :mod:`kvbm_py.vllm.g4_shards`). The request is asked about again the
  next step, when the answer is known: the scheduler never waits for the
  store.
- A key G4 holds is loaded like a host-tier hit, from a host slot the
  books reserve for it: the load job names the keys to fetch first. While
  no host slot is left for it (every slot filled by a store, read by a
  load, or promised to this step's hits), it is a miss instead.
- In each rank, :class:`G4Mover` runs on a thread of its own what touches
  the store: it gets a load's fetched blocks into their slots, checks
  each against the checksum it was published with, and only then starts
  the load (a block held in another split is assembled from the shards
  holding this rank's share, each checked first); it puts every block
  this rank stored (its part of it), with its checksum, once the store
  job ended, and its page layouts beside them. A block and its checksum lie
  together in the slot (the worker leaves room after each block) and
  move as one object. A slot that a put still reads is
  not written: a job that would write it waits on that thread.

A fetch that fails (the store unreachable, the block gone or short, a
checksum that does not match) fails its load job: the engine recomputes
the request, and the manager never asks G4 for those keys again. Nothing
waits on the store but the thread that calls it.
"""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from kvbm_py import _kvbm
from kvbm_py.g4 import SUM_BYTES, G4Client, G4Config
from kvbm_py.vllm.common import log
from kvbm_py.vllm.g4_shards import G4Parts, PageLayout, Plan, plan, shard_name
from kvbm_py.vllm.offload_kept import spec_identity

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

#: How kvbm lays out an offloaded block (the concatenation of its group's
#: layer pages, in parts: :mod:`kvbm_py.vllm.g4_shards`) and names it
#: (vLLM's offload key); part of the identity, so a change never reads old
#: blocks.
G4_LAYOUT = "vllm-offload-pages-2"

#: How long an answer about a key stands before G4 is asked again, s: a
#: key missing now may be published by another engine later.
ANSWER_TTL_S = 2.0

#: How often a rank publishes its page layouts again while it publishes
#: blocks, s (a master that restarted lost them).
LAYOUT_EVERY_S = 2.0

#: Blocks of the largest bundle of shards the assembly memory holds.
ASSEMBLY_BLOCKS = 16


def g4_identity(config: OffloadingConfig, parts: G4Parts) -> tuple[str | None, str]:
    """What makes two engines' blocks interchangeable (see
    :func:`~kvbm_py.vllm.offload_kept.spec_identity`), whatever their
    parallelism: the parts say which. ``(None, why)`` when blocks cannot
    be shared."""
    identity = spec_identity(config, G4_LAYOUT, parallel=False)
    if identity is None:
        return None, (
            "vLLM seeds its prefix hashes at random in every process unless PYTHONHASHSEED "
            "is set (the same value in every engine), so no engine would find another's blocks"
        )
    return f"{identity}\ncanonical_pages: {list(parts.canonical)}", ""


def connect(config: G4Config, identity: str, what: str) -> G4Client | None:
    """A G4 client, or None (logged) when the store cannot be set up: the
    engine then runs on its own tiers."""
    try:
        return G4Client(config, identity)
    except Exception as e:  # the store's set-up failing must not stop the engine
        log.warning("kvbm: G4 at %s not used by the %s: %s", config.master, what, e)
        return None


class G4Lookups:
    """The scheduler's knowledge of which keys G4 holds (for every rank),
    learnt in the background; see the module docs."""

    def __init__(self, client: G4Client, parts: G4Parts, group_pos: dict[int, int]) -> None:
        self.client = client
        #: The parts of each group's blocks, and which group a key is of.
        self.parts, self.group_pos = parts, group_pos
        self._group_ids = {pos: gid for gid, pos in group_pos.items()}
        #: Per group, the other splits some engine published layouts of
        #: (only those are asked for blocks), and when that was learnt.
        self._splits: dict[int, tuple[tuple[int, ...], float]] = {}
        self._lock = threading.Lock()
        #: key -> (held, when learnt, the split it is held in: 0 for this
        #: engine's own parts).
        self._answers: dict[bytes, tuple[bool, float, int]] = {}
        #: Keys asked about since the last flush, and all keys not answered yet.
        self._asked: list[bytes] = []
        self._open: set[bytes] = set()
        self._batches: queue.SimpleQueue[list[bytes] | None] = queue.SimpleQueue()
        #: Existence queries sent, and the seconds each took.
        self.queries = 0
        self.query_seconds: list[float] = []
        self._thread = threading.Thread(target=self._run, name="kvbm-g4-lookup", daemon=True)
        self._thread.start()

    def held(self, key: bytes) -> bool | None:
        """Whether G4 holds ``key``; None while that is not known yet (the
        key is then queued for the next query)."""
        now = time.monotonic()
        with self._lock:
            found = self._answers.get(key)
            if found is not None and now - found[1] < ANSWER_TTL_S:
                return found[0]
            if key not in self._open:
                self._open.add(key)
                self._asked.append(key)
        return None

    def flush(self) -> None:
        """Sends the keys asked about since the last call to the store (one
        query, answered on the lookup thread)."""
        with self._lock:
            batch, self._asked = self._asked, []
        if batch:
            self._batches.put(batch)

    def pending(self) -> bool:
        """Whether keys wait for an answer (the engine keeps stepping
        meanwhile, so the requests asking for them are asked again)."""
        with self._lock:
            return bool(self._open)

    def split(self, key: bytes) -> int:
        """The split of another parallelism whose shards a key G4 holds is
        read from; 0 when it is read from this engine's own parts."""
        with self._lock:
            found = self._answers.get(key)
        return found[2] if found is not None else 0

    def forget(self, keys: Iterable[bytes]) -> None:
        """``keys`` count as not held (a fetch of them failed)."""
        now = time.monotonic()
        with self._lock:
            for key in keys:
                self._answers[key] = (False, now, 0)

    def drop(self, keys: Iterable[bytes] | None = None) -> None:
        """Forgets what is known about ``keys`` (all keys when None): they
        are asked about again (this engine just published them, or reset
        its caches)."""
        with self._lock:
            if keys is None:
                self._answers.clear()
                return
            for key in keys:
                self._answers.pop(key, None)

    def _run(self) -> None:
        while (batch := self._batches.get()) is not None:
            # Mooncake's keys carry the offload key as hex: vLLM's hash and
            # the group.
            started = time.monotonic()
            found = self._ask(batch)
            now = time.monotonic()
            self.queries += 1
            self.query_seconds.append(now - started)
            del self.query_seconds[:-1024]
            with self._lock:
                for key, split in zip(batch, found, strict=True):
                    # An unanswered query reads as not held: the request
                    # goes on without G4 instead of waiting for the store.
                    self._answers[key] = (split is not None, now, split or 0)
                    self._open.discard(key)
                if len(self._answers) > 1 << 16:
                    stale = [k for k, (_, at, _) in self._answers.items() if now - at >= ANSWER_TTL_S]
                    for k in stale:
                        del self._answers[k]

    def _ask(self, batch: list[bytes]) -> list[int | None]:
        """Per key, where G4 holds all its parts: 0 in this engine's own
        parts, else the split of another parallelism whose shards hold it
        (asked in a second query, for keys missing in the first); None
        when it does not (or could not answer)."""
        groups = [self.group_pos.get(int.from_bytes(key[-4:], "big"), 0) for key in batch]
        asked = [(i, (0, self.parts.own[g])) for i, g in enumerate(groups)]
        found: list[int | None] = [None] * len(batch)
        for _ in range(2):
            held = self.client.all_held([[self.client.key(p, batch[i]) for p in parts] for i, (_, parts) in asked])
            if held is None:
                break
            for (i, (split, _)), whole in zip(asked, held, strict=True):
                if found[i] is None and whole:
                    found[i] = split
            # Keys missing in this engine's parts: any other split some
            # engine publishes.
            asked = [
                (i, (d, tuple(shard_name(d, h) for h in range(d))))
                for i, g in enumerate(groups)
                if found[i] is None
                for d in self._published_splits(g)
            ]
            if not asked:
                break
        return found

    def _published_splits(self, group: int) -> tuple[int, ...]:
        """The other splits of ``group`` whose every share's layout is in
        G4 (engines of that split publish), learnt again every
        :data:`ANSWER_TTL_S`: a fleet of one parallelism asks nothing
        more."""
        now = time.monotonic()
        known = self._splits.get(group)
        if known is not None and now - known[1] < ANSWER_TTL_S:
            return known[0]
        others = self.parts.others[group]
        gid = self._group_ids[group]
        held = self.client.all_held(
            [[self.client.layout_key(f"{shard_name(d, h)}/g{gid}") for h in range(d)] for d in others]
        )
        splits = tuple(d for d, whole in zip(others, held or [False] * len(others), strict=True) if whole)
        self._splits[group] = (splits, now)
        return splits

    def close(self) -> None:
        """Stops the lookup thread."""
        self._batches.put(None)


class G4Mover:
    """One rank's traffic with G4, on a thread of its own; see the module
    docs. ``pages`` is the rank's :class:`kvbm_py._kvbm.PageWorker`."""

    def __init__(
        self,
        client: G4Client,
        pages: _kvbm.PageWorker,
        parts: G4Parts,
        layouts: Sequence[PageLayout | None],
        group_ids: Sequence[int],
    ) -> None:
        """``parts`` name this rank's part of each group's blocks;
        ``layouts`` say how its pages of each sharded group lie in the
        canonical page (None for the others); ``group_ids`` are vLLM's ids
        of the groups."""
        self.client, self.pages, self.parts = client, pages, parts
        self.layouts, self.group_ids = list(layouts), list(group_ids)
        #: When this rank's layouts are published again, and the plans
        #: learnt for reading another split's shards, by (group, split).
        self._layouts_due = 0.0
        self._plans: dict[tuple[int, int], Plan] = {}
        self._assembly: tuple[int, int] | None = None
        # Each slot holds a block with its checksum right after it: what a
        # put reads and a get writes.
        self.base, size = pages.slot_memory()
        self.stride = pages.slot_stride
        client.register(self.base, size)
        self._tasks: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._lock = threading.Condition()
        #: Slots a queued or running put reads, with how many puts.
        self._reading: Counter[int] = Counter()
        #: Jobs whose start waits on the thread.
        self._held: set[int] = set()
        #: Tasks queued or running.
        self._tasks_open = 0
        #: ``(job, blocks, why)`` of jobs that failed on the thread.
        self._failed: list[tuple[int, int, str]] = []
        #: Test hook: damages a slot after its block arrived, before the
        #: check (proves that the check bites).
        self.test_corrupt: Callable[[int], None] | None = None
        #: Blocks published, fetched and checked (of them, assembled from
        #: another parallelism's shards), and fetched but damaged.
        self.published = 0
        self.fetched = 0
        self.assembled = 0
        self.damaged = 0
        self._thread = threading.Thread(target=self._run, name="kvbm-g4-mover", daemon=True)
        self._thread.start()

    def _addresses(self, slots: Iterable[int]) -> list[int]:
        """Where each of ``slots`` (its block, then the checksum) starts."""
        return [self.base + slot * self.stride for slot in slots]

    def _run(self) -> None:
        while (task := self._tasks.get()) is not None:
            try:
                task()
            except Exception:  # a bug of a task must not stop the tasks after it
                log.exception("kvbm: a G4 task failed")
            finally:
                with self._lock:
                    self._tasks_open -= 1
                    self._lock.notify_all()

    def _queue(self, task: Callable[[], None]) -> None:
        with self._lock:
            self._tasks_open += 1
        self._tasks.put(task)

    def idle(self) -> bool:
        """Whether no put, fetch or held job is queued or running."""
        with self._lock:
            return self._tasks_open == 0

    def busy(self, slots: Iterable[int]) -> bool:
        """Whether a put still reads any of ``slots``."""
        with self._lock:
            return any(self._reading[s] for s in slots)

    def publish(self, blocks: Sequence[tuple[int, int, bytes]]) -> None:
        """Puts this rank's slice of each ``(group, slot, offload key)``
        block, with its checksum; the slots are not written until then."""
        if not blocks:
            return
        with self._lock:
            self._reading.update(slot for _, slot, _ in blocks)
        self._queue(lambda: self._put(blocks))

    def _put(self, blocks: Sequence[tuple[int, int, bytes]]) -> None:
        try:
            self._publish_layouts()
            for group, items in _by_group(blocks).items():
                if not self.parts.publishes[group]:
                    continue  # another rank holds the same share and puts it
                sealed = self.pages.seal(group, [slot for slot, _ in items])
                # A slot whose bytes changed since they were stored (verify
                # mode) is not published.
                kept = [item for item, ok in zip(items, sealed, strict=True) if ok]
                failed = self.client.put(
                    self.parts.mine[group],
                    [key for _, key in kept],
                    self._addresses(slot for slot, _ in kept),
                    self.pages.block_bytes(group),
                )
                self.published += sum(f is None for f in failed)
        except Exception as e:  # a put that fails loses nothing but the copy in G4
            log.warning("kvbm: G4 put failed: %s", e)
        finally:
            with self._lock:
                self._reading.subtract(slot for _, slot, _ in blocks)
                self._reading = +self._reading
                self._lock.notify_all()

    def after_puts(self, job: int, start: Callable[[], None]) -> None:
        """Starts job ``job`` (``start``) on the thread, after the puts
        queued before it ended."""
        self._hold(job)
        self._queue(lambda: self._release(job, start))

    def fetch(
        self,
        job: int,
        blocks: Sequence[tuple[int, int, bytes, int]],
        start: Callable[[], None],
        before: Callable[[], None] | None = None,
    ) -> None:
        """Runs ``before`` (if any), gets each ``(group, slot, offload key,
        split)`` block into its slot and checks it (split 0: from this
        engine's own parts; else assembled from the shards of that split),
        then starts load job ``job`` (``start``); a block that does not
        arrive whole and checked, or a ``before`` that raises, fails the job
        instead."""
        self._hold(job)

        def task() -> None:
            if before is not None:
                before()
            self._fetch(job, blocks, start)

        self._queue(lambda: self._release(job, task))

    def fail(self, job: int, damaged: int, why: str) -> None:
        """Reports job ``job`` as failed with the next results, ``damaged``
        of its blocks for failing their checksum."""
        with self._lock:
            self._failed.append((job, damaged, why))

    def _fetch(self, job: int, blocks: Sequence[tuple[int, int, bytes, int]], start: Callable[[], None]) -> None:
        by_split: dict[tuple[int, int], list[tuple[int, bytes]]] = {}
        for group, slot, key, split in blocks:
            by_split.setdefault((group, split), []).append((slot, key))
        for (group, split), items in by_split.items():
            slots = [slot for slot, _ in items]
            # A kept host tier's records of these slots go before the bytes.
            self.pages.unrecord(slots)
            if split:
                if not self._assemble(job, group, split, items):
                    return
                continue
            failed = self.client.get(
                self.parts.mine[group],
                [key for _, key in items],
                self._addresses(slots),
                self.pages.block_bytes(group),
            )
            if not self._arrived(job, failed):
                return
            if self.test_corrupt is not None:
                self.test_corrupt(slots[0])
            if not self._checked(job, self.pages.adopt(group, slots)):
                return
        self.fetched += len(blocks)
        start()

    def _arrived(self, job: int, failed: Sequence[Any]) -> bool:
        missing = [f for f in failed if f is not None]
        if missing:
            self.fail(job, 0, f"G4 get: {len(missing)} block(s) {missing[0].value}")
        return not missing

    def _checked(self, job: int, good: list[bool]) -> bool:
        if not all(good):
            self.damaged += good.count(False)
            self.fail(job, good.count(False), f"G4: {good.count(False)} block(s) failed their checksum")
        return all(good)

    def _assemble(self, job: int, group: int, split: int, items: list[tuple[int, bytes]]) -> bool:
        """Reads the shards of split ``split`` that hold this rank's share of
        each ``(slot, offload key)`` block of ``group`` into the assembly
        memory and assembles each block in its slot."""
        p = self._plan(group, split)
        if p is None:
            self.fail(job, 0, f"G4: no published layout relates split {split} to this rank's pages")
            return False
        base, size = self._assembly_memory()
        bundle = len(p.shares) * (p.shard_bytes + SUM_BYTES)
        per = size // bundle
        if per == 0:
            self.fail(job, 0, f"G4: a bundle of {bundle} bytes exceeds the assembly memory")
            return False
        for at in range(0, len(items), per):
            chunk = items[at : at + per]
            keys, addresses = [], []
            for k, (_, key) in enumerate(chunk):
                for i, share in enumerate(p.shares):
                    keys.append(self.client.key(shard_name(split, share), key))
                    addresses.append(base + k * bundle + i * (p.shard_bytes + SUM_BYTES))
            if not self._arrived(job, self.client.get_keys(keys, addresses, p.shard_bytes)):
                return False
            if self.test_corrupt is not None:
                # The first shard's first byte changes on the way.
                ctypes.c_ubyte.from_address(base).value ^= 0xFF
            slots = [slot for slot, _ in chunk]
            good = self.pages.assemble(group, slots, len(p.shares), p.shard_bytes, list(p.pieces))
            if not self._checked(job, good):
                return False
            self.assembled += len(chunk)
        return True

    def _plan(self, group: int, split: int) -> Plan | None:
        """How this rank's share of ``group``'s blocks is built from split
        ``split``'s shards, from the layouts their writers published
        (learnt once; None while they are not found)."""
        found = self._plans.get((group, split))
        mine = self.layouts[group]
        if found is not None or mine is None:
            return found
        writers = {}
        for share in range(split):
            data = self.client.get_layout(f"{shard_name(split, share)}/g{self.group_ids[group]}")
            layout = PageLayout.from_bytes(data) if data else None
            if layout is None:
                return None
            writers[share] = layout
        found = plan(mine, writers, SUM_BYTES)
        if found is not None:
            self._plans[(group, split)] = found
        return found

    def _assembly_memory(self) -> tuple[int, int]:
        """The worker's assembly memory, made and registered with G4 on
        first use: room for :data:`ASSEMBLY_BLOCKS` of the largest bundle of
        shards any split can need (a share of the canonical page no larger
        than the smaller split's)."""
        if self._assembly is None:
            largest = 0
            for g, layout in enumerate(self.layouts):
                s = self.parts.shards[g]
                if layout is None or not s:
                    continue
                for d in self.parts.others[g]:
                    data = layout.canonical * len(layout.runs) // min(d, s)
                    largest = max(largest, data + SUM_BYTES * max(1, d // s))
            self._assembly = self.pages.assembly_memory(ASSEMBLY_BLOCKS * max(1, largest))
            self.client.register(*self._assembly)
        return self._assembly

    def _publish_layouts(self) -> None:
        """Publishes how this rank's pages of each sharded group lie in the
        canonical page, at first and every :data:`LAYOUT_EVERY_S` after."""
        now = time.monotonic()
        if now < self._layouts_due:
            return
        self._layouts_due = now + LAYOUT_EVERY_S
        for g, layout in enumerate(self.layouts):
            if layout is not None and self.parts.publishes[g]:
                self.client.put_layout(f"{self.parts.mine[g]}/g{self.group_ids[g]}", layout.to_bytes())

    def _hold(self, job: int) -> None:
        with self._lock:
            self._held.add(job)

    def _release(self, job: int, start: Callable[[], None]) -> None:
        try:
            start()
        except Exception as e:  # the job fails; the engine hears of it
            self.fail(job, 0, str(e))
        finally:
            with self._lock:
                self._held.discard(job)
                self._lock.notify_all()

    def take_failed(self) -> list[tuple[int, int, str]]:
        """Jobs failed on the thread since the last call: ``(job, blocks
        damaged, why)``."""
        with self._lock:
            failed, self._failed = self._failed, []
        return failed

    def wait(self, jobs: Iterable[int]) -> None:
        """Waits until every one of ``jobs`` held on the thread started (or
        failed)."""
        jobs = set(jobs)
        with self._lock:
            self._lock.wait_for(lambda: not (jobs & self._held))

    def failures(self) -> dict[str, int]:
        """G4 failures of this rank so far, by kind."""
        return {f.value: n for f, n in self.client.failures.items()}

    def close(self) -> None:
        """Stops the thread once the tasks queued so far ran."""
        self._tasks.put(None)


def _by_group(blocks: Sequence[tuple[int, int, bytes]]) -> dict[int, list[tuple[int, bytes]]]:
    out: dict[int, list[tuple[int, bytes]]] = {}
    for group, slot, key in blocks:
        out.setdefault(group, []).append((slot, key))
    return out


def lookup_stats(lookups: G4Lookups | None) -> dict[str, Any]:
    """The scheduler's G4 counters for its stats."""
    if lookups is None:
        return {}
    seconds = sorted(lookups.query_seconds)
    return {
        "g4_queries": lookups.queries,
        "g4_query_p50_ms": 1e3 * seconds[len(seconds) // 2] if seconds else 0.0,
        "g4_lookup_failures": {f.value: n for f, n in lookups.client.failures.items()},
    }

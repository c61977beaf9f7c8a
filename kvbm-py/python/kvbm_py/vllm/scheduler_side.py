"""The connector's scheduler role: kvbm's books in vLLM's engine core."""

from __future__ import annotations

import atexit
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvbm_py import InvalidArgumentError, KvbmError, Scheduler, instance_files, start_metrics_server
from kvbm_py.config import KvbmConfig, SchedulerConfig
from kvbm_py.vllm import kept_g3
from kvbm_py.vllm.common import engine_id, instance_of, log, world_size
from kvbm_py.vllm.fence import WriteFence
from kvbm_py.vllm.metadata import KvbmMetadata
from kvbm_py.vllm.retention import retention_of

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request


#: A block id no G1 has: an onboard aimed there fails on every worker.
_NO_BLOCK = 0xFFFF_FFFF
#: Loads a request may try: one more after a failure (a worker that was
#: lost comes back), then it computes what vLLM does not hold, since a
#: damaged block stays in kvbm's books and every load of it fails.
_LOAD_ATTEMPTS = 2


@dataclass
class _Tracked:
    """A live request as the scheduler side follows it."""

    request: Any
    block_ids: list[int] = field(default_factory=list)
    #: Leading blocks already queued for offload (or known to be there).
    offloaded: int = 0
    #: Whether any offload was queued (then its release must wait).
    has_offloads: bool = False


@dataclass
class _Load:
    block_ids: list[int]
    is_async: bool
    #: vLLM block hashes of the blocks it writes.
    hashes: list[bytes] = field(default_factory=list)


def naming_the_size_key(error: InvalidArgumentError, config: KvbmConfig) -> InvalidArgumentError:
    """``error`` from starting kvbm, with the key and value of the tier it
    finds too large (kvbm's Rust side names the tier, G2 or G3)."""
    key = {"G2": "cpu_cache_gb", "G3": "disk_cache_gb"}.get(str(error)[:2])
    if key is None:
        return error
    return InvalidArgumentError(f"kvbm: {key}={getattr(config, key)!r} GiB per worker: {error}")


def _history_path(vllm_config: VllmConfig, config: KvbmConfig) -> str | None:
    """Where the use history is kept beside kept tiers (None when no tier
    is kept, or it cannot be: the workers log why)."""
    if not (config.keeps_g2 or config.keeps_g3):
        return None
    ident, _ = kept_g3.identity(vllm_config)
    path = config.kept_history_path(ident) if ident is not None else None
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    return path


class SchedulerSide:
    """Match, onboard, offload and release over a kvbm :class:`Scheduler`."""

    def __init__(self, vllm_config: VllmConfig, config: KvbmConfig) -> None:
        self.config = config
        self.block_size = int(vllm_config.cache_config.block_size)
        eid = engine_id(vllm_config)
        world = world_size(vllm_config)
        self.secret_file = config.secret_file_for(eid)
        # Files earlier instances left in $TMPDIR go; this instance's stay
        # until its last process shuts down.
        instance_files.sweep()
        self.files = instance_files.InstanceLock(config.files_digest(eid))
        atexit.register(self.files.release)
        started = time.monotonic()
        # Waits until every worker allocated its G2 and G3 (on its own
        # thread); a worker that could not is an error here.
        settings = SchedulerConfig.for_engine(
            config,
            eid,
            world,
            self.block_size,
            instance=instance_of(eid),
            history_path=_history_path(vllm_config, config),
        )
        try:
            self.kvbm = Scheduler(settings)
        except InvalidArgumentError as e:
            raise naming_the_size_key(e, config) from None
        # A process that exits without shutting the engine down still
        # leaves its use history for the next one.
        atexit.register(self.kvbm.save_history)
        log.info(
            "kvbm: caches ready: %d worker(s), blocks per tier %s (waited %.1f s)",
            world,
            dict(self.kvbm.capacity()),
            time.monotonic() - started,
        )
        if config.metrics_port:
            port = start_metrics_server(config.metrics_port, config.metrics_host)
            log.info("kvbm: Prometheus metrics on %s:%d", config.metrics_host, port)
        #: vLLM KV events from kvbm's tiers, when vLLM publishes KV events.
        self.events = None
        ev = getattr(vllm_config, "kv_events_config", None)
        if ev is not None and getattr(ev, "enable_kv_cache_events", False):
            from kvbm_py.vllm.events import EventTracker

            self.events = EventTracker(self.block_size)
            self.kvbm.subscribe_events()
        #: kvbm's counters when vLLM last took stats.
        self._stats_before: dict[str, Any] | None = None
        #: Whether the log said why G2 turns blocks down (or never will),
        #: and when a step next looks (at most once a second; a finished
        #: request always does).
        self._admission_explained = config.admission == "all"
        self._admission_check_at = 0.0
        self.requests: dict[str, _Tracked] = {}
        self.engine_blocks: dict[str, int] = {}
        self.loading: dict[str, _Load] = {}
        #: Blocks asynchronous loads are writing: hash -> how many loads.
        #: A request whose next block is among them waits for that load
        #: (then vLLM's prefix cache has it) instead of loading it again.
        self.loading_hashes: dict[bytes, int] = {}
        self.sync_started: list[str] = []
        #: Requests allocated (and maybe loading) since the last step's
        #: metadata: a preemption reported in the same step came first.
        self.allocated_now: set[str] = set()
        #: Requests whose onboard started (kvbm keeps them until released).
        self.onboarded: set[str] = set()
        #: Failed loads per live request (vLLM matches a request whose
        #: asynchronous load failed again): see `_LOAD_ATTEMPTS`.
        self.load_failures: dict[str, int] = {}
        self.failures_left = config.test_fail_onboards
        # News for the workers, collected between steps.
        self.pending = KvbmMetadata()
        #: Which blocks a scheduled forward has yet to write: an offload
        #: reads a block only once the forward writing it has run, whoever
        #: asks (a request that hit it in vLLM's prefix cache too).
        self.fence = WriteFence(max(1, int(getattr(vllm_config, "max_concurrent_batches", 1))))
        #: Offloads and releases waiting for the forward of a step, in
        #: decision order: (step, request id, action).
        self.deferred: list[tuple[int, str, Callable[[], Any]]] = []

    # ---- matching and loading ----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        rid = request.request_id
        if rid in self.loading or self.load_failures.get(rid, 0) >= _LOAD_ATTEMPTS:
            return 0, False
        tracked = self.requests.get(rid)
        if rid in self.onboarded or (tracked is not None and tracked.has_offloads):
            # Matched again (a failed asynchronous load, or a preemption):
            # vLLM freed the request's blocks, so kvbm lets go of them
            # (waiting for copies still reading them) and starts over.
            self._forget(rid)
            if tracked is not None:
                tracked.block_ids = []
        engine_blocks = num_computed_tokens // self.block_size
        if self.loading_hashes:
            hashes = request.block_hashes
            if engine_blocks < len(hashes) and hashes[engine_blocks] in self.loading_hashes:
                # Another request is loading this prefix: ask again later.
                return None, False
        try:
            # kvbm keeps the request's keys and last answer: a request
            # matched again (it waits, step after step) costs only the
            # hashes it gained.
            m = self.kvbm.match_prefix(rid, request.block_hashes, request.num_tokens, engine_blocks)
        except Exception as e:
            log.warning("kvbm: match of %s failed, computing it: %s", rid, e)
            return 0, False
        self.engine_blocks[rid] = m.engine_blocks
        if m.external_tokens == 0:
            return 0, False
        log.debug("kvbm: %s matched %r", rid, m)
        return m.external_tokens, self.config.load_async

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        rid = request.request_id
        self.allocated_now.add(rid)
        ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        tracked = self.requests.get(rid)
        if tracked is None:
            tracked = self.requests[rid] = _Tracked(request)
        if num_external_tokens <= 0 or rid in self.loading:
            return
        start = self.engine_blocks.pop(rid, 0)
        n = num_external_tokens // self.block_size
        target = ids[start : start + n]
        # Loaded blocks are in G2/G3 already: no offload for them.
        tracked.offloaded = max(tracked.offloaded, start + n)
        is_async = self.config.load_async
        load = _Load(block_ids=target, is_async=is_async)
        if is_async:
            load.hashes = list(request.block_hashes[start : start + n])
        copy_to = target
        if self.failures_left > 0:
            self.failures_left -= 1
            copy_to = [_NO_BLOCK] * len(target)
        try:
            self.kvbm.onboard(rid, copy_to)
        except Exception as e:
            log.warning("kvbm: onboard of %s not started: %s", rid, e)
            self.pending.load_errors.extend(target)
            if is_async:
                self.pending.finished_recving.append(rid)
            return
        self.loading[rid] = load
        for h in load.hashes:
            self.loading_hashes[h] = self.loading_hashes.get(h, 0) + 1
        self.onboarded.add(rid)
        if not is_async:
            self.sync_started.append(rid)

    def _end_load(self, rid: str) -> _Load | None:
        """Takes the request's load out of the books."""
        load = self.loading.pop(rid, None)
        if load is not None:
            for h in load.hashes:
                left = self.loading_hashes.get(h, 0) - 1
                if left > 0:
                    self.loading_hashes[h] = left
                else:
                    self.loading_hashes.pop(h, None)
        return load

    def _loaded(self, rid: str, meta: KvbmMetadata) -> None:
        load = self._end_load(rid)
        if load is None:
            return
        self.fence.whole(load.block_ids)
        if load.is_async:
            meta.finished_recving.append(rid)
        if self.config.test_corrupt_onboard and load.block_ids:
            meta.corrupt_blocks.append(load.block_ids[0])

    def _failed(self, rid: str, error: KvbmError, meta: KvbmMetadata) -> None:
        load = self._end_load(rid)
        if load is None:
            return
        log.warning("kvbm: load of %s failed, vLLM recomputes %d blocks: %s", rid, len(load.block_ids), error)
        self.load_failures[rid] = self.load_failures.get(rid, 0) + 1
        # Another request may hit these blocks in vLLM's prefix cache
        # before they are recomputed: nothing copies them out until then.
        self.fence.poison(load.block_ids)
        meta.load_errors.extend(load.block_ids)
        if load.is_async:
            meta.finished_recving.append(rid)

    # ---- each step ----

    def build_connector_meta(self, so: SchedulerOutput) -> KvbmMetadata:
        self.fence.begin_step()
        try:
            return self._build_meta(so)
        finally:
            self.fence.end_step()
            if not self._admission_explained and time.monotonic() >= self._admission_check_at:
                self._admission_check_at = time.monotonic() + 1.0
                self._explain_admission()

    def _build_meta(self, so: SchedulerOutput) -> KvbmMetadata:
        meta, self.pending = self.pending, KvbmMetadata()
        self._run_deferred()
        failed_now: set[str] = set()
        # Synchronous loads land before this step's forward.
        for rid in self.sync_started:
            if rid not in self.loading:
                continue
            try:
                self.kvbm.wait_onboard(rid)
            except KvbmError as error:
                failed_now.add(rid)
                self._failed(rid, error, meta)
            else:
                self._loaded(rid, meta)
        self.sync_started = []
        done, failed = self.kvbm.poll_onboards()
        for rid in done:
            self._loaded(rid, meta)
        for rid, failure in failed:
            self._failed(rid, failure, meta)
        # A preempted request's blocks go back to vLLM now: stop reading
        # them before this step's forward can overwrite them.
        for rid in so.preempted_req_ids or ():
            if rid in self.allocated_now:
                # Preempted and scheduled again in this step (vLLM resumes
                # preempted requests at once after a forced prefix-cache
                # reset): its match already let go of the old blocks, and
                # its new load must not be cancelled.
                continue
            tracked = self.requests.get(rid)
            if tracked is not None and (tracked.has_offloads or rid in self.onboarded):
                self._forget(rid)
                tracked.block_ids = []
        self._track_blocks(so)
        self._note_writes(so)
        if self.config.offload == "eager":
            scheduled = [r.req_id for r in so.scheduled_new_reqs]
            scheduled += list(so.scheduled_cached_reqs.req_ids)
            for rid in scheduled:
                tracked = self.requests.get(rid)
                if tracked is not None and rid not in failed_now:
                    self._offload_computed(rid, tracked)
        meta.finished_sending.extend(self.kvbm.poll_released())
        self.allocated_now.clear()
        return meta

    def _track_blocks(self, so: SchedulerOutput) -> None:
        for new in so.scheduled_new_reqs:
            tracked = self.requests.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
        cached = so.scheduled_cached_reqs
        resumed: set[str] = getattr(cached, "resumed_req_ids", set()) or set()
        for i, rid in enumerate(cached.req_ids):
            tracked = self.requests.get(rid)
            if tracked is None:
                continue
            new_ids = cached.new_block_ids[i]
            if rid in resumed:
                tracked.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                tracked.block_ids.extend(new_ids[0])

    def _note_writes(self, so: SchedulerOutput) -> None:
        """Tells the fence which blocks this step's forward writes: for
        each scheduled request, those its scheduled tokens fall in."""
        scheduled = so.num_scheduled_tokens
        for new in so.scheduled_new_reqs:
            self._note_range(new.block_ids[0], new.num_computed_tokens, scheduled.get(new.req_id, 0))
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            tracked = self.requests.get(rid)
            if tracked is not None:
                self._note_range(tracked.block_ids, cached.num_computed_tokens[i], scheduled.get(rid, 0))

    def _note_range(self, block_ids: list[int], computed: int, tokens: int) -> None:
        if tokens > 0:
            first, last = computed // self.block_size, (computed + tokens - 1) // self.block_size
            self.fence.writes(block_ids[first : last + 1])

    def _offload_computed(self, rid: str, tracked: _Tracked) -> None:
        """Queues the request's full blocks computed so far (forwards that
        ran or run now, prefix hits, landed loads) for offload, to run once
        the forwards writing them finished."""
        req = tracked.request
        hashes = req.block_hashes
        full = min(req.num_computed_tokens // self.block_size, len(hashes), len(tracked.block_ids))
        start = tracked.offloaded
        if full <= start:
            return
        # Blocks of a failed load (and those after them) wait until vLLM
        # recomputed them; the request offloads them then.
        full = start + self.fence.clean_prefix(tracked.block_ids[start:full])
        if full <= start:
            return
        parent = hashes[start - 1] if start > 0 else None
        if self.events is not None:
            self.events.note(req, start, full)
        ids, keys = tracked.block_ids[start:full], list(hashes[start:full])
        step = self.fence.written_by(ids)
        self._when_written(rid, step, lambda: self.kvbm.offload(rid, ids, keys, parent))
        tracked.offloaded = full
        tracked.has_offloads = True

    def _when_written(self, rid: str, step: int, action: Callable[[], Any]) -> None:
        """Runs `action` (an offload or a release of `rid`) once the forward
        of `step` finished and after `rid`'s actions decided before it: now,
        or from a later step's metadata."""
        waiting = [s for s, r, _ in self.deferred if r == rid]
        if not waiting and self.fence.is_done(step):
            action()
        else:
            self.deferred.append((max([step, *waiting]), rid, action))

    def _run_deferred(self) -> None:
        """A step is being scheduled: runs, in decision order, what waited
        for forwards that have finished now."""
        if not self.deferred:
            return
        ready = [e for e in self.deferred if self.fence.is_done(e[0])]
        self.deferred = [e for e in self.deferred if not self.fence.is_done(e[0])]
        for _, rid, action in ready:
            try:
                action()
            except Exception as e:
                log.warning("kvbm: deferred offload of %s failed: %s", rid, e)

    def _forget(self, rid: str) -> None:
        """Releases the request in kvbm (its queued offloads are cancelled,
        running ones waited for) while vLLM keeps running it."""
        # Offloads not handed over yet read blocks vLLM takes back.
        self.deferred = [e for e in self.deferred if e[1] != rid]
        self.kvbm.release(rid)
        self.onboarded.discard(rid)
        tracked = self.requests.get(rid)
        if tracked is not None:
            tracked.has_offloads = False

    # ---- the end of a request ----

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        try:
            return self._request_finished(request, block_ids)
        finally:
            if self.config.test_stats_path:
                self._write_stats(self.config.test_stats_path)
            if not self._admission_explained:
                self._explain_admission()

    def _explain_admission(self) -> None:
        """Says once, when G2 first turns blocks down, why: a new user
        otherwise sees G2 stay nearly empty and concludes kvbm does not
        work."""
        refused = int(self.kvbm.stats().get("offloads_not_admitted", 0))
        if refused == 0:
            return
        self._admission_explained = True
        log.info(
            "kvbm: admission=%s turned down %d block(s) so far: G2 admits a block once "
            "kvbm predicts it will be used again (a prefix is kept from its second use "
            "on), which serves more hits when G2 is full; admission=all admits every block",
            self.config.admission,
            refused,
        )

    def _write_stats(self, path: str) -> None:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(dict(self.kvbm.stats()), f)
        os.replace(tmp, path)

    def _request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, None]:
        rid = request.request_id
        self.engine_blocks.pop(rid, None)
        self.onboarded.discard(rid)
        self.load_failures.pop(rid, None)
        load = self._end_load(rid)
        if load is not None:
            # Aborted while loading: stop writing vLLM's blocks (the release
            # cancels the copies and waits for those running). vLLM keeps
            # an asynchronously loading request's blocks until the load is
            # reported finished: report it now that nothing lands any more.
            self.deferred = [e for e in self.deferred if e[1] != rid]
            self.kvbm.release(rid)
            self.requests.pop(rid, None)
            if load.is_async:
                self.pending.finished_recving.append(rid)
            return False, None
        tracked = self.requests.pop(rid, None)
        if tracked is not None and self.config.offload != "none":
            if block_ids:
                tracked.block_ids = list(block_ids)
            self._offload_computed(rid, tracked)
        hint = retention_of(getattr(request, "kv_transfer_params", None))
        if tracked is not None and tracked.has_offloads:
            # vLLM keeps the blocks until the worker reports this id in
            # finished_sending, which happens once the offloads ran.
            self._when_written(rid, 0, lambda: self.kvbm.release_after_offloads(rid, hint))
            return True, None
        self.kvbm.release(rid, hint)
        return False, None

    # ---- events and stats ----

    def take_events(self) -> list[KVCacheEvent]:
        """vLLM KV events of kvbm's tiers since the last call."""
        if self.events is None:
            return []
        return self.events.convert(self.kvbm.take_events())

    def take_stats(self) -> dict[str, float]:
        """What kvbm's counters moved since the last call (KvbmStats
        data)."""
        from kvbm_py.vllm.stats import delta

        now = dict(self.kvbm.stats())
        out = delta(now, self._stats_before)
        self._stats_before = now
        return out

    def reset_cache(self) -> bool:
        self.kvbm.reset()
        if self.config.keeps_g2 or self.config.keeps_g3:
            log.info(
                "kvbm: the cache was reset; the kept tiers forget what they held and keep nothing stored "
                "from now on until the engine restarts (the weights may change around a reset)"
            )
        return True

    def shutdown(self) -> None:
        self.kvbm.shutdown()
        # Every worker read the secret at start-up: nobody needs the file.
        try:
            os.remove(self.secret_file)
        except OSError:
            pass
        self.files.release()

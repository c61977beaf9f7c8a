"""The connector class vLLM loads: one instance per role."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvbm_py import InvalidArgumentError
from kvbm_py.config import KvbmConfig
from kvbm_py.vllm.metadata import KvbmMetadata

if TYPE_CHECKING:
    from collections.abc import Iterable

    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KvbmConnector", "KvbmMetadata"]


def _check_cache_config(vllm_config: VllmConfig, kv_cache_config: Any) -> None:
    """Refuses at start-up what kvbm cannot serve correctly: several KV
    cache groups (block ids are per group) or block hashes over a block
    size other than the cache's (kvbm keys one hash per block)."""
    if kv_cache_config is None:
        return
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    if len(groups) > 1:
        raise InvalidArgumentError(f"kvbm: {len(groups)} KV cache groups (hybrid attention); kvbm serves one")
    block_size = int(vllm_config.cache_config.block_size)
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block_size and int(hash_block_size) != block_size:
        raise InvalidArgumentError(
            f"kvbm: vLLM hashes blocks of {hash_block_size} tokens but caches blocks of "
            f"{block_size}; kvbm needs one hash per cached block"
        )


class KvbmConnector(KVConnectorBase_V1):
    """kvbm as a vLLM v1 KV connector.

    The scheduler role (in the engine core) owns kvbm's books: a kvbm-dist
    leader and the tier engine (G2 host memory, G3 disk). It matches
    ``request.block_hashes`` beyond vLLM's own prefix-cache hit, starts
    onboards into the blocks vLLM allocated, queues offloads of full
    blocks, and holds a finished request's blocks until kvbm read them.
    The worker role (in each worker process) hands vLLM's KV tensors to a
    kvbm-dist worker, which moves the bytes, and reports what the scheduler
    side says finished.
    """

    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None = None,
    ) -> None:
        # vLLM 0.32 always passes the cache configuration; the default is
        # vLLM's own signature of connectors before it.
        super().__init__(vllm_config, role, kv_cache_config)  # type: ignore[arg-type]
        extra = self._kv_transfer_config.kv_connector_extra_config or {}
        self.config = KvbmConfig.from_sources(extra)
        if self.config.g4_master is not None:
            raise InvalidArgumentError(
                "kvbm: g4_master: G4 on a shared store runs behind vLLM's offloading connector "
                '("kv_connector": "KvbmOffloadingConnector"); KvbmConnector has no shared G4'
            )
        _check_cache_config(vllm_config, kv_cache_config)
        self._scheduler = None
        self._worker = None
        if role == KVConnectorRole.SCHEDULER:
            from kvbm_py.vllm.scheduler_side import SchedulerSide

            self._scheduler = SchedulerSide(vllm_config, self.config)
        else:
            from kvbm_py.vllm.worker_side import WorkerSide

            self._worker = WorkerSide(vllm_config, self.config, kv_cache_config)

    # ---- scheduler role ----

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens kvbm can load beyond vLLM's ``num_computed_tokens``, and
        whether the load is asynchronous."""
        assert self._scheduler is not None
        return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        """Starts the onboard into the blocks vLLM allocated."""
        assert self._scheduler is not None
        self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """Collects finished loads and releases, queues offloads."""
        assert self._scheduler is not None
        return self._scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Queues the request's last offloads; ``True`` (keep the blocks)
        while kvbm still reads them."""
        assert self._scheduler is not None
        return self._scheduler.request_finished(request, block_ids)

    def take_events(self) -> Iterable[KVCacheEvent]:
        """KV events of kvbm's tiers since the last call: ``BlockStored``
        and ``BlockRemoved`` with medium ``CPU`` (G2) or ``STORAGE`` (G3).
        Empty unless vLLM publishes KV events."""
        if self._scheduler is None:
            return ()
        return self._scheduler.take_events()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        """kvbm's counters since the last call (scheduler role), or
        ``None`` when nothing moved."""
        if self._scheduler is None:
            return None
        from kvbm_py.vllm.stats import KvbmStats

        stats = KvbmStats(data=self._scheduler.take_stats())
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        """kvbm's stats object over ``data`` (what
        :meth:`get_kv_connector_stats` sent)."""
        from kvbm_py.vllm.stats import KvbmStats

        return KvbmStats(data=dict(data)) if data is not None else KvbmStats()

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[Any, Any],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        """kvbm's ``vllm:kvbm_*`` metrics on vLLM's own Prometheus
        endpoint."""
        from kvbm_py.vllm.stats import KvbmPromMetrics

        return KvbmPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def reset_cache(self) -> bool:
        """Drops every block G2 and G3 hold that no request uses."""
        if self._scheduler is None:
            return True
        return self._scheduler.reset_cache()

    def shutdown(self) -> None:
        """Stops kvbm (the leader tells its workers to exit) and lets go of
        the instance's files in the temporary directory."""
        if self._scheduler is not None:
            self._scheduler.shutdown()
        if self._worker is not None:
            self._worker.shutdown()

    # ---- worker role ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Recognises vLLM's KV tensors as kvbm's G1 and starts the worker;
        an unsupported tensor layout is an error here."""
        assert self._worker is not None
        self._worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Takes this step's news from the scheduler side."""
        super().bind_connector_metadata(connector_metadata)
        if self._worker is not None:
            assert isinstance(connector_metadata, KvbmMetadata)
            self._worker.bind(connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        """Nothing: kvbm's workers move the bytes as the leader says."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Nothing: a load has landed before its request is scheduled."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        """Nothing: offloads copy whole blocks once they are computed."""

    def wait_for_save(self) -> None:
        """Nothing: a finished request's blocks stay allocated until its
        offloads ran (``finished_sending``)."""

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Finished sends and receives, as the scheduler side reported."""
        assert self._worker is not None
        return self._worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks of failed loads: vLLM recomputes them."""
        if self._worker is None:
            return set()
        return self._worker.load_errors()

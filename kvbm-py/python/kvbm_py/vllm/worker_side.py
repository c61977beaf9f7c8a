"""The connector's worker role: vLLM's KV tensors as kvbm's G1."""

from __future__ import annotations

import atexit
import os
from typing import TYPE_CHECKING, Any

from kvbm_py import InvalidArgumentError, Worker, _kvbm, instance_files
from kvbm_py.config import SHM_DIR, KvbmConfig, WorkerConfig
from kvbm_py.vllm import kept_g3
from kvbm_py.vllm.common import engine_id, instance_of, kv_encoding, log, with_encoding, world_size
from kvbm_py.vllm.metadata import KvbmMetadata

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig


def _rank() -> int:
    """This process's rank among the engine's workers (0 without a
    distributed group, e.g. one in-process worker)."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().rank_in_group)
    except Exception:
        return 0


class WorkerSide:
    """Owns the kvbm :class:`Worker` of this rank and reports each step's
    finished transfers."""

    def __init__(self, vllm_config: VllmConfig, config: KvbmConfig, kv_cache_config: Any) -> None:
        self.vllm_config = vllm_config
        self.config = config
        self.kv_cache_config = kv_cache_config
        self.worker: Worker | None = None
        self.tensors: list[torch.Tensor] = []
        self.block_axis = 0
        self._sending: set[str] = set()
        self._recving: set[str] = set()
        self._errors: set[int] = set()

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = list(kv_caches.values())
        if not tensors:
            raise InvalidArgumentError("kvbm: vLLM registered no KV tensors")
        first = tensors[0]
        num_blocks = int(self.kv_cache_config.num_blocks)
        eid = engine_id(self.vllm_config)
        rank = _rank()
        instance_files.sweep()
        self.files = instance_files.InstanceLock(self.config.files_digest(eid))
        atexit.register(self.files.release)
        g3_dir, kept_identity, g2_keep_dir = self._kept_places(eid, rank)
        if kept_identity is not None:
            kept_identity = with_encoding(kept_identity, kv_encoding(kv_caches, num_blocks, self.vllm_config))
        if self.config.test_transfer_delay_ms and not _kvbm.TEST_HOOKS:
            raise InvalidArgumentError("kvbm: test_transfer_delay_ms needs a wheel built with feature test-hooks")
        worker_config = WorkerConfig.for_engine(
            self.config,
            eid,
            rank,
            world_size(self.vllm_config),
            instance=instance_of(eid),
            g3_dir=g3_dir,
            kept_identity=kept_identity,
            g2_keep_dir=g2_keep_dir,
        )
        # kvbm reads each tensor's address, shape, strides, element size
        # and device itself, and keeps the tensors alive.
        self.worker = Worker(worker_config, tensors, num_blocks)
        self.tensors = tensors
        self.block_axis = list(first.shape).index(num_blocks)
        log.info(
            "kvbm: rank %d registered %d KV tensors of shape %s (%d bytes per block)",
            rank,
            len(tensors),
            tuple(first.shape),
            self.worker.block_bytes,
        )

    def _kept_places(self, eid: str, rank: int) -> tuple[str | None, str | None, str | None]:
        """The rank's G3 directory, the identity G3 and G2 are kept under
        across restarts (None: neither is kept) and the directory of a kept
        G2 (None: G2 is not kept)."""
        c = self.config
        keep_g3, keep_g2 = c.keeps_g3, c.keeps_g2
        ident = None
        if keep_g3 or keep_g2:
            ident, why = kept_g3.identity(self.vllm_config)
            if ident is None:
                which = " and ".join(t for t, k in (("G2", keep_g2), ("G3", keep_g3)) if k)
                log.warning(
                    "kvbm: %s not kept across restarts: %s; set PYTHONHASHSEED "
                    "(e.g. PYTHONHASHSEED=0) to keep it, or disk_cache_keep=false / "
                    "cpu_cache_keep=false to silence this",
                    which,
                    why,
                )
        g2_dir = None
        if keep_g2 and ident is not None:
            if os.path.isdir(SHM_DIR):
                kept_g3.sweep_foreign(c, ident, "G2")
                g2_dir = c.kept_g2_dir(ident, rank)
            else:
                log.warning("kvbm: G2 is not kept across restarts: this host has no %s", SHM_DIR)
        if c.disk_cache_gb <= 0:
            return None, (ident if g2_dir else None), g2_dir
        if keep_g3 and ident is not None:
            kept_g3.sweep_foreign(c, ident)
            return c.kept_g3_dir(ident, rank), ident, g2_dir
        return c.g3_dir(eid, rank), None, None

    def bind(self, meta: KvbmMetadata) -> None:
        self._sending.update(meta.finished_sending)
        self._recving.update(meta.finished_recving)
        self._errors.update(meta.load_errors)
        for block in meta.corrupt_blocks:
            # Test hook: bad bytes in a block kvbm loaded, before any
            # forward reads it.
            for t in self.tensors:
                t.select(self.block_axis, block).zero_()

    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        sending, self._sending = self._sending, set()
        recving, self._recving = self._recving, set()
        return (sending or None), (recving or None)

    def load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    def shutdown(self) -> None:
        """Lets go of the instance's files (the last process removes them)."""
        files = getattr(self, "files", None)
        if files is not None:
            files.release()

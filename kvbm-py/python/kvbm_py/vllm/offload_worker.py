"""The rank's half of kvbm as the backend of vLLM's offloading connector
(see :mod:`kvbm_py.vllm.offload`): where a job's blocks live in kvbm's
tiers (:class:`KvbmSlots`, which the manager hands the engine), and the
worker that copies them between the engine's pages of every KV cache
group and this rank's host slots and disk slots (:class:`KvbmOffloadingWorker`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)

from kvbm_py import InvalidArgumentError, _kvbm
from kvbm_py.config import KvbmConfig
from kvbm_py.vllm.common import log as logger
from kvbm_py.vllm.common import with_encoding
from kvbm_py.vllm.g4_shards import PageLayout
from kvbm_py.vllm.offload_g4 import G4Mover, connect
from kvbm_py.vllm.offload_kept import KeptFound, KeptTier, kept_dir, kept_host_dir

if TYPE_CHECKING:
    from kvbm_py.vllm.offload import KvbmOffloadingSpec


class KvbmSlots(BlockIDsLoadStoreSpec):
    """Where a job's blocks live in kvbm's tiers: one slot per key, in the
    order of the engine's blocks in the job, with each key's KV cache group
    (its position among the offloaded groups), which the worker checks
    against the engine's blocks before it copies anything; for a load,
    whether each slot is a disk slot; for a store, the blocks to move from
    a host slot to a disk slot before any slot is written (``(host slot,
    disk slot, group, kvbm key)``; a load that fetches from G4 may move
    some too). With G4: for a load, the blocks to
    fetch into their slot first (``(index in the job, offload key,
    split)``: the split of another parallelism whose shards a block is
    assembled from, 0 for this engine's own parts), or ``broken`` when
    some block found no slot (the job fails, the request is recomputed);
    for a store, each block's offload key, to publish it once stored; for
    either, ``(group, slot, offload key)`` of the blocks leaving
    the host tier, to publish before their slots are written. For a
    store into a kept host tier, each block's kvbm key (``keys``), which
    its slot's record names once it landed."""

    def __init__(
        self,
        slots: list[int],
        groups: list[int],
        disk: list[bool] | None = None,
        demote: list[tuple[int, int, int, int]] | None = None,
        fetch: Sequence[tuple[int, bytes, int]] | None = None,
        publish: Sequence[bytes] | None = None,
        broken: bool = False,
        publish_first: Sequence[tuple[int, int, bytes]] | None = None,
        keys: list[int] | None = None,
    ):
        super().__init__(slots)
        self.groups = groups
        self.disk = disk or [False] * len(slots)
        self.demote = demote or []
        self.fetch = list(fetch or [])
        self.publish = list(publish or [])
        self.broken = broken
        self.publish_first = list(publish_first or [])
        self.keys = keys


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
        rank = spec.config.parallel.rank
        disk_dir = None
        if spec.keeps_disk and spec.kept_identity is not None:
            disk_dir = kept_dir(spec.kvbm, spec.kept_identity, rank)
        elif spec.disk_slots:
            if spec.not_kept_why:
                logger.warning("kvbm: the disk tier starts empty with each engine: %s", spec.not_kept_why)
            disk_dir = _disk_dir(spec.kvbm)
        # What the kept tiers' records are checked against: the identity,
        # and how this rank's tensors lay a block out.
        kept_identity = None
        host_kept = None
        if spec.kept_identity is not None:
            kept_identity = with_encoding(spec.kept_identity, spec.kv_encoding)
            if spec.keeps_host:
                host_kept = (kept_host_dir(spec.kvbm, spec.kept_identity, rank), kept_identity)
        elif spec.kvbm.cpu_cache_keep and spec.not_kept_why:
            logger.warning("kvbm: the host tier starts empty with each engine: %s", spec.not_kept_why)
        self.pages = _kvbm.PageWorker(
            groups,
            num_blocks,
            spec.slots,
            spec.slot_bytes,
            verify=spec.kvbm.verify,
            disk_dir=disk_dir,
            disk_slots=spec.disk_slots,
            sum_tail=spec.g4 is not None,
            # Blocks of engines that lay them out otherwise fail their checks.
            tail_salt=spec.kv_encoding.salt() if spec.kv_encoding is not None else 0,
            disk_kept=kept_identity if spec.keeps_disk else None,
            host_kept=host_kept,
        )
        #: What this rank's kept tiers held at start, for the manager
        #: (None: no tier is kept).
        self.kept: KeptFound | None = None
        host, disk = KeptTier.of(self.pages.kept_host()), KeptTier.of(self.pages.kept())
        if host is not None or disk is not None:
            self.kept = KeptFound(host=host, disk=disk)
        for tier, found in (("host", host), ("disk", disk)):
            if found is not None:
                logger.info(
                    "kvbm: rank %d's %s tier in %s holds %d blocks (%s)",
                    rank,
                    tier,
                    found.directory,
                    len(found.blocks) // _kvbm.KEPT_ENTRY_BYTES,
                    found.started_fresh or "reopened",
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
            parts = spec.g4_parts(rank)
            layouts = [
                PageLayout.of_refs(refs, s) if s else None
                for refs, s in zip(kv_caches.group_data_refs, parts.shards, strict=True)
            ]
            client = None
            if any(s and layout is None for s, layout in zip(parts.shards, layouts, strict=True)):
                # The scheduler names shards this rank cannot relate to its
                # pages: it neither publishes nor reads any (its loads from
                # G4 fail and are recomputed).
                logger.warning("kvbm: G4 not used by rank %d: vLLM's page mappings do not match its shards", rank)
            else:
                client = connect(spec.g4, spec.g4_identity, f"worker of rank {rank}")
            if client is not None:
                group_ids = [g.group_id for g in spec.config.groups]
                self.g4 = G4Mover(client, self.pages, parts, layouts, group_ids)
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
            self.g4.after_puts(job_id, lambda: self.pages.store(job_id, copies, dst_spec.demote, dst_spec.keys))
        else:
            self.pages.store(job_id, copies, dst_spec.demote, dst_spec.keys)
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
        fetch = [(copies[i][0], copies[i][2], key, split) for i, key, split in src_spec.fetch]
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

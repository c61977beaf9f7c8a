"""The tiers behind vLLM's offloading connector, kept across restarts.

Each rank's worker keeps its disk slots in a kept G3 directory and, with
``cpu_cache_keep``, its host slots in a kept G2 directory in
``/dev/shm`` (kvbm's records: a slot names a block only once its bytes
landed, with their checksum, and every read from it is checked against
that checksum). At start each worker reports what its records name
(:class:`KeptFound`) through vLLM's connector handshake: the engine
gathers the reports of every rank once the KV caches are registered,
before the first request, and hands them to the scheduler's connector.
The manager then takes up the blocks that every rank holds in the same
slot, host tier first; a block some rank lacks (an engine killed while
the ranks copied it) is left out, and its slot is written again later,
its records emptied first.

vLLM's events name a block by its offload key, which the records do not
hold (they hold kvbm's 64-bit key). The manager writes the offload key of
each block it stores into a file beside rank 0's host records, and of
each it moves to disk beside rank 0's disk records (:class:`KeptNames`),
so a restarted engine announces the blocks it found and, later, those it
evicts. The file only names blocks: a block without a name is still
served, and only its events are left out.

A reset of the engine's cache (``reset_prefix_cache`` with the connector)
empties every rank's records too, after the copies submitted before it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorHandshakeMetadata

from kvbm_py import _kvbm
from kvbm_py.config import KvbmConfig
from kvbm_py.vllm.kept_g3 import _weights_fingerprint, sweep_foreign

if TYPE_CHECKING:
    from vllm.v1.kv_offload.config import OffloadingConfig

#: How the kept disk tier's slots hold blocks and name them (kvbm's key of
#: an offload key); changes when that does, so old directories are not
#: reused.
KEPT_LAYOUT = "kvbm-offload-kept-1"

#: Bytes of one ``(slot, key)`` entry of a packed report (kvbm's).
KEPT_ENTRY_BYTES: int = _kvbm.KEPT_ENTRY_BYTES

#: The file of offload keys beside rank 0's records.
NAMES_FILE = "offload-keys"

#: The longest offload key the names file holds (a longer one is not
#: named: its block is served, its events left out).
_MAX_NAME = 255


def spec_identity(config: OffloadingConfig, layout: str, parallel: bool = True) -> str | None:
    """What makes blocks stored under ``layout`` by two engines (or by one
    engine before and after a restart) interchangeable: the model and its
    weights, the KV dtype, every group's geometry, the parallelism (unless
    ``parallel`` is false: the caller names it where it matters) and the
    prefix hash seed. None when vLLM seeds its prefix hashes at random
    (``PYTHONHASHSEED`` unset): no block would be found again."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        return None
    p = config.parallel
    fields = {
        "layout": layout,
        "model": config.model.name,
        "weights": _weights_fingerprint(config.model.name, None),
        "kv_dtype": config.model.dtype,
        "groups": [(g.group_id, g.tokens_per_block, len(g.layer_names)) for g in config.groups],
        "bytes_per_block": config.worker_kv_bytes_per_block,
        "tokens_per_hash": config.cache.tokens_per_hash,
        "kv_cache_layout": config.kv_cache_layout,
        "parallel": (p.world_size, p.tp_size, p.pp_size, p.pcp_size, p.dcp_size),
        "hash_seed": hashlib.sha256(seed.encode()).hexdigest()[:16],
    }
    if not parallel:
        del fields["parallel"], fields["bytes_per_block"]
    return "\n".join(f"{k}: {v}" for k, v in fields.items())


def kept_identity(config: OffloadingConfig) -> tuple[str | None, str]:
    """The identity the disk tier is kept under, or ``(None, why it
    cannot be kept)``."""
    identity = spec_identity(config, KEPT_LAYOUT)
    if identity is None:
        return None, (
            "vLLM seeds its prefix hashes at random in every process unless PYTHONHASHSEED "
            "is set (the same value in every process), so no block would be found again"
        )
    return identity, ""


def kept_dir(config: KvbmConfig, identity: str, rank: int) -> str:
    """The kept disk tier's directory of ``rank`` (kvbm takes the first free
    sibling while another engine holds it), after the kept tiers of other
    identities that no engine uses were swept as ``disk_cache_foreign``
    says."""
    sweep_foreign(config, identity)
    return config.kept_g3_dir(identity, rank)


def kept_host_dir(config: KvbmConfig, identity: str, rank: int) -> str:
    """The kept host tier's directory of ``rank`` in ``/dev/shm`` (the
    first free sibling is taken while another engine holds it), after the
    kept host tiers of other identities that no engine uses were swept."""
    sweep_foreign(config, identity, "G2")
    return config.kept_g2_dir(identity, rank)


@dataclasses.dataclass
class KeptTier:
    """What one rank's kept tier (host or disk) held when its worker
    opened it."""

    #: The directory the worker opened.
    directory: str
    #: ``(slot, kvbm key)`` of each block whose record is sound, packed
    #: (see :func:`kvbm_py._kvbm.kept_common`).
    blocks: bytes
    #: Records that were torn or damaged.
    rejected: int
    #: Why the directory was started afresh (None: it was reopened).
    started_fresh: str | None

    @classmethod
    def of(cls, kept: tuple[str, bytes, int, str | None] | None) -> KeptTier | None:
        """From ``PageWorker.kept()`` or ``PageWorker.kept_host()``."""
        return None if kept is None else cls(*kept)


@dataclasses.dataclass
class KeptFound(KVConnectorHandshakeMetadata):
    """What one rank's kept tiers held when its worker opened them (None:
    that tier is not kept)."""

    #: The host tier (G2).
    host: KeptTier | None
    #: The disk tier (G3).
    disk: KeptTier | None


def common_blocks(found: Sequence[KeptTier]) -> tuple[bytes, int]:
    """The blocks every rank's report names, packed in slot order, and how
    many records were left out (torn, damaged, or not on every rank)."""
    common, partial = _kvbm.kept_common([f.blocks for f in found])
    return common, partial + sum(f.rejected for f in found)


def reports_of(found: Mapping[Any, KeptFound | None], world: int, tier: str) -> tuple[list[KeptTier], str]:
    """Rank 0's report of its kept ``tier`` (``host`` or ``disk``) first
    and every other rank's, or ``([], why)`` when they do not cover all
    ``world`` ranks (a rank without that kept tier: nothing of it is taken
    up)."""
    reports = [(rank, getattr(f, tier)) for rank, f in found.items() if isinstance(f, KeptFound)]
    reports = [(rank, r) for rank, r in reports if r is not None]
    if len(reports) != world:
        return [], f"{len(reports)} of {world} ranks reported a kept {tier} tier"
    reports.sort(key=lambda rf: rf[0])
    return [f for _, f in reports], ""


class KeptNames:
    """The offload key of each block stored in a kept tier, appended to a
    file beside rank 0's records: per block its kvbm key (8 bytes,
    little-endian), the key's length (1 byte) and the key. A torn last
    entry is ignored when read."""

    def __init__(self, directory: str, fresh: bool):
        self.path = os.path.join(directory, NAMES_FILE)
        if fresh:
            # The records were started afresh: no name in the file names a
            # block any more.
            with contextlib.suppress(FileNotFoundError):
                os.remove(self.path)
        self._fd: int | None = None
        #: Entries appended since the file was last written whole.
        self.appended = 0

    def read(self) -> dict[int, bytes]:
        """Every name in the file (the last one of a key wins)."""
        try:
            with open(self.path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return {}
        names: dict[int, bytes] = {}
        at = 0
        while at + 9 <= len(data):
            key = int.from_bytes(data[at : at + 8], "little")
            end = at + 9 + data[at + 8]
            if end > len(data):
                break
            names[key] = data[at + 9 : end]
            at = end
        return names

    def rewrite(self, names: Mapping[int, bytes]) -> None:
        """Writes the file anew with just ``names``."""
        self.close()
        tmp = self.path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(_entries(names.items()))
        os.replace(tmp, self.path)
        self.appended = 0

    def append(self, names: Iterable[tuple[int, bytes]]) -> None:
        """Appends ``(kvbm key, offload key)`` names (a failure costs only
        the events of those blocks after a restart)."""
        names = list(names)
        blob = _entries(names)
        if not blob:
            return
        try:
            if self._fd is None:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            os.write(self._fd, blob)
        except OSError:
            return
        self.appended += len(names)

    def close(self) -> None:
        """Closes the file (it is opened again on the next append)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _entries(names: Iterable[tuple[int, bytes]]) -> bytes:
    return b"".join(
        key.to_bytes(8, "little") + bytes([len(name)]) + name for key, name in names if len(name) <= _MAX_NAME
    )

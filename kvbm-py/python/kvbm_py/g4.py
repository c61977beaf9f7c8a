"""G4: a block store shared by engine instances, on Mooncake Store.

What one process of an engine instance sees of it: blocks put from and got
into host memory registered with the store, under keys that name the
engine's identity (model, dtype, page geometry, hash scheme: whatever makes
two instances' blocks interchangeable), the part of the block (a rank's
slice, or a shard: ``kvbm_py.vllm.g4_shards``) and the block's sequence
hash. Each block travels with the 8-byte checksum it was written
with, right after it in memory and in the store (one object, one transfer),
so a reader verifies what it got before it serves a byte.

The store is a cache other processes share, and it may disappear: its
master can die, a client holding a share of its memory can leave. Nothing
here raises for that. Each call says per block whether it happened, every
failure is counted by kind, warnings are rate-limited, and after the store
is found unreachable calls fail at once (no ~4 s timeout per call) until a
health check a few seconds later finds it back. The client re-mounts
itself when the master comes back; no new set-up is needed.

The store client is Mooncake's Python one (``mooncake.store``, from the
``mooncake-transfer-engine`` wheels); it releases the GIL while it works.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvbm_py._kvbm import InvalidArgumentError, KvbmError

log = logging.getLogger("kvbm.g4")

#: A part of a block in G4: a rank's slice (the rank), or a named part.
Part = int | str

#: Bytes of the checksum stored after each block.
SUM_BYTES = 8

#: Mooncake's status codes kvbm tells apart (negative values of its
#: ``ErrorCode``).
_NOT_FOUND = -704
_BUFFER_TOO_SMALL = -600
_TRANSFER_FAILED = -800
_RPC_FAILED = -900
_NO_SPACE = -200


class G4Failure(enum.Enum):
    """Why a block did not move to or from G4."""

    #: The store's master did not answer.
    UNREACHABLE = "unreachable"
    #: The client whose memory holds the block did not serve it (it left
    #: or crashed; the master forgets its blocks a while later).
    TRANSFER = "transfer"
    #: The store holds no block under that key (never put, or evicted).
    MISSING = "missing"
    #: The stored block is not the size asked for.
    SIZE = "size"
    #: The store had no room for a put.
    FULL = "full"
    #: Anything else the store reported.
    OTHER = "other"


def _failure_of(code: int) -> G4Failure:
    if code == _RPC_FAILED:
        return G4Failure.UNREACHABLE
    if code == _TRANSFER_FAILED:
        return G4Failure.TRANSFER
    if code == _NOT_FOUND:
        return G4Failure.MISSING
    if code == _BUFFER_TOO_SMALL:
        return G4Failure.SIZE
    if code == _NO_SPACE:
        return G4Failure.FULL
    return G4Failure.OTHER


@dataclass(frozen=True)
class G4Config:
    """Where the store is and what this process lends it."""

    #: The master's RPC address, ``host:port``.
    master: str
    #: The metadata server: ``http://host:port/metadata`` (the master's
    #: own, started with ``--enable_http_metadata_server``), the same for
    #: every process of the store.
    metadata: str
    #: The transport between clients: ``tcp`` or ``rdma``.
    protocol: str = "tcp"
    #: Host memory this process lends the store, bytes (0: none; the
    #: store's memory then lives in processes that outlive engines).
    segment_bytes: int = 0
    #: The client's own staging buffer for calls that pass bytes, bytes.
    local_buffer_bytes: int = 16 << 20
    #: The address other clients reach this one at.
    hostname: str = "127.0.0.1"
    #: The RDMA device names, comma-separated (``rdma`` only).
    devices: str = ""
    #: How long calls fail at once after the store was found unreachable
    #: before a health check tries it again, s.
    retry_s: float = 2.0


def identity_digest(identity: str) -> str:
    """The short name of an engine identity in G4's keys."""
    return hashlib.sha256(identity.encode()).hexdigest()[:16]


class G4Client:
    """One process's handle on G4: puts, gets and existence queries of
    blocks of one engine identity. Thread-safe."""

    def __init__(self, config: G4Config, identity: str) -> None:
        """Connects to the store of ``config`` for blocks of ``identity``. A
        store that cannot be set up is a :class:`KvbmError`."""
        if not config.master or not config.metadata:
            raise InvalidArgumentError("kvbm: G4 needs the store's master and metadata addresses")
        if config.retry_s <= 0:
            raise InvalidArgumentError(f"kvbm: G4 retry_s={config.retry_s!r} must be > 0")
        self.config = config
        self.namespace = identity_digest(identity)
        from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped,import-not-found,unused-ignore]

        store = MooncakeDistributedStore()
        rc = store.setup(
            config.hostname,
            config.metadata,
            config.segment_bytes,
            config.local_buffer_bytes,
            config.protocol,
            config.devices,
            config.master,
        )
        if rc != 0:
            raise KvbmError(f"kvbm: G4 store at {config.master} could not be set up (status {rc})")
        self._store: Any = store
        self._lock = threading.Lock()
        #: Failures by kind since the client started.
        self.failures: Counter[G4Failure] = Counter()
        #: Blocks put and got.
        self.puts = 0
        self.gets = 0
        self._down_until = 0.0
        self._warned: dict[G4Failure, float] = {}

    def key(self, part: Part, block: bytes) -> str:
        """The key of part ``part`` of the block named ``block`` (its
        sequence hash): a rank's slice (the rank) or a named part."""
        name = part if isinstance(part, str) else f"r{part}"
        return f"kvbm/{self.namespace}/{name}/{block.hex()}"

    def register(self, address: int, size: int) -> None:
        """Registers host memory that blocks are put from and got into (once,
        before any call names it). A :class:`KvbmError` when refused."""
        rc = self._store.register_buffer(address, size)
        if rc != 0:
            raise KvbmError(f"kvbm: G4 refused to register {size} bytes at {address:#x} (status {rc})")

    def available(self) -> bool:
        """Whether calls go to the store now: false for a while after it was
        found unreachable, then true once a health check finds it back."""
        with self._lock:
            down_until = self._down_until
        if not down_until:
            return True
        if time.monotonic() < down_until:
            return False
        if self._store.health_check() != 0:
            self._mark_down()
            return False
        with self._lock:
            self._down_until = 0.0
        return True

    def prefix(self, part: Part, blocks: Sequence[bytes]) -> int:
        """How many of ``blocks`` (a prompt's sequence hashes, in order) the
        store holds from the first on, for part ``part``; 0 while it is
        unreachable."""
        if not blocks or not self.available():
            return 0
        found = self._store.batch_is_exist([self.key(part, b) for b in blocks])
        n = 0
        for status in found:
            if status == 1:
                n += 1
                continue
            if status < 0:
                self._count(_failure_of(status), 1)
            break
        return n

    def held(self, parts: Sequence[Part], blocks: Sequence[bytes]) -> list[bool] | None:
        """Per block of ``blocks``, whether the store holds all its
        ``parts`` (one existence query for all of them); None when the
        store could not answer (unreachable, or any other failure,
        counted)."""
        return self.all_held([[self.key(p, b) for p in parts] for b in blocks])

    def all_held(self, sets: Sequence[Sequence[str]]) -> list[bool] | None:
        """Per set of keys, whether the store holds every key of it (one
        existence query for all the sets); None when the store could not
        answer (as :meth:`exist`)."""
        found = self.exist([k for keys in sets for k in keys])
        if found is None:
            return None
        out, at = [], 0
        for keys in sets:
            out.append(all(found[at : at + len(keys)]))
            at += len(keys)
        return out

    def exist(self, keys: Sequence[str]) -> list[bool] | None:
        """Per key, whether the store holds it (one query); None when the
        store could not answer (unreachable, or any other failure, counted
        once per key)."""
        if not keys:
            return []
        if not self.available():
            return None
        found = self._store.batch_is_exist(list(keys))
        bad = [s for s in found if s < 0]
        if bad or len(found) != len(keys):
            self._count(_failure_of(bad[0]) if bad else G4Failure.OTHER, len(keys))
            return None
        return [s == 1 for s in found]

    def layout_key(self, name: str) -> str:
        """The key of what :meth:`put_layout` publishes under ``name``."""
        return f"kvbm/{self.namespace}/layout/{name}"

    def put_layout(self, name: str, data: bytes) -> bool:
        """Publishes ``data`` under ``name`` beside the blocks, pinned: the
        store does not evict it (a master that restarts forgets it, so a
        writer publishes it again from time to time). Whether it is there."""
        from mooncake.store import ReplicateConfig  # type: ignore[import-untyped,import-not-found,unused-ignore]

        if not self.available():
            return False
        config = ReplicateConfig()
        config.with_hard_pin = True
        rc = int(self._store.upsert(self.layout_key(name), data, config))
        if rc != 0:
            self._count(_failure_of(rc), 1)
        return rc == 0

    def get_layout(self, name: str) -> bytes | None:
        """What :meth:`put_layout` published under ``name``; None when the
        store does not hold it or cannot answer."""
        if not self.available():
            return None
        data = self._store.get(self.layout_key(name))
        return bytes(data) if data else None

    def put(self, part: Part, blocks: Sequence[bytes], addresses: Sequence[int], size: int) -> list[G4Failure | None]:
        """Puts part ``part`` of ``blocks``: block ``i`` from the registered
        memory at ``addresses[i]``, its ``size`` bytes followed by its
        checksum (``SUM_BYTES``). Per block: ``None`` when stored (or when
        the store already held that key), else why not."""
        return self._move(True, [self.key(part, b) for b in blocks], addresses, size)

    def get(self, part: Part, blocks: Sequence[bytes], addresses: Sequence[int], size: int) -> list[G4Failure | None]:
        """Gets part ``part`` of ``blocks`` into the registered memory at
        ``addresses[i]``: ``size`` bytes, then the checksum they were put
        with. Per block: ``None`` when it arrived whole (the caller still
        checks it against its checksum), else why not."""
        return self._move(False, [self.key(part, b) for b in blocks], addresses, size)

    def get_keys(self, keys: Sequence[str], addresses: Sequence[int], size: int) -> list[G4Failure | None]:
        """As :meth:`get`, for keys of any parts (:meth:`key`)."""
        return self._move(False, list(keys), addresses, size)

    def _move(self, put: bool, keys: list[str], addresses: Sequence[int], size: int) -> list[G4Failure | None]:
        n = len(keys)
        if len(addresses) != n:
            raise InvalidArgumentError(f"kvbm: {n} G4 blocks with {len(addresses)} addresses")
        if size <= 0:
            raise InvalidArgumentError(f"kvbm: G4 block size {size}")
        if n == 0:
            return []
        if not self.available():
            self._count(G4Failure.UNREACHABLE, n)
            return [G4Failure.UNREACHABLE] * n
        sizes = [size + SUM_BYTES] * n
        addresses = list(addresses)
        if put:
            codes = self._store.batch_put_from(keys, addresses, sizes)
        else:
            codes = self._store.batch_get_into(keys, addresses, sizes)
        out: list[G4Failure | None] = []
        for code in codes:
            # A get reports the bytes it read, a put 0 (also for a key the
            # store already held: the block is there).
            ok = code == 0 if put else code == size + SUM_BYTES
            if ok:
                out.append(None)
                continue
            why = G4Failure.SIZE if (not put and code > 0) else _failure_of(code)
            out.append(why)
        failed = Counter(f for f in out if f is not None)
        for why, count in failed.items():
            self._count(why, count)
        moved = n - failed.total()
        if put:
            self.puts += moved
        else:
            self.gets += moved
        return out

    def _count(self, why: G4Failure, n: int) -> None:
        if why is G4Failure.UNREACHABLE:
            self._mark_down()
        now = time.monotonic()
        with self._lock:
            self.failures[why] += n
            if now - self._warned.get(why, -1e9) < 10.0:
                return
            self._warned[why] = now
            total = self.failures[why]
        log.warning("kvbm: G4 %s: %d block(s) so far; G1 to G3 go on serving", why.value, total)

    def _mark_down(self) -> None:
        with self._lock:
            self._down_until = time.monotonic() + self.config.retry_s

    def close(self) -> None:
        """Leaves the store: the memory this process lent it (and the
        blocks in it) goes."""
        self._store.close()

"""kvbm's configuration for an engine integration.

:class:`KvbmConfig` holds the user's settings: each is read from the
engine's connector configuration (for vLLM, ``kv_connector_extra_config``),
then from an environment variable, then falls back to its default. See
``docs/vllm.md`` for the table. :class:`WorkerConfig` is what one rank's
:class:`kvbm_py.Worker` is started with, derived from a
:class:`KvbmConfig` by :meth:`WorkerConfig.for_engine`.

A value kvbm cannot use is an :class:`~kvbm_py.InvalidArgumentError`
(also a ``ValueError``).
"""

from __future__ import annotations

import difflib
import hashlib
import math
import os
import socket
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvbm_py._kvbm import InvalidArgumentError
from kvbm_py.g4 import G4Config

GIB = 1 << 30

#: key -> (environment variables, most preferred first; default)
_SOURCES: dict[str, tuple[tuple[str, ...], Any]] = {
    "cpu_cache_gb": (("KVBM_CPU_CACHE_GB", "DYN_KVBM_CPU_CACHE_GB"), 4.0),
    "disk_cache_gb": (("KVBM_DISK_CACHE_GB", "DYN_KVBM_DISK_CACHE_GB"), 0.0),
    "disk_cache_dir": (("KVBM_DISK_CACHE_DIR", "DYN_KVBM_DISK_CACHE_DIR"), None),
    "disk_cache_keep": (("KVBM_DISK_CACHE_KEEP",), True),
    "disk_cache_foreign": (("KVBM_DISK_CACHE_FOREIGN",), "remove"),
    "cpu_cache_keep": (("KVBM_CPU_CACHE_KEEP",), False),
    "offload": (("KVBM_OFFLOAD",), "eager"),
    "admission": (("KVBM_ADMISSION",), "reuse_score"),
    "load_async": (("KVBM_LOAD_ASYNC",), True),
    "endpoint": (("KVBM_ENDPOINT",), None),
    "handshake_timeout_s": (("KVBM_HANDSHAKE_TIMEOUT_S",), 120.0),
    "offload_in_flight": (("KVBM_OFFLOAD_IN_FLIGHT",), 0),
    "metrics_port": (("KVBM_METRICS_PORT", "DYN_KVBM_METRICS_PORT"), 0),
    "metrics_host": (("KVBM_METRICS_HOST",), "127.0.0.1"),
    "verify": (("KVBM_VERIFY",), False),
    "g4_master": (("KVBM_G4_MASTER", "DYN_KVBM_G4_MASTER"), None),
    "g4_metadata": (("KVBM_G4_METADATA", "DYN_KVBM_G4_METADATA"), None),
    "g4_protocol": (("KVBM_G4_PROTOCOL", "DYN_KVBM_G4_PROTOCOL"), "tcp"),
    "g4_devices": (("KVBM_G4_DEVICES",), ""),
    "g4_hostname": (("KVBM_G4_HOSTNAME",), None),
    "g4_segment_gb": (("KVBM_G4_SEGMENT_GB", "DYN_KVBM_G4_SEGMENT_GB"), 1.0),
    "g4_publish": (("KVBM_G4_PUBLISH", "DYN_KVBM_G4_PUBLISH"), "admissions"),
}

OFFLOAD_MODES = ("eager", "finish", "none")
G4_PROTOCOLS = ("tcp", "rdma")
#: Which blocks go to G4: every block G2 admits, once its store is
#: confirmed (``admissions``); every block that leaves G2, before its slot
#: is written again (``evictions``); or none (``off``: this engine only
#: reads).
G4_PUBLISH = ("admissions", "evictions", "off")

#: The port of the store master's HTTP metadata server when
#: ``g4_metadata`` is not given (``mooncake_master``'s default).
G4_METADATA_PORT = 8080
FOREIGN_POLICIES = ("remove", "keep")

#: Names of the G2 and G3 directories kept across restarts, before their
#: digest.
KEPT_PREFIX = "kept-"

#: The ending of the file the use history is kept in beside kept tiers.
HISTORY_SUFFIX = ".uses"

#: The memory-backed file system a kept G2 lives in.
SHM_DIR = "/dev/shm"

#: Test hooks: keys the test suite sets, never read from the environment.
_TEST_KEYS = ("test_corrupt_onboard", "test_fail_onboards", "test_transfer_delay_ms", "test_stats_path")

#: The largest size a tier may be given, GiB per worker (2^64 bytes over
#: all workers is what kvbm can count; a tier's block count is checked
#: once the block size is known).
_MAX_GB = float((1 << 64) // GIB)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def kept_name(identity: str, rank: int) -> str:
    """The name of the kept G2 or G3 directory of ``rank`` under
    ``identity``."""
    return f"{KEPT_PREFIX}{_digest(identity)}-rank{rank}"


def _as_bool(value: Any, key: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("1", "true", "yes", "on"):
        return True
    if text in ("0", "false", "no", "off"):
        return False
    raise InvalidArgumentError(f"kvbm: {key}={value!r} is not a boolean")


def _as_float(value: Any, key: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError, OverflowError):
        raise InvalidArgumentError(f"kvbm: {key}={value!r} is not a number") from None
    if not out >= 0.0 or math.isinf(out):
        raise InvalidArgumentError(f"kvbm: {key}={value!r} must be a finite number >= 0")
    return out


def _as_size(value: Any, key: str) -> float:
    """A size in GiB per worker, no larger than kvbm can count."""
    out = _as_float(value, key)
    if out > _MAX_GB:
        raise InvalidArgumentError(f"kvbm: {key}={value!r} GiB is larger than the limit of {_MAX_GB:.0f} GiB")
    return out


def _unknown_key(key: str, known: list[str]) -> InvalidArgumentError:
    near = difflib.get_close_matches(key, known, n=1)
    hint = f"; did you mean {near[0]!r}?" if near else f"; known keys: {', '.join(sorted(known))}"
    return InvalidArgumentError(f"kvbm: unknown configuration key {key!r}{hint}")


@dataclass(frozen=True)
class KvbmConfig:
    """kvbm's settings for one engine instance.

    Sizes are per worker (per tensor-parallel rank).
    """

    #: G2 (host memory, pinned next to a GPU) per worker, GiB.
    cpu_cache_gb: float = 4.0
    #: G3 (disk) per worker, GiB; 0 disables G3.
    disk_cache_gb: float = 0.0
    #: Directory of the G3 files; a temporary directory when unset.
    disk_cache_dir: str | None = None
    #: G3 outlives the engine: a restarted engine of the same model and
    #: settings finds every block it held (needs ``PYTHONHASHSEED``, see
    #: ``docs/vllm.md``).
    disk_cache_keep: bool = True
    #: What happens to the kept G2 or G3 of another model or setting found
    #: at start (no engine using it): ``remove`` or ``keep``.
    disk_cache_foreign: str = "remove"
    #: G2 outlives the engine process too: it lives in ``/dev/shm`` (host
    #: memory that stays until the host restarts or it is removed), and a
    #: restarted engine of the same model and settings finds every block it
    #: held (needs ``PYTHONHASHSEED``; ``/dev/shm`` must hold
    #: ``cpu_cache_gb``).
    cpu_cache_keep: bool = False
    #: When full blocks are offloaded: ``eager`` (as they fill), ``finish``
    #: (when the request finishes) or ``none``.
    offload: str = "eager"
    #: G2/G3 admission: ``all``, ``reuse_score`` or ``min_uses:N``.
    admission: str = "reuse_score"
    #: Load asynchronously (the request waits while others run) or
    #: synchronously (the scheduler step waits for the load).
    load_async: bool = True
    #: The leader's ZeroMQ endpoint; an IPC socket per engine when unset.
    endpoint: str | None = None
    #: How long the scheduler side waits for every worker, seconds.
    handshake_timeout_s: float = 120.0
    #: Offload batches copying at once; 0 keeps kvbm's default (4). Each
    #: holds its G2 targets, so a G2 of a handful of blocks wants 1.
    offload_in_flight: int = 0
    #: TCP port of kvbm's Prometheus exporter in the scheduler process
    #: (metrics ``kvbm_*``); 0 serves none.
    metrics_port: int = 0
    #: Address the exporter listens on: this host only by default;
    #: ``0.0.0.0`` serves every interface.
    metrics_host: str = "127.0.0.1"
    #: Checksum every block as it lands in G2 or G3 and check it when it
    #: is loaded: a block whose bytes changed is reported to the engine as
    #: a failed load (recomputed, never served) and counted
    #: (``verify_mismatches``). Costs a hash of every byte offloaded and
    #: onboarded (``docs/benchmarks.md``).
    verify: bool = False
    #: G4, a block store engine instances share (Mooncake Store): its
    #: master's RPC address, ``host:port``; None: no G4.
    g4_master: str | None = None
    #: G4's metadata server, ``http://host:port/metadata``; by default the
    #: master's own HTTP metadata server on its host, port 8080.
    g4_metadata: str | None = None
    #: How G4's clients move bytes between hosts: ``tcp`` or ``rdma``.
    g4_protocol: str = "tcp"
    #: The RDMA devices G4 uses, comma-separated (``rdma`` only; empty:
    #: the store's choice).
    g4_devices: str = ""
    #: The address other hosts reach this one at for G4 transfers; by
    #: default this host's name, or ``127.0.0.1`` when the master is on
    #: loopback.
    g4_hostname: str | None = None
    #: Host memory each worker lends G4, GiB (its blocks leave with the
    #: engine; memory lent by ``python -m kvbm_py.g4_local hold`` outlives
    #: it). 0: the engine lends none.
    g4_segment_gb: float = 1.0
    #: Which blocks this engine publishes to G4: ``admissions`` (every
    #: block G2 admits, once stored), ``evictions`` (every block leaving
    #: G2) or ``off`` (it only reads).
    g4_publish: str = "admissions"
    #: Test hook: overwrite the first block of every onboard with zeros
    #: after it landed (proves an output comparison detects bad bytes).
    test_corrupt_onboard: bool = False
    #: Test hook: make this many onboards fail (a real failed copy: they
    #: target a block outside G1, which every worker refuses).
    test_fail_onboards: int = 0
    #: Test hook: every worker holds each copy back this long (ms), so a
    #: test can act while copies are in flight.
    test_transfer_delay_ms: int = 0
    #: Test hook: the scheduler side writes its counters (JSON) here after
    #: every finished request, for tests that cannot reach the engine core.
    test_stats_path: str | None = None

    @classmethod
    def from_sources(cls, extra: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None) -> KvbmConfig:
        """Reads every key from ``extra``, then ``env`` (default
        ``os.environ``), then the default. A key kvbm does not know is
        refused, naming the closest one it does (``extra`` is kvbm's own:
        under vLLM's MultiConnector each connector gets its own
        ``kv_connector_extra_config``)."""
        extra = dict(extra or {})
        env = os.environ if env is None else env
        known = [*_SOURCES, *_TEST_KEYS]
        for key in extra:
            if key not in known:
                raise _unknown_key(str(key), known)
        values: dict[str, Any] = {}
        for key, (names, default) in _SOURCES.items():
            if key in extra and extra[key] is not None:
                values[key] = extra[key]
                continue
            for name in names:
                if env.get(name):
                    values[key] = env[name]
                    break
            else:
                values[key] = default
        cfg = cls(
            cpu_cache_gb=_as_size(values["cpu_cache_gb"], "cpu_cache_gb"),
            disk_cache_gb=_as_size(values["disk_cache_gb"], "disk_cache_gb"),
            disk_cache_dir=values["disk_cache_dir"],
            disk_cache_keep=_as_bool(values["disk_cache_keep"], "disk_cache_keep"),
            disk_cache_foreign=str(values["disk_cache_foreign"]),
            cpu_cache_keep=_as_bool(values["cpu_cache_keep"], "cpu_cache_keep"),
            offload=str(values["offload"]),
            admission=str(values["admission"]),
            load_async=_as_bool(values["load_async"], "load_async"),
            endpoint=values["endpoint"],
            handshake_timeout_s=_as_float(values["handshake_timeout_s"], "handshake_timeout_s"),
            offload_in_flight=int(_as_float(values["offload_in_flight"], "offload_in_flight")),
            metrics_port=int(_as_float(values["metrics_port"], "metrics_port")),
            metrics_host=str(values["metrics_host"]),
            verify=_as_bool(values["verify"], "verify"),
            g4_master=values["g4_master"] or None,
            g4_metadata=values["g4_metadata"] or None,
            g4_protocol=str(values["g4_protocol"]),
            g4_devices=str(values["g4_devices"] or ""),
            g4_hostname=values["g4_hostname"] or None,
            g4_segment_gb=_as_size(values["g4_segment_gb"], "g4_segment_gb"),
            g4_publish=str(values["g4_publish"]),
            test_corrupt_onboard=_as_bool(extra.get("test_corrupt_onboard", False), "test_corrupt_onboard"),
            test_fail_onboards=int(extra.get("test_fail_onboards", 0)),
            test_transfer_delay_ms=int(extra.get("test_transfer_delay_ms", 0)),
            test_stats_path=extra.get("test_stats_path"),
        )
        if not 0 <= cfg.metrics_port <= 65535:
            raise InvalidArgumentError(f"kvbm: metrics_port={cfg.metrics_port} is not a TCP port")
        if cfg.keeps_g2 and cfg.disk_cache_gb > 0 and not cfg.disk_cache_keep:
            raise InvalidArgumentError(
                "kvbm: cpu_cache_keep=true with disk_cache_keep=false: a kept G2 "
                "keeps the G3 behind it too; set disk_cache_keep=true or cpu_cache_keep=false"
            )
        if cfg.disk_cache_foreign not in FOREIGN_POLICIES:
            raise InvalidArgumentError(
                f"kvbm: disk_cache_foreign={cfg.disk_cache_foreign!r}: expected one of {FOREIGN_POLICIES}"
            )
        if cfg.offload not in OFFLOAD_MODES:
            raise InvalidArgumentError(f"kvbm: offload={cfg.offload!r}: expected one of {OFFLOAD_MODES}")
        cfg._check_g4()
        return cfg

    def _check_g4(self) -> None:
        if self.g4_protocol not in G4_PROTOCOLS:
            raise InvalidArgumentError(f"kvbm: g4_protocol={self.g4_protocol!r}: expected one of {G4_PROTOCOLS}")
        if self.g4_publish not in G4_PUBLISH:
            raise InvalidArgumentError(f"kvbm: g4_publish={self.g4_publish!r}: expected one of {G4_PUBLISH}")
        if self.g4_master is not None:
            host, _, port = self.g4_master.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise InvalidArgumentError(f"kvbm: g4_master={self.g4_master!r} is not host:port")
        if self.g4_metadata is not None and not self.g4_metadata.startswith(("http://", "https://")):
            raise InvalidArgumentError(
                f"kvbm: g4_metadata={self.g4_metadata!r}: expected the metadata server's http://host:port/metadata"
            )

    def g4_store(self) -> G4Config | None:
        """Where G4 is and what each worker lends it, or None without G4."""
        if self.g4_master is None:
            return None
        host = self.g4_master.rpartition(":")[0]
        loopback = host in ("127.0.0.1", "localhost", "::1", "[::1]")
        return G4Config(
            master=self.g4_master,
            metadata=self.g4_metadata or f"http://{host}:{G4_METADATA_PORT}/metadata",
            protocol=self.g4_protocol,
            segment_bytes=int(self.g4_segment_gb * GIB),
            hostname=self.g4_hostname or ("127.0.0.1" if loopback else socket.gethostname()),
            devices=self.g4_devices,
        )

    def tier_bytes(self, key: str, world: int) -> int:
        """The bytes of the tier sized by ``key`` (``cpu_cache_gb`` or
        ``disk_cache_gb``) over ``world`` workers; an error naming the key,
        its value and the limit when kvbm cannot count that many."""
        gb = getattr(self, key)
        total = int(gb * GIB) * world
        if total >= 1 << 64:
            limit = ((1 << 64) - 1) / GIB / world
            raise InvalidArgumentError(
                f"kvbm: {key}={gb!r} GiB per worker is larger than the limit of {limit:.0f} GiB with {world} workers"
            )
        return total

    def files_digest(self, engine_id: str) -> str:
        """What the instance's files in the temporary directory are named
        after (``kvbm_py.instance_files``)."""
        return _digest(engine_id)

    def endpoint_for(self, engine_id: str) -> str:
        """The leader's endpoint: the configured one, or an IPC socket named
        after the engine instance (the same in every process of it)."""
        if self.endpoint:
            return self.endpoint
        # IPC paths are limited to ~100 bytes: name the socket by a digest.
        return f"ipc://{tempfile.gettempdir()}/kvbm-{_digest(engine_id)}.sock"

    def secret_file_for(self, engine_id: str) -> str:
        """Where the engine instance's secret is published (mode 0600): the
        first of its processes to start draws it, the others read it."""
        return os.path.join(tempfile.gettempdir(), f"kvbm-{_digest(engine_id)}.secret")

    def g3_base(self) -> str:
        """The directory G3 directories go in."""
        return self.disk_cache_dir or os.path.join(tempfile.gettempdir(), "kvbm-g3")

    def g3_dir(self, engine_id: str, rank: int) -> str | None:
        """The G3 directory of ``rank`` (created), or None without G3."""
        if self.disk_cache_gb <= 0:
            return None
        path = os.path.join(self.g3_base(), f"{_digest(engine_id)}-rank{rank}")
        os.makedirs(path, exist_ok=True)
        return path

    def kept_g3_dir(self, identity: str, rank: int) -> str:
        """The G3 directory of ``rank`` kept across restarts under
        ``identity`` (the same for every engine of that identity)."""
        return os.path.join(self.g3_base(), kept_name(identity, rank))

    @staticmethod
    def g2_base() -> str:
        """The directory kept G2 directories go in: this user's, in
        ``/dev/shm``."""
        return os.path.join(SHM_DIR, f"kvbm-g2-{os.getuid()}")

    @property
    def keeps_g3(self) -> bool:
        """Whether there is a G3 and it outlives the engine."""
        return self.disk_cache_gb > 0 and self.disk_cache_keep

    @property
    def keeps_g2(self) -> bool:
        """Whether there is a G2 and it outlives the engine process."""
        return self.cpu_cache_gb > 0 and self.cpu_cache_keep

    def kept_history_path(self, identity: str) -> str | None:
        """The file the scheduler keeps its use history in beside the kept
        tiers (None when neither G2 nor G3 is kept): in the G3 directory's
        base where G3 is kept, else in the G2 one."""
        if self.keeps_g3:
            base = self.g3_base()
        elif self.keeps_g2:
            base = self.g2_base()
        else:
            return None
        return os.path.join(base, kept_name(identity, 0).rsplit("-rank", 1)[0] + HISTORY_SUFFIX)

    def kept_g2_dir(self, identity: str, rank: int) -> str:
        """The G2 directory of ``rank`` kept across restarts under
        ``identity``."""
        return os.path.join(self.g2_base(), kept_name(identity, rank))


@dataclass(frozen=True)
class WorkerConfig:
    """What one rank's :class:`kvbm_py.Worker` is started with, besides the
    engine's KV tensors.

    :meth:`for_engine` derives it from the user's :class:`KvbmConfig`.
    """

    #: The leader's ZeroMQ endpoint (the scheduler side binds it).
    endpoint: str
    #: This worker's rank, ``0 <= rank < world_size``.
    rank: int
    #: Workers of the engine instance (each holds a slice of every block).
    world_size: int
    #: Where the instance secret is published (the first process of the
    #: instance to start draws it; ``KVBM_INSTANCE_SECRET`` wins).
    secret_file: str
    #: kvbm's 64-bit id of the engine instance (the leader's must match).
    instance: int = 0
    #: The rank's G3 directory; None: no G3.
    g3_dir: str | None = None
    #: The identity G3 (and G2, with ``g2_keep_dir``) is kept across
    #: restarts under; None: neither is kept.
    kept_identity: str | None = None
    #: The directory (in ``/dev/shm``) of a G2 kept across restarts.
    g2_keep_dir: str | None = None
    #: How long the worker waits for the leader before it gives up, s.
    leader_timeout_s: float = 600.0
    #: Test hook: every copy is held back this long (ms); only a wheel
    #: built with feature ``test-hooks`` (``kvbm_py._kvbm.TEST_HOOKS``)
    #: takes a value other than 0.
    transfer_delay_ms: int = 0

    @classmethod
    def for_engine(
        cls,
        config: KvbmConfig,
        engine_id: str,
        rank: int,
        world_size: int,
        *,
        instance: int = 0,
        g3_dir: str | None = None,
        kept_identity: str | None = None,
        g2_keep_dir: str | None = None,
    ) -> WorkerConfig:
        """The configuration of ``rank`` of the engine instance
        ``engine_id``: the endpoint and secret file ``config`` names for
        it, and its test hooks."""
        return cls(
            endpoint=config.endpoint_for(engine_id),
            rank=rank,
            world_size=world_size,
            secret_file=config.secret_file_for(engine_id),
            instance=instance,
            g3_dir=g3_dir,
            kept_identity=kept_identity,
            g2_keep_dir=g2_keep_dir,
            transfer_delay_ms=config.test_transfer_delay_ms,
        )


@dataclass(frozen=True)
class SchedulerConfig:
    """What an engine instance's :class:`kvbm_py.Scheduler` (the leader of
    its workers and the tier engine over them) is started with.

    :meth:`for_engine` derives it from the user's :class:`KvbmConfig`.
    Byte budgets are summed over all workers.
    """

    #: The ZeroMQ endpoint the leader binds (its workers connect to it).
    endpoint: str
    #: Workers of the engine instance (each holds a slice of every block).
    world_size: int
    #: Tokens per block.
    block_size: int
    #: G2 (host memory) over all workers, bytes.
    g2_bytes: int
    #: G3 (disk) over all workers, bytes; 0: no G3.
    g3_bytes: int = 0
    #: kvbm's 64-bit id of the engine instance (its workers' must match).
    instance: int = 0
    #: G2 and G3 admission: ``all``, ``reuse_score`` or ``min_uses:N``.
    admission: str = "reuse_score"
    #: How long the leader waits for every worker, s.
    handshake_timeout_s: float = 120.0
    #: Where the instance secret is published (the first process of the
    #: instance to start draws it; ``KVBM_INSTANCE_SECRET`` wins). None:
    #: the leader draws one no worker knows.
    secret_file: str | None = None
    #: Offload batches copying at once; None: kvbm's default. Each holds
    #: its G2 targets, so a G2 of very few blocks wants 1.
    offload_in_flight: int | None = None
    #: Host memory beyond ``g2_bytes`` that receives the G3 blocks a match
    #: finds (read at once) and holds the G3 writes nobody waits for;
    #: None: kvbm's default with a G3 (256 MiB, at most an eighth of
    #: ``g2_bytes``), 0: off.
    g3_staging_bytes: int | None = None
    #: Workers checksum every block written into G2 or G3 and fail a load
    #: whose bytes no longer match (the engine recomputes it).
    verify: bool = False
    #: Where workers keep G2 or G3 across restarts: the file the use
    #: history is written to every few seconds and read back at start, so
    #: kept blocks rank by their past uses. None: no history is kept.
    history_path: str | None = None

    @classmethod
    def for_engine(
        cls,
        config: KvbmConfig,
        engine_id: str,
        world_size: int,
        block_size: int,
        *,
        instance: int = 0,
        history_path: str | None = None,
    ) -> SchedulerConfig:
        """The configuration of the engine instance ``engine_id`` with
        ``world_size`` workers: the endpoint, secret file, tier sizes and
        policy ``config`` names for it."""
        return cls(
            endpoint=config.endpoint_for(engine_id),
            world_size=world_size,
            block_size=block_size,
            g2_bytes=config.tier_bytes("cpu_cache_gb", world_size),
            g3_bytes=config.tier_bytes("disk_cache_gb", world_size),
            instance=instance,
            admission=config.admission,
            handshake_timeout_s=config.handshake_timeout_s,
            secret_file=config.secret_file_for(engine_id),
            offload_in_flight=config.offload_in_flight or None,
            verify=config.verify,
            history_path=history_path,
        )

"""A G4 store on one host: a Mooncake Store master started here, and
processes that only lend the store memory.

For a single-host deployment, tests and benchmarks of G4
(:mod:`kvbm_py.g4`). :class:`LocalMaster` runs ``mooncake_master`` with
its HTTP metadata server on loopback ports (free ones unless given) and
hands out the :class:`~kvbm_py.g4.G4Config` that reaches it.
:class:`SegmentHolder` runs a process whose whole job is to lend the store
host memory: the store's blocks live in the memory of the clients that
lend it, and a client that closes takes its blocks with it, so blocks that
must outlive an engine (or a benchmark's writer) need a holder that stays
up.

From a shell::

    python -m kvbm_py.g4_local master [--rpc-port P] [--http-port P]
    python -m kvbm_py.g4_local hold --master HOST:PORT \\
        --metadata http://HOST:PORT/metadata --segment-gb N

``master`` prints the ``master`` and ``metadata`` addresses the engines
and holders are given and runs until interrupted; ``hold`` lends ``N``
GiB until interrupted (SIGINT or SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path
from types import TracebackType
from typing import IO, TypeVar

from kvbm_py._kvbm import InvalidArgumentError, KvbmError, KvbmTimeoutError
from kvbm_py.g4 import G4Client, G4Config

#: The identity a holder's client is set up with (a holder puts and gets
#: nothing; the name only keeps it apart from engines' identities).
HOLDER_IDENTITY = "kvbm-segment-holder"

#: What a holder writes (to stdout, or to the descriptor it is given) once
#: its memory is lent.
READY_LINE = b"kvbm-g4-holder ready\n"

#: How much of a log an error message quotes, characters.
_LOG_TAIL = 2000


def master_executable() -> str:
    """The ``mooncake_master`` binary: the one on ``PATH``, else the one the
    ``mooncake-transfer-engine`` wheel ships beside its ``mooncake``
    package. A :class:`KvbmError` when there is neither."""
    found = shutil.which("mooncake_master")
    if found:
        return found
    spec = importlib.util.find_spec("mooncake")
    if spec is not None and spec.origin is not None:
        beside = Path(spec.origin).parent / "mooncake_master"
        if beside.is_file() and os.access(beside, os.X_OK):
            return str(beside)
    raise KvbmError(
        "kvbm: no mooncake_master on PATH or in the mooncake package (pip install mooncake-transfer-engine)"
    )


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports on ``host`` that nothing listens on now
    (another process may still take one before it is used)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _listening(host: str, port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def _tail(path: Path) -> str:
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - _LOG_TAIL))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _end(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL if ``proc`` has not exited within
    ``timeout_s``; waits for it either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
    proc.wait()


def _kill_if_running(proc: subprocess.Popen[bytes]) -> None:
    """Kills ``proc`` unless it has exited (the master of a
    :class:`LocalMaster` never closed, when it is collected or at exit)."""
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _check_port(name: str, port: int | None) -> None:
    if port is not None and not 0 < port < 65536:
        raise InvalidArgumentError(f"kvbm: {name}={port!r} is not a TCP port")


class _Logs:
    """Where a child's output goes: the file asked for (appended to), or a
    file in a temporary directory kept until :meth:`close`."""

    def __init__(self, log: str | Path | None, name: str) -> None:
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if log is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvbm-g4-")
            self.path = Path(self._tmp.name) / name
        else:
            self.path = Path(log)

    def open(self) -> IO[bytes]:
        return self.path.open("ab")

    def close(self) -> None:
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


_C = TypeVar("_C", bound="_Child")


class _Child:
    """A process this one started, with the file its output goes to: what
    :class:`LocalMaster` and :class:`SegmentHolder` share. A context
    manager: leaving it stops the process."""

    _proc: subprocess.Popen[bytes] | None
    _logs: _Logs

    @property
    def log(self) -> Path:
        """The file the process's output goes to."""
        return self._logs.path

    @property
    def pid(self) -> int | None:
        """The process id while it runs."""
        return self._proc.pid if self.running and self._proc is not None else None

    @property
    def running(self) -> bool:
        """Whether the process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def _let_go(self) -> None:
        # A holder also exits when its stdin ends.
        if self._proc is not None and self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ends the process: SIGTERM, then SIGKILL if it has not exited
        within ``timeout_s``."""
        if self._proc is not None:
            self._let_go()
            _end(self._proc, timeout_s)
            self._proc = None

    def kill(self) -> None:
        """Ends the process with SIGKILL, as a crash would (fault tests)."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            self._let_go()
            self._proc = None

    def close(self) -> None:
        """Stops the process and removes its temporary log, if it has one."""
        self.stop()
        self._logs.close()

    def __enter__(self: _C) -> _C:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


class LocalMaster(_Child):
    """A ``mooncake_master`` on this host, with its HTTP metadata server,
    for a single-host deployment, tests and benchmarks: started by the
    constructor, listening on ``host`` (loopback unless told), on the ports
    given or on free ones, which :meth:`restart` keeps. A context manager:
    leaving it stops the master."""

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        rpc_port: int | None = None,
        http_port: int | None = None,
        metrics_port: int | None = None,
        segment_bytes: int = 0,
        local_buffer_bytes: int = 16 << 20,
        protocol: str = "tcp",
        devices: str = "",
        retry_s: float = 2.0,
        lease_ttl_ms: int | None = None,
        client_ttl_s: int | None = None,
        rpc_threads: int | None = None,
        eviction_high_watermark: float | None = None,
        log: str | Path | None = None,
        executable: str | None = None,
        start_timeout_s: float = 30.0,
    ) -> None:
        """Starts the master and returns once it listens.

        ``segment_bytes``, ``local_buffer_bytes``, ``protocol``, ``devices``
        and ``retry_s`` are what :attr:`config` hands clients.
        ``lease_ttl_ms`` (how long a block read stays pinned),
        ``client_ttl_s`` (how long a silent client's memory stays in the
        store), ``rpc_threads`` and ``eviction_high_watermark`` (the share of
        the store's memory in use that starts eviction) are the master's
        own; ``None`` leaves Mooncake's default. Its output goes to ``log``
        (appended), else to a temporary file removed by :meth:`close`.

        An unusable argument is an :class:`InvalidArgumentError`; no master
        binary, or one that exits while starting, a :class:`KvbmError`; one
        that does not listen within ``start_timeout_s`` a
        :class:`KvbmTimeoutError`.
        """
        for name, port in (("rpc_port", rpc_port), ("http_port", http_port), ("metrics_port", metrics_port)):
            _check_port(name, port)
        if segment_bytes < 0 or local_buffer_bytes <= 0:
            raise InvalidArgumentError(
                f"kvbm: segment_bytes={segment_bytes} must be >= 0 and local_buffer_bytes={local_buffer_bytes} > 0"
            )
        if protocol not in ("tcp", "rdma"):
            raise InvalidArgumentError(f"kvbm: G4 protocol {protocol!r} is neither 'tcp' nor 'rdma'")
        if retry_s <= 0 or start_timeout_s <= 0:
            raise InvalidArgumentError(f"kvbm: retry_s={retry_s} and start_timeout_s={start_timeout_s} must be > 0")
        for name, value in (
            ("lease_ttl_ms", lease_ttl_ms),
            ("client_ttl_s", client_ttl_s),
            ("rpc_threads", rpc_threads),
        ):
            if value is not None and value <= 0:
                raise InvalidArgumentError(f"kvbm: {name}={value} must be > 0")
        if eviction_high_watermark is not None and not 0 < eviction_high_watermark <= 1:
            raise InvalidArgumentError(f"kvbm: eviction_high_watermark={eviction_high_watermark} must be in (0, 1]")
        #: The address everything listens on and clients are reached at.
        self.host = host
        self._fixed = (rpc_port, http_port, metrics_port)
        self._segment_bytes = segment_bytes
        self._local_buffer_bytes = local_buffer_bytes
        self._protocol = protocol
        self._devices = devices
        self._retry_s = retry_s
        self._flags = [
            f"--{flag}={value}"
            for flag, value in (
                ("default_kv_lease_ttl", lease_ttl_ms),
                ("client_ttl", client_ttl_s),
                ("rpc_thread_num", rpc_threads),
                ("eviction_high_watermark_ratio", eviction_high_watermark),
            )
            if value is not None
        ]
        self._timeout_s = start_timeout_s
        self._executable = executable or master_executable()
        self._logs = _Logs(log, "mooncake_master.log")
        self._proc: subprocess.Popen[bytes] | None = None
        #: The master's RPC port, its HTTP metadata server's and its
        #: metrics server's.
        self.rpc_port, self.http_port, self.metrics_port = self._ports()
        # Free ports may be taken between the look and the master's bind:
        # a first start that fails takes new ones (fixed ports are kept).
        for attempt in range(3):
            try:
                self.start()
                return
            except KvbmTimeoutError:
                self.close()
                raise
            except KvbmError:
                if attempt == 2 or all(p is not None for p in self._fixed):
                    self.close()
                    raise
                self.rpc_port, self.http_port, self.metrics_port = self._ports()

    def _ports(self) -> tuple[int, int, int]:
        free = iter(free_ports(3, self.host))
        rpc, http, metrics = (p if p is not None else next(free) for p in self._fixed)
        return rpc, http, metrics

    @property
    def master(self) -> str:
        """The master's RPC address, ``host:port`` (:attr:`G4Config.master`)."""
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        """The metadata server's URL (:attr:`G4Config.metadata`)."""
        return f"http://{self.host}:{self.http_port}/metadata"

    @property
    def config(self) -> G4Config:
        """What a client of this store is set up with: the addresses, and
        the segment size, staging buffer, transport and retry delay given to
        the constructor (``dataclasses.replace`` changes one for a client)."""
        return G4Config(
            master=self.master,
            metadata=self.metadata,
            protocol=self._protocol,
            segment_bytes=self._segment_bytes,
            local_buffer_bytes=self._local_buffer_bytes,
            hostname=self.host,
            devices=self._devices,
            retry_s=self._retry_s,
        )

    def start(self) -> None:
        """Starts the master on this object's ports (nothing when it runs)
        and returns once both its RPC and its metadata ports listen. A new
        master holds no blocks: clients re-mount their memory by themselves.
        A :class:`KvbmError` when it exits while starting, a
        :class:`KvbmTimeoutError` when it does not listen in time."""
        if self.running:
            return
        args = [
            self._executable,
            f"--rpc_address={self.host}",
            f"--rpc_port={self.rpc_port}",
            "--enable_http_metadata_server=true",
            f"--http_metadata_server_host={self.host}",
            f"--http_metadata_server_port={self.http_port}",
            f"--metrics_host={self.host}",
            f"--metrics_port={self.metrics_port}",
            *self._flags,
        ]
        with self._logs.open() as out:
            proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
        self._proc = proc
        weakref.finalize(self, _kill_if_running, proc)
        deadline = time.monotonic() + self._timeout_s
        while not (_listening(self.host, self.rpc_port) and _listening(self.host, self.http_port)):
            if proc.poll() is not None:
                self._proc = None
                raise KvbmError(f"kvbm: mooncake_master exited ({proc.returncode}) while starting: {_tail(self.log)}")
            if time.monotonic() > deadline:
                self.kill()
                raise KvbmTimeoutError(
                    f"kvbm: mooncake_master did not listen on {self.master} within {self._timeout_s} s: {_tail(self.log)}"
                )
            time.sleep(0.05)

    def restart(self) -> None:
        """Stops the master if it runs and starts a new one on the same
        ports (it holds no blocks until clients put again)."""
        self.stop()
        self.start()

    def hold(self, segment_bytes: int, *, log: str | Path | None = None) -> SegmentHolder:
        """Starts a :class:`SegmentHolder` lending ``segment_bytes`` to this
        store."""
        return SegmentHolder(self.config, segment_bytes, log=log)


class SegmentHolder(_Child):
    """A process that only lends host memory to a G4 store (a
    :class:`~kvbm_py.g4.G4Client` with ``segment_bytes`` > 0 that puts and
    gets nothing), for a single-host deployment, tests and benchmarks:
    blocks other clients put may land in its memory and stay there after
    their writers closed. It runs ``python -m kvbm_py.g4_local hold`` and
    exits when this object stops it or when the process that started it
    ends. A context manager: leaving it stops the holder, and the blocks in
    its memory go."""

    def __init__(
        self,
        config: G4Config,
        segment_bytes: int,
        *,
        log: str | Path | None = None,
        python: str | None = None,
        start_timeout_s: float = 60.0,
    ) -> None:
        """Starts a holder lending ``segment_bytes`` to the store ``config``
        names (its address, transport and devices; its ``segment_bytes`` is
        not used) and returns once the memory is lent. Its output (Mooncake's
        log) goes to ``log``, else to a temporary file removed by
        :meth:`close`; ``python`` runs it (this interpreter unless told).

        A ``segment_bytes`` <= 0 is an :class:`InvalidArgumentError`; a
        holder that exits while starting (Mooncake refuses a segment under
        16 MiB, say) a
        :class:`KvbmError`; one not ready within ``start_timeout_s`` (no
        store there: Mooncake keeps trying) a :class:`KvbmTimeoutError`.
        """
        if segment_bytes <= 0:
            raise InvalidArgumentError(f"kvbm: a segment holder lends segment_bytes={segment_bytes}: must be > 0")
        if start_timeout_s <= 0:
            raise InvalidArgumentError(f"kvbm: start_timeout_s={start_timeout_s} must be > 0")
        #: What the holder was started with.
        self.config = replace(config, segment_bytes=segment_bytes)
        self._logs = _Logs(log, "segment_holder.log")
        # The holder imports this package from where this process found it.
        env = os.environ.copy()
        here = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join([here, *filter(None, [env.get("PYTHONPATH")])])
        self._proc: subprocess.Popen[bytes] | None = None
        ready_r, ready_w = os.pipe()
        args = [
            python or sys.executable,
            "-m",
            "kvbm_py.g4_local",
            "hold",
            f"--master={config.master}",
            f"--metadata={config.metadata}",
            f"--segment-bytes={segment_bytes}",
            f"--protocol={config.protocol}",
            f"--hostname={config.hostname}",
            f"--devices={config.devices}",
            f"--ready-fd={ready_w}",
            "--exit-with-stdin",
        ]
        try:
            with self._logs.open() as out:
                self._proc = subprocess.Popen(
                    args,
                    stdin=subprocess.PIPE,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env=env,
                    pass_fds=(ready_w,),
                )
            os.close(ready_w)
            ready_w = -1
            self._wait_ready(ready_r, start_timeout_s)
        except BaseException:
            # Not ready: nothing of it to leave gracefully.
            if ready_w >= 0:
                os.close(ready_w)
            self.kill()
            self._logs.close()
            raise
        finally:
            os.close(ready_r)

    def _wait_ready(self, fd: int, timeout_s: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout_s
        got = b""
        while not got.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0:
                raise KvbmTimeoutError(f"kvbm: segment holder not ready within {timeout_s} s: {_tail(self._logs.path)}")
            readable, _, _ = select.select([fd], [], [], min(left, 0.2))
            chunk = os.read(fd, 64) if readable else b""
            if readable and not chunk:
                self._proc.wait()
                raise KvbmError(
                    f"kvbm: segment holder exited ({self._proc.returncode}) while starting: {_tail(self._logs.path)}"
                )
            got += chunk
        if got != READY_LINE:
            raise KvbmError(f"kvbm: segment holder said {got!r} while starting")


def _run_holder(args: argparse.Namespace) -> int:
    """``hold``: lends the memory, says so, and waits for SIGINT, SIGTERM or
    (with ``--exit-with-stdin``) the end of stdin; then leaves the store."""
    config = G4Config(
        master=args.master,
        metadata=args.metadata,
        protocol=args.protocol,
        segment_bytes=args.segment_bytes,
        hostname=args.hostname,
        devices=args.devices,
    )
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _sig, _frame: done.set())
    client = G4Client(config, HOLDER_IDENTITY)
    try:
        if args.exit_with_stdin:

            def watch() -> None:
                while sys.stdin.buffer.read(4096):
                    pass
                done.set()

            threading.Thread(target=watch, name="kvbm-g4-stdin", daemon=True).start()
        if args.ready_fd is not None:
            os.write(args.ready_fd, READY_LINE)
            os.close(args.ready_fd)
        else:
            sys.stdout.buffer.write(READY_LINE)
            sys.stdout.flush()
        while not done.wait(0.5):
            pass
    finally:
        client.close()
    return 0


def _run_master(args: argparse.Namespace) -> int:
    """``master``: runs a :class:`LocalMaster` until SIGINT or SIGTERM."""
    done = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda _sig, _frame: done.set())
    with LocalMaster(
        host=args.host,
        rpc_port=args.rpc_port,
        http_port=args.http_port,
        metrics_port=args.metrics_port,
        log=args.log,
    ) as m:
        print(f"master {m.master}\nmetadata {m.metadata}\nlog {m.log}", flush=True)
        while not done.wait(0.5):
            if not m.running:
                print(f"kvbm: mooncake_master exited: {_tail(m.log)}", file=sys.stderr)
                return 1
    return 0


def _positive_bytes(gib: float | None, nbytes: int | None) -> int:
    n = nbytes if nbytes is not None else int((gib or 0.0) * (1 << 30))
    if n <= 0:
        raise InvalidArgumentError("kvbm: a segment holder lends more than 0 bytes")
    return n


def main(argv: list[str] | None = None) -> int:
    """``python -m kvbm_py.g4_local master|hold ...``: see the module's doc.
    Bad arguments exit 2 with a message; a store that cannot be reached
    exits 1."""
    ap = argparse.ArgumentParser(prog="python -m kvbm_py.g4_local", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    m = sub.add_parser("master", help="run a mooncake_master on this host until interrupted")
    m.add_argument("--host", default="127.0.0.1")
    m.add_argument("--rpc-port", type=int, help="default: a free port")
    m.add_argument("--http-port", type=int, help="the metadata server's; default: a free port")
    m.add_argument("--metrics-port", type=int, help="default: a free port")
    m.add_argument("--log", help="the master's output (default: a temporary file)")
    h = sub.add_parser("hold", help="lend this process's memory to a store until interrupted")
    h.add_argument("--master", required=True, help="the master's RPC address, host:port")
    h.add_argument("--metadata", required=True, help="http://host:port/metadata")
    size = h.add_mutually_exclusive_group(required=True)
    size.add_argument("--segment-gb", type=float, help="GiB to lend")
    size.add_argument("--segment-bytes", type=int, help="bytes to lend")
    h.add_argument("--protocol", default="tcp", choices=("tcp", "rdma"))
    h.add_argument("--hostname", default="127.0.0.1", help="the address other clients reach this one at")
    h.add_argument("--devices", default="", help="RDMA devices, comma-separated (rdma only)")
    h.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    h.add_argument("--exit-with-stdin", action="store_true", help="also exit when stdin ends")
    args = ap.parse_args(argv)
    try:
        if args.command == "master":
            return _run_master(args)
        args.segment_bytes = _positive_bytes(args.segment_gb, args.segment_bytes)
        return _run_holder(args)
    except InvalidArgumentError as e:
        ap.error(str(e))
    except KvbmError as e:
        print(e, file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

"""G4 on Mooncake Store, on one host: what kvbm's client (``kvbm_py.g4``)
moves and what a lookup costs, each against Mooncake's own figure for the
same work measured in the same run.

The store: a ``mooncake_master`` and a segment holder (a separate process
that only lends the store memory, ``kvbm_py.g4_local``) started here; the
bench's client lends nothing, so every block crosses between two processes
over Mooncake's TCP transport (to this host's own address: the kernel
routes it through loopback).

- put and get bandwidth through ``G4Client.put`` / ``get``: 16-token
  blocks of Llama-3.1-8B's shape per rank (32 layers x K, V x 16 tokens x 8
  KV heads x 128 x bf16 = 2 MiB, each followed by its 8-byte checksum), ``--batch``
  blocks per call, ``--rounds`` calls per repetition, from and into a
  registered host buffer. Reference: Mooncake's ``transfer_engine_bench``
  (the binary in the ``mooncake`` wheel) between two processes over TCP,
  the same block size and batch, one submitting thread, write and read,
  for ``--te-seconds`` each, timed right before the G4 figure (each run is a
  new initiator process whose buffer is new memory: its first batch pays
  the page faults, a few percent of a 3 s run). Every block a get returns
  is compared with what was put, between the timed calls.
- the first put into memory the holder never wrote (page faults in the
  holder); the timed puts go into memory written before (a warm-up pass
  put and removed), as a store that has run a while has.
- what a call costs besides its bytes: puts and gets of ``--batch`` blocks
  of ``--small-bytes``, the mean per call over 50 (p50 and p99 beside it);
  reference: Mooncake's ``transfer_engine_bench`` write and read batches
  of the same blocks, the mean per batch over a 1 s run (one run each: a
  noisy row on a busy machine).
- lookups: ``G4Client.prefix`` over a prompt of ``--prompt`` blocks held by
  the store, for one rank and for two (two calls), p50 and p99 over
  ``--lookups`` calls; reference: Mooncake's ``batch_is_exist`` on the same
  keys (one master call), interleaved with them.

Each ratio is the median of the repetitions' ratios [min-max]. A plain
Mooncake client removes the bench's blocks between repetitions (kvbm's
client has no remove).

    python kvbm-py/benches/g4_bench.py [--batch 32] [--rounds 12] [--reps 5]
        [--te-seconds 3] [--prompt 64] [--lookups 300]
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import os
import re
import statistics
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from dataclasses import replace
from pathlib import Path

from kvbm_py.g4 import SUM_BYTES, G4Client
from kvbm_py.g4_local import LocalMaster, free_ports

LAYERS, TOKENS, KV_HEADS, HEAD_DIM, DTYPE_BYTES = 32, 16, 8, 128, 2
#: One rank's 16-token block of Llama-3.1-8B: K and V of every layer.
BLOCK = LAYERS * 2 * TOKENS * KV_HEADS * HEAD_DIM * DTYPE_BYTES
#: The bytes of a block put for lookups (only its key matters to them).
LOOKUP_BLOCK = 64 << 10
IDENTITY = "g4-bench/llama-3.1-8b/bf16/16"
#: Calls timed each way with small blocks.
SMALL_CALLS = 50


def te_binary() -> str:
    """Mooncake's ``transfer_engine_bench``, beside the ``mooncake`` package."""
    import mooncake  # type: ignore[import-untyped]

    exe = Path(mooncake.__file__).parent / "transfer_engine_bench"
    if not exe.is_file():
        raise SystemExit(f"no transfer_engine_bench in {exe.parent}")
    return str(exe)


class TransferEngineBench:
    """Mooncake's ``transfer_engine_bench``: a target process lending a
    buffer, registered with the master's HTTP metadata server, and
    initiator runs that read from or write to it over TCP."""

    def __init__(self, metadata: str, block: int, batch: int, logs: Path) -> None:
        self.exe = te_binary()
        self.metadata = metadata
        self.block, self.batch = block, batch
        self.logs = logs
        # Each request of the one thread is at block_size * i in both
        # buffers.
        self.buffer = block * batch
        self.name = f"127.0.0.1:{free_ports(1)[0]}"
        self.target = subprocess.Popen(
            [*self._common(self.name), f"--block_size={block}", "--mode=target"],
            stdout=(logs / "te_target.log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        self._wait_registered()

    def _common(self, name: str) -> list[str]:
        return [
            self.exe,
            "--protocol=tcp",
            f"--metadata_server={self.metadata}",
            f"--local_server_name={name}",
            f"--buffer_size={self.buffer}",
            f"--batch_size={self.batch}",
            "--threads=1",
        ]

    def _wait_registered(self) -> None:
        """Until the target's segment, with its buffer, is in the metadata
        server."""
        url = f"{self.metadata}?key={urllib.parse.quote('mooncake/ram/' + self.name, safe='')}"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.target.poll() is not None:
                raise SystemExit(f"transfer_engine_bench target exited: see {self.logs / 'te_target.log'}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if b'"buffers":[{' in r.read():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise SystemExit("transfer_engine_bench target did not register within 30 s")

    def run(self, operation: str, seconds: int, block: int | None = None) -> tuple[float, float]:
        """One initiator run: ``operation`` (read or write) of blocks of
        ``block`` bytes (the target's unless given) for ``seconds``; its
        throughput, bytes/s, and seconds per batch."""
        block = block or self.block
        out = subprocess.run(
            [
                *self._common(f"127.0.0.1:{free_ports(1)[0]}"),
                f"--block_size={block}",
                "--mode=initiator",
                f"--segment_id={self.name}",
                f"--operation={operation}",
                f"--duration={seconds}",
                "--report_unit=MB",
                "--report_precision=2",
            ],
            capture_output=True,
            text=True,
            timeout=seconds + 60,
        )
        with (self.logs / "te_initiator.log").open("a") as f:
            f.write(out.stdout + out.stderr)
        m = re.search(r"Test completed: duration ([\d.]+), batch count (\d+), throughput ([\d.]+) MB/s", out.stderr)
        if out.returncode != 0 or m is None:
            raise SystemExit(f"transfer_engine_bench {operation} failed ({out.returncode}): {out.stderr[-1500:]}")
        duration, batches = float(m.group(1)), int(m.group(2))
        return float(m.group(3)) * 1e6, duration / max(batches, 1)

    def close(self) -> None:
        self.target.terminate()
        try:
            self.target.wait(10)
        except subprocess.TimeoutExpired:
            self.target.kill()
            self.target.wait()


class Buffers:
    """The registered host memory: ``n`` source blocks and ``n``
    destination blocks, each followed by its checksum."""

    def __init__(self, client: G4Client, n: int, block: int) -> None:
        self.n, self.block = n, block
        stride = block + SUM_BYTES
        self.mem = ctypes.create_string_buffer(2 * n * stride)
        self.base = ctypes.addressof(self.mem)
        client.register(self.base, 2 * n * stride)
        for i in range(n):
            ctypes.memmove(self.base + i * stride, os.urandom(block), block)
        self.src = [self.base + i * stride for i in range(n)]
        self.dst = [self.base + (n + i) * stride for i in range(n)]
        self.src_sums = [at + block for at in self.src]
        self.dst_sums = [at + block for at in self.dst]

    def stamp(self, serial: int) -> None:
        """Makes the source blocks those of batch ``serial``: each starts
        with (serial, index), its checksum is a digest of it."""
        for i in range(self.n):
            ctypes.memmove(self.src[i], self.tag(serial, i), 16)
            ctypes.memmove(self.src_sums[i], self.sum(serial, i), SUM_BYTES)

    @staticmethod
    def tag(serial: int, i: int) -> bytes:
        return serial.to_bytes(8, "little") + i.to_bytes(8, "little")

    @staticmethod
    def sum(serial: int, i: int) -> bytes:
        return hashlib.blake2b(Buffers.tag(serial, i), digest_size=SUM_BYTES).digest()

    def check(self, serial: int) -> None:
        """The destination blocks are batch ``serial``'s, byte for byte."""
        for i in range(self.n):
            got = ctypes.string_at(self.dst[i], self.block)
            rest = ctypes.string_at(self.src[i] + 16, self.block - 16)
            assert got[:16] == self.tag(serial, i) and got[16:] == rest, f"block {i} of batch {serial} differs"
            assert ctypes.string_at(self.dst_sums[i], SUM_BYTES) == self.sum(serial, i), f"checksum {i} of {serial}"


def page_faults(pid: int | None) -> int:
    """Minor page faults of process ``pid`` so far (0 when unknown)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])
    except (OSError, IndexError, ValueError):
        return 0


def names(tag: str, n: int) -> list[bytes]:
    """``n`` sequence-hash-like block names."""
    return [hashlib.blake2b(f"{tag}/{i}".encode(), digest_size=32).digest() for i in range(n)]


def spread(values: list[float], unit: float = 1.0, digits: int = 2) -> str:
    """``median [min-max]`` of ``values / unit``."""
    v = [x / unit for x in values]
    return f"{statistics.median(v):.{digits}f} [{min(v):.{digits}f}-{max(v):.{digits}f}]"


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="blocks per put/get call and per TE batch")
    ap.add_argument("--rounds", type=int, default=12, help="put/get calls per repetition")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--te-seconds", type=int, default=3, help="duration of each transfer_engine_bench run")
    ap.add_argument("--block-bytes", type=int, default=BLOCK, help="default: one rank's 16-token Llama-3.1-8B block")
    ap.add_argument("--small-bytes", type=int, default=4096, help="block size of the per-call cost rows")
    ap.add_argument("--prompt", type=int, default=64, help="blocks of the prompt looked up")
    ap.add_argument("--lookups", type=int, default=300)
    a = ap.parse_args()
    if min(a.batch, a.rounds, a.reps, a.te_seconds, a.block_bytes, a.small_bytes, a.prompt, a.lookups) <= 0:
        ap.error("every size and count must be > 0")
    from mooncake.store import MooncakeDistributedStore  # type: ignore[import-untyped]

    t_start = time.monotonic()
    load = os.getloadavg()[0]
    n, block = a.batch, a.block_bytes
    pass_bytes = a.rounds * n * (block + SUM_BYTES)
    lookup_bytes = 2 * a.prompt * (LOOKUP_BLOCK + SUM_BYTES)
    small_bytes = SMALL_CALLS * n * (a.small_bytes + SUM_BYTES)
    # Room for one repetition's blocks, the small ones and the prompt's,
    # well under the master's eviction watermark, and Mooncake's 16 MiB
    # minimum.
    segment = max(16 << 20, ((pass_bytes + lookup_bytes + small_bytes) * 3 // 2 + (1 << 20)) & ~((1 << 20) - 1))

    with tempfile.TemporaryDirectory(prefix="g4-bench-") as tmp:
        logs = Path(tmp)
        master = LocalMaster(log=logs / "master.log")
        holder = te = client = store = None
        try:
            holder = master.hold(segment, log=logs / "holder.log")
            config = replace(master.config, segment_bytes=0)
            client = G4Client(config, IDENTITY)
            store = MooncakeDistributedStore()
            rc = store.setup("127.0.0.1", config.metadata, 0, 16 << 20, "tcp", "", config.master)
            if rc != 0:
                raise SystemExit(f"a plain Mooncake client could not be set up ({rc})")
            buf = Buffers(client, n, block)
            te = TransferEngineBench(config.metadata, block, n, logs)

            def put_pass(serial0: int, tag: str) -> tuple[float, list[list[bytes]]]:
                """``--rounds`` puts of fresh blocks; their seconds (puts
                only) and names."""
                spent, batches = 0.0, []
                for r in range(a.rounds):
                    keys = names(f"{tag}/{r}", n)
                    buf.stamp(serial0 + r)
                    t0 = time.perf_counter()
                    got = client.put(0, keys, buf.src, block)
                    spent += time.perf_counter() - t0
                    assert got == [None] * n, f"put {tag}/{r}: {got}"
                    batches.append(keys)
                return spent, batches

            def get_pass(serial0: int, batches: list[list[bytes]]) -> float:
                spent = 0.0
                for r, keys in enumerate(batches):
                    t0 = time.perf_counter()
                    got = client.get(0, keys, buf.dst, block)
                    spent += time.perf_counter() - t0
                    assert got == [None] * n, f"get {r}: {got}"
                    # Between the timed calls, every returned byte checked
                    # (the source still holds the last batch's bytes past
                    # each block's tag).
                    buf.check(serial0 + r)
                return spent

            def remove(batches: list[list[bytes]]) -> None:
                keys = [client.key(0, k) for b in batches for k in b]
                codes = store.batch_remove(keys, True)
                assert all(c == 0 for c in codes), f"remove: {set(codes)}"

            moved = a.rounds * n * block
            # First puts into memory the holder never wrote; then the same
            # memory, freed, is what the timed puts land in.
            te.run("write", 1)  # the target's buffer, written once
            te_write0, _ = te.run("write", a.te_seconds)
            faults0 = page_faults(holder.pid)
            cold_s, warm = put_pass(0, "warm-up")
            cold_faults = page_faults(holder.pid) - faults0
            remove(warm)
            cold = (moved / cold_s, te_write0)
            warm_faults = 0

            put_rate, get_rate, te_w, te_r, put_ratio, get_ratio = [], [], [], [], [], []
            serial = a.rounds
            for rep in range(a.reps):
                w, _ = te.run("write", a.te_seconds)
                faults0 = page_faults(holder.pid)
                put_s, batches = put_pass(serial, f"rep{rep}")
                warm_faults += page_faults(holder.pid) - faults0
                r, _ = te.run("read", a.te_seconds)
                get_s = get_pass(serial, batches)
                remove(batches)
                serial += a.rounds
                put_rate.append(moved / put_s)
                get_rate.append(moved / get_s)
                te_w.append(w)
                te_r.append(r)
                put_ratio.append(moved / put_s / w)
                get_ratio.append(moved / get_s / r)

            # Small blocks: what a call costs besides its bytes.
            small_put, small_get = [], []
            for r in range(SMALL_CALLS):
                keys = names(f"small/{r}", n)
                t0 = time.perf_counter()
                assert client.put(0, keys, buf.src, a.small_bytes) == [None] * n
                t1 = time.perf_counter()
                assert client.get(0, keys, buf.dst, a.small_bytes) == [None] * n
                small_put.append(t1 - t0)
                small_get.append(time.perf_counter() - t1)
            _, te_small_write = te.run("write", 1, a.small_bytes)
            _, te_small_read = te.run("read", 1, a.small_bytes)

            # Lookups: a prompt held for ranks 0 and 1 (small blocks: only
            # the keys matter).
            small = G4Client(config, IDENTITY)
            mem = ctypes.create_string_buffer(a.prompt * (LOOKUP_BLOCK + SUM_BYTES))
            base = ctypes.addressof(mem)
            small.register(base, len(mem))
            prompt = names("prompt", a.prompt)
            addrs = [base + i * (LOOKUP_BLOCK + SUM_BYTES) for i in range(a.prompt)]
            for rank in (0, 1):
                assert small.put(rank, prompt, addrs, LOOKUP_BLOCK) == [None] * a.prompt
            assert client.prefix(0, prompt) == a.prompt and client.prefix(1, prompt) == a.prompt
            keys = {rank: [client.key(rank, b) for b in prompt] for rank in (0, 1)}
            held = getattr(client, "held", None)
            cases: dict[str, list[float]] = {k: [] for k in ("p1", "r1", "p2", "r2", "h2")}
            for _ in range(a.lookups):
                t0 = time.perf_counter()
                client.prefix(0, prompt)
                t1 = time.perf_counter()
                store.batch_is_exist(keys[0])
                t2 = time.perf_counter()
                client.prefix(0, prompt)
                client.prefix(1, prompt)
                t3 = time.perf_counter()
                store.batch_is_exist(keys[0] + keys[1])
                t4 = time.perf_counter()
                cases["p1"].append(t1 - t0)
                cases["r1"].append(t2 - t1)
                cases["p2"].append(t3 - t2)
                cases["r2"].append(t4 - t3)
                if held is not None:
                    t5 = time.perf_counter()
                    held((0, 1), prompt)
                    cases["h2"].append(time.perf_counter() - t5)
            small.close()
        finally:
            for part in (te, store, client, holder):
                if part is not None:
                    part.close()
            master.close()

        us = 1e6
        gb = 1e9

        def p(key: str) -> str:
            return f"p50 {percentile(cases[key], 0.5) * us:.0f} µs, p99 {percentile(cases[key], 0.99) * us:.0f} µs"

        def lookup_ratio(key: str, ref: str) -> str:
            return f"{percentile(cases[key], 0.5) / percentile(cases[ref], 0.5):.2f} (p50)"

        mib = block / (1 << 20)
        print(
            f"G4 on Mooncake Store over TCP (to this host's own address, through loopback), {os.cpu_count()} CPUs, "
            f"load {load:.1f} at the start; blocks of {mib:g} MiB, {n} per call / TE batch, {a.rounds} calls per "
            f"repetition, {a.reps} repetitions, TE runs of {a.te_seconds} s with 1 thread; every block got back checked; "
            f"{time.monotonic() - t_start:.0f} s"
        )
        print()
        print("| figure | reference (same run) | ratio |")
        print("|---|---|---|")
        print(
            f"| G4 put, {n} × {mib:g} MiB per call: {spread(put_rate, gb)} GB/s | "
            f"transfer_engine_bench write: {spread(te_w, gb)} GB/s | {spread(put_ratio)} |"
        )
        print(
            f"| G4 get: {spread(get_rate, gb)} GB/s | transfer_engine_bench read: {spread(te_r, gb)} GB/s | "
            f"{spread(get_ratio)} |"
        )
        per_mib = moved / (1 << 20)
        print(
            f"| G4 put into memory the holder never wrote (first pass; holder page faults per MiB: "
            f"{cold_faults / per_mib:.0f}, timed puts: {warm_faults / per_mib / a.reps:.1f}): {cold[0] / gb:.2f} GB/s | "
            f"transfer_engine_bench write: {cold[1] / gb:.2f} GB/s | {cold[0] / cold[1]:.2f} |"
        )
        kib = a.small_bytes / 1024
        for what, g4_s, te_s, te_op in (
            ("put", small_put, te_small_write, "write"),
            ("get", small_get, te_small_read, "read"),
        ):
            mean = statistics.fmean(g4_s)
            print(
                f"| G4 {what}, {n} × {kib:g} KiB per call: mean {mean * 1e3:.2f} ms (p50 "
                f"{percentile(g4_s, 0.5) * 1e3:.2f}, p99 {percentile(g4_s, 0.99) * 1e3:.2f}) | transfer_engine_bench "
                f"{te_op}, {n} × {kib:g} KiB: mean {te_s * 1e3:.2f} ms per batch | {mean / te_s:.2f} |"
            )
        print(
            f"| prefix, {a.prompt}-block prompt, 1 rank: {p('p1')} | batch_is_exist, {a.prompt} keys: {p('r1')} | "
            f"{lookup_ratio('p1', 'r1')} |"
        )
        print(
            f"| prefix, 2 ranks × {a.prompt} (two calls): {p('p2')} | batch_is_exist, {2 * a.prompt} keys: {p('r2')} | "
            f"{lookup_ratio('p2', 'r2')} |"
        )
        if cases["h2"]:
            print(
                f"| held, 2 ranks × {a.prompt} (one query): {p('h2')} | batch_is_exist, {2 * a.prompt} keys: "
                f"{p('r2')} | {lookup_ratio('h2', 'r2')} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

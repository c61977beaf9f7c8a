"""G4 on a real Mooncake Store: a ``mooncake_master`` started here on
loopback TCP, clients in this process and in others. Blocks round-trip with
their checksums; a missing block, another identity's block and a store
whose master was killed are counted failures, never wrong bytes or a hang;
the client resumes when the master comes back, without a new set-up.

Skips without the ``mooncake`` package, unless ``KVBM_REQUIRE_G4=1``
(``cargo xtask ci`` installs it and sets that).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

if os.environ.get("KVBM_REQUIRE_G4") == "1":
    import mooncake.store as mooncake
else:
    mooncake = pytest.importorskip("mooncake.store")

from kvbm_py.g4 import SUM_BYTES, G4Client, G4Config, G4Failure

BLOCK = 64 << 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Master:
    """A ``mooncake_master`` on loopback, with its HTTP metadata server."""

    def __init__(self, log: Path) -> None:
        self.rpc, self.http, self.metrics = _free_port(), _free_port(), _free_port()
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def config(self) -> G4Config:
        return G4Config(
            master=f"127.0.0.1:{self.rpc}",
            metadata=f"http://127.0.0.1:{self.http}/metadata",
            segment_bytes=32 << 20,
            local_buffer_bytes=4 << 20,
            retry_s=0.5,
        )

    def start(self) -> None:
        exe = shutil.which("mooncake_master") or str(Path(mooncake.__file__).parent / "mooncake_master")
        args = [
            exe,
            "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http}",
            "--metrics_host=127.0.0.1",
            f"--metrics_port={self.metrics}",
            "--rpc_thread_num=2",
            "--default_kv_lease_ttl=1000",
            "--client_ttl=5",
        ]
        self.proc = subprocess.Popen(args, stdout=self.log.open("ab"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.rpc)) == 0:
                    return
            assert self.proc.poll() is None, self.log.read_text()[-2000:]
            time.sleep(0.05)
        raise AssertionError("the master did not listen within 30 s")

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    m = Master(tmp_path / "master.log")
    m.start()
    yield m
    m.kill()


class Host:
    """Registered host memory for ``n`` blocks and their checksums."""

    def __init__(self, client: G4Client, n: int) -> None:
        self.n = n
        self.mem = ctypes.create_string_buffer(n * (BLOCK + SUM_BYTES))
        self.base = ctypes.addressof(self.mem)
        client.register(self.base, n * (BLOCK + SUM_BYTES))

    def block(self, i: int) -> int:
        return self.base + i * BLOCK

    def sum(self, i: int) -> int:
        return self.base + self.n * BLOCK + i * SUM_BYTES

    def fill(self, i: int, seed: int) -> None:
        data = bytes((seed * 131 + j * 7) % 256 for j in range(BLOCK))
        ctypes.memmove(self.block(i), data, BLOCK)
        ctypes.memmove(self.sum(i), seed.to_bytes(SUM_BYTES, "little"), SUM_BYTES)

    def holds(self, i: int, seed: int) -> bool:
        data = ctypes.string_at(self.block(i), BLOCK)
        want = bytes((seed * 131 + j * 7) % 256 for j in range(BLOCK))
        return data == want and ctypes.string_at(self.sum(i), SUM_BYTES) == seed.to_bytes(SUM_BYTES, "little")


def names(n: int, salt: str = "") -> list[bytes]:
    return [f"{salt}block-{i}".encode().ljust(32, b".") for i in range(n)]


def test_blocks_round_trip_with_their_checksums_and_a_prefix_is_found(master: Master) -> None:
    c = G4Client(master.config, "llama-8b/bf16/16")
    try:
        h = Host(c, 8)
        blocks = names(4)
        for i in range(4):
            h.fill(i, 100 + i)
        assert c.put(0, blocks[:3], [h.block(i) for i in range(3)], BLOCK, [h.sum(i) for i in range(3)]) == [None] * 3
        assert c.prefix(0, blocks) == 3
        assert c.prefix(1, blocks) == 0, "another rank's slices are other keys"
        assert c.prefix(0, blocks[3:] + blocks[:3]) == 0, "a prefix starts at the first block"
        got = c.get(0, blocks, [h.block(4 + i) for i in range(4)], BLOCK, [h.sum(4 + i) for i in range(4)])
        assert got == [None, None, None, G4Failure.MISSING]
        assert all(h.holds(4 + i, 100 + i) for i in range(3))
        assert c.failures[G4Failure.MISSING] == 1
        assert (c.puts, c.gets) == (3, 3)
    finally:
        c.close()


def test_a_block_put_by_one_process_is_read_by_another_and_identities_share_nothing(
    master: Master, tmp_path: Path
) -> None:
    # A second process puts while it stays up (its segment holds part of
    # the pool); this one reads.
    script = tmp_path / "put.py"
    script.write_text(
        f"""
import ctypes, sys, time
sys.path[:0] = {sys.path!r}
from kvbm_py.g4 import G4Client, G4Config, SUM_BYTES
c = G4Client(G4Config(**{master.config.__dict__!r}), "llama-8b/bf16/16")
n, B = 4, {BLOCK}
mem = ctypes.create_string_buffer(n * (B + SUM_BYTES))
base = ctypes.addressof(mem)
c.register(base, n * (B + SUM_BYTES))
for i in range(n):
    ctypes.memmove(base + i * B, bytes((200 + i) % 256 for _ in range(B)), B)
    ctypes.memmove(base + n * B + i * SUM_BYTES, (200 + i).to_bytes(SUM_BYTES, "little"), SUM_BYTES)
names = [f"block-{{i}}".encode().ljust(32, b".") for i in range(n)]
assert c.put(0, names, [base + i * B for i in range(n)], B, [base + n * B + i * SUM_BYTES for i in range(n)]) == [None] * n
print("PUT", flush=True)
sys.stdin.read()
c.close()
"""
    )
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=os.environ.copy()
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"PUT"
        c = G4Client(master.config, "llama-8b/bf16/16")
        other = G4Client(master.config, "llama-8b/fp8/16")
        try:
            h = Host(c, 4)
            blocks = names(4)
            assert c.prefix(0, blocks) == 4
            assert c.get(0, blocks, [h.block(i) for i in range(4)], BLOCK, [h.sum(i) for i in range(4)]) == [None] * 4
            for i in range(4):
                assert ctypes.string_at(h.block(i), BLOCK) == bytes([(200 + i) % 256]) * BLOCK
                assert ctypes.string_at(h.sum(i), SUM_BYTES) == (200 + i).to_bytes(SUM_BYTES, "little")
            assert other.prefix(0, blocks) == 0, "another identity sees none of them"
        finally:
            other.close()
            c.close()
    finally:
        proc.communicate(b"", timeout=30)


def test_a_killed_master_fails_calls_fast_and_the_client_resumes_when_it_returns(master: Master) -> None:
    c = G4Client(master.config, "llama-8b/bf16/16")
    try:
        h = Host(c, 4)
        blocks = names(2, "before-")
        h.fill(0, 1)
        h.fill(1, 2)
        assert c.put(0, blocks, [h.block(0), h.block(1)], BLOCK, [h.sum(0), h.sum(1)]) == [None, None]
        master.kill()
        # The first call learns it (the client's own timeout); the next
        # ones fail at once.
        first = c.put(0, names(1, "during-"), [h.block(2)], BLOCK, [h.sum(2)])
        assert first == [G4Failure.UNREACHABLE]
        t = time.monotonic()
        assert c.get(0, blocks, [h.block(2), h.block(3)], BLOCK, [h.sum(2), h.sum(3)]) == [G4Failure.UNREACHABLE] * 2
        assert c.prefix(0, blocks) == 0
        assert time.monotonic() - t < 0.2, "calls wait while the store is known down"
        assert c.failures[G4Failure.UNREACHABLE] >= 3
        master.start()
        deadline = time.monotonic() + 30
        while not c.available():
            assert time.monotonic() < deadline, "the client did not find the master back"
            time.sleep(0.1)
        # A restarted master holds nothing; new blocks flow again.
        assert c.prefix(0, blocks) == 0
        after = names(1, "after-")
        h.fill(2, 3)
        deadline = time.monotonic() + 30
        while c.put(0, after, [h.block(2)], BLOCK, [h.sum(2)]) != [None]:
            assert time.monotonic() < deadline, f"puts did not resume: {dict(c.failures)}"
            time.sleep(0.2)
        assert c.get(0, after, [h.block(3)], BLOCK, [h.sum(3)]) == [None]
        assert h.holds(3, 3)
    finally:
        c.close()

"""G4 on a real Mooncake Store: a ``mooncake_master`` started here on
loopback TCP, clients in this process and in others. Blocks round-trip with
their checksums; a missing block, another identity's block and a store
whose master was killed are counted failures, never wrong bytes or a hang;
the client resumes when the master comes back, without a new set-up.
The local master (``kvbm_py.g4_local``) keeps its ports across restarts;
blocks in a segment holder's memory outlive their writer, and a killed
holder's blocks fail to transfer.

Skips without the ``mooncake`` package, unless ``KVBM_REQUIRE_G4=1``
(``cargo xtask ci`` installs it and sets that).
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

if os.environ.get("KVBM_REQUIRE_G4") == "1":
    import mooncake.store  # noqa: F401
else:
    pytest.importorskip("mooncake.store")

from kvbm_py import InvalidArgumentError, KvbmError, KvbmTimeoutError
from kvbm_py.g4 import SUM_BYTES, G4Client, G4Config, G4Failure
from kvbm_py.g4_local import LocalMaster, SegmentHolder

BLOCK = 64 << 10


@pytest.fixture
def master(tmp_path: Path) -> Iterator[LocalMaster]:
    """A master on loopback for one test; clients lend 32 MiB each, dead
    clients and read leases expire fast."""
    with LocalMaster(
        segment_bytes=32 << 20,
        local_buffer_bytes=4 << 20,
        retry_s=0.5,
        lease_ttl_ms=1000,
        client_ttl_s=5,
        rpc_threads=2,
        log=tmp_path / "master.log",
    ) as m:
        yield m


class Host:
    """Registered host memory for ``n`` blocks, each followed by its
    checksum."""

    def __init__(self, client: G4Client, n: int) -> None:
        self.n = n
        self.mem = ctypes.create_string_buffer(n * (BLOCK + SUM_BYTES))
        self.base = ctypes.addressof(self.mem)
        client.register(self.base, n * (BLOCK + SUM_BYTES))

    def block(self, i: int) -> int:
        return self.base + i * (BLOCK + SUM_BYTES)

    def sum(self, i: int) -> int:
        return self.block(i) + BLOCK

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


def test_blocks_round_trip_with_their_checksums_and_a_prefix_is_found(master: LocalMaster) -> None:
    c = G4Client(master.config, "llama-8b/bf16/16")
    try:
        h = Host(c, 8)
        blocks = names(4)
        for i in range(4):
            h.fill(i, 100 + i)
        assert c.put(0, blocks[:3], [h.block(i) for i in range(3)], BLOCK) == [None] * 3
        assert c.prefix(0, blocks) == 3
        assert c.prefix(1, blocks) == 0, "another rank's slices are other keys"
        assert c.prefix(0, blocks[3:] + blocks[:3]) == 0, "a prefix starts at the first block"
        got = c.get(0, blocks, [h.block(4 + i) for i in range(4)], BLOCK)
        assert got == [None, None, None, G4Failure.MISSING]
        assert all(h.holds(4 + i, 100 + i) for i in range(3))
        assert c.failures[G4Failure.MISSING] == 1
        assert (c.puts, c.gets) == (3, 3)
    finally:
        c.close()


def test_a_block_put_by_one_process_is_read_by_another_and_identities_share_nothing(
    master: LocalMaster, tmp_path: Path
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
    at = base + i * (B + SUM_BYTES)
    ctypes.memmove(at, bytes((200 + i) % 256 for _ in range(B)), B)
    ctypes.memmove(at + B, (200 + i).to_bytes(SUM_BYTES, "little"), SUM_BYTES)
names = [f"block-{{i}}".encode().ljust(32, b".") for i in range(n)]
assert c.put(0, names, [base + i * (B + SUM_BYTES) for i in range(n)], B) == [None] * n
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
            assert c.get(0, blocks, [h.block(i) for i in range(4)], BLOCK) == [None] * 4
            for i in range(4):
                assert ctypes.string_at(h.block(i), BLOCK) == bytes([(200 + i) % 256]) * BLOCK
                assert ctypes.string_at(h.sum(i), SUM_BYTES) == (200 + i).to_bytes(SUM_BYTES, "little")
            assert other.prefix(0, blocks) == 0, "another identity sees none of them"
        finally:
            other.close()
            c.close()
    finally:
        proc.communicate(b"", timeout=30)


def test_a_killed_master_fails_calls_fast_and_the_client_resumes_when_it_returns(master: LocalMaster) -> None:
    c = G4Client(master.config, "llama-8b/bf16/16")
    try:
        h = Host(c, 4)
        blocks = names(2, "before-")
        h.fill(0, 1)
        h.fill(1, 2)
        assert c.put(0, blocks, [h.block(0), h.block(1)], BLOCK) == [None, None]
        master.kill()
        # The first call learns it (the client's own timeout); the next
        # ones fail at once.
        first = c.put(0, names(1, "during-"), [h.block(2)], BLOCK)
        assert first == [G4Failure.UNREACHABLE]
        t = time.monotonic()
        assert c.get(0, blocks, [h.block(2), h.block(3)], BLOCK) == [G4Failure.UNREACHABLE] * 2
        assert c.prefix(0, blocks) == 0
        assert time.monotonic() - t < 0.2, "calls wait while the store is known down"
        assert c.failures[G4Failure.UNREACHABLE] >= 3
        master.restart()
        deadline = time.monotonic() + 30
        while not c.available():
            assert time.monotonic() < deadline, "the client did not find the master back"
            time.sleep(0.1)
        # A restarted master holds nothing; new blocks flow again.
        assert c.prefix(0, blocks) == 0
        after = names(1, "after-")
        h.fill(2, 3)
        deadline = time.monotonic() + 30
        while c.put(0, after, [h.block(2)], BLOCK) != [None]:
            assert time.monotonic() < deadline, f"puts did not resume: {dict(c.failures)}"
            time.sleep(0.2)
        assert c.get(0, after, [h.block(3)], BLOCK) == [None]
        assert h.holds(3, 3)
    finally:
        c.close()


def test_a_local_master_keeps_its_ports_across_restarts_and_refuses_bad_arguments(tmp_path: Path) -> None:
    with LocalMaster(log=tmp_path / "master.log") as m:
        ports, pid = (m.rpc_port, m.http_port, m.metrics_port), m.pid
        assert m.running and m.config.master == f"127.0.0.1:{m.rpc_port}"
        assert m.config.metadata == f"http://127.0.0.1:{m.http_port}/metadata"
        m.restart()
        assert m.running and m.pid != pid
        assert (m.rpc_port, m.http_port, m.metrics_port) == ports
        m.stop()
        assert not m.running and m.pid is None
        m.start()
        assert m.running
    assert not m.running
    for bad in (
        {"segment_bytes": -1},
        {"protocol": "udp"},
        {"rpc_port": 70000},
        {"retry_s": 0},
        {"lease_ttl_ms": 0},
        {"eviction_high_watermark": 1.5},
    ):
        with pytest.raises(InvalidArgumentError):
            LocalMaster(**bad)
    with pytest.raises(KvbmError, match="exited"):
        LocalMaster(executable="/bin/false", log=tmp_path / "false.log")


def test_blocks_in_a_segment_holder_outlive_their_writer_and_a_killed_holder_fails_transfers(
    master: LocalMaster, tmp_path: Path
) -> None:
    lender_free = replace(master.config, segment_bytes=0)
    with master.hold(16 << 20, log=tmp_path / "holder.log") as holder:
        assert holder.running
        writer = G4Client(lender_free, "llama-8b/bf16/16")
        try:
            h = Host(writer, 4)
            for i in range(4):
                h.fill(i, 40 + i)
            blocks, at = names(4), [h.block(i) for i in range(4)]
            assert writer.put(0, blocks, at, BLOCK) == [None] * 4
        finally:
            writer.close()
        reader = G4Client(lender_free, "llama-8b/bf16/16")
        try:
            h = Host(reader, 4)
            assert reader.prefix(0, blocks) == 4, "the writer lent nothing: its blocks are in the holder"
            at = [h.block(i) for i in range(4)]
            assert reader.get(0, blocks, at, BLOCK) == [None] * 4
            assert all(h.holds(i, 40 + i) for i in range(4))
            holder.kill()
            assert not holder.running
            got = reader.get(0, blocks[:1], [h.block(0)], BLOCK)
            assert got[0] is not None, "a block whose holder is gone cannot arrive"
        finally:
            reader.close()


def test_a_segment_holder_without_a_store_is_an_error_not_a_hang(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgumentError):
        SegmentHolder(G4Config(master="127.0.0.1:1", metadata="http://127.0.0.1:1/metadata"), 0)
    with LocalMaster(log=tmp_path / "master.log") as m:
        gone = m.config
    t = time.monotonic()
    with pytest.raises(KvbmTimeoutError):
        SegmentHolder(gone, 1 << 20, start_timeout_s=2.0, log=tmp_path / "holder.log")
    assert time.monotonic() - t < 10
    hold = [sys.executable, "-m", "kvbm_py.g4_local", "hold", f"--master={gone.master}", f"--metadata={gone.metadata}"]
    bad = subprocess.run(
        [*hold, "--segment-gb=0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "more than 0 bytes" in bad.stderr

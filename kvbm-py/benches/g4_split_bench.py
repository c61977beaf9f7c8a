"""G4 across tensor-parallel sizes, on one host: what it costs a rank to
read a block another parallelism published (its shards read, checked and
assembled into the slot, ``G4Mover`` and ``PagedWorker.assemble``), against
reading the same bytes published by an engine of its own split, in the
same run.

The store: a ``mooncake_master`` and a segment holder started here, TCP
to this host's own address (as ``g4_bench.py``). The blocks: 16 tokens of
Llama-3.1-8B (32 layers, 8 KV heads of 128, bf16: 2 MiB whole, 1 MiB per
rank at TP = 2), K and V in separate page halves, NHD (vLLM's mappings of
them). Writers at TP = 1 and TP = 2 publish ``--blocks`` blocks each.

- TP = 1 from TP = 2: the one rank reads both shards of each block
  (2 MiB) and assembles them; reference: the same rank reading TP = 1's
  one shard of the same size straight into its slot.
- TP = 2 from TP = 1: rank 0 reads TP = 1's whole shard of each block
  (2 MiB) for its 1 MiB half; reference: rank 0 reading its own split's
  1 MiB shard.

Each figure is the block bytes a rank ends with per second, the median
over ``--reps`` interleaved fetches of all ``--blocks`` blocks (one job);
the ratio is the median of the repetitions' ratios [min-max].

    python kvbm-py/benches/g4_split_bench.py [--blocks 32] [--reps 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.offloading.canonical_mapping import _layer_mapping, _RankContext
from vllm.v1.kv_cache_interface import FullAttentionSpec
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)

from kvbm_py import _kvbm
from kvbm_py.g4 import G4Client
from kvbm_py.g4_local import LocalMaster
from kvbm_py.vllm.g4_shards import G4Parts, PageLayout
from kvbm_py.vllm.offload_g4 import G4Mover

LAYERS, TOKENS, HEADS, HEAD = 32, 16, 8, 128


def layout(tp: int, rank: int) -> PageLayout:
    """vLLM's mapping of rank ``rank``'s pages at ``tp`` ranks (K and V
    halves, NHD, bf16), as a G4 page layout."""
    heads = HEADS // tp
    spec = FullAttentionSpec(block_size=TOKENS, num_kv_heads=heads, head_size=HEAD, dtype=torch.bfloat16)
    half = TOKENS * heads * HEAD
    t = torch.empty_strided((2, 2, TOKENS, heads, HEAD), (2 * half, half, heads * HEAD, HEAD, 1), device="meta")
    m = _layer_mapping(spec, t.to(torch.bfloat16), 2, _RankContext(tp, 1, 1, 1, HEADS, rank))
    assert m is not None
    found = PageLayout.of_refs([SimpleNamespace(mapping=m, page_size_bytes=m.local_page_size_bytes)] * LAYERS, tp)
    assert found is not None
    return found


def config(tp: int) -> OffloadingConfig:
    p = OffloadingParallelConfig(0, tp, tp, 1, 1, 1, 0, 1, None, False)
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(TOKENS, tuple(f"l{i}" for i in range(LAYERS)), 0),),
        worker_kv_bytes_per_block=0,
        enable_kv_cache_events=False,
        extra_config={},
        engine_id="bench",
        model=OffloadingModelConfig("bench", "bfloat16"),
        cache=OffloadingCacheConfig(TOKENS, 1),
        parallel=p,
    )


class Rank:
    """One rank of an engine at ``tp`` ranks over ``blocks`` blocks of
    random pages, with its G4 traffic."""

    def __init__(self, master: LocalMaster, tp: int, rank: int, blocks: int) -> None:
        self.layout = layout(tp, rank)
        page = self.layout.page
        self.layers = [torch.randint(-128, 127, (blocks, page), dtype=torch.int8) for _ in range(LAYERS)]
        self.pages = _kvbm.PageWorker([(self.layers, page)], blocks, blocks, page * LAYERS, sum_tail=True)
        info = {0: {"shards": tp, "splits": [1, 2, 4, 8], "page": HEADS * TOKENS * 2 * HEAD * 2}}
        self.parts = G4Parts.of(config(tp), info, rank)
        self.client = G4Client(master.config, "g4-split-bench")
        self.mover = G4Mover(self.client, self.pages, self.parts, [self.layout], [0])
        self.bytes = page * LAYERS

    def close(self) -> None:
        self.mover.close()
        self.client.close()

    def settle(self) -> None:
        while not self.mover.idle():
            time.sleep(0.0005)

    def publish(self, keys: list[bytes]) -> None:
        n = len(keys)
        self.pages.store(1, [(0, i, i) for i in range(n)], [])
        self.pages.wait([1])
        assert all(r[1] for r in self.pages.finished())
        self.mover.publish([(0, i, k) for i, k in enumerate(keys)])
        self.settle()

    def fetch(self, keys: list[bytes], split: int) -> float:
        """Seconds to fetch ``keys`` (from ``split``; 0: this rank's own)
        into the slots, checked (and assembled)."""
        t = time.perf_counter()
        self.mover.fetch(9, [(0, i, k, split) for i, k in enumerate(keys)], lambda: None)
        self.settle()
        took = time.perf_counter() - t
        failed = self.mover.take_failed()
        if failed:
            raise SystemExit(f"a fetch failed: {failed}")
        return took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=32)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="g4-split-"))
    n = a.blocks
    with (
        LocalMaster(segment_bytes=0, local_buffer_bytes=16 << 20, log=logs / "master.log") as master,
        master.hold(4 * n * (2 << 20) + (256 << 20), log=logs / "holder.log"),
    ):
        rng = random.Random(0)
        one = [rng.randbytes(32) + bytes(4) for _ in range(n)]
        two = [rng.randbytes(32) + bytes(4) for _ in range(n)]
        both = [rng.randbytes(32) + bytes(4) for _ in range(n)]
        # Writers first, then each reader alone: a client's transfer
        # threads compete for this host's cores while it lives.
        w1 = Rank(master, 1, 0, n)
        w1.publish(one)
        w1.publish(both)
        w1.close()
        for r in range(2):
            w = Rank(master, 2, r, n)
            w.publish(two)
            w.publish(both)
            w.close()
        rows = []
        for name, tp, across, own in (
            ("TP = 1 from TP = 2's two shards", 1, (two, 2), (one, 0)),
            ("TP = 2 rank from TP = 1's one shard", 2, (one, 1), (two, 0)),
        ):
            reader = Rank(master, tp, 0, n)
            reader.fetch(*across)
            reader.fetch(*own)
            got, ref = [], []
            for _ in range(a.reps):
                got.append(n * reader.bytes / reader.fetch(*across))
                ref.append(n * reader.bytes / reader.fetch(*own))
            reader.close()
            ratios = [g / r for g, r in zip(got, ref, strict=True)]
            rows.append((name, statistics.median(got), statistics.median(ref), ratios))
    print(f"{n} blocks per fetch, {a.reps} repetitions; GB/s of block bytes a rank ends with")
    print()
    print("| figure | reference: same split, same run | ratio |")
    print("|---|---|---|")
    for name, got, ref, ratios in rows:
        spread = f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        print(f"| {name}: {got / 1e9:.2f} GB/s | {ref / 1e9:.2f} GB/s | {spread} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

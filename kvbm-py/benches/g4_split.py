"""A Mooncake trace split across two engine instances, with and without a
shared G4: the combined prefix hit rate against one instance serving the
whole trace.

Each instance is a process of its own: vLLM's real ``Scheduler`` (G1 is
vLLM's prefix cache) with ``KvbmOffloadingConnector`` (G2 host slots, G3
disk slots, and with ``--g4`` a Mooncake Store on loopback that this
program starts), over host KV tensors that a fabricated model fills (the
test suite's harness: no weights, every block's bytes derived from its
hash). Each trace block is one 16-token engine block whose tokens follow
from its hash id, so two requests sharing hash ids share a prefix; each
prompt gets one token more, so that every block of it can hit. Requests
generate two tokens (vLLM's connector stores a step's blocks the step
after). They run one at a time in trace order: request ``i``
goes to instance ``i % 2`` (the trace names no sessions), and the next
starts once it finished and its blocks were stored (and put into G4).
The three set-ups (one instance, two without G4, two with it) replay at
once, each in processes of its own.

Capacities are fractions of the trace's distinct blocks, per instance
(``--g1 0.02 --g2 0.06 --g3 0.12``, the replay's ``2 / 6 / 12`` row). The
hit rate is the share of prompt blocks not computed (found in G1, G2, G3
or G4), over the requests after ``--warmup`` (none by default).

    PYTHONHASHSEED=0 python kvbm-py/benches/g4_split.py \\
        --trace conversation_trace.jsonl [--requests N]

(the trace: Mooncake's public conversation trace, JSON lines with
``hash_ids``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

BLOCK = 16
#: Bytes of one block of the harness's model (2 layers x K,V x 16 tokens x
#: 2 heads x 64 x fp16).
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 64 * 2
GIB = 1 << 30
#: Token ids a block is drawn from (the harness's model's vocabulary).
VOCAB = 1024


def tokens_of(hash_ids: list[int]) -> list[int]:
    """A prompt whose block ``k`` is a function of ``hash_ids[k]`` alone,
    plus one token (so the last block can hit too)."""
    out = []
    for h in hash_ids:
        rng = random.Random(h)
        out += [rng.randrange(3, VOCAB) for _ in range(BLOCK)]
    return out + [3]


def instance(args: argparse.Namespace) -> int:
    """One instance: reads requests (JSON lines of hash ids) from stdin and
    answers each with the blocks it did not compute."""
    import gc

    from sched_harness import build

    extra = {
        "cpu_cache_gb": (args.g2_blocks + 0.5) * BLOCK_BYTES / GIB,
        "disk_cache_gb": (args.g3_blocks + 0.5) * BLOCK_BYTES / GIB if args.g3_blocks else 0,
        "disk_cache_dir": args.dir,
        "admission": args.admission,
    }
    if args.g4_master:
        extra.update({"g4_master": args.g4_master, "g4_metadata": args.g4_metadata, "g4_segment_gb": 0})
    h = build(
        Path(args.dir),
        extra,
        num_blocks=args.g1_blocks,
        connector="KvbmOffloadingConnector",
        max_model_len=args.max_len,
        batched_tokens=2048,
        model_dir=args.model_dir,
    )
    gc.freeze()
    manager = h.connector.connector_scheduler.manager
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().connector_worker.worker
    mover = getattr(worker, "g4", None)

    def settled() -> bool:
        return h.idle() and manager.books.counts()["writing"] == 0 and (mover is None or mover.idle())

    for n, line in enumerate(sys.stdin):
        hash_ids = json.loads(line)
        if hash_ids is None:
            break
        prompt = tokens_of(hash_ids)
        rid = f"r{n}"
        h.request(rid, prompt, 2)
        h.run_until(settled, timeout_s=60, sleep_s=0)
        # The second token's step stores the prompt's last blocks (vLLM's
        # connector stores what earlier steps computed); it computes one.
        computed = h.scheduled.pop(rid, 0) - 1
        hit = min(len(hash_ids), max(0, len(prompt) - computed) // BLOCK)
        print(json.dumps({"blocks": len(hash_ids), "hit": hit}), flush=True)
    stats = dict(manager.stats)
    stats["g4"] = manager.g4_stats()
    if mover is not None:
        stats["g4_published"], stats["g4_fetched"] = mover.published, mover.fetched
        stats["g4_put_failures"] = mover.failures()
    print(json.dumps({"stats": stats}), flush=True)
    h.close()
    return 0


class Instance:
    """An instance process and its pipe."""

    def __init__(self, args: argparse.Namespace, name: str, g4: tuple[str, str] | None, root: Path) -> None:
        d = root / name
        d.mkdir()
        self.log_path = d / "stderr.log"
        cmd = [
            sys.executable,
            __file__,
            "instance",
            f"--g1-blocks={args.g1_blocks}",
            f"--g2-blocks={args.g2_blocks}",
            f"--g3-blocks={args.g3_blocks}",
            f"--admission={args.admission}",
            f"--max-len={args.max_len}",
            f"--dir={d}",
            f"--model-dir={root / 'model'}",
        ]
        if g4 is not None:
            cmd += [f"--g4-master={g4[0]}", f"--g4-metadata={g4[1]}"]
        env = {**os.environ, "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0"), "TMPDIR": str(d)}
        self.log = (d / "stderr.log").open("w")
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, env=env
        )

    def run(self, hash_ids: list[int]) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(hash_ids) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise SystemExit(f"an instance exited ({self.proc.returncode}): {self.log_path.read_text()[-3000:]}")
        return dict(json.loads(line))

    def finish(self) -> dict:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("null\n")
        self.proc.stdin.flush()
        stats = dict(json.loads(self.proc.stdout.readline())["stats"])
        self.proc.wait(60)
        return stats


def replay(args: argparse.Namespace, trace: list[list[int]], instances: int, g4: tuple[str, str] | None) -> dict:
    """Replays ``trace`` over ``instances`` instances (request ``i`` on
    instance ``i % instances``); the hit rate and each instance's
    counters."""
    with tempfile.TemporaryDirectory(prefix="kvbm-g4-split-") as root:
        # One model directory: the instances run the same model (its path
        # and files are part of the identity G4 shares blocks under).
        (Path(root) / "model").mkdir()
        procs = [Instance(args, f"i{k}", g4, Path(root)) for k in range(instances)]
        hit = total = 0
        started = time.monotonic()
        for i, hash_ids in enumerate(trace):
            r = procs[i % instances].run(hash_ids)
            if i >= args.warmup:
                hit += r["hit"]
                total += r["blocks"]
        stats = [p.finish() for p in procs]
    return {"rate": hit / max(1, total), "seconds": time.monotonic() - started, "stats": stats}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="command")
    inst = sub.add_parser("instance")
    for flag in ("--g1-blocks", "--g2-blocks", "--g3-blocks", "--max-len"):
        inst.add_argument(flag, type=int, required=True)
    inst.add_argument("--admission", required=True)
    inst.add_argument("--dir", required=True)
    inst.add_argument("--model-dir", required=True)
    inst.add_argument("--g4-master")
    inst.add_argument("--g4-metadata")
    ap.add_argument("--trace", type=Path, help="a Mooncake trace (JSON lines with hash_ids)")
    ap.add_argument("--requests", type=int, default=0, help="the first N requests (0: all)")
    ap.add_argument("--warmup", type=int, default=0, help="requests not counted")
    ap.add_argument("--g1", type=float, default=0.02)
    ap.add_argument("--g2", type=float, default=0.06)
    ap.add_argument("--g3", type=float, default=0.12)
    ap.add_argument("--admission", default="reuse_score")
    ap.add_argument("--g4-gb", type=float, default=4.0, help="memory lent to the store")
    args = ap.parse_args()
    if args.command == "instance":
        return instance(args)
    if args.trace is None or not args.trace.is_file():
        print(f"kvbm: no trace at {args.trace} (pass --trace, a Mooncake trace)", file=sys.stderr)
        return 2
    with args.trace.open() as f:
        trace = [json.loads(line)["hash_ids"] for line in f]
    if args.requests:
        trace = trace[: args.requests]
    distinct = len({h for t in trace for h in t})
    longest = max(len(t) for t in trace)
    args.g1_blocks = max(int(args.g1 * distinct), longest + 4)
    args.g2_blocks = max(1, int(args.g2 * distinct))
    args.g3_blocks = int(args.g3 * distinct)
    args.max_len = (longest + 1) * BLOCK + 16
    print(
        f"{len(trace)} requests, {distinct} distinct blocks; per instance G1 {args.g1_blocks}, "
        f"G2 {args.g2_blocks}, G3 {args.g3_blocks} blocks of {BLOCK_BYTES} bytes",
        flush=True,
    )
    from kvbm_py.g4_local import LocalMaster

    # The three replays run at once: each keeps one process busy at a time.
    with (
        tempfile.TemporaryDirectory(prefix="kvbm-g4-store-") as logs,
        LocalMaster(log=Path(logs) / "master.log") as master,
        master.hold(int(args.g4_gb * GIB)),
        ThreadPoolExecutor(3) as pool,
    ):
        runs = [
            pool.submit(replay, args, trace, 1, None),
            pool.submit(replay, args, trace, 2, None),
            pool.submit(replay, args, trace, 2, (master.master, master.metadata)),
        ]
        one, two, shared = (r.result() for r in runs)
    best = 1 - distinct / sum(len(t) for t in trace)
    print("\n| setup | prefix hit rate | vs one instance | seconds |\n|---|---|---|---|")
    for name, r in (
        ("one instance, whole trace", one),
        ("two instances, no G4", two),
        ("two instances, shared G4", shared),
    ):
        print(f"| {name} | {100 * r['rate']:.2f} % | {r['rate'] / one['rate']:.3f} | {r['seconds']:.0f} |")
    print(f"| every repeat a hit (no capacity limit) | {100 * best:.2f} % | | |")
    print("\nCounters of the instances with G4: " + json.dumps(shared["stats"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

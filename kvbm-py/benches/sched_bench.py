"""Scheduler-side cost of kvbm's vLLM connector per scheduler step.

vLLM asks the connector ``get_num_new_matched_tokens`` for every waiting
request it considers, every step, until the request is scheduled. This
measures that call on vLLM's own ``Request`` objects (block hashes from
vLLM's request block hasher, sha256-cbor, 16-token blocks) for a prompt of
``--tokens`` tokens, through the connector vLLM's real ``Scheduler`` built
(the test suite's harness: kvbm's leader and one worker over host
tensors), in four cases:

* miss, first call: a new request, nothing of it cached;
* miss, again: the same request asked again;
* G2 hit, first call: a new request whose every block is in G2 (kvbm
  matches and holds them; one block is given back, the full-prompt rule);
* G2 hit, again.

Per-call microseconds are medians over ``--reps`` timed batches; the
targets are 30 µs (miss) and 50 µs (G2 hit). After start-up the Python
heap is frozen for the garbage collector, as vLLM's engine core does
(``freeze_gc_heap``): otherwise collections walking vLLM's million
start-up objects land inside the timed calls. Build the wheel with
``maturin build --release`` for meaningful figures.

    python kvbm-py/benches/sched_bench.py [--tokens 4096] [--requests 200] [--reps 5]
        [--admission reuse_score|all] [--connector KvbmOffloadingConnector [--window TOKENS]]

``--connector KvbmOffloadingConnector`` measures kvbm behind vLLM's
offloading connector (vLLM's scheduler half, with a request's keys built
and each group's lookup made in one call, ``kvbm_py.vllm.offload_lookup``);
its G2 hit is set up in the books alone. ``--window`` makes the model
hybrid: a full-attention group and a sliding-window group (both asked for
a hit). The reference, in the same run, is vLLM's own offloading on the
same requests: vLLM's scheduler half as vLLM ships it, with its own
manager (``CPUOffloadingManager``, LRU, as many slots) for kvbm's.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

BLOCK = 16
TARGET_MISS_US = 30.0
TARGET_HIT_US = 50.0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096, help="prompt tokens")
    ap.add_argument("--requests", type=int, default=200, help="new requests per batch")
    ap.add_argument("--repeat", type=int, default=2000, help="calls per batch of the same request")
    ap.add_argument("--reps", type=int, default=5, help="timed batches per case")
    ap.add_argument("--admission", default="reuse_score", help="kvbm's admission policy (the connector's default)")
    ap.add_argument(
        "--connector",
        default="KvbmConnector",
        choices=["KvbmConnector", "KvbmOffloadingConnector"],
        help="kvbm's own connector, or kvbm behind vLLM's offloading connector",
    )
    ap.add_argument(
        "--window",
        type=int,
        help="tokens: the second layer a sliding-window group of this window, the hybrid manager on "
        "(with --connector KvbmOffloadingConnector)",
    )
    args = ap.parse_args()
    if args.window is not None and args.connector != "KvbmOffloadingConnector":
        ap.error("--window needs --connector KvbmOffloadingConnector (KvbmConnector serves one KV cache group)")
    warnings.simplefilter("ignore")

    from vllm import SamplingParams
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from sched_harness import build

    blocks = args.tokens // BLOCK
    tmp = tempfile.mkdtemp(prefix="kvbm-sched-bench-")
    os.environ["TMPDIR"] = tmp
    tempfile.tempdir = tmp
    spec = args.connector == "KvbmOffloadingConnector"
    h = build(
        tmp,
        {"cpu_cache_gb": 0.05, "admission": args.admission},
        num_blocks=blocks + 8,
        connector=args.connector,
        sliding_window=args.window,
    )
    hash_fn = get_hash_fn_by_name("sha256_cbor")
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(BLOCK, hash_fn)
    conn = h.connector
    sp = SamplingParams(max_tokens=1)
    from vllm.utils.gc_utils import freeze_gc_heap

    freeze_gc_heap()

    def cases() -> list[tuple[str, list[float], float]]:
        """The four cases on the connector's manager as it is now."""
        # Misses: every request starts with its own token, so no block of
        # it was ever stored.
        miss_first = first_calls("miss", lambda i: 1000 + i)
        r = request("miss-again", 999)
        miss_again = repeated_calls(r)
        assert conn.get_num_new_matched_tokens(r, 0) == (0, False)
        finish(r)
        fill()
        got, _ = conn.get_num_new_matched_tokens(request("check", 1), 0)
        assert got >= (blocks - 1) * BLOCK, got  # all in G2 (but a given-back block)
        finish(request("check", 1))
        hit_first = first_calls("hit", lambda i: 1)
        r = request("hit-again", 1)
        hit_again = repeated_calls(r)
        finish(r)
        return [
            ("miss, first call", miss_first, TARGET_MISS_US),
            ("miss, again", miss_again, TARGET_MISS_US),
            ("G2 hit, first call", hit_first, TARGET_HIT_US),
            ("G2 hit, again", hit_again, TARGET_HIT_US),
        ]

    def request(rid: str, first_token: int):
        prompt = [first_token] + [(7 * i) % 30000 + 3 for i in range(1, args.tokens)]
        r = Request(rid, prompt, sp, None, block_hasher=hasher)
        conn.on_new_request(r)  # as vLLM's scheduler does when a request arrives
        return r

    def finish(r) -> None:
        conn.request_finished(r, [])

    def first_calls(prefix: str, first_token) -> list[float]:
        out = []
        for rep in range(args.reps):
            reqs = [request(f"{prefix}{rep}-{i}", first_token(i)) for i in range(args.requests)]
            assert all(len(r.block_hashes) == blocks for r in reqs)
            t0 = time.perf_counter()
            for r in reqs:
                conn.get_num_new_matched_tokens(r, 0)
            out.append((time.perf_counter() - t0) / len(reqs) * 1e6)
            for r in reqs:
                finish(r)
        return out

    def repeated_calls(r) -> list[float]:
        conn.get_num_new_matched_tokens(r, 0)
        out = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for _ in range(args.repeat):
                conn.get_num_new_matched_tokens(r, 0)
            out.append((time.perf_counter() - t0) / args.repeat * 1e6)
        return out

    def fill() -> None:
        """Fills G2 with the prompt every hit request shares."""
        seed = request("seed", 1)
        if spec:
            # The books say every block is stored (no bytes needed to ask).
            from vllm.v1.kv_offload.base import ReqContext, make_offload_key

            manager = conn.connector_scheduler.manager
            ctx = ReqContext("seed")
            groups = [g.group_idx for g in conn.connector_scheduler.config.kv_group_configs]
            out = manager.prepare_store([make_offload_key(b, g) for g in groups for b in seed.block_hashes], ctx)
            manager.complete_store(out.keys_to_store, ctx)
        else:
            # Its blocks written to G1 and offloaded through kvbm.
            kvbm = h.kvbm
            kvbm.match_prefix("seed", seed.block_hashes, seed.num_tokens, 0)
            kvbm.offload("seed", list(range(blocks)), list(seed.block_hashes))
            kvbm.flush()
            kvbm.release_after_offloads("seed")
            deadline = time.monotonic() + 60
            while "seed" not in kvbm.poll_released():
                assert time.monotonic() < deadline, "the offloads never finished"
                time.sleep(0.01)

    rows = cases()
    reference: list[tuple[str, list[float], float]] = []
    if spec:
        # The same requests and cases with vLLM's own offloading (its
        # scheduler half and its manager), in the order kvbm, vLLM, vLLM,
        # kvbm (a process's first round tends to be its slowest).
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import (
            OffloadingConnectorScheduler,
        )
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

        sched = conn.connector_scheduler
        kvbm_manager, kvbm_half = sched.manager, sched.__class__
        sched.manager = CPUOffloadingManager(num_chunks=kvbm_manager.books.slots, cache_policy="lru")
        sched.__class__ = OffloadingConnectorScheduler
        reference = [(n, a + b, t) for (n, a, t), (_, b, _) in zip(cases(), cases(), strict=True)]
        sched.manager, sched.__class__ = kvbm_manager, kvbm_half
        rows = [(n, a + b, t) for (n, a, t), (_, b, _) in zip(rows, cases(), strict=True)]
    h.close()

    print(
        f"get_num_new_matched_tokens through {args.connector}, {args.tokens}-token prompt "
        f"({blocks} blocks of {BLOCK}), admission {args.admission}"
        + (f", a full-attention and a {args.window}-token sliding-window group:" if args.window else ":")
    )
    ok = True
    for i, (name, xs, target) in enumerate(rows):
        med = statistics.median(xs)
        ok &= med <= target
        line = (
            f"  {name:20s} {med:8.2f} us/call  [{min(xs):.2f}-{max(xs):.2f}]"
            f"  target <= {target:.0f} us: {'met' if med <= target else 'MISSED'}"
        )
        if reference:
            ref = statistics.median(reference[i][1])
            line += f"; vLLM's own offloading {ref:.2f} us ({med / ref:.2f}x)"
        print(line)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""One engine behind vLLM's offloading connector with G4 on a Mooncake Store
that this process starts on loopback, through a master crash and restart:

1. the case's waves (every block computed, published to G4);
2. the master killed; vLLM's prefix cache dropped; the waves again (the
   host tier serves them), then the next seed's case (new prompts: G4 is
   asked, its failures are counted, nothing waits on it);
3. the master restarted (empty); kvbm's tiers and vLLM's prefix cache
   dropped; the waves again: G4 holds nothing, every block is computed
   and published anew;
4. kvbm's tiers and vLLM's prefix cache dropped; the waves again: the
   blocks come from G4, which resumed without restarting anything.

And the engine without kvbm over both cases (the reference). Prints
one JSON line: each round's outputs and counters, and the reference's.
usage: python g4_faults.py MODEL_DIR SEED LOG_DIR
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from differential import OffloadSide, build_engine, case_of, drop_prefix_cache, run_waves, shut_down
from fuzz_workload import MAX_TOKENS

#: How long the store may take to serve puts again after its master came
#: back (its clients re-mount their memory by themselves).
RESUME_S = 60.0


def wait_until_writable(config) -> None:
    """Polls until a block can be put into the store again (the master up
    and the holder's memory re-mounted)."""
    import ctypes

    from kvbm_py.g4 import SUM_BYTES, G4Client

    probe = G4Client(dataclasses.replace(config, segment_bytes=0), "kvbm-test-probe")
    block = (ctypes.c_uint8 * (4096 + SUM_BYTES))()
    probe.register(ctypes.addressof(block), 4096 + SUM_BYTES)
    deadline = time.monotonic() + RESUME_S
    n = 0
    try:
        while True:
            n += 1
            key = n.to_bytes(8, "big")
            if probe.put(0, [key], [ctypes.addressof(block)], 4096) == [None]:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"G4 took no put {RESUME_S:.0f} s after its master restarted: {probe.failures}")
            time.sleep(0.2)
    finally:
        probe.close()


def main() -> int:
    from kvbm_py.g4_local import LocalMaster

    model_dir, seed, logs = sys.argv[1], int(sys.argv[2]), Path(sys.argv[3])
    case, other = case_of(seed, MAX_TOKENS), case_of(seed + 1, MAX_TOKENS)
    result: dict = {}
    llm = build_engine(model_dir, None, {})
    result["reference"], _ = run_waves(llm, case, "ref")
    llm.reset_prefix_cache()
    result["reference_other"], _ = run_waves(llm, other, "ref")
    shut_down(llm)
    with (
        LocalMaster(log=logs / "master.log", retry_s=0.5) as master,
        master.hold(128 << 20, log=logs / "holder.log"),
    ):
        extra = {
            "cpu_cache_gb": 0.05,
            "admission": "all",
            "verify": True,
            "g4_master": master.master,
            "g4_metadata": master.metadata,
            "g4_segment_gb": 0,
        }
        llm = build_engine(model_dir, extra, {}, "KvbmOffloadingConnector")
        side = OffloadSide(llm)
        rounds = []

        def one_round(tag: str, then_other: bool = False) -> None:
            started = time.monotonic()
            outputs, aborted = run_waves(llm, case, tag)
            others = run_waves(llm, other, tag + "o")[0] if then_other else {}
            drop_prefix_cache(llm)
            side.flush()
            rounds.append(
                {
                    "outputs": outputs,
                    "other_outputs": others,
                    "aborted": aborted,
                    "seconds": time.monotonic() - started,
                    "stats": side.stats(),
                    "g4": side.manager.g4_stats(),
                    "worker_g4_failures": side.worker_g4_failures(),
                }
            )

        one_round("r1")
        master.kill()
        one_round("r2", then_other=True)
        master.start()
        wait_until_writable(master.config)
        drop_prefix_cache(llm, reset_connector=True)
        one_round("r3")
        drop_prefix_cache(llm, reset_connector=True)
        one_round("r4")
        shut_down(llm)
    result["rounds"] = rounds
    print("KVBM_RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

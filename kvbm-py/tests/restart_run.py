"""One vLLM engine on CPU with kvbm's G3 kept across restarts.

Generates a set of prompts sharing prefixes (all at once), waits for kvbm's
offloads, prints the outputs and kvbm's counters as one JSON line; with
KILL, then starts another wave of prompts and kills its own process
(SIGKILL) while their blocks are on their way to G3, as a crash would.
With SPEC, kvbm runs behind vLLM's offloading connector
(``KvbmOffloadingConnector``), and the counters are its manager's.
usage: python restart_run.py MODEL_DIR EXTRA_CONFIG_JSON [kill] [spec]
"""

import json
import os
import random
import signal
import sys
import threading
import time

from engine_run import BLOCK, build_llm, scheduler_connector


def prompts(seed: int) -> list[list[int]]:
    """Four prompts: two pairs, each pair sharing a 3-block prefix."""
    rng = random.Random(seed)
    out = []
    for _ in range(2):
        shared = [rng.randrange(3, 512) for _ in range(3 * BLOCK)]
        for _ in range(2):
            out.append(shared + [rng.randrange(3, 512) for _ in range(BLOCK + 5)])
    return out


def main() -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, extra = sys.argv[1], json.loads(sys.argv[2])
    kill, spec = "kill" in sys.argv[3:], "spec" in sys.argv[3:]
    llm = build_llm(model_dir, extra, connector="KvbmOffloadingConnector" if spec else "KvbmConnector")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)

    def generate(batch):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    if spec:
        manager = scheduler_connector(llm).connector_scheduler.manager

        def stats() -> dict:
            return dict(manager.stats)

        def flush() -> None:
            # Steps until no store is in flight (each step lets copies land).
            deadline = time.monotonic() + 60
            while manager.books.counts()["writing"] and time.monotonic() < deadline:
                generate([[1]])
    else:
        side = scheduler_connector(llm)._scheduler

        def stats() -> dict:
            return dict(side.kvbm.stats())

        flush = side.kvbm.flush

    if spec:
        # One prompt at a time: vLLM's offloading connector stores a
        # step's blocks at once, so each store then finds the slots the
        # last one filled ready and moves their blocks to disk.
        outputs = []
        for p in prompts(1):
            outputs += generate([p])
            flush()
    else:
        outputs = generate(prompts(1))
        flush()
    result = {"outputs": outputs, "stats": stats()}
    print("KVBM_RESULT " + json.dumps(result), flush=True)
    if kill:
        # A second wave, killed while it computes and offloads.
        threading.Timer(0.7, lambda: os.kill(os.getpid(), signal.SIGKILL)).start()
        generate(prompts(2) + prompts(3))
        time.sleep(30)
        return 3
    return 0


if __name__ == "__main__":
    sys.exit(main())

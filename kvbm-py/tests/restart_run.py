"""One vLLM engine on CPU with kvbm's G3 kept across restarts.

Generates a set of prompts sharing prefixes (all at once), waits for kvbm's
offloads, prints the outputs and kvbm's counters as one JSON line; with
KILL, then starts another wave of prompts and kills its own process
(SIGKILL) while their blocks are on their way to G3, as a crash would.
usage: python restart_run.py MODEL_DIR EXTRA_CONFIG_JSON [kill]
"""

import json
import os
import random
import signal
import sys
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK = 32


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
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    model_dir, extra = sys.argv[1], json.loads(sys.argv[2])
    kill = len(sys.argv) > 3 and sys.argv[3] == "kill"
    llm = LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        dtype="bfloat16",
        max_model_len=512,
        max_num_seqs=4,
        block_size=BLOCK,
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvbmConnector",
            kv_connector_module_path="kvbm_py.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        ),
    )
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, detokenize=False)
    side = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler

    def generate(batch):
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], greedy, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    outputs = generate(prompts(1))
    side.kvbm.flush()
    result = {"outputs": outputs, "stats": dict(side.kvbm.stats())}
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

"""One full vLLM engine run on CPU with kvbm's connector.

Generate a prompt greedily, let kvbm's offloads finish, drop vLLM's own
prefix cache, generate the same prompt again (its prefix now comes from
kvbm), and print both outputs and kvbm's counters as one JSON line.
With VARIANTS (in-process engine core only), two more prompts follow: a
partial hit (the prompt's first 2 blocks and a new suffix) and a
full-prompt hit (exactly the prompt's first 4 blocks), each generated with
its prefix loaded from kvbm and again computed from scratch (vLLM's and
kvbm's caches dropped), with how many blocks kvbm loaded for each.
With CORRUPT (in-process engine core only), the prompt a third time with
the corrupt-onboard test hook switched on: loaded from kvbm again, one
loaded block zeroed on every rank before the forward reads it.
usage: python engine_run.py MODEL_DIR EXTRA_CONFIG_JSON [ENGINE_ARGS_JSON [OPTIONS_JSON]]
where OPTIONS_JSON is {"variants": bool, "corrupt": bool}
"""

import dataclasses
import json
import os
import random
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # unless the test says 1
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

BLOCK = 32


def build_llm(model_dir: str, extra: dict, engine_args: dict | None = None, connector: str = "KvbmConnector"):
    """vLLM's engine on CPU over the model in `model_dir` (prefix caching
    on, seed 0), with kvbm's `connector` configured by `extra`."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    return LLM(
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
            kv_connector=connector,
            kv_connector_module_path="kvbm_py.vllm" if connector == "KvbmConnector" else "kvbm_py.vllm.offload",
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        ),
        **(engine_args or {}),
    )


#: How long a test waits for kvbm's copies to land before it calls the
#: engine stuck. A wall-clock bound, not a count of engine steps: a step of
#: the tiny models takes a few milliseconds, a slow disk's write far more.
SETTLE_S = 120.0


def settle(done, step, what) -> None:
    """Steps the engine (`step`) until `done()` holds; an error saying
    `what` (a text, or a function giving one) after `SETTLE_S` seconds.
    Past the first steps it waits 10 ms between steps, so a slow copy
    costs waiting rather than thousands of steps."""
    deadline = time.monotonic() + SETTLE_S
    tries = 0
    while not done():
        if time.monotonic() > deadline:
            raise SystemExit(f"{what() if callable(what) else what} after {SETTLE_S:.0f} s")
        step()
        tries += 1
        if tries > 20:
            time.sleep(0.01)


def drop_prefix_cache(llm, reset_connector: bool = False) -> None:
    """Drops vLLM's prefix cache (and with `reset_connector` kvbm's tiers).
    A finished request's blocks stay with vLLM until kvbm reports their
    offloads done, which a later engine step carries: steps the engine
    until vLLM lets go."""
    from vllm import SamplingParams

    one = SamplingParams(max_tokens=1, detokenize=False)
    settle(
        lambda: llm.reset_prefix_cache(reset_connector=reset_connector),
        lambda: llm.generate([{"prompt_token_ids": [1]}], one, use_tqdm=False),
        "reset_prefix_cache kept refusing",
    )


def scheduler_connector(llm):
    """kvbm's scheduler-role connector inside the in-process engine core."""
    return llm.llm_engine.engine_core.engine_core.scheduler.connector


def main() -> int:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    model_dir, extra = sys.argv[1], json.loads(sys.argv[2])
    engine_args = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    options = json.loads(sys.argv[4]) if len(sys.argv) > 4 else {}
    variants = options.get("variants", False)
    llm = build_llm(model_dir, extra, engine_args)
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, detokenize=False)
    rng = random.Random(7)
    prompt = [rng.randrange(3, 512) for _ in range(4 * BLOCK + 3)]

    def generate(tokens, params):
        out = llm.generate([TokensPrompt(prompt_token_ids=tokens)], params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    first = generate(prompt, greedy)
    drop_prefix_cache(llm)
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
        # Let kvbm's background copies (G2 victims on their way to G3)
        # land, so what the second request finds does not depend on timing.
        scheduler_connector(llm)._scheduler.kvbm.flush()
    second = generate(prompt, greedy)
    result = {"first": first, "second": second}
    if variants:
        kvbm = scheduler_connector(llm)._scheduler.kvbm
        cases = {
            "partial": prompt[: 2 * BLOCK] + [rng.randrange(3, 512) for _ in range(40)],
            "full_prompt": prompt[: 4 * BLOCK],
        }
        out = {}
        for name, tokens in cases.items():
            drop_prefix_cache(llm)
            kvbm.flush()
            before = kvbm.stats()["g2_to_g1_blocks"]
            loaded = generate(tokens, greedy)
            out[name] = {"loaded": loaded, "blocks": kvbm.stats()["g2_to_g1_blocks"] - before}
        for name, tokens in cases.items():
            drop_prefix_cache(llm)
            drop_prefix_cache(llm, reset_connector=True)  # kvbm's G2 and G3 too
            out[name]["computed"] = generate(tokens, greedy)
        result["variants"] = out
    if options.get("corrupt"):
        side = scheduler_connector(llm)._scheduler
        drop_prefix_cache(llm)
        side.kvbm.flush()
        side.config = dataclasses.replace(side.config, test_corrupt_onboard=True)
        before = side.kvbm.stats()["g2_to_g1_blocks"]
        corrupted = generate(prompt, greedy)
        result["corrupt"] = {
            "output": corrupted,
            "blocks": side.kvbm.stats()["g2_to_g1_blocks"] - before,
        }
    if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0":
        # Each worker rank as kvbm's leader sees it.
        result["ranks"] = list(scheduler_connector(llm)._scheduler.kvbm.ranks())
    if "test_stats_path" in extra:
        # The engine core runs in another process: read what it wrote.
        with open(extra["test_stats_path"]) as f:
            stats = json.load(f)
    else:
        stats = dict(scheduler_connector(llm)._scheduler.kvbm.stats())
    result["stats"] = stats
    print("KVBM_RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())

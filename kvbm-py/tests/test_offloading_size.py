"""vLLM's own switch for offloading, ``--kv-offloading-size`` (GiB for all
ranks), with ``"spec_name": "kvbm"``: vLLM builds its
``OffloadingConnector`` over kvbm's spec, sized by that switch, and a
prompt whose prefix comes back from kvbm gives the same greedy output."""

import json
import subprocess
import sys

from conftest import engine_env

SCRIPT = r"""
import json, sys, time
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, enforce_eager=True, max_model_len=512,
          block_size=32, enable_prefix_caching=True, seed=0, dtype="bfloat16",
          kv_offloading_size=0.05,
          kv_transfer_config=KVTransferConfig(kv_connector_extra_config={"spec_name": "kvbm"}))
core = llm.llm_engine.engine_core.engine_core
conn = core.scheduler.connector
manager = conn.connector_scheduler.manager
prompt = [{"prompt_token_ids": [(7 * i) % 500 + 3 for i in range(200)]}]
greedy = SamplingParams(max_tokens=8, temperature=0)
first = list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
deadline = time.monotonic() + 120
while manager.books.counts()["writing"] and time.monotonic() < deadline:
    llm.generate([{"prompt_token_ids": [1]}], SamplingParams(max_tokens=1), use_tqdm=False)
llm.reset_prefix_cache()
second = list(llm.generate(prompt, greedy, use_tqdm=False)[0].outputs[0].token_ids)
print("KVBM_RESULT " + json.dumps({
    "connector": type(conn).__name__, "manager": type(manager).__name__,
    "slots": manager.books.slots, "first": first, "second": second, "loaded": manager.stats["loaded"],
}))
"""


def test_vllms_offloading_size_switch_runs_kvbms_spec(tiny_hybrid_model, tmp_path):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, tiny_hybrid_model],
        env=engine_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("KVBM_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-8000:]
    r = json.loads(lines[-1][len("KVBM_RESULT ") :])
    assert (r["connector"], r["manager"]) == ("OffloadingConnector", "KvbmOffloadingManager"), r
    # 0.05 GiB of 32 KiB slots (one block of either KV cache group).
    assert r["slots"] == int(0.05 * (1 << 30)) // 32768, r
    assert r["loaded"] > 0 and r["second"] == r["first"], r

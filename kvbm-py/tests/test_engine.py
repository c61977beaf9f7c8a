"""vLLM's full engine on CPU with kvbm's connector: a prompt computed once,
vLLM's prefix cache dropped, the same prompt again with its prefix loaded
from kvbm must give identical greedy outputs."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from conftest import HERE, engine_env

BLOCK_BYTES = 2 * 2 * 2 * 32 * 64 * 2  # layers x K/V x heads x tokens x head x bf16
GIB = 1 << 30


def run_engine(
    model: str,
    tmp_path: Path,
    extra: dict,
    engine_args: dict | None = None,
    env: dict | None = None,
    variants: bool = False,
    corrupt: bool = False,
) -> dict:
    options = {"variants": variants, "corrupt": corrupt}
    args = [json.dumps(extra), json.dumps(engine_args or {}), json.dumps(options)]
    proc = subprocess.run(
        [sys.executable, str(HERE / "engine_run.py"), model, *args],
        env={**engine_env(tmp_path), **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    lines = [l for l in proc.stdout.splitlines() if l.startswith("KVBM_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-8000:]
    return json.loads(lines[-1][len("KVBM_RESULT ") :])


def test_prefix_onboarded_from_g2_gives_identical_output(tiny_model, tmp_path):
    r = run_engine(tiny_model, tmp_path, {"cpu_cache_gb": 0.01, "admission": "all"}, variants=True, corrupt=True)
    s = r["stats"]
    # The prompt's 4 full blocks went to G2 and came back from it.
    assert s["g1_to_g2_blocks"] >= 4, s
    assert s["g2_to_g1_blocks"] >= 4, s
    assert s["onboard_failures"] == 0, s
    assert r["second"] == r["first"], r
    v = r["variants"]
    # A partial hit: 2 blocks loaded, the new suffix computed.
    assert v["partial"]["blocks"] == 2, v
    assert v["partial"]["loaded"] == v["partial"]["computed"], v
    # The whole prompt in kvbm: all but the last block loaded (vLLM
    # computes the last token).
    assert v["full_prompt"]["blocks"] == 3, v
    assert v["full_prompt"]["loaded"] == v["full_prompt"]["computed"], v
    # The comparison bites: the prompt loaded again with one onboarded
    # block zeroed gives another output.
    assert r["corrupt"]["blocks"] == 4, r["corrupt"]
    assert r["corrupt"]["output"] != r["first"], r


def test_prefix_onboarded_from_g3_when_g2_is_too_small(tiny_model, tmp_path):
    extra = {
        "cpu_cache_gb": 1.5 * BLOCK_BYTES / GIB,  # G2 holds one block
        "disk_cache_gb": 0.01,
        "disk_cache_dir": str(tmp_path / "g3"),
        "admission": "all",
        "load_async": False,
        # One batch at a time: two in flight would each want G2's only
        # block, and the second would be skipped.
        "offload_in_flight": 1,
    }
    # Prefill one block per step, so each block reaches kvbm on its own and
    # pushes the one before it from G2 to G3.
    r = run_engine(tiny_model, tmp_path, extra, {"max_num_batched_tokens": 32})
    s = r["stats"]
    assert s["g2_to_g3_blocks"] >= 3, s
    assert s["g3_to_g1_blocks"] >= 3, s
    assert s["g2_to_g1_blocks"] + s["g3_to_g1_blocks"] == 4, s
    assert s["onboard_failures"] == 0, s
    assert r["second"] == r["first"], r


#: An engine instance's files in $TMPDIR (kvbm_py.instance_files).
INSTANCE_FILE = re.compile(r"^kvbm-[0-9a-f]{16}\.(sock|secret|lock|tmp-\d+)$")


def _instance_files(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if INSTANCE_FILE.match(p.name))


def test_engine_core_and_worker_in_separate_processes(tiny_model, tmp_path):
    # vLLM's default process layout: the scheduler (kvbm's leader) in the
    # engine-core process, the model runner (kvbm's worker) in a worker
    # process; they meet over kvbm's IPC socket.
    # Files an instance killed earlier left: removed at start.
    for name in (
        "kvbm-0123456789abcdef.sock",
        "kvbm-0123456789abcdef.secret",
        "kvbm-0123456789abcdef.lock",
        "kvbm-fedcba9876543210.secret",
    ):
        (tmp_path / name).write_text("x")
    extra = {"cpu_cache_gb": 0.01, "admission": "all", "test_stats_path": str(tmp_path / "stats.json")}
    r = run_engine(tiny_model, tmp_path, extra, env={"VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    s = r["stats"]
    assert s["g2_to_g1_blocks"] == 4, s
    assert r["second"] == r["first"], r
    # The planted ones went at start. The engine's own go at shutdown when
    # vLLM lets its processes exit; a process vLLM terminates leaves them,
    # but with their lock free, so the next start removes them.
    from kvbm_py.instance_files import sweep

    assert not any(
        n.startswith(("kvbm-0123456789abcdef", "kvbm-fedcba9876543210")) for n in _instance_files(tmp_path)
    ), _instance_files(tmp_path)
    sweep(str(tmp_path))
    assert _instance_files(tmp_path) == [], _instance_files(tmp_path)


def _one_cpu_per_rank(ranks: int) -> str:
    """vLLM's CPU thread binding for `ranks` worker processes: one CPU of
    this process's each (vLLM's automatic binding wants a NUMA node per
    rank), or none when there are too few."""
    cpus = sorted(os.sched_getaffinity(0))
    return "|".join(str(c) for c in cpus[:ranks]) if len(cpus) >= ranks else "nobind"


def test_tensor_parallel_ranks_onboard_from_g2(tiny_model, tmp_path):
    # TP = 2: vLLM's multiprocessing executor runs two worker processes,
    # each with one of the model's two KV heads and a kvbm worker of that
    # rank; kvbm's leader is in the engine core (this test's engine
    # process). Generate, drop vLLM's prefix cache, generate again: the
    # prefix comes back from G2 on both ranks. Then once more with one
    # onboarded block zeroed on every rank: the output must change.
    env = {
        "VLLM_CPU_OMP_THREADS_BIND": _one_cpu_per_rank(2),
        # vLLM torch.compiles its vocabulary-parallel embedding mask when
        # TP > 1; the compile cache lives under the per-test TMPDIR, so
        # every run would spend ~15 s compiling C++. Eager gives the same
        # outputs.
        "TORCH_COMPILE_DISABLE": "1",
    }
    r = run_engine(
        tiny_model,
        tmp_path,
        {"cpu_cache_gb": 0.01, "admission": "all"},
        {"tensor_parallel_size": 2},
        env=env,
        corrupt=True,
    )
    s = r["stats"]
    assert r["ranks"] == ["live", "live"], r["ranks"]
    assert r["second"] == r["first"], r
    # The prompt's 4 full blocks went to G2 and came back twice (clean,
    # then corrupted), with nothing failed.
    assert s["g1_to_g2_blocks"] >= 4, s
    assert s["g2_to_g1_blocks"] == 8 and s["hits_g2"] == 8, s
    assert s["onboard_failures"] == 0 and s["copy_failures"] == 0, s
    # Bytes are summed over ranks: every block moved on both, each rank
    # holding half of a block (one KV head of two).
    rank_block_bytes = BLOCK_BYTES // 2
    assert s["g2_to_g1_bytes"] == 8 * 2 * rank_block_bytes, s
    assert s["g1_to_g2_bytes"] == s["g1_to_g2_blocks"] * 2 * rank_block_bytes, s
    assert r["corrupt"]["blocks"] == 4, r["corrupt"]
    assert r["corrupt"]["output"] != r["first"], r

"""Engine runs of the differential test: vLLM on CPU, with kvbm's connector
or without it (the reference), one engine after another in this process
(vLLM's import is most of an engine's start-up).

With kvbm ("extra" an object), each case runs twice: its waves
(round 1), then kvbm is made to release the finished blocks, vLLM's prefix
cache is dropped, and the same waves again (round 2: the shared prefixes
now come from kvbm). Between cases, vLLM's and kvbm's caches are dropped,
so each case starts empty. Without kvbm ("extra" ``null``), each case's
waves run once, with vLLM's prefix cache dropped between cases.
Prints one JSON line per run: per case, the outputs of each round
(prompt index -> token ids), which prompts were aborted, and kvbm's
counters.
usage: python differential.py MODEL_DIR RUNS_JSON
where RUNS_JSON is a list of {"name", "extra" (object or null), "engine"
(vLLM engine arguments), "seeds", "connector" (optional: kvbm's connector
by name, KvbmConnector by default), "model_dir" (optional: another model
than MODEL_DIR), "max_tokens" (optional: the most a
case's prompts generate), "corrupt_g3" (optional: damage every G3 block
between the rounds) and "restart" (optional: run round 2 on a new engine
of the same configuration)}; a negative seed -N is the reported
failure with N prompts sharing a prefix (fuzz_workload.repro_case).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from engine_run import drop_prefix_cache, settle
from fuzz_workload import BLOCK, MAX_MODEL_LEN, MAX_TOKENS, Case, make_case, repro_case

#: An engine that neither finishes nor drains in this many steps is stuck.
MAX_STEPS = 20_000


def case_of(seed: int, max_tokens: int) -> Case:
    return repro_case(-seed) if seed < 0 else make_case(seed, max_tokens)


def build_engine(model_dir: str, extra: dict | None, engine_args: dict, connector: str = "KvbmConnector"):
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kv = None
    if extra is not None:
        module = "kvbm_py.vllm" if connector == "KvbmConnector" else "kvbm_py.vllm.offload"
        kv = KVTransferConfig(
            kv_connector=connector,
            kv_connector_module_path=module,
            kv_role="kv_both",
            kv_connector_extra_config=extra,
            kv_load_failure_policy="recompute",
        )
    args = {"max_num_seqs": 8, "dtype": "bfloat16", **engine_args}
    return LLM(
        model=model_dir,
        skip_tokenizer_init=True,
        enforce_eager=True,
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        enable_prefix_caching=True,
        seed=0,
        kv_transfer_config=kv,
        **args,
    )


def greedy(max_tokens: int):
    from vllm import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, detokenize=False)


def run_waves(llm, case: Case, tag: str) -> tuple[dict[int, list[int]], list[int]]:
    """Runs the case's waves through the engine step by step; returns the
    finished prompts' outputs and the aborted prompts."""
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    outputs: dict[int, list[int]] = {}
    aborted: list[int] = []
    for w, wave in enumerate(case.waves):
        waiting = sorted(wave, key=lambda a: a.at_step)
        prompt_of: dict[str, int] = {}
        aborts: dict[int, list[str]] = {}
        step = 0
        while waiting or engine.has_unfinished_requests():
            while waiting and waiting[0].at_step <= step:
                a = waiting.pop(0)
                name = f"{tag}-{case.seed}-{w}-{a.prompt}"
                rid = engine.add_request(
                    name, TokensPrompt(prompt_token_ids=case.prompts[a.prompt]), greedy(a.max_tokens)
                )
                prompt_of[name] = prompt_of[rid] = a.prompt
                if a.abort_after is not None:
                    aborts.setdefault(step + a.abort_after, []).append(rid)
                    aborted.append(a.prompt)
            if step in aborts:
                engine.abort_request(aborts.pop(step))
            for out in engine.step():
                if out.finished and out.request_id in prompt_of:
                    outputs[prompt_of[out.request_id]] = list(out.outputs[0].token_ids)
            step += 1
            if step > MAX_STEPS:
                raise SystemExit(f"seed {case.seed}: wave {w} still running after {MAX_STEPS} steps: {stuck(llm)}")
    for p in aborted:
        outputs.pop(p, None)
    return outputs, aborted


def stuck(llm) -> str:
    """The engine's unfinished requests: id, status, tokens computed of
    all, and the free blocks (what a stuck run reports)."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    reqs = [*sched.running, *sched.waiting]
    free = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    shown = ", ".join(f"{r.request_id} {r.status.name} {r.num_computed_tokens}/{r.num_tokens}" for r in reqs)
    holders: dict[str, list[int]] = {}
    for m in sched.kv_cache_manager.coordinator.single_type_managers:
        for rid, blocks in m.req_to_blocks.items():
            held = [b.block_id for b in blocks if b.block_id]
            if held:
                holders.setdefault(rid, []).extend(held)
    states = {rid: sched.requests[rid].status.name if rid in sched.requests else "gone" for rid in holders}
    return f"{shown}; {free} free blocks; holding blocks: {holders} in states {states}"


class ConnectorSide:
    """kvbm's scheduler side inside the in-process engine core: its
    counters, and a flush that lets every queued copy land."""

    def __init__(self, llm):
        self.kvbm = llm.llm_engine.engine_core.engine_core.scheduler.connector._scheduler.kvbm

    def stats(self) -> dict:
        return dict(self.kvbm.stats())

    def flush(self) -> None:
        self.kvbm.flush()


class OffloadSide:
    """The same for kvbm behind vLLM's offloading connector: the manager's
    counters (loads per KV cache group), the worker's failed blocks when
    it runs in this process, and a flush that steps the engine until no
    store is in flight."""

    def __init__(self, llm):
        self.llm = llm
        core = llm.llm_engine.engine_core.engine_core
        self.manager = core.scheduler.connector.connector_scheduler.manager
        self.groups = len(core.scheduler.kv_cache_config.kv_cache_groups)

    def _worker(self):
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return None
        conn = get_kv_transfer_group()
        return getattr(getattr(conn, "connector_worker", None), "worker", None)

    def stats(self) -> dict:
        m = self.manager.stats
        out = {
            "g1_to_g2_blocks": m["stored"],
            "g2_to_g1_blocks": m["loaded"] - m["loaded_from_disk"],
            "g3_to_g1_blocks": m["loaded_from_disk"],
            "g2_to_g3_blocks": m["demoted"],
            "g2_recovered_blocks": m["recovered_host"],
            "g3_recovered_blocks": m["recovered"] - m["recovered_host"],
            "groups": self.groups,
        }
        out.update({f"loaded_group_{g}": n for g, n in m["loaded_per_group"].items()})
        if "loaded_from_g4" in m:
            out["g4_to_g1_blocks"] = m["loaded_from_g4"]
            out["g4_unplaced"] = m["g4_unplaced"]
            out["g4_from_other_splits"] = m["g4_from_other_splits"]
        out["doomed_keys"] = m["damaged"]
        w = self._worker()
        if w is not None:
            out["verify_mismatches"] = w.failed_blocks
            out["slot_bytes"], out["widest_block"] = w.slot_bytes, w.widest_block
            if w.g4 is not None:
                out["g4_published"], out["g4_fetched"] = w.g4.published, w.g4.fetched
                out["g4_damaged"] = w.g4.damaged
        return out

    def worker_g4_failures(self) -> dict:
        """G4's failures in this process's worker, by kind."""
        w = self._worker()
        return w.g4.failures() if w is not None and w.g4 is not None else {}

    def flush(self) -> None:
        w = self._worker()
        mover = w.g4 if w is not None else None
        settle(
            lambda: self.manager.books.counts()["writing"] == 0 and (mover is None or mover.idle()),
            lambda: self.llm.generate([{"prompt_token_ids": [1]}], greedy(1), use_tqdm=False),
            lambda: f"stores still in flight: {self.manager.books.counts()} {self.manager.stats}",
        )


def scheduler_side(llm, connector: str = "KvbmConnector"):
    """kvbm's scheduler side inside the in-process engine core."""
    return ConnectorSide(llm) if connector == "KvbmConnector" else OffloadSide(llm)


def reference(llm, seeds: list[int], max_tokens: int) -> dict:
    """Each case's waves once on the engine without kvbm: the same batches
    as kvbm's first round (at TP = 2 the CPU engine's outputs depend on
    which requests share a batch, so the schedule is replayed exactly)."""
    out = {}
    for seed in seeds:
        outputs, _ = run_waves(llm, case_of(seed, max_tokens), "ref")
        out[str(seed)] = {str(k): v for k, v in outputs.items()}
        llm.reset_prefix_cache()
    return out


def corrupt_files(directory: str) -> int:
    """Flips one byte in every 4 KiB of each G3 file under `directory`
    (every stored block); returns the bytes flipped."""
    flipped = 0
    for root, _, files in os.walk(directory):
        for name in files:
            if not name.endswith(".blocks"):
                continue
            with open(os.path.join(root, name), "r+b") as f:
                size = f.seek(0, os.SEEK_END)
                for at in range(0, size, 4096):
                    f.seek(at)
                    byte = f.read(1)
                    f.seek(at)
                    f.write(bytes([byte[0] ^ 0x5A]))
                    flipped += 1
    return flipped


def count_preemptions(llm, preempted: list[str]) -> None:
    """Appends every request vLLM preempts to `preempted`, so that a test
    can tell that it provoked some."""
    sched = llm.llm_engine.engine_core.engine_core.scheduler
    preempt = sched._preempt_request

    def counting(request, *args, **kwargs):
        preempted.append(request.request_id)
        return preempt(request, *args, **kwargs)

    sched._preempt_request = counting


def counters_since(side, before: dict) -> dict:
    """kvbm's integer counters moved since `before`."""
    now = side.stats()
    return {k: now[k] - before.get(k, 0) for k in now if isinstance(now[k], int)}


def with_kvbm(
    llm,
    seeds: list[int],
    max_tokens: int,
    corrupt_g3: str | None = None,
    connector: str = "KvbmConnector",
    restart=None,
    keeps: bool = False,
):
    """Runs each case twice (see the module doc); with `corrupt_g3` (the G3
    directory), G3's bytes are damaged between the rounds. With `restart`
    (a function that shuts an engine down and starts the same one again),
    round 2 runs on a new engine, which finds round 1's blocks in the tiers
    kept across restarts; where that is what the run tests (`keeps`), each
    later case starts on a new engine too. Returns the cases and the
    engine last running."""
    side = scheduler_side(llm, connector)
    preempted: list[str] = []
    count_preemptions(llm, preempted)
    out = {}
    for seed in seeds:
        preempted.clear()
        case = case_of(seed, max_tokens)
        before = side.stats()
        first, aborted = run_waves(llm, case, "r1")
        drop_prefix_cache(llm)
        # Let kvbm's background copies (G2 victims on their way to G3) land,
        # so what round 2 finds does not depend on timing.
        side.flush()
        moved = {}
        if restart is not None:
            moved = counters_since(side, before)
            llm = restart(llm)
            side = scheduler_side(llm, connector)
            count_preemptions(llm, preempted)
            # A new engine's counters start at zero: the blocks it
            # recovered at start-up count.
            before = {}
        if corrupt_g3 is not None and not corrupt_files(corrupt_g3):
            raise SystemExit(f"no G3 file to corrupt under {corrupt_g3}")
        second, aborted2 = run_waves(llm, case, "r2")
        for k, v in counters_since(side, before).items():
            moved[k] = moved.get(k, 0) + v
        if isinstance(side, OffloadSide):
            moved["groups"] = side.groups
            moved["hybrid_manager"] = not llm.llm_engine.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        out[str(seed)] = {
            "first": {str(k): v for k, v in first.items()},
            "second": {str(k): v for k, v in second.items()},
            "aborted": sorted(set(aborted) | set(aborted2)),
            "preemptions": len(preempted),
            "stats": moved,
        }
        # The next case starts with empty caches, vLLM's and kvbm's.
        drop_prefix_cache(llm)
        drop_prefix_cache(llm, reset_connector=True)
        if restart is not None and keeps and seed != seeds[-1]:
            # A reset stops the kept tiers until the engine restarts: the
            # next case's blocks are kept by a new engine. The reset
            # reaches the workers with the next step, which empties their
            # records first.
            llm.generate([{"prompt_token_ids": [1]}], greedy(1), use_tqdm=False)
            llm = restart(llm)
            side = scheduler_side(llm, connector)
            count_preemptions(llm, preempted)
    return out, llm


def shut_down(llm) -> None:
    """Stops the engine (and kvbm with it) so that the next one can start
    in this process."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    cleanup_dist_env_and_memory()


def main() -> int:
    model_dir, runs = sys.argv[1], json.loads(sys.argv[2])
    for run in runs:
        connector = run.get("connector", "KvbmConnector")

        def start():
            return build_engine(run.get("model_dir", model_dir), run["extra"], run["engine"], connector)

        def restart(llm):
            shut_down(llm)
            return start()

        llm = start()
        seeds, max_tokens = run["seeds"], run.get("max_tokens", MAX_TOKENS)
        if run["extra"] is None:
            result = reference(llm, seeds, max_tokens)
        else:
            corrupt = run["extra"]["disk_cache_dir"] if run.get("corrupt_g3") else None
            again = restart if run.get("restart") else None
            # Runs with G4 test what a new engine finds there, not in its
            # own kept tiers.
            keeps = not any(k.startswith("g4_") for k in run["extra"])
            result, llm = with_kvbm(llm, seeds, max_tokens, corrupt, connector, again, keeps)
        print("KVBM_RESULT " + json.dumps({"name": run["name"], "cases": result}), flush=True)
        shut_down(llm)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""G4 through vLLM's engine on CPU, its master killed and restarted mid-run
(g4_faults.py): every output equals the engine's without kvbm, the host
tier serves while the store is gone, failures are counted, no round hangs,
and G4 serves again once its master is back, with nothing restarted.

(Blocks shared between two engines, byte for byte, are the differential
test's ``spec-hybrid-g4-shared`` configuration.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import HERE, engine_env

if os.environ.get("KVBM_REQUIRE_G4") != "1":
    pytest.importorskip("mooncake.store")

#: A case with prompts sharing stems over several waves.
SEED = 3


def test_master_killed_and_restarted_mid_run(tiny_hybrid_model, tmp_path):
    env = {**engine_env(tmp_path), "PYTHONHASHSEED": "0"}
    proc = subprocess.run(
        [sys.executable, str(HERE / "g4_faults.py"), tiny_hybrid_model, str(SEED), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("KVBM_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-4000:] + proc.stderr[-8000:]
    r = json.loads(lines[-1][len("KVBM_RESULT ") :])
    want = r["reference"]
    rounds = r["rounds"]
    for i, rnd in enumerate(rounds, 1):
        for prompt, tokens in rnd["outputs"].items():
            assert tokens == want[prompt], f"round {i}, prompt {prompt}: {tokens} != {want[prompt]} (seed {SEED})"
        for prompt, tokens in rnd["other_outputs"].items():
            other = r["reference_other"][prompt]
            assert tokens == other, f"round {i}, prompt {prompt} of seed {SEED + 1}: {tokens} != {other}"
    r1, r2, r3, r4 = (x["stats"] for x in rounds)
    # Round 1 published its blocks; round 2 ran on the host tier with the
    # store gone, and counted the store's failures.
    assert r1["g4_published"] > 0, r1
    assert r2["g2_to_g1_blocks"] > r1["g2_to_g1_blocks"], (r1, r2)
    down = rounds[1]["g4"]["g4_lookup_failures"].get("unreachable", 0) + rounds[1]["worker_g4_failures"].get(
        "unreachable", 0
    )
    assert down > 0, rounds[1]
    # A round with the store gone costs seconds, not the store's timeouts
    # per call.
    assert rounds[1]["seconds"] < 60, rounds[1]
    # After the restart the store was empty: round 3 computed and
    # published anew; round 4 loaded from it.
    assert r3["g4_published"] > r2["g4_published"], (r2, r3)
    assert r4["g4_to_g1_blocks"] > r3["g4_to_g1_blocks"], (r3, r4)
    assert r4["g4_damaged"] == 0 and r4["verify_mismatches"] == 0, r4

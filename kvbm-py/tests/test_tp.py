"""Two tensor-parallel ranks in two worker processes, through the
scheduler-side object in this one: the benchmark's CPU mode, which checks
every byte on both ranks, round trips through G2 and G3, and kills a rank
in the middle of an onboard (the onboard fails naming it, nothing counts
as loaded, a new process rejoins the rank and the next transfer
succeeds). Every copy is held back 200 ms so the kill lands mid-transfer."""

import subprocess
import sys
from pathlib import Path

import pytest

import kvbm_py

BENCH = Path(__file__).resolve().parents[1] / "benches" / "tp_bench.py"


@pytest.mark.skipif(not kvbm_py._kvbm.TEST_HOOKS, reason="a wheel built without feature test-hooks")
def test_two_rank_processes_survive_a_killed_rank(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(BENCH),
            "--device",
            "cpu",
            "--layers",
            "4",
            "--heads",
            "2",
            "--head-dim",
            "64",
            "--blocks",
            "128",
            "--reps",
            "3",
            "--kill-after-ms",
            "50",
            "--transfer-delay-ms",
            "200",
            "--dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert "every byte checked on every rank" in text, text
    assert "mismatched blocks per rank [0, 0]" in text, text
    assert "rank 1" in text.split("killed rank 1", 1)[1], text
    assert "rejoined" in text, text

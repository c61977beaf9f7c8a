"""An engine instance's files in the temporary directory: what a stopped
instance left is removed at the next start, a live instance's never."""

import os
import subprocess
import sys

from kvbm_py.instance_files import InstanceLock, sweep

A, B, C = "0123456789abcdef", "fedcba9876543210", "00000000000000aa"


def _touch(d, *names):
    for n in names:
        (d / n).write_text("x")


def _left(d):
    return sorted(p.name for p in d.iterdir())


def test_files_of_stopped_instances_go_and_a_live_ones_stay(tmp_path):
    # A: a full set whose lock nobody holds; B: no lock file at all (a
    # killed start, or a version that took none).
    _touch(tmp_path, f"kvbm-{A}.sock", f"kvbm-{A}.secret", f"kvbm-{A}.lock", f"kvbm-{A}.tmp-4242")
    _touch(tmp_path, f"kvbm-{B}.sock", f"kvbm-{B}.secret")
    # C: live, its lock held (by this process, through its own open file).
    live = InstanceLock(C, str(tmp_path))
    _touch(tmp_path, f"kvbm-{C}.sock", f"kvbm-{C}.secret")
    # Not an instance's files.
    _touch(tmp_path, "kvbm-g3", "kvbm-notadigest.sock", "other.sock")
    removed = sweep(str(tmp_path))
    assert sorted(removed) == sorted(
        [
            f"kvbm-{A}.sock",
            f"kvbm-{A}.secret",
            f"kvbm-{A}.lock",
            f"kvbm-{A}.tmp-4242",
            f"kvbm-{B}.sock",
            f"kvbm-{B}.secret",
            f"kvbm-{B}.lock",
        ]
    )
    assert _left(tmp_path) == sorted(
        ["kvbm-g3", "kvbm-notadigest.sock", "other.sock", f"kvbm-{C}.lock", f"kvbm-{C}.secret", f"kvbm-{C}.sock"]
    )
    live.release()
    assert _left(tmp_path) == ["kvbm-g3", "kvbm-notadigest.sock", "other.sock"]


def test_the_last_process_of_an_instance_removes_its_files(tmp_path):
    first = InstanceLock(C, str(tmp_path))
    second = InstanceLock(C, str(tmp_path))
    _touch(tmp_path, f"kvbm-{C}.sock", f"kvbm-{C}.secret")
    first.release()
    assert f"kvbm-{C}.secret" in _left(tmp_path), "another process still runs"
    first.release()  # twice is harmless
    second.release()
    assert _left(tmp_path) == []


def test_a_lock_held_by_another_process_protects_its_files(tmp_path):
    # The holder is another process, killed without its shutdown: while
    # it lives its files stay; once it is gone they are stale.
    code = (
        "import sys, time\n"
        "from kvbm_py.instance_files import InstanceLock\n"
        f"lock = InstanceLock({C!r}, {str(tmp_path)!r})\n"
        f"open({str(tmp_path / f'kvbm-{C}.secret')!r}, 'w').close()\n"
        "print('locked', flush=True)\n"
        "sys.stdin.read()\n"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert sweep(str(tmp_path)) == []
        assert f"kvbm-{C}.secret" in _left(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    assert sorted(sweep(str(tmp_path))) == [f"kvbm-{C}.lock", f"kvbm-{C}.secret"]
    assert os.listdir(tmp_path) == []

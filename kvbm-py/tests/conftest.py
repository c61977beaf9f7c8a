"""Shared fixtures: the tiny model, the environment vLLM runs in, and the
removal of kept G2 directories a test made."""

import contextlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

ENGINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
}


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    """A tiny random Llama, written once per pytest run."""
    out = tmp_path_factory.mktemp("tiny-llama")
    subprocess.run([sys.executable, str(HERE / "tiny_model.py"), str(out)], check=True)
    return str(out)


@pytest.fixture(scope="session")
def tiny_mamba_model(tmp_path_factory) -> str:
    """A tiny random Qwen3-Next-style model (linear attention + full
    attention: a Mamba state group and a KV cache group), written once
    per pytest run."""
    out = tmp_path_factory.mktemp("tiny-mamba")
    subprocess.run([sys.executable, str(HERE / "tiny_model.py"), str(out), "mamba"], check=True)
    return str(out)


@pytest.fixture(scope="session")
def tiny_hybrid_model(tmp_path_factory) -> str:
    """A tiny random Gemma-3-style model (sliding window + full attention:
    two KV cache groups), written once per pytest run."""
    out = tmp_path_factory.mktemp("tiny-hybrid")
    subprocess.run([sys.executable, str(HERE / "tiny_model.py"), str(out), "hybrid"], check=True)
    return str(out)


def engine_env(tmp_path: Path) -> dict:
    """The environment of an engine subprocess: offline, in-process engine
    core, 1 GiB of CPU KV cache, kvbm's sockets and files under tmp_path."""
    env = dict(os.environ)
    env.update(ENGINE_ENV)
    env["TMPDIR"] = str(tmp_path)
    return env


#: Bytes of one slot's record in a kept tier's ``slots`` file, and of the
#: header before the first.
KEPT_RECORD, KEPT_HEADER = 32, 4096


def kept_slots(kept_dir: Path) -> list[int]:
    """Slots whose records name a block, in a kept tier's directory."""
    raw = (kept_dir / "slots").read_bytes()[KEPT_HEADER:]
    n = KEPT_RECORD
    return [i for i in range(len(raw) // n) if raw[i * n + 24 : i * n + 32] != bytes(8)]


@contextlib.contextmanager
def kept_g2_removed():
    """Yields the directory kept G2s live in (this user's, in /dev/shm) and
    what it held before; removes what was added there when the block
    ends. Kept G2s live outside pytest's temporary directories, and an
    engine of the same identity in a later test would find them."""
    from kvbm_py.config import KvbmConfig

    base = Path(KvbmConfig.g2_base())
    before = set(base.iterdir()) if base.is_dir() else set()
    try:
        yield base, before
    finally:
        for entry in (set(base.iterdir()) if base.is_dir() else set()) - before:
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)

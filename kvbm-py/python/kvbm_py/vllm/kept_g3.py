"""A G3 that outlives the engine: the identity its bytes are kept under,
and what happens to the kept G3 of other identities.

A restarted engine reopens its G3 only if every block in it still means
the same thing: the same model weights, KV dtype, block size, prefix hash
scheme and seed, and parallelism. That identity names the directory (one
per rank) and is written inside it; kvbm's worker adds the block geometry
and refuses a directory written under anything else.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
from typing import TYPE_CHECKING

from kvbm_py.config import HISTORY_SUFFIX, KEPT_PREFIX, KvbmConfig, kept_name
from kvbm_py.vllm.common import log

if TYPE_CHECKING:
    from vllm.config import VllmConfig

#: How kvbm turns vLLM's block hashes into its own keys; changes when that
#: mapping does, so old directories are not reused.
HASH_MAPPING = "vllm-block-hash-1"

#: Files whose size and modification time stand for a local model's weights.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", "config.json")


def _weights_fingerprint(model: str, revision: str | None) -> str:
    """What changes when a model's weights do: for a local directory, the
    names, sizes and modification times of its weight files; for a hub
    model, the snapshot it resolved to, where the local cache knows it."""
    if os.path.isdir(model):
        entries = []
        for name in sorted(os.listdir(model)):
            if name.endswith(_WEIGHT_SUFFIXES):
                st = os.stat(os.path.join(model, name))
                entries.append(f"{name}:{st.st_size}:{st.st_mtime_ns}")
        return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(model, "config.json", revision=revision)
        if isinstance(path, str):
            # .../snapshots/<commit>/config.json
            return os.path.basename(os.path.dirname(path))
    except Exception:
        pass
    return str(revision)


def identity(vllm_config: VllmConfig) -> tuple[str | None, str]:
    """The identity G3 is kept under, or ``(None, why it cannot be kept)``."""
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is None or seed == "random":
        return None, (
            "vLLM seeds its prefix hashes at random in every process unless "
            "PYTHONHASHSEED is set (the same value in every process), so no "
            "block would be found again"
        )
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    fields = {
        "model": model.model,
        "revision": model.revision,
        "weights": _weights_fingerprint(model.model, model.revision),
        "dtype": str(model.dtype),
        "kv_cache_dtype": cache.cache_dtype,
        "block_size": cache.block_size,
        "prefix_hash": getattr(cache, "prefix_caching_hash_algo", "unknown"),
        "hash_seed": hashlib.sha256(seed.encode()).hexdigest()[:16],
        "hash_mapping": HASH_MAPPING,
        "tensor_parallel": parallel.tensor_parallel_size,
        "pipeline_parallel": parallel.pipeline_parallel_size,
    }
    return "\n".join(f"{k}: {v}" for k, v in fields.items()), ""


def _lock_if_unused(path: str) -> int | None:
    """The kept G3 directory ``path``'s lock, taken, when no process holds
    it (a descriptor to close once done with the directory); None while an
    engine uses it."""
    try:
        fd = os.open(os.path.join(path, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:
        os.close(fd)
        return None


def sweep_foreign(config: KvbmConfig, ours: str, tier: str = "G3") -> list[str]:
    """Removes (or, with ``disk_cache_foreign = keep``, leaves) the kept
    directories of ``tier`` (G2 or G3) of other identities that no engine
    uses; logs which. Returns those removed."""
    base = config.g2_base() if tier == "G2" else config.g3_base()
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    mine = kept_name(ours, 0).rsplit("-rank", 1)[0]
    removed = []
    for name in names:
        path = os.path.join(base, name)
        if not name.startswith(KEPT_PREFIX) or name.startswith(mine + "-rank"):
            continue
        if name.endswith(HISTORY_SUFFIX) and name != mine + HISTORY_SUFFIX:
            # Another identity's use history: advisory, nobody holds it.
            if config.disk_cache_foreign == "remove":
                with contextlib.suppress(OSError):
                    os.remove(path)
            continue
        if not os.path.isdir(path):
            continue
        # Held while the directory goes, so that an engine starting on it
        # meanwhile finds it in use and takes a directory of its own.
        lock = _lock_if_unused(path)
        if lock is None:
            continue
        try:
            if config.disk_cache_foreign == "keep":
                log.info("kvbm: kept %s of another model or setting left in place: %s", tier, path)
                continue
            shutil.rmtree(path, ignore_errors=True)
            log.info("kvbm: kept %s of another model or setting removed: %s", tier, path)
            removed.append(path)
        finally:
            os.close(lock)
    return removed

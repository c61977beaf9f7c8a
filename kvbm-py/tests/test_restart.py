"""G3 outlives the engine: a vLLM engine on CPU is killed (SIGKILL) while
it offloads; a new engine with the same configuration serves the first
one's prompts from the G3 it left on disk, token for token the same, and a
block damaged on disk while no engine ran is recomputed, never served."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

from conftest import HERE, engine_env, kept_g2_removed, kept_slots
from test_engine import BLOCK_BYTES, GIB


def _run(model: str, tmp_path: Path, extra: dict, kill: bool = False, spec: bool = False) -> dict:
    env = {**engine_env(tmp_path), "PYTHONHASHSEED": "0"}
    args = [sys.executable, str(HERE / "restart_run.py"), model, json.dumps(extra)]
    args += (["kill"] if kill else []) + (["spec"] if spec else [])
    proc = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("KVBM_RESULT ")]
    expected = -9 if kill else 0
    assert proc.returncode == expected and lines, (proc.returncode, proc.stdout[-4000:] + proc.stderr[-8000:])
    return json.loads(lines[-1][len("KVBM_RESULT ") :])


def _damage(kept_dir: Path, slots: list[int], stride: int) -> None:
    """Flips one byte of each of `slots` in the kept directory's data file
    (slots `stride` bytes apart), as a disk or memory that changed at rest."""
    with open(kept_dir / "blocks", "r+b") as f:
        for slot in slots:
            f.seek(slot * stride + 100)
            b = f.read(1)
            f.seek(slot * stride + 100)
            f.write(bytes([b[0] ^ 0x5A]))


def _cache_tool(base: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvbm_py.cache", "--verify", str(base)], capture_output=True, text=True, timeout=60
    )


def _config(model: str, **kw) -> SimpleNamespace:
    """The parts of a vLLM configuration the kept G3's identity reads."""
    return SimpleNamespace(
        model_config=SimpleNamespace(model=model, revision=None, dtype="torch.bfloat16"),
        cache_config=SimpleNamespace(
            cache_dtype="auto", block_size=kw.get("block_size", 32), prefix_caching_hash_algo="sha256"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=kw.get("tp", 1), pipeline_parallel_size=1),
    )


def test_identity_names_what_the_bytes_mean(tmp_path, monkeypatch):
    from kvbm_py.vllm.kept_g3 import identity

    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"w" * 10)
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    none, why = identity(_config(str(model)))
    assert none is None and "PYTHONHASHSEED" in why
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    base, _ = identity(_config(str(model)))
    assert base is not None and base == identity(_config(str(model)))[0]
    assert identity(_config(str(model), block_size=16))[0] != base
    assert identity(_config(str(model), tp=2))[0] != base
    monkeypatch.setenv("PYTHONHASHSEED", "1")
    assert identity(_config(str(model)))[0] != base
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    # New weights at the same path are another model.
    (model / "model.safetensors").write_bytes(b"v" * 11)
    assert identity(_config(str(model)))[0] != base


def test_the_kv_encoding_names_how_a_block_is_laid_out():
    import torch

    from kvbm_py.vllm.common import kv_encoding

    def engine(*backends):
        ctx = {
            f"l{i}": SimpleNamespace(attn_backend=SimpleNamespace(get_name=lambda b=b: b))
            for i, b in enumerate(backends)
        }
        return SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context=ctx))

    split = {f"l{i}": torch.zeros(10, 2, 16, 128, dtype=torch.float16) for i in range(2)}
    base = kv_encoding(split, 10, engine("A", "A"))
    assert base == kv_encoding(split, 10, engine("A", "A"))
    assert "backends A;" in str(base) and "Bx2x16x128 order 0,1,2,3 torch.float16" in str(base)
    # The salt of blocks shared with other engines names the backends only
    # (the shapes change with the parallelism).
    assert base.salt() == kv_encoding({"l0": torch.zeros(10, 1, 16, 128)}, 10, engine("A")).salt() != 0
    assert kv_encoding(split, 10, engine("B", "B")).salt() not in (0, base.salt())
    # Two layouts of one shape: the backends tell them apart.
    assert kv_encoding(split, 10, engine("B", "B")) != base
    # K and V outermost in memory, blocks inside: another order.
    outer = {n: torch.zeros(2, 10, 16, 128, dtype=torch.float16).transpose(0, 1) for n in split}
    assert "order 1,0,2,3" in str(kv_encoding(outer, 10, engine("A", "A")))
    # Another element type, another shape.
    assert kv_encoding({n: t.to(torch.bfloat16) for n, t in split.items()}, 10, engine("A", "A")) != base
    assert kv_encoding({n: torch.zeros(10, 2, 16, 2, 64) for n in split}, 10, engine("A", "A")) != base
    # A layer of several tensors (Mamba state), and no layers vLLM built.
    state = {"m": [torch.zeros(10, 4, 8), torch.zeros(10, 16)]}
    unknown = kv_encoding(state, 10, SimpleNamespace())
    assert str(unknown) == "backends unknown; tensors Bx16 order 0,1 torch.float32; Bx4x8 order 0,1,2 torch.float32"
    assert unknown.salt() == 0


def test_other_identities_are_removed_or_kept_by_policy(tmp_path):
    import fcntl

    from kvbm_py.config import KvbmConfig
    from kvbm_py.vllm.kept_g3 import sweep_foreign

    cfg = KvbmConfig.from_sources({"disk_cache_gb": 1, "disk_cache_dir": str(tmp_path)}, env={})
    ours = cfg.kept_g3_dir("mine", 0)
    for d in (ours, ours + ".2", cfg.kept_g3_dir("old", 0), cfg.kept_g3_dir("busy", 1)):
        os.makedirs(d)
        Path(d, "lock").write_text("")
    unrelated = tmp_path / "not-kvbm"
    unrelated.mkdir()
    busy = os.open(os.path.join(cfg.kept_g3_dir("busy", 1), "lock"), os.O_RDWR)
    fcntl.flock(busy, fcntl.LOCK_EX)
    keep = KvbmConfig.from_sources(
        {"disk_cache_gb": 1, "disk_cache_dir": str(tmp_path), "disk_cache_foreign": "keep"}, env={}
    )
    assert sweep_foreign(keep, "mine") == []
    assert sweep_foreign(cfg, "mine") == [cfg.kept_g3_dir("old", 0)]
    os.close(busy)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == sorted(
        [
            os.path.basename(ours),
            os.path.basename(ours) + ".2",
            os.path.basename(cfg.kept_g3_dir("busy", 1)),
            "not-kvbm",
        ]
    ), left


def test_kept_g3_serves_a_restarted_engine(tiny_model, tmp_path):
    base = tmp_path / "g3"
    extra = {
        "cpu_cache_gb": 1.5 * BLOCK_BYTES / GIB,  # G2 holds one block: the rest goes to G3
        "disk_cache_gb": 64 * BLOCK_BYTES / GIB,
        "disk_cache_dir": str(base),
        "admission": "all",
        "offload_in_flight": 1,
    }
    # A foreign kept G3 nobody uses: removed at start.
    foreign = base / "kept-0000000000000000-rank0"
    foreign.mkdir(parents=True)
    (foreign / "identity").write_text("model: another\n")
    first = _run(tiny_model, tmp_path, extra, kill=True)
    assert first["stats"]["g2_to_g3_blocks"] >= 8, first["stats"]
    assert not foreign.exists()
    kept = [d for d in base.iterdir() if d.name.startswith("kept-") and d.is_dir()]
    assert len(kept) == 1 and kept[0].name.endswith("-rank0"), kept
    slots = kept_slots(kept[0])
    assert len(slots) >= 8, slots
    clean = _cache_tool(base)
    assert clean.returncode == 0 and f"blocks {len(slots)} of 64" in clean.stdout, clean.stdout + clean.stderr
    assert "verified: 0 blocks fail" in clean.stdout, clean.stdout
    # Damage the bytes of the first two blocks written to G3 (G3 fills
    # its highest slots first: the first prompts' first blocks) while no
    # engine runs.
    _damage(kept[0], slots[-2:], BLOCK_BYTES)
    damaged = _cache_tool(base)
    assert damaged.returncode == 1 and "verified: 2 blocks fail" in damaged.stdout, damaged.stdout
    second = _run(tiny_model, tmp_path, extra)
    s = second["stats"]
    # The engine's first requests were served from the G3 the killed one
    # left, token for token the same as computed; the damaged block was
    # caught and recomputed.
    assert s["g3_to_g1_blocks"] >= 4, s
    assert second["outputs"] == first["outputs"]
    assert s["onboard_failures"] >= 1 or s.get("verify_mismatches", 0) >= 1, (json.dumps(s), slots)
    assert s["g3_recovered_blocks"] == len(slots), s

    # The same weights under another path are another identity: nothing
    # is reused, and the unused G3 of the first is removed.
    other = tmp_path / "model-copy"
    shutil.copytree(tiny_model, other)
    third = _run(str(other), tmp_path, extra)
    t = third["stats"]
    assert t["g3_recovered_blocks"] == 0 and t["g3_to_g1_blocks"] == 0, t
    assert third["outputs"] == first["outputs"]
    assert not kept[0].exists()
    assert len([d for d in base.iterdir() if d.name.startswith("kept-") and d.is_dir()]) == 1
    # The first identity's use history went with its G3.
    assert not (base / (kept[0].name.rsplit("-rank", 1)[0] + ".uses")).exists()


def test_kept_g3_behind_the_offloading_connector_serves_a_restarted_engine(tiny_hybrid_model, tmp_path):
    """The same on a hybrid model behind ``KvbmOffloadingConnector``: a G2
    of a few slots in front of G3, the engine killed while it offloads."""
    base = tmp_path / "g3"
    extra = {
        "cpu_cache_gb": 8.5 * BLOCK_BYTES / GIB,
        "disk_cache_gb": 64 * BLOCK_BYTES / GIB,
        "disk_cache_dir": str(base),
        "admission": "all",
    }
    first = _run(tiny_hybrid_model, tmp_path, extra, kill=True, spec=True)
    assert first["stats"]["demoted"] >= 8, first["stats"]
    kept = [d for d in base.iterdir() if d.name.startswith("kept-") and d.is_dir()]
    assert len(kept) == 1 and kept[0].name.endswith("-rank0"), kept
    slots = kept_slots(kept[0])
    assert len(slots) >= 8, slots
    clean = _cache_tool(base)
    assert clean.returncode == 0 and "verified: 0 blocks fail" in clean.stdout, clean.stdout + clean.stderr

    # Every block the killed engine recorded is taken up, and its first
    # prompts are served from them, token for token the same as computed.
    second = _run(tiny_hybrid_model, tmp_path, extra, spec=True)
    s = second["stats"]
    assert s["recovered"] == len(slots), (s, slots)
    assert second["outputs"] == first["outputs"]
    assert s["loaded_from_disk"] >= 4 and s["damaged"] == 0, s

    # Every kept block damaged on disk while no engine runs: the store's
    # reader finds them, and the next engine catches each block it loads
    # and recomputes it, outputs still the same.
    slots = kept_slots(kept[0])
    identity = (kept[0] / "identity").read_text()
    stride = int(next(line for line in identity.splitlines() if line.startswith("inner: ")).split()[1])
    _damage(kept[0], slots, stride)
    found = _cache_tool(base)
    assert found.returncode == 1 and f"verified: {len(slots)} blocks fail" in found.stdout, found.stdout
    third = _run(tiny_hybrid_model, tmp_path, extra, spec=True)
    t = third["stats"]
    assert t["recovered"] == len(slots), (t, slots)
    assert third["outputs"] == first["outputs"]
    assert t["damaged"] >= 1, t


def test_kept_g2_serves_a_restarted_engine_and_refuses_damaged_blocks(tiny_model, tmp_path):
    if not os.path.isdir("/dev/shm"):
        import pytest

        pytest.skip("this host has no /dev/shm")
    extra = {"cpu_cache_gb": 64 * BLOCK_BYTES / GIB, "cpu_cache_keep": True, "admission": "all"}
    with kept_g2_removed() as (base, before):
        first = _run(tiny_model, tmp_path, extra, kill=True)
        assert first["stats"]["g1_to_g2_blocks"] >= 8, first["stats"]
        kept = [d for d in base.iterdir() if d not in before and d.name.startswith("kept-") and d.is_dir()]
        assert len(kept) == 1 and kept[0].name.endswith("-rank0"), kept
        slots = kept_slots(kept[0])
        assert len(slots) >= 8, slots

        # The killed engine's G2 serves the new one from its first request.
        second = _run(tiny_model, tmp_path, extra)
        s = second["stats"]
        assert second["outputs"] == first["outputs"]
        assert s["g2_recovered_blocks"] == len(slots), s
        assert s["g2_to_g1_blocks"] >= 4 and s["g1_to_g2_blocks"] == 0, s
        assert s.get("onboard_failures", 0) == 0, s
        # The engine that exited wrote its use history beside its G2, for
        # the next one to rank the kept blocks by.
        uses = [p for p in base.iterdir() if p not in before and p.name.endswith(".uses")]
        assert len(uses) == 1 and uses[0].stat().st_size > 0, uses

        # Bytes changed in host memory while no engine ran: caught by the
        # checksums the records carry, recomputed, never served.
        slots = kept_slots(kept[0])
        _damage(kept[0], slots, BLOCK_BYTES)
        third = _run(tiny_model, tmp_path, extra)
        t = third["stats"]
        assert third["outputs"] == first["outputs"]
        assert t["g2_recovered_blocks"] == len(slots), t
        assert t["onboard_failures"] >= 1 or t.get("verify_mismatches", 0) >= 1, t


def test_kept_g2_behind_the_offloading_connector_serves_a_restarted_engine(tiny_hybrid_model, tmp_path):
    """The hybrid model behind ``KvbmOffloadingConnector`` with
    ``cpu_cache_keep``: the engine killed while it offloads leaves its host
    slots in /dev/shm, the next takes up every recorded block and serves
    its first prompts from them; bytes changed there while no engine ran
    are caught and recomputed."""
    if not os.path.isdir("/dev/shm"):
        import pytest

        pytest.skip("this host has no /dev/shm")
    extra = {"cpu_cache_gb": 64 * BLOCK_BYTES / GIB, "cpu_cache_keep": True, "admission": "all"}
    with kept_g2_removed() as (base, before):
        first = _run(tiny_hybrid_model, tmp_path, extra, kill=True, spec=True)
        assert first["stats"]["stored"] >= 8, first["stats"]
        kept = [d for d in base.iterdir() if d not in before and d.name.startswith("kept-") and d.is_dir()]
        assert len(kept) == 1 and kept[0].name.endswith("-rank0"), kept
        slots = kept_slots(kept[0])
        assert len(slots) >= 8, slots

        second = _run(tiny_hybrid_model, tmp_path, extra, spec=True)
        s = second["stats"]
        assert s["recovered_host"] == s["recovered"] == len(slots), (s, slots)
        assert second["outputs"] == first["outputs"]
        assert s["loaded"] >= 4 and s["loaded_from_disk"] == 0 and s["damaged"] == 0, s

        slots = kept_slots(kept[0])
        identity = (kept[0] / "identity").read_text()
        stride = int(next(line for line in identity.splitlines() if line.startswith("inner: ")).split()[1])
        _damage(kept[0], slots, stride)
        third = _run(tiny_hybrid_model, tmp_path, extra, spec=True)
        t = third["stats"]
        assert t["recovered"] == len(slots), (t, slots)
        assert third["outputs"] == first["outputs"]
        assert t["damaged"] >= 1, t

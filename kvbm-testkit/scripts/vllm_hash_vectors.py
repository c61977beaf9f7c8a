#!/usr/bin/env python3
"""Generate vLLM prefix-cache hash vectors for kvbm-block's `vllm-sha256` scheme.

The values come from vLLM's own code, not from a re-implementation: the script
opens a vLLM wheel, extracts `vllm/utils/hashing.py`,
`vllm/v1/core/kv_cache_utils.py` and `vllm/multimodal/utils.py` into a
temporary directory, and executes only the functions needed for block hashing
(`sha256_cbor`, `init_none_hash`, `hash_block_tokens`, the extra-key
generators, `get_request_block_hasher`, `get_mm_features_in_window`). The rest
of those modules imports half of vLLM and torch, so the functions are lifted
out of the module source by name (the AST is not modified apart from dropping
type annotations, which would otherwise name vLLM classes) and run with stub
request objects. vLLM's code is never committed; only the vectors are.

Usage:
    pip download --no-deps vllm==0.33.0 -d /tmp/vllm-wheel
    pip install cbor2
    python3 kvbm-testkit/scripts/vllm_hash_vectors.py \
        --wheel /tmp/vllm-wheel/vllm-0.33.0-*.whl \
        --out kvbm-block/tests/data/vllm_hash_vectors.json
    # optional: time vLLM's hashing per block (reference for benchmarks)
    python3 kvbm-testkit/scripts/vllm_hash_vectors.py --wheel ... --bench
"""

from __future__ import annotations

import argparse
import ast
import glob
import hashlib
import json
import os
import random
import sys
import tempfile
import timeit
import types
import zipfile
from typing import Any

import cbor2

HASHING_PY = "vllm/utils/hashing.py"
KV_CACHE_UTILS_PY = "vllm/v1/core/kv_cache_utils.py"
MM_UTILS_PY = "vllm/multimodal/utils.py"

KV_CACHE_UTILS_NAMES = {
    "DEFAULT_NONE_HASH_SEED",
    "_NON_CRYPTO_HASH_FUNCTIONS",
    "_NONE_HASH_SEED",
    "resolve_none_hash_seed",
    "get_none_hash_seed",
    "init_none_hash",
    "hash_block_tokens",
    "_gen_mm_extra_hash_keys",
    "_gen_lora_extra_hash_keys",
    "_gen_prompt_embeds_extra_hash_keys",
    "generate_block_hash_extra_keys",
    "get_request_block_hasher",
}
MM_UTILS_NAMES = {"get_mm_features_in_window"}


def _strip_annotations(node: ast.AST) -> ast.AST:
    for sub in ast.walk(node):
        if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)):
            sub.returns = None
            args = sub.args
            for a in args.posonlyargs + args.args + args.kwonlyargs:
                a.annotation = None
            if args.vararg:
                args.vararg.annotation = None
            if args.kwarg:
                args.kwarg.annotation = None
    return node


def _top_level_name(node: ast.stmt) -> str | None:
    if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
        return node.name
    if isinstance(node, ast.Assign) and len(node.targets) == 1:
        t = node.targets[0]
        if isinstance(t, ast.Name):
            return t.id
    if isinstance(node, ast.AnnAssign) and node.value is not None:
        if isinstance(node.target, ast.Name):
            return node.target.id
    return None


def lift(source: str, filename: str, names: set[str], namespace: dict) -> None:
    """Execute the top-level definitions `names` of `source` in `namespace`."""
    tree = ast.parse(source, filename)
    body = []
    for node in tree.body:
        name = _top_level_name(node)
        if name in names:
            if isinstance(node, ast.AnnAssign):
                node = ast.copy_location(ast.Assign(targets=[node.target], value=node.value), node)
            body.append(_strip_annotations(node))
    found = {_top_level_name(n) for n in body}
    missing = names - found
    if missing:
        raise SystemExit(f"{filename}: definitions not found: {sorted(missing)}")
    module = ast.fix_missing_locations(ast.Module(body=body, type_ignores=[]))
    exec(compile(module, filename, "exec"), namespace)


class _Logger:
    def warning(self, *args, **kwargs):
        pass

    info = debug = warning


def load_vllm(wheel: str, tmp: str) -> dict:
    with zipfile.ZipFile(wheel) as zf:
        for member in (HASHING_PY, KV_CACHE_UTILS_PY, MM_UTILS_PY):
            zf.extract(member, tmp)

    def read(member: str) -> str:
        with open(os.path.join(tmp, member), encoding="utf-8") as f:
            return f.read()

    # hashing.py imports only the standard library and cbor2: run it whole.
    hashing = types.ModuleType("vllm_hashing")
    exec(compile(read(HASHING_PY), HASHING_PY, "exec"), hashing.__dict__)

    import bisect

    ns: dict[str, Any] = {
        "__name__": "vllm_kv_cache_utils",
        "os": os,
        "hashlib": hashlib,
        "bisect": bisect,
        "BlockHash": lambda b: b,  # NewType("BlockHash", bytes) is the identity
        "xxhash": hashing.xxhash,
        "xxhash_cbor": hashing.xxhash_cbor,
        "logger": _Logger(),
        "tensor_data": None,  # only used for prompt embeds, which we do not generate
    }
    lift(read(MM_UTILS_PY), MM_UTILS_PY, MM_UTILS_NAMES, ns)
    lift(read(KV_CACHE_UTILS_PY), KV_CACHE_UTILS_PY, KV_CACHE_UTILS_NAMES, ns)
    ns["sha256_cbor"] = hashing.sha256_cbor
    return ns


# ---- stub request objects, with exactly the attributes the hashing code reads ----


class _Pos:
    def __init__(self, offset: int, length: int):
        self.offset = offset
        self.length = length


class _MmFeature:
    def __init__(self, identifier: str, offset: int, length: int):
        self.identifier = identifier
        self.mm_position = _Pos(offset, length)


class _Lora:
    def __init__(self, name: str, path: str):
        self.lora_name = name
        self.lora_path = path


class _Request:
    def __init__(self, tokens, mm, lora, cache_salt):
        self.all_token_ids = list(tokens)
        self.num_tokens = len(tokens)
        self.block_hashes: list[bytes] = []
        self.mm_features = [_MmFeature(*m) for m in mm]
        self.lora_request = _Lora(*lora) if lora else None
        self.cache_salt = cache_salt
        self.prompt_embeds = None
        self._prompt_embeds_per_block_hashes = {}


# ---- typed JSON for Python values (JSON cannot tell a tuple from bytes) ----


def tag(v: Any) -> Any:
    if v is None:
        return {"t": "none"}
    if isinstance(v, bool):
        return {"t": "bool", "v": v}
    if isinstance(v, int):
        return {"t": "int", "v": str(v)}
    if isinstance(v, str):
        return {"t": "str", "v": v}
    if isinstance(v, bytes):
        return {"t": "bytes", "v": v.hex()}
    if isinstance(v, (tuple, list)):
        return {"t": "array", "v": [tag(x) for x in v]}
    raise TypeError(type(v))


def with_seed(ns: dict, seed: str | None):
    if seed is None:
        os.environ.pop("PYTHONHASHSEED", None)
    else:
        os.environ["PYTHONHASHSEED"] = seed
    ns["init_none_hash"](ns["sha256_cbor"])
    return ns["NONE_HASH"]


SEEDS = [None, "0", "42", "kvbm-test-seed", "", "h\u00e9llo \u4e16\u754c"]

CBOR_VALUES = [
    None, True, False, 0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32,
    2**63 - 1, 2**64 - 1, 2**64, 2**70 + 5, 2**127 - 1, -1, -24, -25, -256, -257,
    -(2**32), -(2**32) - 1, -(2**63), -(2**64), -(2**64) - 1, -(2**100), -(2**127),
    b"", b"\x00\xff", bytes(range(40)), "", "a", "x" * 23, "y" * 24, "\u00e9\u4e16",
    "z" * 300, (), (1,), (1, (2, "x")), tuple(range(30)), ("lora", "name", "/p"),
    (("mm", "abc", -3), ("cache_salt", "s")),
]


def extra_keys_pool(rng: random.Random) -> list[Any]:
    return [
        None,
        (("lora", "sql-adapter", "/loras/sql"),),
        (("cache_salt", "tenant-7"),),
        (("mm", "f00dfeed" * 8, 0),),
        (("mm", "img", -5), ("mm", "img2", 3)),
        (("lora", "a", "b"), ("mm", "x", 2), ("cache_salt", "salt")),
        (("prompt_embeds", hashlib.sha256(b"embeds").digest()),),
        ("plain string", 7, -7, 2**40, -(2**40), 2**65, b"raw", None, True),
        (rng.randrange(-(2**70), 2**70),),
    ]


def gen_tokens(rng: random.Random, n: int) -> list[int]:
    pick = rng.random()
    if pick < 0.3:
        return [rng.randrange(0, 24) for _ in range(n)]
    if pick < 0.6:
        return [rng.randrange(0, 200_000) for _ in range(n)]
    return [rng.choice([0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1]) for _ in range(n)]


def generate(ns: dict) -> dict:
    rng = random.Random(20260430)
    sha256_cbor = ns["sha256_cbor"]
    out: dict[str, Any] = {
        "source": "vllm==0.33.0 wheel: vllm/utils/hashing.py, vllm/v1/core/kv_cache_utils.py, "
        "vllm/multimodal/utils.py; generated by kvbm-testkit/scripts/vllm_hash_vectors.py",
        "cbor2_version": getattr(cbor2, "__version__", "unknown"),
    }

    out["cbor"] = [
        {"value": tag(v), "hex": cbor2.dumps(v, canonical=True).hex()} for v in CBOR_VALUES
    ]

    out["none_hash"] = [
        {"seed": seed, "hash": with_seed(ns, seed).hex()} for seed in SEEDS
    ]
    # Sanity: the default seed is the fixed string, and NONE_HASH is sha256_cbor(seed).
    assert with_seed(ns, None) == sha256_cbor("vllm-none-hash")

    blocks = []
    pool = extra_keys_pool(rng)
    for i in range(60):
        seed = SEEDS[i % len(SEEDS)]
        none_hash = with_seed(ns, seed)
        n = rng.choice([1, 2, 4, 16, 16, 32, 64, 128])
        tokens = gen_tokens(rng, n)
        parent = None if i % 3 == 0 else hashlib.sha256(bytes([i])).digest()
        extra = pool[i % len(pool)]
        h = ns["hash_block_tokens"](sha256_cbor, parent, tokens, extra)
        blocks.append(
            {
                "seed": seed,
                "none_hash": none_hash.hex(),
                "parent": None if parent is None else parent.hex(),
                "tokens": tokens,
                "extra_keys": tag(extra),
                "hash": h.hex(),
            }
        )
    out["blocks"] = blocks

    sequences = []
    for i in range(40):
        seed = SEEDS[i % len(SEEDS)]
        with_seed(ns, seed)
        page = rng.choice([1, 2, 4, 8, 16, 32])
        n = rng.randrange(0, page * 6 + 3)
        tokens = gen_tokens(rng, n)
        lora = ("lora-%d" % i, "/adapters/%d" % i) if i % 4 == 1 else None
        cache_salt = ["", "salt-%d" % i, None][i % 3]
        mm = []
        if i % 2 == 0 and n > 0:
            pos = rng.randrange(0, max(1, n // 2))
            while pos < n and len(mm) < 4:
                length = rng.randrange(1, page * 2 + 2)
                mm.append(("img-%d-%d" % (i, len(mm)), pos, length))
                pos += length + rng.randrange(0, page + 1)
        req = _Request(tokens, mm, lora, cache_salt)
        hasher = ns["get_request_block_hasher"](page, sha256_cbor)
        # vLLM hashes incrementally as tokens arrive; do it in two steps to
        # exercise its resume path (curr_mm_idx recomputation).
        split = rng.randrange(0, n + 1)
        req.num_tokens = split
        req.block_hashes.extend(hasher(req))
        req.num_tokens = n
        req.block_hashes.extend(hasher(req))
        sequences.append(
            {
                "seed": seed,
                "page_size": page,
                "tokens": tokens,
                "lora": list(lora) if lora else None,
                "cache_salt": cache_salt,
                "mm": [list(m) for m in mm],
                "hashes": [h.hex() for h in req.block_hashes],
            }
        )
    out["sequences"] = sequences
    with_seed(ns, None)
    return out


def bench(ns: dict) -> None:
    sha256_cbor = ns["sha256_cbor"]
    with_seed(ns, None)
    rng = random.Random(1)
    parent = hashlib.sha256(b"p").digest()
    for page in (16, 512):
        tokens = [rng.randrange(0, 150_000) for _ in range(page)]
        runs = []
        for _ in range(7):
            n = 20_000 if page == 16 else 2_000
            t = timeit.timeit(
                lambda: ns["hash_block_tokens"](sha256_cbor, parent, tokens, None), number=n
            )
            runs.append(t / n * 1e9)
        runs.sort()
        print(
            f"vLLM hash_block_tokens(sha256_cbor) page {page}: median {runs[3]:.0f} ns/block "
            f"(min {runs[0]:.0f}, max {runs[-1]:.0f}) over 7 runs"
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", required=True, help="path (or glob) of the vllm wheel")
    ap.add_argument("--out", help="where to write the JSON vectors")
    ap.add_argument("--bench", action="store_true", help="time vLLM's block hashing")
    args = ap.parse_args()
    wheels = glob.glob(args.wheel)
    if len(wheels) != 1:
        raise SystemExit(f"expected one wheel for {args.wheel!r}, found {wheels}")
    saved_seed = os.environ.get("PYTHONHASHSEED")
    with tempfile.TemporaryDirectory() as tmp:
        ns = load_vllm(wheels[0], tmp)
        if args.out:
            data = generate(ns)
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(data, f, indent=1, ensure_ascii=False)
                f.write("\n")
            print(f"wrote {args.out}: {len(data['cbor'])} cbor, {len(data['none_hash'])} "
                  f"none_hash, {len(data['blocks'])} blocks, {len(data['sequences'])} sequences")
        if args.bench:
            bench(ns)
    if saved_seed is not None:
        os.environ["PYTHONHASHSEED"] = saved_seed
    return 0


if __name__ == "__main__":
    sys.exit(main())

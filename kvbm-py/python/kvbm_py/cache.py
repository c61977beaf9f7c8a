"""Lists or verifies kvbm's kept G3 directories.

usage: python -m kvbm_py.cache [--verify] DIR...

Each DIR is a rank's kept G3 directory, or a ``disk_cache_dir`` holding
several. Prints each one's identity, blocks, bytes and damaged records;
``--verify`` reads every block of a directory no engine has open and
checks it against its checksum. Exits 1 when anything is damaged.
"""

from __future__ import annotations

import argparse
import os
import sys

from kvbm_py._kvbm import KvbmError, inspect_g3


def _stores(path: str) -> list[str]:
    if os.path.isfile(os.path.join(path, "identity")):
        return [path]
    try:
        names = sorted(os.listdir(path))
    except OSError as e:
        raise SystemExit(f"kvbm: {path}: {e}") from None
    return [os.path.join(path, n) for n in names if os.path.isfile(os.path.join(path, n, "identity"))]


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    size = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvbm_py.cache", description=__doc__.splitlines()[0])
    parser.add_argument("--verify", action="store_true", help="read every block and check its checksum")
    parser.add_argument("dirs", nargs="+", metavar="DIR")
    args = parser.parse_args(argv)
    damaged = False
    for path in [s for d in args.dirs for s in _stores(d)]:
        try:
            seen = inspect_g3(path, args.verify)
        except KvbmError as e:
            print(f"{path}: cannot be read: {e}")
            damaged = True
            continue
        print(f"{path}{'  (in use)' if seen['in_use'] else ''}")
        for line in seen["identity"].splitlines():
            print(f"  {line}")
        print(
            f"  blocks {seen['blocks']} of {seen['slots']}, {_size(seen['block_bytes'])} "
            f"({_size(seen['disk_bytes'])} on disk), damaged records {seen['bad_records']}"
        )
        if seen["verified"]:
            print(
                f"  verified: {len(seen['bad_blocks'])} blocks fail their checksum"
                + (f" (slots {seen['bad_blocks'][:20]})" if seen["bad_blocks"] else "")
            )
        elif args.verify:
            print("  not verified: an engine has it open")
        damaged |= seen["bad_records"] > 0 or bool(seen["bad_blocks"])
    return 1 if damaged else 0


if __name__ == "__main__":
    sys.exit(main())

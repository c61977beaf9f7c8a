"""The files an engine instance keeps in the temporary directory, and their
clean-up.

Each instance names its files after a digest of its engine id:
``kvbm-<digest>.sock`` (the leader's IPC endpoint, when no endpoint is
configured), ``kvbm-<digest>.secret`` (the instance secret) and the secret's
temporary ``kvbm-<digest>.tmp-<pid>`` while it is published. A process
killed before its shutdown leaves them behind.

Every process of an instance holds a shared ``flock`` on
``kvbm-<digest>.lock`` from before it creates any of those files until it
exits. A file set whose lock nobody holds belongs to no live instance: the
next start of any instance removes it, and the last process of an instance
to shut down removes its own. A live instance's files are never touched: a
lock that a process holds refuses the exclusive lock the clean-up takes.
(Files of a version of kvbm that took no lock count as left behind.)
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import tempfile

log = logging.getLogger("vllm.kvbm_py")

#: What an instance's files are called: digest, then what follows it.
_NAME = re.compile(r"^kvbm-([0-9a-f]{16})\.(sock|secret|lock|tmp-\d+)$")


def _path(directory: str, digest: str, suffix: str) -> str:
    return os.path.join(directory, f"kvbm-{digest}.{suffix}")


class InstanceLock:
    """This process's shared hold on its instance's lock file."""

    def __init__(self, digest: str, directory: str | None = None) -> None:
        self.digest = digest
        self.directory = directory or tempfile.gettempdir()
        self.path = _path(self.directory, digest, "lock")
        self._fd: int | None = None
        # Reopen until the file locked is the one at the path: a clean-up
        # may unlink it between the open and the lock.
        for _ in range(100):
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                same = os.stat(self.path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fd = fd
                return
            os.close(fd)
        raise OSError(f"kvbm: could not lock {self.path}")

    def release(self) -> None:
        """Lets go; if no other process of the instance holds the lock any
        more, removes the instance's files."""
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # another process of the instance still runs
            return
        try:
            _remove_set(self.directory, self.digest)
        finally:
            os.close(fd)


def _remove_set(directory: str, digest: str) -> list[str]:
    """Removes an instance's files (the caller holds its lock exclusively)."""
    removed = []
    for name in os.listdir(directory):
        m = _NAME.match(name)
        if m and m.group(1) == digest:
            try:
                os.remove(os.path.join(directory, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def sweep(directory: str | None = None) -> list[str]:
    """Removes the files of instances no process holds the lock of; returns
    the names removed. Files of a live instance stay."""
    directory = directory or tempfile.gettempdir()
    try:
        names = os.listdir(directory)
    except OSError:
        return []
    digests = {m.group(1) for m in map(_NAME.match, names) if m}
    removed: list[str] = []
    for digest in sorted(digests):
        lock = _path(directory, digest, "lock")
        try:
            # Created when missing: a process of the instance starting now
            # then waits for this lock, and finds it unlinked afterwards.
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)  # a live instance
            continue
        try:
            removed += _remove_set(directory, digest)
        finally:
            os.close(fd)
    if removed:
        log.info("kvbm: removed %d file(s) left by stopped instances in %s", len(removed), directory)
    return removed

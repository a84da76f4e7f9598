"""One owner per run dir: a POSIX lock on RUN_DIR/node.lock, with the owner's pid written into it.

The kernel drops the lock when its process dies (even by SIGKILL), so a stale lock file never blocks a
restart. `lockf` (POSIX record locks) rather than `flock`: record locks are not inherited by forked
children, so the swarm's DHT process, forked at start-up, never keeps a dead node's run dir locked.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_FILE = "node.lock"


class RunDirBusy(RuntimeError):
    """Another live process owns the run dir."""


class RunDirLock:
    def __init__(self, run_dir: Path):
        self.path = Path(run_dir) / LOCK_FILE

    def acquire(self) -> None:
        """Take the lock for this process's lifetime, or raise RunDirBusy naming the owner's pid."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirBusy(
                f"run dir {self.path.parent} is in use by pid {owner} (lock {self.path}); "
                "stop that node first or choose another --run-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)  # fd stays open: the process's exit drops the lock

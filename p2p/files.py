"""Files that readers and crashes never see half-written: temp file in the same directory, fsync, rename."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Make a rename or a new name in directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomically(path: Path, text: str) -> None:
    """Write `text` to `path` so a reader or a crash sees the old file or the new one, never a mix: a
    private (0600) temp file beside it, fsync, rename over `path`, fsync of the directory. Creates the
    parent directory; the temp file is removed if anything fails."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def unused_name(path: Path) -> Path:
    """`path` if nothing is there, else the first free `path.1`, `path.2`, ...: a copy set aside twice keeps both."""
    n, free = 0, path
    while free.exists():
        n += 1
        free = path.with_name(f"{path.name}.{n}")
    return free

"""Run-dir logging: one JSON line per round in metrics.jsonl, readable log lines in node.log."""

from __future__ import annotations

import errno
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

METRICS_FILE = "metrics.jsonl"
LOG_FILE = "node.log"
TRACE_LOGGER = "sapo.trace"  # tracebacks of failures the console tells in one line: node.log only


def read_records(path: str | Path, partial_ok: bool = False) -> list[dict[str, Any]]:
    """A metrics.jsonl's records in file order, blank lines skipped: the one reader of the node's JSONL files
    that scripts and tests share. A line that is not a JSON object raises ValueError naming the file and the
    line; with `partial_ok` (a live file, which a node appends to while this reads) a last line cut short is
    left out instead."""
    lines = Path(path).read_bytes().splitlines()
    out = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rec = orjson.loads(line)
        except orjson.JSONDecodeError as exc:
            if partial_ok and number == len(lines):
                break
            raise ValueError(f"{path}: line {number} is not JSON ({exc})") from exc
        if not isinstance(rec, dict):
            raise ValueError(f"{path}: line {number} is not a JSON object")
        out.append(rec)
    return out


class ConsoleHandler(logging.StreamHandler):
    """stderr logging that survives its reader: when the pipe or terminal is gone (EPIPE, EIO, closed
    file), it stops writing there, points fds 1 and 2 at /dev/null (so no later print or the exit-time
    flush fails) and calls `on_lost` once. node.log keeps every line either way."""

    LOST = (errno.EPIPE, errno.EIO, errno.ECONNRESET, errno.EBADF)

    def __init__(self, stream, on_lost: Callable[[], None] | None = None):
        super().__init__(stream)
        self.on_lost = on_lost
        self.lost = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.lost:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        closed = isinstance(exc, ValueError) and "closed file" in str(exc)  # io's "I/O operation on closed file"
        if not (isinstance(exc, OSError) and exc.errno in self.LOST or closed):
            super().handleError(record)
            return
        self.lost = True
        silence_std_streams()
        if self.on_lost is not None:
            self.on_lost()


class NodeLogHandler(logging.FileHandler):
    """node.log that a full disk (or a failing one) cannot turn into a traceback on the console for every line:
    the first write that fails says so once on stderr, and the file is left alone from then on, even once space
    is freed (the console goes on with its own lines: not the debug-level tracebacks that only node.log gets).
    Errors that are not the file's (a malformed record) are logging's usual report."""

    def __init__(self, path: Path):
        super().__init__(path, encoding="utf-8")
        self.lost: OSError | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if self.lost is None:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            super().handleError(record)
            return
        self.lost = exc
        stream, self.stream = self.stream, None
        try:
            if stream is not None:
                stream.close()  # its buffer cannot be flushed either: closed now, not at exit with another error
        except (OSError, ValueError):
            pass
        try:
            why = exc.strerror or os.strerror(exc.errno or 0)
            sys.stderr.write(f"sapo-node: {self.baseFilename} cannot be written ({why}): the console goes on alone\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass


def silence_std_streams() -> None:
    """Point fds 1 and 2 at /dev/null: writes to a closed pipe or a hung-up terminal then go nowhere."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            os.dup2(devnull, fd)
        except OSError:
            pass
    os.close(devnull)


def setup_logging(
    run_dir: Path, level: str = "INFO", name: str = "", on_console_lost: Callable[[], None] | None = None
) -> None:
    """Console + RUN_DIR/node.log, so nothing a node says is lost when the terminal goes away.
    `on_console_lost` is called once (from any thread) if stderr's reader goes away."""
    run_dir.mkdir(parents=True, exist_ok=True)
    label = name.replace("%", "%%") + " " if name else ""  # a name is text, never a format field
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s {label}%(name)s: %(message)s")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = NodeLogHandler(run_dir / LOG_FILE)
    console = ConsoleHandler(sys.stderr, on_console_lost)
    console.setLevel(level.upper())  # TRACE_LOGGER's debug lines pass the root's level, not the console's
    for handler in (file_handler, console):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger(TRACE_LOGGER).setLevel(logging.DEBUG)
    for noisy in ("hivemind", "httpx", "urllib3", "transformers", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def log_traceback(message: str) -> None:
    """The exception being handled, traceback and all, into node.log at debug level (whatever --log-level
    says); the console states the failure in one line elsewhere."""
    logging.getLogger(TRACE_LOGGER).debug(message, exc_info=True)


class MetricsWriter:
    """Appends one JSON object per round; flushed per line so a killed node keeps every finished round."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / METRICS_FILE

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "ab") as f:
            f.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            f.flush()

    def last(self) -> dict[str, Any] | None:
        """The newest whole record (on resume, after truncate_after: the last completed round's)."""
        lines = self.path.read_bytes().splitlines() if self.path.exists() else []
        try:
            rec = orjson.loads(lines[-1]) if lines else None
        except orjson.JSONDecodeError:
            return None
        return rec if isinstance(rec, dict) else None

    def replace_last(self, record: dict[str, Any]) -> None:
        """The newest record, completed later (an evaluation a stop skipped); written atomically."""
        lines = self.path.read_bytes().splitlines()[:-1]
        lines.append(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY))
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in lines))
        tmp.replace(self.path)

    def truncate_after(self, last_round: int) -> int:
        """On resume: rounds after the checkpoint will run again. Their old lines move to
        metrics.orphaned.jsonl (kept, never deleted) so metrics.jsonl has each round once."""
        if not self.path.exists():
            return 0
        keep: list[bytes] = []
        orphaned: list[bytes] = []
        for line in self.path.read_bytes().splitlines():
            try:
                rec = orjson.loads(line)
                (keep if isinstance(rec, dict) and int(rec.get("round", -1)) <= last_round else orphaned).append(line)
            except (orjson.JSONDecodeError, TypeError, ValueError):
                orphaned.append(line)  # a line cut by a kill (or edited into no record): keep it aside
        if orphaned:
            with open(self.path.with_name("metrics.orphaned.jsonl"), "ab") as f:
                f.write(b"\n".join(orphaned) + b"\n")
        tmp = self.path.with_suffix(".tmp")
        tmp.write_bytes(b"".join(line + b"\n" for line in keep))
        tmp.replace(self.path)
        return len(orphaned)


def peak_memory_mb(device) -> float:
    import resource

    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB

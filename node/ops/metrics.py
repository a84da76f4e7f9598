"""Run-dir logging: one JSON line per round in metrics.jsonl, readable log lines in node.log."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

import orjson

METRICS_FILE = "metrics.jsonl"
LOG_FILE = "node.log"


def setup_logging(run_dir: Path, level: str = "INFO", name: str = "") -> None:
    """Console + RUN_DIR/node.log, so nothing a node says is lost when the terminal goes away."""
    run_dir.mkdir(parents=True, exist_ok=True)
    fmt = logging.Formatter(f"%(asctime)s %(levelname)s {name + ' ' if name else ''}%(name)s: %(message)s")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    file_handler = logging.FileHandler(run_dir / LOG_FILE, encoding="utf-8")
    console = logging.StreamHandler(sys.stderr)
    for handler in (file_handler, console):
        handler.setFormatter(fmt)
        root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in ("hivemind", "httpx", "urllib3", "transformers", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


class MetricsWriter:
    """Appends one JSON object per round; flushed per line so a killed node keeps every finished round."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / METRICS_FILE

    def write(self, record: dict[str, Any]) -> None:
        with open(self.path, "ab") as f:
            f.write(orjson.dumps(record, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n")
            f.flush()

    def truncate_after(self, last_round: int) -> int:
        """On resume: rounds after the checkpoint will run again. Their old lines move to
        metrics.orphaned.jsonl (kept, never deleted) so metrics.jsonl has each round once."""
        if not self.path.exists():
            return 0
        keep, orphaned = [], []
        for line in self.path.read_bytes().splitlines():
            try:
                rec = orjson.loads(line)
                (keep if int(rec.get("round", -1)) <= last_round else orphaned).append(line)
            except (orjson.JSONDecodeError, TypeError, ValueError):
                orphaned.append(line)  # a line cut by a kill: keep it aside
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

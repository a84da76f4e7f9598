"""Shared test setup: never touch a model hub; helpers to run the real CLI."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parents[1]


def node_env(**extra: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", SAPO_THREADS="1")
    env.update(extra)
    return env


def live_metrics(run_dir: Path) -> list[dict]:
    """Round records of a run that may still be writing: no file yet -> [], a half-written line skipped."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(orjson.loads(line))
        except orjson.JSONDecodeError:
            pass  # a line being written right now
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def newest_checkpoint(run_dir: Path) -> int | None:
    """Round of the newest complete checkpoint directory in a run dir (None if there is none)."""
    rounds = [int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("round-*") if p.is_dir()]
    return max(rounds, default=None)


def run_node(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node.cli", *args], cwd=REPO, env=node_env(**env),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def tiny_args():
    """A fast solo configuration on the tiny random model."""
    return ["--model", "tiny-random", "--tasks", "smoke", "--generations", "4", "--num-local", "2",
            "--max-new-tokens", "8", "--seed", "3"]

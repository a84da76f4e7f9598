"""Shared test setup: never touch a model hub; helpers to run the real CLI."""

import os
import subprocess
import sys
from pathlib import Path

import orjson
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Nodes and bootstrap peers started by tests mint their keys at a low proof-of-work difficulty (seconds
# at the default on a shared CI core); tests that check the proof of work set their own.
os.environ.setdefault("SAPO_POW_DIFFICULTY", "8")

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


def run_node(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "node.cli", *args], cwd=REPO, env=node_env(**env),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def tiny_args():
    """A fast solo configuration on the tiny random model."""
    return ["--model", "tiny-random", "--tasks", "smoke", "--generations", "4", "--num-local", "2",
            "--max-new-tokens", "8", "--seed", "3"]

"""Real swarms on this machine, for the benchmarks and the suite: the bootstrap peer and `sapo-node`
processes, each in its own session (so its DHT process and p2pd go with it), output to a file.

tests/conftest.py uses the same helpers and starts the processes from its preloaded interpreter (`SPAWN`,
tests/forkserver.py); a benchmark starts fresh interpreters.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node.ops.metrics import read_records
from p2p.identity import KEY_FILENAME, Identity

REPO = Path(__file__).resolve().parents[2]
# how a Proc starts `python ARGS` instead of a fresh interpreter: (args, cwd, env, output file) -> a
# Popen-like process, or None where it cannot (tests/conftest.py sets it)
SPAWN: Callable[[list[str], Path, dict, Path], Any] | None = None
# a node run that does not test the evaluation skips it: two evaluations (after round 0 and the last round)
# would cost more than a short run's rounds; a run that wants one passes --eval-every again (the last flag wins)
NO_EVAL = ["--eval-every", "0"]
LOOPBACK = "/ip4/127.0.0.1/tcp/0"
MANY_ROUNDS = "100000"  # never reached: the caller stops peers with SIGTERM
TINY = [
    "--tasks",
    "smoke",
    "--num-local",
    "2",
    "--num-external",
    "4",
    "--generations",
    "4",
    "--max-new-tokens",
    "8",
    "--rounds",
    MANY_ROUNDS,
    *NO_EVAL,
]


def as_in_the_suite() -> None:
    """Nodes a benchmark starts run as in the suite unless the environment says otherwise: offline, on the
    paper's defaults (not the CPU recipe), their keys minted at a low proof of work."""
    for name, value in (
        ("HF_HUB_OFFLINE", "1"),
        ("TRANSFORMERS_OFFLINE", "1"),
        ("TOKENIZERS_PARALLELISM", "false"),
        ("SAPO_RECIPE", "none"),
        ("SAPO_POW_DIFFICULTY", "8"),
    ):
        os.environ.setdefault(name, value)


def node_env(**extra: str) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1", SAPO_THREADS="1")
    env.update(extra)
    return env


def live_metrics(run_dir: Path) -> list[dict]:
    """Round records of a run that may still be writing: no file yet -> [], a half-written line skipped."""
    path = run_dir / "metrics.jsonl"
    return read_records(path, partial_ok=True) if path.exists() else []


class Proc:
    """A subprocess in its own session (so its DHT process and p2pd can be killed with it); output to a file."""

    def __init__(self, args: list[str], out: Path, **env: str):
        self.out = out
        self.dumps_stacks = args[:2] == ["-m", "node.cli"]  # sapo-node registers SIGUSR1 (faulthandler)
        self._fh = open(out, "ab")
        self.p: Any = SPAWN(args, REPO, node_env(**env), out) if SPAWN is not None else None
        if self.p is None:
            self.p = subprocess.Popen(
                [sys.executable, *args],
                cwd=REPO,
                env=node_env(**env),
                stdout=self._fh,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.p.poll() is None

    def text(self) -> str:
        return self.out.read_text(errors="replace")

    def stop(self, timeout: float = 60) -> int:
        """SIGTERM, wait; returns the exit code."""
        if self.alive():
            self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(timeout)
        finally:
            self.cleanup()

    def session_alive(self) -> bool:
        """Is any process of this session (the node, its DHT process, p2pd) still there?"""
        try:
            os.killpg(self.p.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def cleanup(self) -> None:
        if self.alive():
            self.p.kill()
            self.p.wait(30)
        try:  # whatever is left of the session (an orphaned DHT process or p2pd)
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._fh.close()


def start_bootstrap(tmp: Path, swarm: str, host: str = LOOPBACK, announce: str = "") -> tuple[Proc, list[str]]:
    """The bootstrap peer and its multiaddrs; with `announce`, the address peers dial instead of `host` (a
    relay's: scripts/bench/relay.py)."""
    maddrs_file = tmp / "boot-maddrs.txt"
    proc = Proc(
        [
            "-m",
            "bootstrap.main",
            "--host-maddrs",
            host,
            *(["--announce-maddrs", announce] if announce else []),
            "--identity-dir",
            str(tmp / "boot"),
            "--swarm",
            swarm,
            "--maddrs-file",
            str(maddrs_file),
            "--log-interval",
            "5",
        ],
        tmp / "boot.out",
    )
    deadline = time.monotonic() + 60
    while not maddrs_file.exists():
        if not proc.alive():
            raise AssertionError(f"bootstrap exited early:\n{proc.text()}")
        if time.monotonic() > deadline:
            proc.cleanup()
            raise AssertionError("bootstrap maddrs file never appeared")
        time.sleep(0.1)
    return proc, maddrs_file.read_text().split()


def start_node(
    run_dir: Path,
    peers: list[str],
    swarm: str,
    *extra: str,
    model: str = "tiny-random",
    seed: int = 0,
    host: str = LOOPBACK,
    announce: str = "",
) -> Proc:
    """A `sapo-node` on the tiny settings; with `announce`, the address other peers dial (a relay's)."""
    args = [
        "-m",
        "node.cli",
        "--model",
        model,
        *TINY,
        "--seed",
        str(seed),
        "--swarm",
        swarm,
        "--run-dir",
        str(run_dir),
        "--host-maddrs",
        host,
        *(["--announce-maddrs", announce] if announce else []),
        "--peers",
        *peers,
        *extra,
    ]
    return Proc(args, run_dir.parent / f"{run_dir.name}.out")


def prefix_of(run_dir: Path, timeout: float = 60) -> str:
    """The 16-hex-char key prefix metrics use in external_sources (identity file appears at startup)."""
    path = run_dir / KEY_FILENAME
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)
    time.sleep(0.2)  # written atomically? be safe against a half-written file
    return Identity.load_or_create(path, create=False).public_key_hex[:16]


def stop_all(procs: list[Proc]) -> list[int]:
    codes = []
    for p in procs:
        if p.alive():
            p.p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            codes.append(p.p.wait(60))
        finally:
            p.cleanup()
    return codes

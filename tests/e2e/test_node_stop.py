"""Stopping a real `sapo-node` (tiny random model, silo): real signals, a real closed pipe, a real lock.

A stop abandons the round in progress at a safe point, checkpoints the last completed round and exits 0;
the abandoned round is redone on resume exactly as if it had never started.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from conftest import NO_EVAL, REPO, free_port, live_metrics, newest_checkpoint, node_env, run_node

pytestmark = pytest.mark.timeout(600)

# Rounds of a second or two, most of it generation (128 tokens: long enough to be signalled mid-way),
# and a GRPO update in every round.
ARGS = [
    "--model",
    "tiny-random",
    "--tasks",
    "smoke",
    "--generations",
    "6",
    "--num-local",
    "3",
    "--max-new-tokens",
    "128",
    "--seed",
    "4",
    "--checkpoint-every",
    "10",
    *NO_EVAL,
]
HANG_GUARD_S = 120  # not a speed target (scripts/bench/stop.py measures that): only "it did not hang"


def start(run_dir: Path, *extra: str, **popen) -> subprocess.Popen:
    popen.setdefault("stdout", open(run_dir.parent / f"{run_dir.name}.out", "ab"))
    popen.setdefault("stderr", subprocess.STDOUT)
    return subprocess.Popen(
        [sys.executable, "-m", "node.cli", *ARGS, "--run-dir", str(run_dir), *extra], cwd=REPO, env=node_env(), **popen
    )


def wait_until(pred, proc: subprocess.Popen, what: str, timeout: float = 240, poll: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert proc.poll() is None, f"node exited ({proc.returncode}) while waiting for {what}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(poll)


def status(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as resp:
            return json.loads(resp.read())
    except OSError:  # not serving yet (model loading)
        return None


def in_phase(port: int, round_: int, phase: str):
    def check() -> bool:
        snap = status(port)
        return snap is not None and snap["round"] == round_ and snap["phase"] == phase

    return check


def stop_in_round_2(run_dir: Path, *signals: signal.Signals) -> tuple[int, str]:
    """Start a node, send `signals` (100 ms apart at most) while round 2 is generating; (exit code, node.log)."""
    port = free_port()
    proc = start(run_dir, "--rounds", "4", "--status-port", str(port))
    try:
        wait_until(in_phase(port, 2, "generate"), proc, "round 2 generating")
        for i, sig in enumerate(signals):
            if i:
                time.sleep(0.05)  # the repeat is the behaviour under test: two signals within 100 ms
            proc.send_signal(sig)
        rc = proc.wait(HANG_GUARD_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, (run_dir / "node.log").read_text()


def compared(records: list[dict]) -> list[dict]:
    """What must repeat exactly (tasks, generations, rewards, selection) and the loss (float tolerance)."""
    keys = (
        "round",
        "reward_mean",
        "reward_max",
        "tokens_generated",
        "num_local",
        "dropped_zero_adv_local",
        "optimizer_steps",
    )
    return [{k: r[k] for k in keys} | {"loss": pytest.approx(r["loss"], rel=1e-5, abs=1e-9)} for r in records]


@pytest.mark.slow
def test_double_sigint_mid_round_checkpoints_last_round_and_resume_matches_uninterrupted(tmp_path):
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    assert run_node(*ARGS, "--rounds", "4", "--run-dir", str(straight)).returncode == 0

    rc, log = stop_in_round_2(stopped, signal.SIGINT, signal.SIGINT)
    assert rc == 0, log[-3000:]
    assert "round 2 abandoned at a safe point" in log
    assert "aborting" not in log  # the repeat was not an abort (the rule itself: tests/test_cli_signals.py)
    assert [r["round"] for r in live_metrics(stopped)] == [0, 1]  # no trace of the abandoned round
    assert newest_checkpoint(stopped) == 1  # --checkpoint-every 10: written by the stop itself

    resumed = run_node(*ARGS, "--rounds", "4", "--run-dir", str(stopped), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from round-000001: next round 2" in resumed.stderr
    assert not (stopped / "metrics.orphaned.jsonl").exists()
    assert compared(live_metrics(stopped)) == compared(live_metrics(straight))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_sigterm_and_sighup_stop_the_same_way(tmp_path, sig):
    run_dir = tmp_path / "run"
    rc, log = stop_in_round_2(run_dir, sig)
    assert rc == 0, log[-3000:]
    assert f"{sig.name}: stopping at a safe point" in log and "round 2 abandoned" in log
    assert [r["round"] for r in live_metrics(run_dir)] == [0, 1]
    assert newest_checkpoint(run_dir) == 1


@pytest.mark.slow
def test_closed_console_pipe_is_a_graceful_stop(tmp_path):
    """`sapo-node ... 2>&1 | tee log`, then tee dies: the node must not crash nor lose a round."""
    run_dir = tmp_path / "run"
    reader = subprocess.Popen(["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL)
    proc = start(run_dir, "--rounds", "100000", stdout=reader.stdin, stderr=reader.stdin)
    reader.stdin.close()  # the node's end is the only writer left
    try:
        wait_until(lambda: len(live_metrics(run_dir)) >= 2, proc, "two rounds")
        reader.kill()
        reader.wait()
        rc = proc.wait(HANG_GUARD_S)
    finally:
        for p in (proc, reader):
            if p.poll() is None:
                p.kill()
                p.wait()
    log = (run_dir / "node.log").read_text()
    assert rc == 0, log[-3000:]
    assert "console closed: stopping at a safe point" in log
    rounds = [r["round"] for r in live_metrics(run_dir)]
    assert rounds == list(range(len(rounds))) and len(rounds) >= 2
    assert newest_checkpoint(run_dir) == rounds[-1]  # every completed round kept


@pytest.mark.slow
def test_second_node_on_a_run_dir_exits_2_naming_the_owner(tmp_path):
    run_dir = tmp_path / "run"
    first = start(run_dir, "--rounds", "100000")
    try:
        wait_until(lambda: len(live_metrics(run_dir)) >= 1, first, "the first node's first round")
        second = run_node(*ARGS, "--rounds", "3", "--run-dir", str(run_dir), "--resume")
        assert second.returncode == 2
        assert f"is in use by pid {first.pid}" in second.stderr and str(run_dir) in second.stderr
        assert len(second.stderr.strip().splitlines()) == 1 and "Traceback" not in second.stderr
        first.kill()  # SIGKILL: the lock file stays behind with a dead pid in it ...
        first.wait()
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert (run_dir / "node.lock").read_text().strip() == str(first.pid)
    # ... and does not block the next owner (the kernel dropped the lock with the process)
    again = run_node(*ARGS, "--rounds", "1", "--run-dir", str(run_dir), "--resume")
    assert again.returncode == 0, again.stderr[-3000:]

"""scripts/local_swarm.sh as a user runs it: in a terminal (a real pty) stopped with Ctrl-C, and piped
through `tee` (which the same Ctrl-C kills). Two peers of the tiny model on a real DHT over loopback."""

from __future__ import annotations

import os
import pty
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from conftest import REPO, live_metrics, newest_checkpoint, node_env

pytestmark = pytest.mark.timeout(600)

PEERS = 2
NODE_ARGS = ["--max-new-tokens", "16", "--checkpoint-every", "1000"]  # checkpoints come from the stop only


class Terminal:
    """Runs a shell command line as the session leader of a new pty, as a terminal would; drains its output."""

    def __init__(self, command: str, env: dict):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: bash in the pty's session, in the terminal's foreground process group
            os.chdir(REPO)
            # as a terminal's shell starts: a test run launched in the background (`cmd &` without job
            # control) inherits SIGINT/SIGQUIT ignored, and bash cannot trap a signal ignored on entry
            for sig in (signal.SIGINT, signal.SIGQUIT):
                signal.signal(sig, signal.SIG_DFL)
            os.execvpe("bash", ["bash", "-c", command], env)
        self.output = bytearray()
        self.reader = threading.Thread(target=self._drain, daemon=True)
        self.reader.start()

    def _drain(self) -> None:
        while True:
            try:
                chunk = os.read(self.fd, 4096)
            except OSError:  # EIO: every process holding the slave side has gone
                return
            if not chunk:
                return
            self.output += chunk

    def ctrl_c(self) -> None:
        os.write(self.fd, b"\x03")  # the line discipline sends SIGINT to the foreground process group

    def wait(self, timeout: float) -> int:
        deadline = time.monotonic() + timeout
        while True:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.reader.join(10)
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
            if time.monotonic() > deadline:
                os.kill(self.pid, 9)
                raise AssertionError(f"still running after {timeout}s:\n{self.text()[-3000:]}")
            time.sleep(0.1)

    def text(self) -> str:
        return self.output.decode(errors="replace")


def swarm_env(root: Path) -> dict:
    return node_env(
        SAPO_SKIP_SETUP="1",
        SAPO_VENV=sys.prefix,
        SAPO_PEERS=str(PEERS),
        SAPO_MODEL="tiny-random",
        SAPO_TASKS="smoke",
        SAPO_LOCAL_ROUNDS="100000",
        SAPO_RUN_ROOT=str(root),
        SAPO_GENERATIONS="4",
        SAPO_EVAL_EVERY="0",
        TERM="dumb",
    )  # no held-out evaluation: these tests are about stopping


def run_and_interrupt(tmp_path: Path, pipeline: str) -> tuple[int, Path, str]:
    """Start the script in a terminal (followed by `pipeline`), Ctrl-C once every peer has finished two
    rounds; returns (the script's exit code, swarm root, terminal output)."""
    root, rc_file = tmp_path / "swarm", tmp_path / "script.rc"
    script = f"bash scripts/local_swarm.sh {' '.join(NODE_ARGS)}; echo $? > {rc_file}"
    term = Terminal(f"{{ {script}; }}{pipeline}", swarm_env(root))
    dirs = [root / f"peer{i}" for i in range(PEERS)]
    try:
        deadline = time.monotonic() + 300
        while not all(len(live_metrics(d)) >= 2 for d in dirs):
            if os.waitpid(term.pid, os.WNOHANG)[0]:
                raise AssertionError(f"the script exited early:\n{term.text()[-3000:]}")
            assert time.monotonic() < deadline, f"peers never reached round 2:\n{term.text()[-3000:]}"
            time.sleep(0.2)
        term.ctrl_c()
        term.wait(240)  # the terminal's shell itself may die of the SIGINT (it is in the foreground group)
    finally:
        kill_leftovers([*(d / "node.lock" for d in dirs), root / "bootstrap" / "bootstrap.pid"])
    assert rc_file.exists(), f"the script did not finish:\n{term.text()[-3000:]}"
    return int(rc_file.read_text()), root, term.text()


def kill_leftovers(pid_files: list[Path]) -> None:
    """If the script failed: its peers and bootstrap run in sessions of their own, so end those sessions."""
    for path in pid_files:
        try:
            pid = int(path.read_text().split()[0])
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            if b"sapo-node" in cmdline or b"sapo-bootstrap" in cmdline:  # still ours, not a reused pid
                os.killpg(pid, signal.SIGKILL)
        except (OSError, ValueError, IndexError):  # no file, or the process is already gone
            pass


def assert_every_peer_kept_its_rounds(root: Path) -> None:
    for i in range(PEERS):
        d = root / f"peer{i}"
        rounds = [r["round"] for r in live_metrics(d)]
        log = (d / "node.log").read_text()
        assert rounds == list(range(len(rounds))) and len(rounds) >= 2, rounds
        assert newest_checkpoint(d) == rounds[-1], (d, rounds)  # the last completed round is on disk
        assert log.count("stopping at a safe point") == 1, log[-3000:]  # asked exactly once
        assert "aborting" not in log


@pytest.mark.slow
def test_ctrl_c_in_a_terminal_stops_every_peer_once_after_checkpointing(tmp_path):
    rc, root, out = run_and_interrupt(tmp_path, "")
    assert rc == 0, out[-3000:]
    assert_every_peer_kept_its_rounds(root)
    assert "stopped at round(s)" in out and "after a request (SIGINT)" in out, out[-3000:]
    assert "finished" not in out


@pytest.mark.slow
def test_ctrl_c_under_tee_also_stops_every_peer_cleanly(tmp_path):
    """Ctrl-C kills tee too: the script's stdout breaks, yet it waits for its peers and logs what happened."""
    rc, root, out = run_and_interrupt(tmp_path, f" | tee {tmp_path / 'swarm.out'}")
    assert rc == 0, out[-3000:]
    assert_every_peer_kept_its_rounds(root)
    summary = (root / "local_swarm.log").read_text()
    assert "stopped at round(s)" in summary and "finished" not in summary, summary

"""One owner per run dir: a live owner (another process) is named; a dead one's lock file is no obstacle."""

import subprocess
import sys

import pytest

from conftest import REPO
from node.ops.runlock import RunDirBusy, RunDirLock

OWNER = """
import sys
sys.path.insert(0, {repo!r})
from node.ops.runlock import RunDirLock
RunDirLock({run_dir!r}).acquire()
print("locked", flush=True)
sys.stdin.read()  # hold the lock until the test closes our stdin or kills us
"""


def test_busy_run_dir_names_the_owner_and_a_dead_owner_does_not_block(tmp_path):
    run_dir = tmp_path / "run"
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER.format(repo=str(REPO), run_dir=str(run_dir))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert owner.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirBusy, match=rf"run dir {run_dir} is in use by pid {owner.pid}"):
            RunDirLock(run_dir).acquire()
        owner.kill()  # SIGKILL: no cleanup; the lock file with its pid stays behind
        owner.wait()
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    assert (run_dir / "node.lock").read_text().strip() == str(owner.pid)
    lock = RunDirLock(run_dir)
    lock.acquire()
    assert (run_dir / "node.lock").read_text().strip() != str(owner.pid)


def test_a_fresh_start_refuses_a_run_dir_whose_checkpoints_outlived_its_metrics(tmp_path):
    """metrics.jsonl lost or deleted: the checkpoints still say a run is there; without --resume the node
    would overwrite them. An empty checkpoints/ (a start stopped before round 0 ended) is no run."""
    import subprocess
    import sys

    import torch

    from node.cli import run_evidence
    from node.ops.checkpoint import CheckpointStore

    run_dir = tmp_path / "run"
    assert run_evidence(run_dir) == ""
    store = CheckpointStore(run_dir)
    assert run_evidence(run_dir) == ""
    store.save(3, {"w": torch.zeros(1)}, {}, {})
    assert run_evidence(run_dir) == "checkpoints/round-000003"
    cmd = [sys.executable, "-m", "node.cli", "--run-dir", str(run_dir), "--rounds", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "already holds a run (checkpoints/round-000003); pass --resume" in done.stderr
    assert (store.dir / "round-000003" / "model.pt").exists()

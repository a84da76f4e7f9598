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

"""A real `sapo-node` (tiny random model, silo) whose disk fills up mid-run: a 64 MB tmpfs in a mount namespace
that the test creates (root; skipped with the reason elsewhere), filled from outside the node.

The node stops with one line that says the disk is full and what to do (no traceback, no `--- Logging error
---` for every line node.log cannot take), a start on the still-full disk says the same, no half-written
checkpoint holds the space, and once space is freed `--resume` goes on with every round in order.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, node_env

pytestmark = pytest.mark.timeout(600)

SCRIPT = r"""
set -u
mount -t tmpfs -o size=64m tmpfs "$MNT" || exit 97
run() {
  "$PY" -m node.cli --model tiny-random --tasks smoke --generations 4 --num-local 2 --max-new-tokens 32 \
    --seed 1 --checkpoint-every 1 --eval-every 0 --no-tensorboard --run-dir "$MNT/run" "$@"
}
run --rounds 100000 > "$OUT/first.txt" 2>&1 &
pid=$!
for _ in $(seq 1 1200); do
  [ "$(cat "$MNT/run/metrics.jsonl" 2>/dev/null | wc -l)" -ge 2 ] && break
  kill -0 "$pid" 2>/dev/null || break
  sleep 0.1
done
dd if=/dev/zero of="$MNT/filler" bs=1M count=128 2>/dev/null
wait "$pid"; echo $? > "$OUT/first.rc"
run --rounds 100000 --resume > "$OUT/full.txt" 2>&1; echo $? > "$OUT/full.rc"
ls -a "$MNT/run/checkpoints" > "$OUT/checkpoints.txt"
rm "$MNT/filler"
newest=$(ls "$MNT/run/checkpoints" | grep '^round-' | sort | tail -n 1)
run --rounds $((10#${newest#round-} + 3)) --resume > "$OUT/resumed.txt" 2>&1; echo $? > "$OUT/resumed.rc"
cp "$MNT/run/metrics.jsonl" "$OUT/"
"""


def _mount_namespaces_work(probe_dir) -> str | None:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return "a tmpfs in a mount namespace needs root and unshare (util-linux)"
    probe_dir.mkdir()
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {probe_dir}"], capture_output=True, text=True
    )
    return None if r.returncode == 0 else f"cannot mount a tmpfs in a mount namespace here: {r.stderr.strip()}"


@pytest.mark.slow
def test_a_full_disk_stops_the_node_in_one_line_and_resume_goes_on_once_freed(tmp_path):
    why = _mount_namespaces_work(tmp_path / "probe")
    if why:
        pytest.skip(why)
    mnt, out = tmp_path / "mnt", tmp_path / "out"
    mnt.mkdir()
    out.mkdir()
    env = node_env(MNT=str(mnt), OUT=str(out), PY=sys.executable, SAPO_RECIPE="none")
    done = subprocess.run(["unshare", "-m", "bash", "-c", SCRIPT], cwd=REPO, env=env, timeout=540)
    assert done.returncode == 0, done.returncode

    for run in ("first", "full"):  # stopped by the full disk mid-run; started on it
        console = (out / f"{run}.txt").read_text()
        assert (out / f"{run}.rc").read_text().strip() == "1", console[-3000:]
        assert "Traceback" not in console and "Logging error" not in console, console[-3000:]
        last = console.strip().splitlines()[-1]
        assert last.startswith("sapo-node: error: the disk holding ") and " is full: " in last, last
        assert last.endswith("free some space, then start again with --resume"), last
    kept = (out / "checkpoints.txt").read_text().split()
    assert not [name for name in kept if name.startswith(".tmp-")], kept  # no half-written copy holds the space
    newest = max(int(name.removeprefix("round-")) for name in kept if name.startswith("round-"))

    resumed = (out / "resumed.txt").read_text()
    assert (out / "resumed.rc").read_text().strip() == "0", resumed[-3000:]
    rounds = [int(line.split('"round":')[1].split(",")[0]) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rounds == list(range(newest + 3)), (newest, rounds)  # resumed to --rounds newest + 3, none twice


def test_what_counts_as_a_full_disk(tmp_path):
    """ENOSPC and EDQUOT, by their errno, naming the file where one is known; nothing else (the checkpoint store
    turns torch.save's errno-less failure on a full disk into ENOSPC: tests/ops/test_checkpoint_export.py)."""
    from node.cli import disk_full

    said = disk_full(OSError(errno.ENOSPC, "No space left on device", "/x/metrics.jsonl"), tmp_path)
    assert said == (
        "the disk holding /x/metrics.jsonl is full: No space left on device. Every checkpoint and metrics line "
        "written before is intact: free some space, then start again with --resume"
    )
    assert disk_full(OSError(errno.ENOSPC, "No space left on device"), tmp_path).startswith(
        f"the disk holding {tmp_path} is full"
    )
    assert "Disk quota exceeded" in disk_full(OSError(errno.EDQUOT, os.strerror(errno.EDQUOT)), tmp_path)
    assert disk_full(OSError(errno.EACCES, "Permission denied"), tmp_path) is None
    assert disk_full(RuntimeError("unexpected pos 64 vs 0"), tmp_path) is None

"""End to end: the real `sapo-node` CLI on a tiny random model with real reasoning-gym tasks."""

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, run_node
from helpers_learning import check_records
from node.ops.checkpoint import CheckpointStore
from node.ops.metrics import read_records

REQUIRED_FIELDS = {
    "round",
    "t_start",
    "t_end",
    "round_s",
    "phase_s",
    "swarm_io_s",
    "reward_mean",
    "reward_max",
    "num_local",
    "num_external",
    "dropped_zero_adv_local",
    "dropped_zero_adv_external",
    "loss",
    "clip_frac",
    "tokens_generated",
    "peak_mem_mb",
}


def read_rounds(run_dir):
    return read_records(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_resume_reproduces_an_uninterrupted_run(tmp_path, tiny_args):
    """Same seed: 2 rounds + resume for 2 more == 4 rounds straight (RNG, sampler, optimizer restored). On the
    way: every record has its fields, a second start on the run dir without --resume is refused, and the
    resume says where it picked up."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = [*tiny_args, "--checkpoint-every", "1"]
    assert run_node(*common, "--rounds", "4", "--run-dir", str(straight)).returncode == 0
    first = run_node(*common, "--rounds", "2", "--run-dir", str(split))
    assert first.returncode == 0, first.stderr[-2000:]
    records = read_rounds(split)
    assert [r["round"] for r in records] == [0, 1]
    check_records(records)
    for r in records:
        assert REQUIRED_FIELDS <= set(r), REQUIRED_FIELDS - set(r)
        assert {"generate", "score", "train", "publish", "fetch"} <= set(r["phase_s"])
        assert r["tokens_generated"] > 0
    assert (split / "node.log").read_text().count("round 1 |") == 1

    again = run_node(*common, "--rounds", "4", "--run-dir", str(split))
    assert again.returncode == 2 and "--resume" in again.stderr  # never clobbers an existing run

    resumed = run_node(*common, "--rounds", "4", "--run-dir", str(split), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from round-000001: next round 2" in resumed.stderr
    assert [r["round"] for r in read_rounds(split)] == [0, 1, 2, 3]
    keys = ("reward_mean", "tokens_generated", "loss", "num_local")
    a = [{k: r[k] for k in keys} for r in read_rounds(straight)]
    b = [{k: r[k] for k in keys} for r in read_rounds(split)]
    assert a == b


@pytest.mark.slow
def test_sigkill_never_leaves_an_unloadable_latest_checkpoint(tmp_path):
    """A child saves checkpoints in a tight loop; we SIGKILL it at several moments mid-write. The claim is
    about a store that holds a checkpoint, so each kill waits until the child reports its first complete
    one (on a loaded machine that can take longer than any fixed delay); the kills then land at various
    points of later writes, and whatever they hit, the newest loadable checkpoint is a completed one."""
    script = f"""
import sys, torch
sys.path.insert(0, {str(REPO)!r})
from node.ops.checkpoint import CheckpointStore
model = torch.nn.Linear(512, 512)
opt = torch.optim.Adam(model.parameters())
model(torch.randn(2, 512)).sum().backward(); opt.step()
store = CheckpointStore(sys.argv[1], keep=2)
r = 0
while True:
    store.save(r, model.state_dict(), opt.state_dict(), {{"next_round": r + 1, "blob": "x" * 200000}})
    print(f"saved {{r}}", flush=True)
    r += 1
"""
    for delay in (0.0, 0.05, 0.15, 0.3, 0.45):
        store_dir = tmp_path / f"after-{delay}"
        proc = subprocess.Popen([sys.executable, "-c", script, str(store_dir)], stdout=subprocess.PIPE, text=True)
        first = proc.stdout.readline().strip()  # blocks until a checkpoint of this child is complete
        assert first.startswith("saved "), first
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        saved = max(int(line.split()[1]) for line in [first, *proc.stdout.read().splitlines()] if line)
        proc.stdout.close()
        ckpt = CheckpointStore(store_dir, keep=2).load_latest()
        assert ckpt is not None and ckpt.state["next_round"] == ckpt.round + 1
        # every completed save survives; the one the kill interrupted may or may not have completed
        assert saved <= ckpt.round <= saved + 1, (saved, ckpt.round)


@pytest.mark.slow
def test_corrupt_latest_checkpoint_falls_back(tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    assert run_node(*tiny_args, "--rounds", "4", "--checkpoint-every", "2", "--run-dir", str(run_dir)).returncode == 0
    latest = run_dir / "checkpoints" / "round-000003"
    with open(latest / "model.pt", "r+b") as f:  # flip bytes in the middle: size unchanged, hash differs
        f.seek(200)
        f.write(b"\x00garbage\x00")
    resumed = run_node(*tiny_args, "--rounds", "5", "--run-dir", str(run_dir), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "skipping checkpoint round-000003" in resumed.stderr
    assert "resumed from round-000001: next round 2" in resumed.stderr
    rounds = [r["round"] for r in read_rounds(run_dir)]
    assert rounds == [0, 1, 2, 3, 4]
    orphaned = (run_dir / "metrics.orphaned.jsonl").read_text().splitlines()
    assert [json.loads(x)["round"] for x in orphaned] == [2, 3]  # nothing lost


@pytest.mark.parametrize(
    "args, flag",
    [
        (["--lr", "0"], "--lr"),
        (["--generations", "1"], "--generations"),
        (["--tasks", "no_such_dataset"], "--tasks"),
        (["--loss-type", "ppo"], "--loss-type"),
        (["--peers", "localhost:1234"], "--peers"),
        (["--peers", "/ip4/127.0.0.1/tcp/1"], "--peers: no peer id"),
        (["--host-maddrs", "/ip4/999.0.0.1/tcp/0"], "--host-maddrs: /ip4/999.0.0.1 is not an IPv4 address"),
        (["--swarm-start", "--announce-maddrs", "foo"], "--announce-maddrs: a multiaddr starts with '/'"),
        (["--require-peers"], "--require-peers needs --peers"),
    ],
)
def test_invalid_flags_exit_2_naming_the_flag(tmp_path, args, flag):
    result = run_node(*args, "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 2
    assert flag in result.stderr
    assert "Traceback" not in result.stderr


def test_model_that_cannot_load_gives_clear_error(tmp_path):
    result = run_node("--model", str(tmp_path / "missing.gguf"), "--rounds", "1", "--run-dir", str(tmp_path / "r"))
    assert result.returncode == 1
    assert "GGUF file not found" in result.stderr and "Traceback" not in result.stderr


def test_a_device_this_machine_lacks_is_one_clear_error(tmp_path):
    """--device cuda:N beyond the GPUs here (or on a CPU-only torch) names the flag instead of a traceback."""
    result = run_node(
        "--model", "tiny-random", "--device", "cuda:99", "--rounds", "1", "--run-dir", str(tmp_path / "r")
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert "--device" in result.stderr and "Traceback" not in result.stderr


def test_run_dir_entries_of_the_wrong_kind_are_one_clear_error(tmp_path):
    """A file where the run dir's checkpoints/ belongs, a directory where node.log does: one line, exit 1,
    nothing deleted; the traceback (if any) in node.log."""
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    (run_dir / "checkpoints").write_text("mine")
    result = run_node("--model", "tiny-random", "--rounds", "1", "--eval-every", "0", "--run-dir", str(run_dir))
    assert result.returncode == 1, result.stderr[-2000:]
    assert "cannot build the node: FileExistsError" in result.stderr and "Traceback" not in result.stderr
    assert (run_dir / "checkpoints").read_text() == "mine"
    other = tmp_path / "o"
    (other / "node.log").mkdir(parents=True)
    result = run_node("--model", "tiny-random", "--rounds", "1", "--run-dir", str(other))
    assert result.returncode == 1 and "cannot write the run dir's log" in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr


def test_a_run_dir_that_is_a_file_or_a_status_address_that_cannot_listen_is_one_line(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    result = run_node("--model", "tiny-random", "--rounds", "1", "--run-dir", str(afile))
    assert result.returncode == 2 and f"--run-dir {afile}: cannot hold a run there" in result.stderr, result.stderr
    assert afile.read_text() == "mine"
    result = run_node(
        "--model", "tiny-random", "--rounds", "1", "--eval-every", "0", "--status-port", "18080",
        "--status-host", "999.1.1.1", "--run-dir", str(tmp_path / "r"),
    )  # fmt: skip
    assert result.returncode == 1, result.stderr[-2000:]
    assert "StatusUnavailable: --status-host/--status-port 999.1.1.1:18080" in result.stderr
    assert "Traceback" not in result.stderr

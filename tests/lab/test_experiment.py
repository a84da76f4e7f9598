"""End to end: `sapo-experiment` runs a preset over the real DHT, stops on Ctrl-C, resumes, and reports."""

import json
import signal
import subprocess
import sys
import time

import pytest

from conftest import NO_EVAL, REPO, live_metrics, node_env, run_python
from helpers_learning import check_records
from node.lab.run_record import SIMD_FLAGS
from tbread import read_scalars

TINY = [
    "--model",
    "tiny-random",
    "--tasks",
    "smoke",
    "--generations",
    "4",
    "--max-new-tokens",
    "8",
    "--seeds",
    "0",
    "--peers",
    "2",
    "--threads",
    "1",
]


def experiment(*args: str) -> list[str]:
    return [sys.executable, "-m", "node.lab.experiment", *args]


def rounds_of(peer_dir) -> list[int]:
    return [r["round"] for r in live_metrics(peer_dir)]


def external_used(peer_dirs) -> int:
    for d in peer_dirs:
        check_records(live_metrics(d))
    return sum(r["num_external"] for d in peer_dirs for r in live_metrics(d))


@pytest.mark.slow
def test_preset_over_dht_resumes_after_ctrl_c(tmp_path):
    ROUNDS = 6  # Ctrl-C lands once both peers have a round: the stop takes well under a round of the tiny model
    exp = tmp_path / "exp"
    cmd = experiment("2/2", "--rounds", str(ROUNDS), "--out", str(exp), *TINY, *NO_EVAL)
    run = exp / "2-2" / "seed0"
    peers = [run / "peer0", run / "peer1"]

    first = subprocess.Popen(cmd, cwd=REPO, env=node_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        while not all(rounds_of(p) for p in peers):  # both peers are in the swarm and training
            assert first.poll() is None, first.stdout.read()[-3000:]
            assert time.monotonic() < deadline, "no peer finished a round"
            time.sleep(0.2)
        first.send_signal(signal.SIGINT)  # what Ctrl-C does
        out, _ = first.communicate(timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
    assert first.returncode == 130, out[-3000:]
    assert "resume with the same command" in out
    assert json.loads((run / "run.json").read_text())["status"] == "interrupted"
    done_before = [rounds_of(p) for p in peers]
    assert any(len(r) < ROUNDS for r in done_before), done_before  # it really stopped early
    assert all((p / "checkpoints").is_dir() for p in peers)  # each peer checkpointed on the way out

    second = run_python(cmd[1:], timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    meta = json.loads((run / "run.json").read_text())
    assert meta["status"] == "complete"
    assert meta["num_local"] == 2 and meta["num_external"] == 2 and meta["peers"] == 2
    assert meta["versions"]["torch"] and meta["versions"]["hivemind"] and meta["git_commit"]
    assert meta["git_commits"] == [meta["git_commit"]]  # both parts of the run on one commit
    for p, before in zip(peers, done_before):
        got = rounds_of(p)
        assert got == list(range(ROUNDS)), got  # continued where it stopped: no round lost, none repeated
        assert got[: len(before)] == before
    assert external_used(peers) > 0, "the two peers never trained on each other's groups"

    assert not list(run.glob("peer*/checkpoints")), "a finished run keeps no checkpoints by default"

    third = run_python(cmd[1:], timeout=120)
    assert third.returncode == 0 and "complete, skipped" in third.stderr, third.stderr[-2000:]


@pytest.mark.slow
def test_memory_mode_comparison_then_report(tmp_path):
    """Silo vs swarm in the in-process round-robin mode, then `sapo-report` on the result."""
    exp = tmp_path / "exp"
    done = run_python(
        experiment(
            "4/0",
            "2/2",
            "--mode",
            "memory",
            "--rounds",
            "3",
            "--out",
            str(exp),
            *TINY,
            "--eval-every",
            "2",
            "--eval-size",
            "6",
        )[1:],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    silo = [rounds_of(exp / "4-0" / "seed0" / f"peer{p}") for p in range(2)]
    assert silo == [[0, 1, 2], [0, 1, 2]]
    assert external_used([exp / "2-2" / "seed0" / f"peer{p}" for p in range(2)]) > 0
    meta = json.loads((exp / "2-2" / "seed0" / "run.json").read_text())
    assert meta["mode"] == "memory"
    assert meta["eval_engine"] == "auto" and meta["evaluators"] == ["torch"]  # tiny-random: llama.cpp cannot serve it
    assert meta["rollout_engines"] == ["torch"]  # and sampled with torch, every peer's records say so
    # what tells runs of one seed on two machines apart: the CPU (llama.cpp's kernels) and the engines' versions
    assert set(meta["cpu"]) == {"name", "simd"} and set(meta["cpu"]["simd"]) <= set(SIMD_FLAGS)
    assert {"ik-llama-cpp-python", "llama-cpp-python", "torch"} <= set(meta["versions"])
    # `tensorboard --logdir EXP` finds every peer of every configuration, each round once
    logdirs = sorted({str(f.parent.relative_to(exp)) for f in exp.rglob("events.out.tfevents.*")})
    assert logdirs == [f"{c}/seed0/peer{p}/tb" for c in ("2-2", "4-0") for p in range(2)]
    for logdir in logdirs:
        assert [step for step, _ in read_scalars(exp / logdir)["reward/mean"]] == [0, 1, 2]

    report = run_python(["-m", "node.lab.report", str(exp), "--out", str(tmp_path / "report")], timeout=120)
    assert report.returncode == 0, report.stderr[-2000:]
    text = (tmp_path / "report" / "report.md").read_text()
    assert "4/0" in text and "2/2" in text
    # every peer evaluated after rounds 0 and 2 (the last), and the report leads with it
    evaluated = [r["round"] for r in live_metrics(exp / "2-2" / "seed0" / "peer0") if "eval_accuracy" in r]
    assert evaluated == [0, 2]
    # the peers start from the same weights: one evaluated them, the other read its result
    starts = [live_metrics(exp / "2-2" / "seed0" / f"peer{p}")[0] for p in range(2)]
    assert starts[0]["start_scores"] == starts[1]["start_scores"] and len(starts[0]["start_scores"]) == 6
    assert len(list((exp / "2-2" / "seed0" / "shared-eval").glob("*.json"))) == 1
    assert done.stderr.count("held-out evaluation of the starting weights: another peer's result") == 2  # per arm
    assert text.index("## Held-out accuracy") < text.index("## Cumulative reward")
    assert {p.name for p in (tmp_path / "report").glob("*.png")} >= {
        "per_agent_rewards.png",
        "moving_average_band.png",
        "cumulative_reward.png",
    }


@pytest.mark.slow
def test_memory_mode_lora_peers_share_one_base(tmp_path):
    """Three LoRA peers in one process: one base model, an adapter (and optimizer) each, adapter-only
    checkpoints that name the same base; the learning rate follows the LoRA rule without --lr."""
    exp = tmp_path / "exp"
    done = run_python(
        experiment(
            "2/2",
            "--mode",
            "memory",
            "--rounds",
            "2",
            "--out",
            str(exp),
            *TINY[:-4],
            "--peers",
            "3",
            "--threads",
            "1",
            "--lora-rank",
            "2",
            "--eval-every",
            "0",
            "--keep-run-checkpoints",
        )[1:],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "3 peers share one base model, each with its own rank-2 LoRA adapter" in done.stderr
    run = exp / "2-2" / "seed0"
    meta = json.loads((run / "run.json").read_text())
    assert meta["lora_rank"] == 2 and meta["lr"] == 1e-5
    manifests = [
        json.loads(next((run / f"peer{p}" / "checkpoints").glob("round-*/MANIFEST.json")).read_text()) for p in range(3)
    ]
    assert len({m["meta"]["base"] for m in manifests}) == 1
    assert all(m["meta"]["lora"] == {"rank": 2, "alpha": 32.0} for m in manifests)
    assert [rounds_of(run / f"peer{p}") for p in range(3)] == [[0, 1]] * 3


@pytest.mark.slow
def test_memory_mode_usefulness_policy_moves_j_inside_the_nodes(tmp_path):
    """The adaptive split runs inside real nodes: with `usefulness`, I + J stays 4 and J leaves its
    starting 2 as the peers measure what the other's groups carry; no round trains on more than it chose."""
    exp = tmp_path / "exp"
    done = run_python(
        experiment("usefulness", "--mode", "memory", "--rounds", "8", "--out", str(exp), *TINY, "--eval-every", "0")[
            1:
        ],
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    peers = [live_metrics(exp / "usefulness" / "seed0" / f"peer{p}") for p in range(2)]
    for records in peers:
        check_records(records)
        assert [r["round"] for r in records] == list(range(8))
        assert all(r["ij_policy"] == "usefulness" and r["target_local"] + r["target_external"] == 4 for r in records)
        assert records[0]["target_external"] == 2  # the preset's starting split
        assert all(1 <= r["target_external"] <= 3 for r in records)  # at least one local group, one external
    moved = [sorted({r["target_external"] for r in records}) for records in peers]
    assert any(len(js) > 1 for js in moved), moved
    assert external_used([exp / "usefulness" / "seed0" / f"peer{p}" for p in range(2)]) > 0

"""End to end with --lora-rank: the real `sapo-node` CLI on the tiny random model. Checkpoints hold the
adapter and its optimizer state only, resume reproduces an uninterrupted run, weights that belong to
another base or another kind are refused in one line, and a new run can start from another's adapter."""

import re

import pytest
import torch
from test_node_solo import read_rounds

from conftest import run_node
from node.build import build_node
from node.learn.lora import attach, base_fingerprint
from node.learn.model_io import load_model
from node.learn.tasks import resolve_mix
from node.ops.checkpoint import CheckpointError, CheckpointStore, export_weights
from node.ops.config import load_config
from node.swarm.exchange import Silo

CPU = torch.device("cpu")
LORA = ["--lora-rank", "4", "--lora-alpha", "8", "--checkpoint-every", "1"]


@pytest.mark.slow
def test_lora_resume_reproduces_an_uninterrupted_run_with_adapter_only_checkpoints(tmp_path, tiny_args):
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = [*tiny_args, *LORA, "--beta", "0.05"]
    assert run_node(*common, "--rounds", "4", "--run-dir", str(straight)).returncode == 0
    assert run_node(*common, "--rounds", "2", "--run-dir", str(split)).returncode == 0
    resumed = run_node(*common, "--rounds", "4", "--run-dir", str(split), "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    keys = ("reward_mean", "tokens_generated", "loss", "kl", "num_local")
    a = [{k: r.get(k) for k in keys} for r in read_rounds(straight)]
    b = [{k: r.get(k) for k in keys} for r in read_rounds(split)]
    assert a == b and len(a) == 4

    ckpt = CheckpointStore(split).load_latest()
    assert ckpt.meta["lora"] == {"rank": 4, "alpha": 8.0} and ckpt.meta["model"] == "tiny-random"
    assert ckpt.model and all(".lora_A." in k or ".lora_B." in k for k in ckpt.model)
    assert len(ckpt.optimizer["state"]) == len(ckpt.model)  # Adam moments for the adapter only
    assert ckpt.state["config"]["lr"] == 1e-5  # 10x the full fine-tuning default: no --lr given
    full_bytes = 4 * sum(p.numel() for p in load_model("tiny-random", CPU)[0].parameters())
    assert (ckpt.path / "model.pt").stat().st_size < full_bytes / 5


@pytest.mark.slow
def test_mismatched_checkpoints_are_refused_in_one_line(tmp_path, tiny_args):
    run_dir = tmp_path / "run"
    assert run_node(*tiny_args, *LORA, "--rounds", "1", "--run-dir", str(run_dir)).returncode == 0
    other_rank = run_node(*tiny_args, "--lora-rank", "2", "--rounds", "2", "--run-dir", str(run_dir), "--resume")
    assert other_rank.returncode == 1
    assert "holds a LoRA adapter (rank 4, alpha 8.0), this node trains a LoRA adapter (rank 2" in other_rank.stderr


@pytest.mark.parametrize(
    "lora, model, refused",
    [
        (0, "tiny-random", "holds a LoRA adapter (rank 4, alpha 8.0), this node trains a full model"),
        (4, "tiny-random-smol", "was trained on another base model ('tiny-random'"),
        (4, "tiny-random", None),
    ],
)
@pytest.mark.slow
def test_identity_check_names_what_differs(tmp_path, lora, model, refused):
    saved = {
        "model": "tiny-random",
        "base": base_fingerprint(load_model("tiny-random", CPU)[0]),
        "lora": {"rank": 4, "alpha": 8.0},
    }
    cfg = load_config(
        ["--model", model, "--run-dir", str(tmp_path), "--lora-rank", str(lora), "--lora-alpha", "8"], env={}
    )
    net, tok = load_model(model, CPU)
    node = build_node(cfg, resolve_mix("smoke"), net, tok, Silo(), CPU)
    node.worker.shutdown()
    if refused is None:
        node.persistence.check_identity(saved, "checkpoint x")
    else:
        with pytest.raises(CheckpointError, match=re.escape(refused)):
            node.persistence.check_identity(saved, "checkpoint x")
    if lora:  # checkpoints from before manifests named a base hold whole models
        with pytest.raises(CheckpointError, match="holds a full model"):
            node.persistence.check_identity(None, "an old checkpoint")
    else:
        node.persistence.check_identity(None, "an old checkpoint")


@pytest.mark.slow
def test_a_new_run_starts_from_another_runs_adapter(tmp_path, tiny_args):
    """The target starts from the source's weights exported without the optimizer (what experiment cells commit
    for other machines; such an export never resumes a run). It runs with another seed than the source, so its
    own fresh adapter differs from the source's in every A matrix (checked): ending equal to the source's can
    only come from --lora-init."""
    source, target = tmp_path / "source", tmp_path / "target"
    assert run_node(*tiny_args, *LORA, "--lr", "1e-2", "--rounds", "2", "--run-dir", str(source)).returncode == 0
    exported = export_weights(CheckpointStore(source).load_latest().path, tmp_path / "adapter")  # as cells commit
    started = run_node(
        *tiny_args,
        *LORA,
        "--rounds",
        "1",
        "--lr",
        "1e-12",
        "--seed",
        "4",
        "--run-dir",
        str(target),
        "--lora-init",
        str(exported),
    )
    assert started.returncode == 0, started.stderr[-2000:]
    assert "adapter initialised from" in started.stderr
    theirs, ours = CheckpointStore(source).load_latest().model, CheckpointStore(target).load_latest().model
    fresh = attach(load_model("tiny-random", CPU)[0], 4, 8.0, seed=4).state_dict()  # the target without --lora-init
    assert set(fresh) == set(theirs) == set(ours)
    lora_a = [k for k in theirs if ".lora_A." in k]
    assert lora_a and not any(torch.allclose(theirs[k], fresh[k], atol=1e-3) for k in lora_a)
    assert all(torch.allclose(theirs[k], ours[k], atol=1e-6) for k in theirs)  # lr 1e-12: one step moves nothing
    wrong = run_node(
        *tiny_args,
        "--lora-rank",
        "2",
        "--rounds",
        "1",
        "--run-dir",
        str(tmp_path / "wrong"),
        "--lora-init",
        str(source / "checkpoints" / "round-000001"),
    )
    assert wrong.returncode == 1 and "--lora-init" in wrong.stderr
    export_weights(exported, tmp_path / "resumer" / "checkpoints" / "round-000001")  # weights without optimizer
    resumed = run_node(*tiny_args, *LORA, "--rounds", "2", "--run-dir", str(tmp_path / "resumer"), "--resume")
    assert resumed.returncode == 1 and "holds weights only (an export for --lora-init)" in resumed.stderr

"""Weights-only exports of a checkpoint (node/ops/checkpoint.py export_weights): what an experiment commits so
that runs on other machines can start from it with --lora-init; they load, they verify, they never resume."""

import json

import pytest
import torch

from node.ops.checkpoint import CheckpointError, CheckpointStore, export_weights, load_from


def saved(tmp_path):
    store = CheckpointStore(tmp_path / "run")
    weights = {"a.lora_A.weight": torch.randn(4, 8), "a.lora_B.weight": torch.zeros(8, 4)}
    optimizer = {"state": {0: {"exp_avg": torch.randn(4, 8), "exp_avg_sq": torch.rand(4, 8)}}, "param_groups": []}
    path = store.save(7, weights, optimizer, {"sampler": [1, 2]}, {"model": "m", "lora": {"rank": 4, "alpha": 8.0}})
    return path, weights


def test_an_export_holds_the_weights_and_identity_without_the_optimizer(tmp_path):
    path, weights = saved(tmp_path)
    assert load_from(tmp_path / "run").optimizer is not None  # a run dir: its newest checkpoint, whole
    out = export_weights(path, tmp_path / "out" / "adapter")
    assert sorted(p.name for p in out.parent.iterdir()) == ["adapter"]  # no temp dir left beside it
    assert not (out / "optimizer.pt").exists()
    ckpt = load_from(out)
    assert ckpt.optimizer is None and ckpt.round == 7 and ckpt.state["sampler"] == [1, 2]
    assert ckpt.meta == {"model": "m", "lora": {"rank": 4, "alpha": 8.0}}
    assert all(torch.equal(ckpt.model[k], weights[k]) for k in weights)
    origin = json.loads((out / "MANIFEST.json").read_text())["exported_from"]
    assert origin.endswith(path.name) and str(tmp_path) not in origin  # no local directories in what is shared
    again = export_weights(path, out)  # replacing an export: whole, not merged
    assert load_from(again).round == 7


def test_a_corrupt_source_or_export_is_refused(tmp_path):
    path, _ = saved(tmp_path)
    out = export_weights(path, tmp_path / "adapter")
    with (out / "model.pt").open("r+b") as f:
        f.write(b"garbage")
    with pytest.raises(CheckpointError, match="model.pt is missing, truncated or corrupt"):
        load_from(out)
    (path / "model.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="model.pt is missing, truncated or corrupt"):
        export_weights(path, tmp_path / "second")
    assert not (tmp_path / "second").exists()


def test_a_checkpoint_newer_than_the_present_is_set_aside_not_preferred(tmp_path):
    """A run that went back (its newest checkpoint was corrupt, or a restore point outlived a crash) must not
    prune what it just saved in favour of a checkpoint from the timeline it left, nor load that one later."""
    store = CheckpointStore(tmp_path / "run", keep=1)
    weights = {"w": torch.ones(2)}
    store.save(19, weights, {}, {})
    store.save(15, weights, {}, {})
    assert store.load_latest().round == 15
    assert (store.dir / "abandoned" / "round-000019" / "model.pt").exists()  # kept, out of the way

"""Weights-only exports of a checkpoint (node/ops/checkpoint.py export_weights): what an experiment commits so
that runs on other machines can start from it with --lora-init; they load, they verify, they never resume. And
the store itself: what it sets aside, puts back and prunes, and what a full disk leaves."""

import errno
import hashlib
import json
import logging
import os
import shutil

import pytest
import torch

from node.ops.checkpoint import CheckpointError, CheckpointStore, export_weights, load_from, round_of


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


def test_a_newest_checkpoint_that_does_not_load_is_set_aside_before_its_round_is_saved_again(tmp_path):
    """A resume that falls back past a corrupt newest checkpoint re-saves that round later: the corrupt copy
    goes to abandoned/ (recoverable by hand), never overwritten; another run's --lora-init moves nothing."""
    store = CheckpointStore(tmp_path / "run", keep=3)
    store.save(4, {"w": torch.zeros(2)}, {}, {})
    store.save(5, {"w": torch.ones(2)}, {}, {})
    (store.dir / "round-000005" / "model.pt").write_bytes(b"cut")
    assert load_from(tmp_path / "run").round == 4  # read-only use: the run dir is left as it is
    assert (store.dir / "round-000005").exists() and not (store.dir / "abandoned").exists()
    assert store.load_latest().round == 4
    assert (store.dir / "abandoned" / "round-000005" / "model.pt").read_bytes() == b"cut"
    store.save(5, {"w": torch.full((2,), 2.0)}, {}, {})
    assert (store.dir / "abandoned" / "round-000005" / "model.pt").read_bytes() == b"cut"
    assert torch.equal(store.load_latest().model["w"], torch.full((2,), 2.0))


def crashed_resave(store, round_):
    """The state a re-save of `round_` leaves when killed between its two renames: the round only in .old-*."""
    final = store.dir / f"round-{round_:06d}"
    old = store.dir / f".old-{final.name}-4242"
    final.rename(old)
    return old


def test_a_round_left_only_in_old_by_an_interrupted_resave_is_put_back(tmp_path, caplog):
    store = CheckpointStore(tmp_path / "run", keep=3)
    store.save(4, {"w": torch.zeros(2)}, {}, {})
    store.save(5, {"w": torch.ones(2)}, {}, {})
    old = crashed_resave(store, 5)
    ckpt = CheckpointStore(tmp_path / "run", keep=3).load_latest()  # a restarted node: not round 4
    assert ckpt.round == 5 and torch.equal(ckpt.model["w"], torch.ones(2))
    assert not old.exists() and (store.dir / "round-000005" / "MANIFEST.json").exists()
    assert "restored from .old-round-000005-4242" in caplog.text


def test_an_old_dir_that_does_not_verify_is_kept_not_loaded(tmp_path):
    store = CheckpointStore(tmp_path / "run", keep=3)
    store.save(4, {"w": torch.zeros(2)}, {}, {})
    store.save(5, {"w": torch.ones(2)}, {}, {})
    old = crashed_resave(store, 5)
    (old / "model.pt").write_bytes(b"garbage")
    assert store.load_latest().round == 4
    assert (old / "model.pt").read_bytes() == b"garbage"  # never deleted: recoverable by hand
    store.save(6, {"w": torch.ones(2)}, {}, {})
    assert old.exists()


def test_a_round_left_only_in_old_is_put_back_before_a_save_sets_it_aside(tmp_path):
    store = CheckpointStore(tmp_path / "run", keep=3)
    store.save(4, {"w": torch.zeros(2)}, {}, {})
    store.save(5, {"w": torch.ones(2)}, {}, {})
    old = crashed_resave(store, 5)
    store.save(3, {"w": torch.zeros(2)}, {}, {})  # a run that went back: round 5 set aside, not lost
    assert not old.exists() and (store.dir / "abandoned" / "round-000005" / "model.pt").exists()


def test_prune_removes_an_old_dir_whose_round_is_in_place(tmp_path):
    store = CheckpointStore(tmp_path / "run", keep=3)
    store.save(5, {"w": torch.ones(2)}, {}, {})
    stale = store.dir / ".old-round-000005-4242"  # a completed swap whose rmtree was interrupted
    stale.mkdir()
    (stale / "model.pt").write_bytes(b"half")
    unrelated = store.dir / ".old-notes"
    unrelated.mkdir()
    store.save(6, {"w": torch.ones(2)}, {}, {})
    assert not stale.exists() and (store.dir / "round-000005").exists() and unrelated.exists()


@pytest.mark.parametrize(
    "manifest, message",
    [
        ({"round": 7, "files": {}}, "does not list model.pt and state.json"),
        ({"round": 7, "files": []}, "does not list model.pt and state.json"),
        ({"round": 7, "files": {"model.pt": "x", "state.json": {}}}, "entry for model.pt is malformed"),
        ({"round": 7, "files": {"model.pt": {"size": 1e999, "sha256": ""}, "state.json": {}}}, "model.pt is malformed"),
        ([1, 2], "missing or unreadable MANIFEST.json"),
    ],
)
def test_a_crafted_manifest_is_a_checkpoint_error(tmp_path, manifest, message):
    """--lora-init names any directory: what its manifest says is checked before a file is trusted."""
    path, _ = saved(tmp_path)
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match=message):
        load_from(path)


def test_files_that_match_a_rewritten_manifest_but_do_not_load_are_a_checkpoint_error(tmp_path):
    path, _ = saved(tmp_path)
    manifest = json.loads((path / "MANIFEST.json").read_text())
    for name, content in (("state.json", b"[1]"), ("model.pt", b"junk")):
        (path / name).write_bytes(content)
        manifest["files"][name] = {"size": len(content), "sha256": hashlib.sha256(content).hexdigest()}
    (path / "MANIFEST.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not load"):
        load_from(path)


def test_a_round_set_aside_twice_keeps_both_copies(tmp_path):
    store = CheckpointStore(tmp_path / "run", keep=3)
    for content in (b"first", b"second"):
        store.save(4, {"w": torch.zeros(2)}, {}, {})
        store.save(5, {"w": torch.ones(2)}, {}, {})
        (store.dir / "round-000005" / "model.pt").write_bytes(content)
        assert store.load_latest().round == 4
    assert (store.dir / "abandoned" / "round-000005" / "model.pt").read_bytes() == b"first"
    assert (store.dir / "abandoned" / "round-000005.1" / "model.pt").read_bytes() == b"second"


def test_a_save_that_fails_leaves_no_copy_behind_and_the_last_checkpoint_loads(tmp_path, monkeypatch):
    """A full disk mid-save: its half-written copy is removed (it would hold the space the next try needs), as
    is one a crashed process left; the checkpoint saved before still loads."""
    path, weights = saved(tmp_path)
    store = CheckpointStore(tmp_path / "run")
    for pid in (999999, os.getpid()):  # unfinished saves, one of this pid (a container's node is always pid 1)
        (store.dir / f".tmp-round-00000{8 if pid == 999999 else 3}-{pid}").mkdir()
    real_save = torch.save

    def disk_full(obj, f, *args, **kwargs):
        if str(f).endswith("optimizer.pt"):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_full)
    with pytest.raises(OSError, match="No space left"):
        store.save(8, weights, {}, {}, {})
    assert sorted(p.name for p in store.dir.iterdir()) == [path.name]
    assert store.load_latest().round == 7


def test_a_full_disk_that_torch_save_hides_is_said_as_enospc(tmp_path, monkeypatch):
    """torch.save on a full disk raises RuntimeError ("unexpected pos"), no errno: with under 1 MB left (measured
    before the half-written copy is removed) the store raises ENOSPC from it; with room, the error as it was."""
    path, weights = saved(tmp_path)
    store = CheckpointStore(tmp_path / "run")

    def hidden(obj, f, *args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    monkeypatch.setattr(torch, "save", hidden)
    free = {"bytes": 10**9}
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**12, 0, free["bytes"]))
    with pytest.raises(RuntimeError, match="unexpected pos"):
        store.save(8, weights, {}, {}, {})
    free["bytes"] = 4096
    with pytest.raises(OSError) as raised:
        store.save(8, weights, {}, {}, {})
    assert raised.value.errno == errno.ENOSPC and isinstance(raised.value.__cause__, RuntimeError)
    assert sorted(p.name for p in store.dir.iterdir()) == [path.name]


def test_a_disk_without_room_for_two_more_checkpoints_is_said_once(tmp_path, monkeypatch, caplog):
    path, weights = saved(tmp_path)
    size = sum(f.stat().st_size for f in path.iterdir())
    store = CheckpointStore(tmp_path / "run")
    free = {"bytes": size}
    monkeypatch.setattr(shutil, "disk_usage", lambda _: shutil._ntuple_diskusage(10**12, 0, free["bytes"]))
    with caplog.at_level(logging.WARNING, logger="node.ops.checkpoint"):
        store.save(8, weights, {}, {}, {})
        store.save(9, weights, {}, {}, {})  # still low: not said again
        free["bytes"] = 3 * size
        store.save(10, weights, {}, {}, {})
        free["bytes"] = size  # low again: said again
        store.save(11, weights, {}, {}, {})
    warnings = [r.getMessage() for r in caplog.records if "free some space" in r.getMessage()]
    assert len(warnings) == 2 and f"the disk holding {store.dir} has" in warnings[0]


@pytest.mark.parametrize("stray", ["round-\u00b2", "round-"])
def test_a_stray_directory_named_like_a_checkpoint_is_no_checkpoint(tmp_path, stray):
    """str.isdigit() takes '²', which int() refuses: such a name is not a round, at start or at a save."""
    store = CheckpointStore(tmp_path / "checkpoints")
    store.save(3, {"w": torch.ones(2)}, {}, {})
    (store.dir / stray).mkdir()
    assert round_of(store.dir / stray) is None
    store.save(4, {"w": torch.ones(2)}, {}, {})
    assert store.load_latest() is not None and (store.dir / stray).is_dir()

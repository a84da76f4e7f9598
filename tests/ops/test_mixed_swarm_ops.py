"""A mixed local swarm, as an operator sees it: memory sized per model, each peer's model on the progress view."""

from __future__ import annotations

import orjson
import pytest

from node.ops import resources
from node.ops.progress import main as progress_main


def test_memory_check_sizes_each_peer_by_its_own_model(monkeypatch, capsys):
    sizes = {"small": 100_000_000, "big": 300_000_000}
    monkeypatch.setattr(resources, "count_parameters", sizes.__getitem__)
    monkeypatch.setattr(resources, "free_bytes", lambda device: 10**15)
    assert resources.main(["--models", "small,small,big", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    full = 2 * resources.peer_bytes(sizes["small"], "cpu") + resources.peer_bytes(sizes["big"], "cpu")
    assert "2 peers x" in out and "(small: 100M params" in out and "1 peers x" in out and "(big: 300M" in out
    assert f"3 peers need {full / resources.GIB:.1f} GiB" in out
    # LoRA peers hold no gradients or Adam moments for the frozen weights: fp32 grads (4) + Adam m and v (8)
    saved = resources.peer_bytes(sizes["big"], "cpu") - resources.peer_bytes(sizes["big"], "cpu", lora=True)
    assert saved == sizes["big"] * (4 + 8)
    monkeypatch.setattr(resources, "free_bytes", lambda device: full - 1)
    assert resources.main(["--models", "small,small,big", "--device", "cpu"]) == 3
    assert resources.main(["--models", "small,small,big", "--device", "cpu", "--lora-rank", "8"]) == 0


@pytest.mark.parametrize("with_records", [False, True])
def test_progress_names_each_peers_model(tmp_path, capsys, with_records):
    runs = [tmp_path / "peer0", tmp_path / "peer1"]
    for run, model in zip(runs, ("default", "gemma3-270m")):
        run.mkdir()
        if with_records:
            rec = {"round": 0, "reward_mean": 0.5, "num_local": 2, "num_external": 1, "model": model}
            (run / "metrics.jsonl").write_bytes(orjson.dumps(rec) + b"\n")
    # before the first round only the script's list names them; the records win once there
    assert (
        progress_main(
            [*map(str, runs), "--once", "--models", "default,other" if with_records else "default,gemma3-270m"]
        )
        == 0
    )
    rows = {line.split()[0]: line.split()[1] for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows == {"peer0": "default", "peer1": "gemma3-270m"}


def test_memory_check_sizes_peers_at_the_rank_their_arguments_resolve_to(monkeypatch, capsys):
    """local_swarm.sh passes its peers' arguments: on a CPU the recipe's LoRA rank 8 applies unless they say."""
    monkeypatch.setattr(resources, "count_parameters", lambda model: 100_000_000)
    monkeypatch.setattr(resources, "free_bytes", lambda device: 10**15)
    monkeypatch.setenv("SAPO_PEERS", "5")  # the script's peer count: not the node's --peers multiaddrs
    monkeypatch.delenv("SAPO_LORA_RANK", raising=False)
    monkeypatch.delenv("SAPO_RECIPE", raising=False)  # the suite's default: the node's own is auto
    for node_args, lora in (
        (["--device", "cpu"], True),
        (["--device", "cpu", "--recipe", "none"], False),
        (["--device", "cpu", "--lora-rank", "0"], False),
        (["--device=cuda"], False),
        (["--device", "cpu", "--no-such-flag"], False),
    ):
        assert resources.main(["--models", "a,b", "--device", "cpu", "--", *node_args]) == 0
        assert ("LoRA)" in capsys.readouterr().out) is lora, node_args
    # on a GPU the packaged models take the CPU recipe (LoRA), any other model the paper's setup
    assert resources.main(["--models", "default,a", "--device", "cuda", "--", "--device=cuda"]) == 0
    assert [("LoRA)" in line) for line in capsys.readouterr().out.splitlines()[:2]] == [True, False]
    monkeypatch.setenv("SAPO_LORA_RANK", "4")
    assert resources.main(["--models", "a", "--device", "cpu", "--", "--recipe", "none"]) == 0
    assert "LoRA)" in capsys.readouterr().out

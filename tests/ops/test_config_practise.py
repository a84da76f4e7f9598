"""--practise as an option: its three sources, one-line errors, and what a node built with it does: samples only
its part, records each part's held-out accuracy, keeps the option in its checkpoints, and says so when a resume
practises another part."""

import logging

import orjson
import pytest
import torch

from conftest import small_silo_node
from node.build import practised_part
from node.learn.model_io import load_model
from node.learn.tasks import PRESETS
from node.ops.checkpoint import CheckpointStore
from node.ops.config import ConfigError, load_config


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", torch.device("cpu"))


def test_flag_env_and_file_set_it(tmp_path):
    assert load_config([], env={}).practise == ""  # the whole mix
    path = tmp_path / "node.toml"
    path.write_text('practise = "chain_sum:2"\n')
    assert load_config(["--config", str(path)], env={}).practise == "chain_sum:2"
    assert load_config(["--config", str(path)], env={"SAPO_PRACTISE": "chain_sum"}).practise == "chain_sum"
    assert load_config(["--practise", "basic_arithmetic"], env={"SAPO_PRACTISE": "chain_sum"}).practise == (
        "basic_arithmetic"
    )


@pytest.mark.parametrize(
    "value, message",
    [
        ("chain_sum:0", "--practise needs a positive weight for chain_sum (got '0')"),
        ("chain_sum,chain_sum", "--practise names chain_sum twice"),
        ("chain sum", "--practise takes dataset names of the task mix, optionally with weights"),
    ],
)
def test_a_malformed_value_is_one_line_naming_the_flag(value, message):
    with pytest.raises(ConfigError) as info:
        load_config(["--practise", value], env={})
    assert str(info.value).startswith(message) and "\n" not in str(info.value)


def test_a_part_the_mix_lacks_is_a_config_error():
    cfg = load_config(["--tasks", "smoke", "--practise", "chain_sum"], env={})
    with pytest.raises(ConfigError, match=r"^--practise chain_sum: not in the task mix smoke \(its datasets: "):
        practised_part(cfg, PRESETS["smoke"])


def records(run_dir) -> list[dict]:
    return [orjson.loads(line) for line in (run_dir / "metrics.jsonl").read_bytes().splitlines()]


async def test_a_node_samples_its_part_records_each_part_and_says_when_a_resume_changes_it(tmp_path, tiny, caplog):
    """Smoke mix: propositional_logic practised, palindrome_generation not. Every evaluation (the starting
    weights' too) covers both and says how each part fares; a resume that practises the other part goes on
    from the checkpoint's sampler state, drawing from the new part, and says so."""
    flags = ("--eval-every", "1", "--eval-size", "4", "--checkpoint-every", "1")

    def node_of(rounds: int, part: str, *extra: str):
        node = small_silo_node(*tiny, "tiny-random", rounds, tmp_path, "--practise", part, *flags, *extra)
        sample, drawn = node.sampler.sample, []

        def watched(n):
            tasks = sample(n)
            drawn.extend(t.spec.dataset for t in tasks)
            return tasks

        node.sampler.sample = watched
        return node, drawn

    node, drawn = node_of(2, "propositional_logic")
    assert await node.run() == 2
    assert set(drawn) == {"propositional_logic"} and len(drawn) == 4
    recs = records(tmp_path)
    for rec in recs:
        assert set(rec["eval_datasets"]) == {"propositional_logic", "palindrome_generation"}  # the whole mix
        for part in ("practised", "other"):
            scores = [
                s
                for s, d in zip(rec["eval_scores"], rec["eval_datasets"])
                if (d == "propositional_logic") == (part == "practised")
            ]
            assert rec[f"eval_accuracy_{part}"] == pytest.approx(sum(scores) / len(scores), abs=1e-4)
    assert "start_accuracy_practised" in recs[0] and "start_accuracy_other" in recs[0]
    ckpt = CheckpointStore(tmp_path, keep=2).load_latest()
    assert ckpt is not None and ckpt.state["config"]["practise"] == "propositional_logic"

    node, drawn = node_of(3, "palindrome_generation", "--resume")
    with caplog.at_level(logging.WARNING, logger="sapo.node"):
        assert await node.run() == 1
    assert "--practise changed since the checkpoint: 'propositional_logic' -> 'palindrome_generation'" in caplog.text
    assert set(drawn) == {"palindrome_generation"}
    assert [r["round"] for r in records(tmp_path)] == [0, 1, 2]

"""The held-out evaluation on policies whose score is known: an oracle must score 1.0 and a policy that
gives one fixed answer per dataset exactly the constant-answer baseline, through the real path (the mix's
prompt, batched greedy decoding, answer extraction with the forced prefix, the training reward). Collapse
signals on a policy that has collapsed."""

from collections import Counter

import pytest
import torch

from helpers_learning import ScriptedPolicy
from node.learn.evaluate import HeldOutEval
from node.learn.groups import Group, Prompter, collapse_metrics, local_group
from node.learn.model_io import load_model
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.tasks import PRESETS, TaskSampler, eval_tasks

# reasoning-gym's propositional_logic has no gold answer (its scorer checks the formula a reply gives)
NO_GOLD = {"propositional_logic"}


@pytest.fixture(scope="module")
def tok():
    return load_model("tiny-random", torch.device("cpu"))[1]


def in_format(mix, text: str) -> str:
    """A reply in the mix's answer format: the prefix is forced by the prompt, the closing tag is ours."""
    return ("" if mix.answer_prefix else "<answer>") + text + "</answer>"


def run_eval(mix, tok, respond, size: int = 40):
    held = HeldOutEval(mix, size, every=1, rounds=1, batch_size=16)  # several batches of the real path
    # a mix split by content answers its unseen set in the same pass: the policy knows those questions too
    policy = ScriptedPolicy(tok, eval_tasks(mix, size) + eval_tasks(mix, size, unseen=True), respond)
    result = held.run(policy, tok, Prompter(tok, mix), max_new_tokens=8)
    assert policy.calls >= 2, "the set is answered in batches"
    return held, result


@pytest.mark.parametrize("name", ["cpu-easy", "cpu-learn", "test-learn", "paper"])
def test_an_oracle_scores_one_on_every_dataset(tok, name):
    mix = PRESETS[name]
    held, result = run_eval(mix, tok, lambda t: in_format(mix, t.answer))
    assert result.answers == [t.answer for t in held.tasks]  # each answer landed on its own task
    graded = {d: acc for d, acc in result.by_dataset.items() if d not in NO_GOLD}
    assert graded and all(acc == 1.0 for acc in graded.values()), result.by_dataset
    assert set(result.by_dataset) == set(mix.datasets)
    if not NO_GOLD & set(mix.datasets):
        assert result.accuracy == 1.0 > result.baseline
        assert result.to_record()["eval_distinct_answers"] == pytest.approx(result.distinct_gold, abs=1e-4)


@pytest.mark.parametrize("name", ["cpu-easy", "cpu-learn", "test-learn"])
def test_one_fixed_answer_per_dataset_scores_exactly_the_constant_baseline(tok, name):
    """These mixes score exact answers only, so the best fixed answer is each dataset's most common one."""
    mix = PRESETS[name]
    tasks = eval_tasks(mix, 40)
    common = {d: Counter(t.answer for t in tasks if t.spec.dataset == d).most_common(1)[0][0] for d in mix.datasets}
    held, result = run_eval(mix, tok, lambda t: in_format(mix, common[t.spec.dataset]))
    assert result.accuracy == pytest.approx(result.baseline, abs=1e-12)
    assert 0 < result.baseline < 1
    for d, acc in result.by_dataset.items():
        assert acc == pytest.approx(held.seen.baseline_by_dataset[d], abs=1e-12)
    # a collapsed policy: one distinct answer per dataset
    assert result.distinct_answers() == pytest.approx(len(mix.datasets) / 40)


def test_a_reply_in_the_wrong_format_scores_what_the_reward_gives_it(tok):
    """test-learn's trap (node/learn/tasks.py): the right number in the example's format earns 1/15."""
    mix = PRESETS["test-learn"]
    _, result = run_eval(mix, tok, lambda t: f"The answer is {t.answer}</answer>")
    assert result.accuracy == pytest.approx(1 / 15) and result.accuracy < result.baseline


def test_collapse_signals_of_a_peaked_policy():
    """A policy whose next-token distribution is nearly one-hot: token entropy near 0, every group's G
    completions the same, so no group carries a learning signal; external groups that do still count."""
    model, tok = load_model("tiny-random", torch.device("cpu"))
    mix = PRESETS["smoke"]
    prompter = Prompter(tok, mix)
    tasks = TaskSampler(mix, 2).sample(3)
    prompts = [prompter(t) for t in tasks]
    cfg = SamplingConfig(max_new_tokens=6)
    torch.manual_seed(0)
    spread = collapse_metrics(
        [local_group(t, s, mix.answer_prefix) for t, s in zip(tasks, sample_groups(model, tok, prompts, 4, cfg))], []
    )
    with torch.no_grad():
        model.model.norm.weight.mul_(200.0)  # logits x200: the same argmax, almost all the mass on it
    torch.manual_seed(0)
    sampled = sample_groups(model, tok, prompts, 4, cfg)
    local = [local_group(t, s, mix.answer_prefix) for t, s in zip(tasks, sampled)]
    assert all(len(set(map(tuple, s.completion_ids))) == 1 for s in sampled)  # collapsed: G copies
    peaked = collapse_metrics(local, [])
    log_v = float(torch.log(torch.tensor(float(len(tok)))))
    assert spread["entropy_mean"] > 0.5 * log_v and peaked["entropy_mean"] < 0.01 * log_v
    assert peaked["signal_frac"] == 0.0 and peaked["external_signal_frac"] == 0.0
    external = [
        Group(tasks[0], ["<answer>a</answer>", "<answer>b</answer>"], [1.0, 0.0], source="ab" * 32),
        Group(tasks[1], ["<answer>a</answer>", "<answer>a</answer>"], [0.5, 0.5], source="cd" * 32),
    ]
    mixed = collapse_metrics(local, external)
    assert mixed["signal_frac"] == pytest.approx(1 / 5) and mixed["external_signal_frac"] == 0.5
    assert mixed["entropy_mean"] == peaked["entropy_mean"]  # entropy is the node's own samples only

"""Held-out evaluation: a fixed set no training task can come from; evaluating changes no training record."""

import orjson
import pytest
import torch

from conftest import small_silo_node, tiny_gemma3
from node.learn.evaluate import HeldOutEval, constant_answer_baseline, evaluate, greedy_texts
from node.learn.groups import Prompter, collapse_metrics, local_group
from node.learn.kvcache import cache_arg
from node.learn.model_io import load_model
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.tasks import DATASET_SIZE, EVAL_INDEX_START, PRESETS, TaskSampler, TaskSpec, eval_tasks, is_eval_index
from node.ops.config import ConfigError, load_config
from node.ops.metrics import MetricsWriter


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-random", torch.device("cpu"))


def test_eval_set_is_fixed_weighted_and_in_the_reserved_range():
    mix = PRESETS["cpu-easy"]
    tasks = eval_tasks(mix, 64)
    assert [t.spec for t in tasks] == [t.spec for t in eval_tasks(mix, 64)]
    assert len(tasks) == 64 and all(is_eval_index(t.spec.index) for t in tasks)
    counts = {name: sum(t.spec.dataset == name for t in tasks) for name in mix.datasets}
    assert counts == {"count_bits": 19, "letter_counting": 13, "ransom_note": 19, "syllogism": 13}
    assert len({t.spec for t in tasks}) == 64


def test_constant_answer_baseline_is_the_best_fixed_answer_per_dataset(tiny):
    """The yardstick a collapsed policy lands on: no fixed answer per dataset beats it, the best one
    reaches it, and it is what a "model" that always gives those answers scores through evaluate()."""
    from collections import Counter

    from node.learn.tasks import score

    tasks = eval_tasks(PRESETS["cpu-easy"], 64)
    baseline = constant_answer_baseline(tasks)
    by_dataset = {}
    for t in tasks:
        by_dataset.setdefault(t.spec.dataset, []).append(t)
    best = {}
    for name, group in by_dataset.items():
        answers = Counter(t.answer for t in group)
        for answer in answers:  # every fixed answer found in the set
            total = sum(score(t, answer) for t in group)
            if total > best.get(name, (None, -1.0))[1]:
                best[name] = (answer, total)
        assert best[name][1] == max(answers.values())  # exact-match scorers: the most common answer
    assert baseline == pytest.approx(sum(total for _, total in best.values()) / len(tasks))
    assert 0.3 < baseline < 1.0  # short-answer tasks are partly guessable, not entirely

    held_out = HeldOutEval(PRESETS["smoke"], 4, every=1, rounds=1)
    model, tok = tiny
    result = held_out.run(model, tok, Prompter(tok, PRESETS["smoke"]), max_new_tokens=4)
    record = result.to_record()
    assert record["eval_baseline"] == constant_answer_baseline(held_out.tasks)
    # per task, in the set's order, so two evaluations pair task by task (scripts/research/solo_evidence.py)
    assert record["eval_datasets"] == [t.spec.dataset for t in held_out.tasks]
    assert len(record["eval_scores"]) == len(record["eval_answers"]) == 4
    assert sum(record["eval_scores"]) / 4 == pytest.approx(record["eval_accuracy"], abs=1e-3)
    names = {t.spec.dataset for t in held_out.tasks}
    per = {n: record[f"eval_baseline/{n}"] for n in names}
    counts = {n: sum(t.spec.dataset == n for t in held_out.tasks) for n in names}
    assert sum(per[n] * counts[n] for n in names) / 4 == pytest.approx(record["eval_baseline"])
    assert 0 <= record["eval_distinct_answers"] <= 1 and 0 < record["eval_distinct_gold"] <= 1


def test_a_mix_split_by_content_is_also_evaluated_on_its_unseen_set(tiny):
    """cpu-learn: one pass answers both sets; the unseen set's fields sit beside the in-distribution ones,
    each read against its own constant-answer baseline. A mix without a split records no unseen field."""
    model, tok = tiny
    mix = PRESETS["cpu-learn"]
    held_out = HeldOutEval(mix, 6, every=1, rounds=1, unseen_size=4)
    result = held_out.run(model, tok, Prompter(tok, mix), max_new_tokens=3)
    record = result.to_record()
    unseen = held_out.unseen.tasks
    assert len(unseen) == 4 and all(mix.reserves(t) for t in unseen)
    assert not any(mix.reserves(t) for t in held_out.tasks) and record["eval_size"] == 6
    assert record["eval_unseen_size"] == 4 and record["eval_unseen_datasets"] == [t.spec.dataset for t in unseen]
    assert record["eval_unseen_baseline"] == constant_answer_baseline(unseen)
    assert record["eval_baseline"] == constant_answer_baseline(held_out.tasks)
    assert sum(record["eval_unseen_scores"]) / 4 == pytest.approx(record["eval_unseen_accuracy"], abs=1e-3)
    assert {f"eval_unseen_accuracy/{n}" for n in mix.datasets} <= set(record)
    assert {f"eval_unseen_baseline/{n}" for n in mix.datasets} <= set(record)
    assert len(record["eval_unseen_answers"]) == 4 and 0 < record["eval_unseen_distinct_gold"] <= 1
    assert "eval_unseen_s" not in record and record["eval_s"] > 0  # one pass, one time
    alone = evaluate(model, tok, Prompter(tok, mix), unseen, max_new_tokens=3)
    assert alone.scores == result.unseen.scores  # batched with the other set or alone: the same answers
    assert "unseen accuracy" in result.log_line(5)

    smoke = HeldOutEval(PRESETS["smoke"], 4, every=1, rounds=1, unseen_size=4)
    plain = smoke.run(model, tok, Prompter(tok, PRESETS["smoke"]), max_new_tokens=3).to_record()
    assert smoke.unseen is None and not [k for k in plain if k.startswith("eval_unseen")]


def test_training_never_draws_or_accepts_an_eval_task():
    mix = PRESETS["cpu-easy"]
    sampler = TaskSampler(mix, seed=0)  # the eval set's own dataset seed
    sampler.counter = EVAL_INDEX_START - 2
    indices = [t.spec.index for t in sampler.sample(4)]
    assert indices == [EVAL_INDEX_START - 2, EVAL_INDEX_START - 1, 0, 1]  # wraps below the reserved range
    resumed = TaskSampler(mix, seed=0)
    resumed.load_state_dict({"rng": sampler.state_dict()["rng"], "counter": EVAL_INDEX_START + 5})
    assert resumed.counter < EVAL_INDEX_START
    for task in eval_tasks(mix, 16):  # a peer publishing an eval task is refused, whatever its seed
        assert not mix.allows(task.spec)
    config = mix.datasets["count_bits"]["config"]
    assert mix.allows(TaskSpec.make("count_bits", config, 0, EVAL_INDEX_START - 1))
    assert not mix.allows(TaskSpec.make("count_bits", config, 7, DATASET_SIZE - 1))


def test_evaluate_scores_greedy_answers_per_dataset(tiny):
    model, tok = tiny
    mix = PRESETS["smoke"]
    prompter = Prompter(tok, mix)
    tasks = eval_tasks(mix, 6)
    state = torch.random.get_rng_state()
    first = evaluate(model, tok, prompter, tasks, max_new_tokens=6, batch_size=4)
    assert torch.equal(state, torch.random.get_rng_state())
    again = evaluate(model, tok, prompter, tasks, max_new_tokens=6, batch_size=6)
    assert first.size == 6 and set(first.by_dataset) == set(mix.datasets)
    assert first.accuracy == again.accuracy and first.by_dataset == again.by_dataset  # greedy, batch-independent
    rec = first.to_record()
    assert {"eval_accuracy", "eval_s", "eval_size", "eval_accuracy/propositional_logic"} <= set(rec)


def test_collapse_metrics_from_sampled_groups(tiny):
    model, tok = tiny
    mix = PRESETS["smoke"]
    prompter = Prompter(tok, mix)
    tasks = TaskSampler(mix, 1).sample(2)
    torch.manual_seed(0)
    sampled = sample_groups(model, tok, [prompter(t) for t in tasks], 3, SamplingConfig(max_new_tokens=5))
    groups = [local_group(t, s, mix.answer_prefix) for t, s in zip(tasks, sampled)]
    vocab_log = torch.log(torch.tensor(float(len(tok))))
    for s in sampled:  # a random model samples from a near-uniform distribution: entropy near log |V|
        assert all(0.5 * vocab_log < h <= vocab_log + 1e-4 for h in s.entropy)
    groups[0].rewards, groups[1].rewards = [1.0, 0.0, 0.0], [0.5, 0.5, 0.5]
    m = collapse_metrics(groups, [])
    assert m["signal_frac"] == 0.5 and 0.5 * vocab_log < m["entropy_mean"] <= vocab_log + 1e-4


async def test_a_run_with_eval_has_the_same_training_records_as_without(tmp_path, tiny):
    records = {}
    for every in (0, 1):
        node = small_silo_node(
            tiny[0], tiny[1], "tiny-random", 3, tmp_path / str(every), "--eval-every", str(every), "--eval-size", "4"
        )
        records[every] = [(await node.run_round(r)).record for r in range(3)]
        node.worker.shutdown()
    keys = ("reward_mean", "loss", "tokens_generated", "clip_frac", "grad_norm", "entropy_mean", "signal_frac")
    assert [{k: r[k] for k in keys} for r in records[0]] == [{k: r[k] for k in keys} for r in records[1]]
    assert all("eval_accuracy" not in r for r in records[0])
    assert all(0.0 <= r["eval_accuracy"] <= 1.0 and r["eval_size"] == 4 and r["eval_s"] > 0 for r in records[1])
    assert all("eval" in r["phase_s"] for r in records[1])


def two_round_node(tiny, run_dir, *extra):
    return small_silo_node(tiny[0], tiny[1], "tiny-random", 2, run_dir, "--eval-every", "1", "--eval-size", "4", *extra)


async def test_an_evaluation_skipped_by_a_stop_runs_on_resume_with_the_same_result(tmp_path, tiny):
    """A stop after round 1's update keeps the round without its due evaluation; the resumed node evaluates
    round 1's checkpoint first, into round 1's record, and gets what an unstopped run got."""

    def node_at(run_dir, *extra):
        return two_round_node(tiny, run_dir, *extra)

    await node_at(tmp_path / "whole").run()
    stopped = node_at(tmp_path / "stopped")
    train = stopped.train

    def train_then_stop(groups):
        stats = train(groups)
        if stopped.next_round == 1:
            stopped.stop.set("test")
        return stats

    stopped.train = train_then_stop
    assert await stopped.run() == 2
    metrics = MetricsWriter(tmp_path / "stopped")
    assert metrics.last()["round"] == 1 and "eval_accuracy" not in metrics.last()
    assert await node_at(tmp_path / "stopped", "--resume").run() == 0  # nothing left to train, one evaluation
    whole = [orjson.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_bytes().splitlines()]
    resumed = [orjson.loads(x) for x in metrics.path.read_bytes().splitlines()]
    assert [r["round"] for r in resumed] == [0, 1] and resumed[1]["eval_on_resume"]
    keys = ("eval_accuracy", "eval_distinct_answers", "reward_mean", "loss")
    assert [{k: r[k] for k in keys} for r in resumed] == [{k: r[k] for k in keys} for r in whole]


def test_a_resume_without_a_checkpoint_sets_the_earlier_rounds_aside(tmp_path, tiny):
    """Rounds of a start killed before its first checkpoint run again from round 0: their old lines move
    to metrics.orphaned.jsonl (kept) instead of standing twice in metrics.jsonl."""
    (tmp_path / "metrics.jsonl").write_text('{"round": 0, "reward_mean": 0.5}\n')
    node = two_round_node(tiny, tmp_path, "--resume")
    assert node.persistence.resume() is None
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert (tmp_path / "metrics.orphaned.jsonl").read_text() == '{"round": 0, "reward_mean": 0.5}\n'
    node.worker.shutdown()


def test_greedy_texts_come_back_in_prompt_order(tiny, caplog):
    """Batches are formed from length-sorted prompts; each text must still land on its own prompt. A model
    whose forward takes no cache or positions is decoded by its `generate`, with a warning."""
    _, tok = tiny

    class Echo(torch.nn.Module):  # "generates" the first real token of its prompt: text identifies prompt
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1))

        def forward(self, input_ids):  # nothing else: greedy_rows' call is a TypeError
            raise AssertionError("not called with these arguments")

        def generate(self, input_ids, attention_mask, **_):
            first = input_ids.gather(1, attention_mask.argmax(dim=1, keepdim=True))
            return torch.cat([input_ids, first, first], dim=1)

    prompts = ["z" * 9, "a", "q" * 5, "m" * 2, "k" * 7, "b"]
    texts = greedy_texts(Echo(), tok, prompts, max_new_tokens=2, batch_size=4)
    assert "falls back to generate" in caplog.text
    assert texts == [tok.decode(tok(p, add_special_tokens=False)["input_ids"][:1] * 2) for p in prompts]
    assert len(set(texts)) == len(prompts)


def test_common_prompt_prefix_runs_once_with_the_same_next_token_scores(tiny):
    """[prefix | pad | rest] on a cached prefix gives the scores of the plain left-padded layout."""
    from node.learn.kvcache import CommonPrefix

    model, tok = tiny
    mix = PRESETS["cpu-easy"]
    prompter = Prompter(tok, mix)
    prompts = [prompter(t) for t in eval_tasks(mix, 5)]
    ids = tok(prompts, add_special_tokens=False)["input_ids"]
    assert len({len(x) for x in ids}) > 1
    prefix = CommonPrefix.build(model, ids, 8)
    assert prefix is not None and len(prefix.ids) >= CommonPrefix.MIN_TOKENS
    assert all(x[: len(prefix.ids)] == prefix.ids for x in ids)
    input_ids, attn, cache = prefix.batch(ids, tok.pad_token_id)
    gen = {
        "do_sample": False,
        "max_new_tokens": 3,
        "output_scores": True,
        "return_dict_in_generate": True,
        "pad_token_id": tok.pad_token_id,
        "eos_token_id": None,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }
    shared = model.generate(input_ids=input_ids, attention_mask=attn, **cache_arg(cache), **gen)
    plain = model.generate(**tok(prompts, return_tensors="pt", padding=True, add_special_tokens=False), **gen)
    for a, b in zip(shared.scores, plain.scores):
        assert torch.allclose(a, b, atol=1e-4), (a - b).abs().max()
    assert CommonPrefix.build(model, [[1, 2, 3], [4, 5, 6]], 3) is None  # nothing in common


def test_a_finished_row_leaves_the_batch_and_the_others_decode_as_with_generate(tiny):
    """greedy_rows drops a row (and its cache rows) once it stops; every row's tokens are still the ones
    `generate` gives it, also for the rows that go on after others have left."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from node.learn.evaluate import greedy_rows
    from node.learn.kvcache import CommonPrefix, left_padded

    _, tok = tiny
    torch.manual_seed(0)  # large weights: the tiny-random model answers every prompt with the same token
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.5,
            tie_word_embeddings=True,
        )
    ).eval()
    prompter = Prompter(tok, PRESETS["cpu-easy"])
    ids = tok([prompter(t) for t in eval_tasks(PRESETS["cpu-easy"], 6)], add_special_tokens=False)["input_ids"]
    prefix = CommonPrefix.build(model, ids, 8)
    gen = {
        "do_sample": False,
        "max_new_tokens": 8,
        "pad_token_id": tok.pad_token_id,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }
    input_ids, attn, cache = prefix.batch(ids, tok.pad_token_id)
    free = model.generate(input_ids=input_ids, attention_mask=attn, **cache_arg(cache), eos_token_id=None, **gen)[
        :, input_ids.shape[1] :
    ].tolist()
    stops = sorted({free[0][1], free[2][4]})  # rows end at different steps; the others run to the cap

    def upto_stop(row: list[int]) -> list[int]:
        ends = [i for i, t in enumerate(row) if t in stops]
        return row[: ends[0] + 1] if ends else row

    expected = [upto_stop(row) for row in free]
    assert len({len(row) for row in expected}) > 1 and max(map(len, expected)) == 8
    input_ids, attn, cache = prefix.batch(ids, tok.pad_token_id)
    assert greedy_rows(model, input_ids, attn, cache, 8, stops) == expected
    assert cache.get_seq_length() == input_ids.shape[1] + 7  # the cache ended with the rows still decoding
    assert cache.layers[0].keys.shape[0] == sum(len(row) == 8 for row in expected)

    plain_ids, plain_attn = left_padded(ids, tok.pad_token_id)  # no prefix: the rows' own cache from scratch
    plain = model.generate(input_ids=plain_ids, attention_mask=plain_attn, eos_token_id=stops, **gen)
    assert greedy_rows(model, plain_ids, plain_attn, None, 8, stops) == [
        upto_stop(row) for row in plain[:, plain_ids.shape[1] :].tolist()
    ]


def test_greedy_rows_on_a_sliding_window_cache_gives_generates_tokens():
    """Gemma 3's cache mixes sliding-window and full layers; with a window (8) shorter than the sequences,
    rows that leave at different steps still get `generate`'s tokens."""
    from node.learn.evaluate import greedy_rows
    from node.learn.kvcache import left_padded

    torch.manual_seed(0)
    model = tiny_gemma3(300, 8, tie=False).eval()
    with torch.no_grad():  # large random weights: each row writes its own varied tokens
        for p in model.parameters():
            p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(1)
    ids, attn = left_padded([torch.randint(3, 300, (n,), generator=g).tolist() for n in (5, 12, 9, 3)], 0)
    gen = {
        "do_sample": False,
        "max_new_tokens": 10,
        "pad_token_id": 0,
        "temperature": None,
        "top_p": None,
        "top_k": None,
    }
    free = model.generate(input_ids=ids, attention_mask=attn, eos_token_id=None, **gen)[:, ids.shape[1] :].tolist()
    stops = sorted({free[0][2], free[3][5]})
    expected = [row[: next((i + 1 for i, t in enumerate(row) if t in stops), len(row))] for row in free]
    assert len({len(row) for row in expected}) > 1 and max(map(len, expected)) == 10
    assert ids.shape[1] + 10 > 8  # the window is exceeded
    assert greedy_rows(model, ids, attn, None, 10, stops) == expected


@pytest.mark.parametrize("window", [512, 64])
def test_a_sliding_window_model_shares_the_common_prefix_while_prompts_fit_its_window(tiny, window):
    """Gemma 3 (a sliding layer and a full one): the chat template and system prompt run once for the set
    when the longest prompt and its answer fit the window, with the greedy tokens of the unshared layout;
    past the window nothing is shared."""
    from node.learn.evaluate import greedy_rows
    from node.learn.kvcache import CommonPrefix, left_padded

    _, tok = tiny
    torch.manual_seed(0)
    model = tiny_gemma3(len(tok), window, pad_id=tok.pad_token_id).eval()
    with torch.no_grad():  # large random weights: varied tokens
        for p in model.parameters():
            p.normal_(0, 0.3)
    prompter = Prompter(tok, PRESETS["cpu-easy"])
    ids = tok([prompter(t) for t in eval_tasks(PRESETS["cpu-easy"], 4)], add_special_tokens=False)["input_ids"]
    assert 64 < max(map(len, ids)) and max(map(len, ids)) + 8 <= 512
    prefix = CommonPrefix.build(model, ids, 8)
    assert (prefix is not None) == (window == 512)
    plain_ids, plain_attn = left_padded(ids, tok.pad_token_id)
    expected = greedy_rows(model, plain_ids, plain_attn, None, 8, [])
    if prefix is not None:
        assert greedy_rows(model, *prefix.batch(ids, tok.pad_token_id), 8, []) == expected


def test_the_schedule_adds_early_rounds_to_every_n_and_the_last():
    """--eval-at 3,6 with --eval-every 10 (the quick start's): rounds 0, 3, 6, 10, 20, ... and the last; the
    progress view is told the next one; --eval-every 0 is off, early rounds included."""
    held = HeldOutEval(PRESETS["smoke"], 4, every=10, rounds=25, at=(3, 6))
    assert [r for r in range(25) if held.due(r)] == [0, 3, 6, 10, 20, 24]
    assert [held.next_due(r) for r in (0, 1, 4, 7, 11, 21, 24, 25)] == [0, 3, 6, 10, 20, 24, 24, None]
    off = HeldOutEval(PRESETS["smoke"], 4, every=0, rounds=25, at=(3,))
    assert not any(off.due(r) for r in range(25)) and off.next_due(0) is None
    assert load_config(["--eval-at", "6,3"], env={}).eval_rounds == (3, 6)
    assert load_config([], env={"SAPO_EVAL_AT": "3 6"}).eval_rounds == (3, 6)
    assert load_config([], env={}).eval_rounds == ()  # plain sapo-node: every 10 rounds, as before
    with pytest.raises(ConfigError, match="--eval-at"):
        load_config(["--eval-at", "3;six"], env={})
    quick = HeldOutEval(PRESETS["smoke"], 4, every=10, rounds=25, at=(3, 6), round0=False)
    assert [r for r in range(25) if quick.due(r)] == [3, 6, 10, 20, 24] and quick.next_due(0) == 3
    assert quick.enabled  # the starting weights are still evaluated (evaluation.start_due reads this)
    # the early points read the held-out set alone; the regular ones (and the last) the unseen set too
    assert [r for r in range(25) if quick.due(r) and quick.unseen_due(r)] == [10, 20, 24]
    assert load_config(["--no-eval-round0"], env={}).eval_round0 is False

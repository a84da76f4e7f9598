"""Held-out evaluation: greedy answers to the mix's fixed evaluation set, accuracy overall and per dataset.

The set comes from `tasks.eval_tasks` (a reserved index range no training task can come from). A mix
with a content split (`TaskMix.unseen_share`) has a second, *unseen* set in the same pass: tasks whose
content training never draws, so its accuracy shows what the node learned beyond the facts it saw.
Greedy decoding uses no random numbers, and the torch RNG state is restored anyway, so a run with
evaluation gives the same training records as one without.

The greedy answers come from torch (`greedy_texts`) or, with `--eval-engine`, from the rollout engine
(llama.cpp's `LlamaEngine.greedy`, on the weights it was synced to); each record names which
(`eval_engine`), and docs/EVALUATION.md says how far the two agree.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from node.learn.formats import stop_token_ids
from node.learn.groups import Prompter, score_responses
from node.learn.kvcache import CommonPrefix, cache_arg, generate_positions, left_padded, returned_cache
from node.learn.screen import answer_span
from node.learn.stop import StopRequest
from node.learn.tasks import Task, TaskMix, eval_tasks, extract_answer, score

if TYPE_CHECKING:
    from node.learn.engines import RolloutEngine

log = logging.getLogger(__name__)

MAX_ANSWER_CHARS = 40  # answers kept per task in metrics.jsonl (enough to tell a collapse)
MAX_OUTSIDE_CHARS = 120  # text outside each answer kept per task (enough to tell whose words they are)
EVAL_BATCH = 64  # prompts per decoding batch; 128 outgrows the memory allowance
# (docs/benchmarks/prefix-sharing-and-evaluation.md)


@dataclass
class EvalResult:
    accuracy: float  # mean reward (reasoning-gym's score in [0, 1]) over the whole set
    by_dataset: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    size: int = 0
    baseline: float | None = None  # what the best constant answer per dataset scores on this set
    scores: list[float] = field(default_factory=list)  # per task, in the set's fixed order
    answers: list[str | None] = field(default_factory=list)  # the extracted greedy answer per task
    # per task, the greedy completion's text outside the answer the reward reads (node/learn/screen.py): what
    # the canary compares with the starting weights' (another peer's text in our answers shows up here)
    outside: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)  # per task
    distinct_gold: float | None = None  # distinct_answers of the gold answers themselves
    baseline_by_dataset: dict[str, float] = field(default_factory=dict)
    unseen: EvalResult | None = None  # the unseen set's result, evaluated in the same pass (mixes with a split)
    engine: str = "torch"  # what decoded the greedy answers: torch, or the rollout engine's name (llama)

    def distinct_answers(self) -> float:
        return distinct_share(self.datasets, self.answers)

    def to_record(self, prefix: str = "eval", practised: frozenset[str] = frozenset()) -> dict:
        """Keys of a metrics.jsonl row: eval_accuracy, eval_accuracy/<dataset>, eval_s (the whole pass),
        eval_size, eval_baseline (the constant-answer yardstick), eval_distinct_answers, and per task (same
        order every evaluation, so two evaluations pair task by task) eval_scores and eval_answers, and
        eval_engine (what decoded them). With an unseen set, the same keys of it under eval_unseen_
        (eval_unseen_accuracy, ...; no eval_unseen_s or eval_unseen_engine). `prefix` "start": the starting
        weights' evaluation (start_accuracy, ..., start_unseen_accuracy, ...). `practised` (--practise: the
        datasets the node samples itself): the accuracy of each part too (`part_accuracies`)."""
        out = {
            **self.fields(prefix, practised),
            f"{prefix}_s": round(self.seconds, 4),
            f"{prefix}_engine": self.engine,
        }
        if self.unseen is not None:
            out.update(self.unseen.fields(f"{prefix}_unseen", practised))
        return out

    def part_accuracies(self, practised: frozenset[str]) -> dict[str, float]:
        """{"practised": mean score over the set's tasks of the practised datasets, "other": over the rest's}:
        whether a node that practises part of the mix learns the rest from its peers. A part with no task in
        this set has no entry; no `practised` (the whole mix practised), none at all."""
        out: dict[str, float] = {}
        for part, inside in (("practised", True), ("other", False)) if practised else ():
            scores = [x for x, name in zip(self.scores, self.datasets) if (name in practised) == inside]
            if scores:
                out[part] = sum(scores) / len(scores)
        return out

    def fields(self, prefix: str, practised: frozenset[str] = frozenset()) -> dict:
        out: dict = {f"{prefix}_accuracy": self.accuracy, f"{prefix}_size": self.size}
        out.update({f"{prefix}_accuracy_{part}": acc for part, acc in self.part_accuracies(practised).items()})
        out.update({f"{prefix}_accuracy/{name}": acc for name, acc in sorted(self.by_dataset.items())})
        if self.baseline is not None:
            out[f"{prefix}_baseline"] = self.baseline
        out.update({f"{prefix}_baseline/{name}": b for name, b in sorted(self.baseline_by_dataset.items())})
        if self.distinct_gold is not None:
            out[f"{prefix}_distinct_gold"] = round(self.distinct_gold, 4)
        if self.scores:
            out[f"{prefix}_distinct_answers"] = round(self.distinct_answers(), 4)
            out[f"{prefix}_scores"] = [round(x, 4) for x in self.scores]
            out[f"{prefix}_answers"] = [None if a is None else a[:MAX_ANSWER_CHARS] for a in self.answers]
            out[f"{prefix}_datasets"] = list(self.datasets)
        if self.outside:
            out[f"{prefix}_outside"] = [t[:MAX_OUTSIDE_CHARS] for t in self.outside]
        return out

    def log_line(self, r: int | None, practised: frozenset[str] = frozenset()) -> str:
        """One line for node.log; `r` None for the starting weights, evaluated before round 0. `practised`: each
        part's accuracy too."""
        when = f"after round {r}" if r is not None else "of the starting weights, before round 0"
        line = (
            f"held-out accuracy {self.accuracy:.3f} {when} ({self.size} tasks, greedy by {self.engine}, "
            f"{self.seconds:.1f}s; one constant answer per dataset scores {self.baseline or 0.0:.3f}"
            f"{_parts_text(self.part_accuracies(practised))})"
        )
        if self.unseen is not None:
            line += (
                f"; unseen accuracy {self.unseen.accuracy:.3f} ({self.unseen.size} tasks whose content "
                f"training never draws; constant answer {self.unseen.baseline or 0.0:.3f}"
                f"{_parts_text(self.unseen.part_accuracies(practised))})"
            )
        return line


def _parts_text(parts: dict[str, float]) -> str:
    """`; practised 0.400, other 0.250` (nothing without parts), for the log line."""
    return "".join(f"{'; ' if i == 0 else ', '}{part} {acc:.3f}" for i, (part, acc) in enumerate(parts.items()))


def distinct_share(datasets: list[str], answers: list[str | None]) -> float:
    """Distinct (dataset, answer) pairs, no answer not counted, over the number of tasks: near the gold
    answers' own share when a policy answers the questions, near (datasets / tasks) when it collapsed
    onto fixed answers."""
    return len({(d, a) for d, a in zip(datasets, answers) if a is not None}) / max(len(answers), 1)


def constant_answer_baselines(tasks: list[Task]) -> dict[str, float]:
    """Per dataset: the accuracy of the best answer that ignores the question (always "True", always
    "1"), chosen on this set."""
    by_dataset: dict[str, list[Task]] = {}
    for task in tasks:
        by_dataset.setdefault(task.spec.dataset, []).append(task)
    return {
        name: max(sum(score(t, answer) for t in group) for answer in {str(t.answer) for t in group}) / len(group)
        for name, group in by_dataset.items()
    }


def constant_answer_baseline(tasks: list[Task], by_dataset: dict[str, float] | None = None) -> float:
    """Accuracy of the best policy that ignores the question: one fixed answer per dataset (the one that
    scores best on this set). On short-answer mixes a collapsed policy lands exactly here, so held-out
    accuracy only shows learning where it is above this line. `by_dataset`: constant_answer_baselines of
    these tasks, when the caller has them already."""
    per = by_dataset if by_dataset is not None else constant_answer_baselines(tasks)
    counts: dict[str, int] = {}
    for task in tasks:
        counts[task.spec.dataset] = counts.get(task.spec.dataset, 0) + 1
    return sum(per[name] * n for name, n in counts.items()) / len(tasks) if tasks else 0.0


@torch.no_grad()
def greedy_texts(
    model: torch.nn.Module,
    tokenizer,
    prompts: list[str],
    max_new_tokens: int,
    batch_size: int,
    stop: StopRequest | None = None,
    compact: bool = True,
) -> list[str]:
    """Greedy completions, `batch_size` prompts per batch, decoded without special tokens, in the order of
    `prompts`. Batches hold prompts of similar length (sorted), so little of a batch is padding, and a row
    that has answered leaves its batch (`greedy_rows`; `compact=False` decodes with `generate` instead,
    every row until the batch's longest answer ends). A stop request ends it within one decoder layer
    (RoundAbandoned)."""
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    order = sorted(range(len(prompts)), key=lambda i: len(ids[i]))
    texts: list[str] = [""] * len(prompts)
    try:
        with stop.watch(model) if stop is not None else nullcontext():
            prefix = CommonPrefix.build(model, ids, max_new_tokens)  # the chat template and system prompt, once
        stop_ids = stop_token_ids(tokenizer)
        for start in range(0, len(prompts), batch_size):
            if stop is not None:
                stop.check()
            batch = order[start : start + batch_size]
            rows = [ids[i] for i in batch]
            with stop.watch(model) if stop is not None else nullcontext():
                new = None
                if compact:
                    try:
                        new = greedy_rows(
                            model,
                            *_batch_inputs(prefix, rows, tokenizer.pad_token_id, device),
                            max_new_tokens,
                            stop_ids,
                        )
                    except TypeError as exc:  # a model whose forward takes no positions or cache: generate
                        log.warning("greedy decoding falls back to generate (%s)", exc)
                        compact = False
                if new is None:  # fresh inputs: a failed greedy_rows may have left the cache half extended
                    input_ids, attn, cache = _batch_inputs(prefix, rows, tokenizer.pad_token_id, device)
                    out = model.generate(
                        input_ids=input_ids,
                        attention_mask=attn,
                        **cache_arg(cache),
                        do_sample=False,
                        max_new_tokens=max_new_tokens,
                        use_cache=True,
                        pad_token_id=tokenizer.pad_token_id,
                        eos_token_id=stop_ids,
                        temperature=None,
                        top_p=None,
                        top_k=None,
                    )
                    new = out[:, input_ids.shape[1] :]
            for i, text in zip(batch, tokenizer.batch_decode(new, skip_special_tokens=True)):
                texts[i] = text
    finally:
        model.train(was_training)
    return texts


def _batch_inputs(
    prefix: CommonPrefix | None, rows: list[list[int]], pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """(input ids, attention mask, cache or None) of a batch: on a copy of the common prefix's cache, or
    left-padded from scratch."""
    if prefix is not None:
        return prefix.batch(rows, pad_id)
    input_ids, attn = left_padded(rows, pad_id)
    return input_ids.to(device), attn.to(device), None


@torch.no_grad()
def greedy_rows(
    model: torch.nn.Module, ids: torch.Tensor, attn: torch.Tensor, cache, max_new_tokens: int, stop_ids: list[int]
) -> list[list[int]]:
    """Greedy decoding of a left-padded batch, continuing from `cache` (a DynamicCache holding the rows'
    first tokens) or from nothing (None). A row that emits a stop token leaves the batch, its cache rows
    with it: answers here are mostly a few tokens, and with `generate` one rambling row kept all the others
    decoding to the cap (a third of the row-steps did any work: docs/benchmarks/prefix-sharing-and-evaluation.md).
    Positions are counted as `generate` counts them, so each row gets `generate`'s tokens. Returns each row's new
    tokens, its stop token included."""
    positions = generate_positions(attn)
    start, length = (cache.get_seq_length() if cache is not None else 0), ids.shape[1]
    out = model(
        input_ids=ids[:, start:],
        attention_mask=attn,
        position_ids=positions[:, start:],
        **cache_arg(cache),
        cache_position=torch.arange(start, length, device=ids.device),
        use_cache=True,
        logits_to_keep=1,
    )
    logits, cache = out.logits[:, -1], returned_cache(out)
    rows, pos = torch.arange(ids.shape[0]), positions[:, -1:]
    stops = torch.tensor(stop_ids, device=ids.device)
    new: list[list[int]] = [[] for _ in range(ids.shape[0])]
    for step in range(max_new_tokens):
        token = logits.float().argmax(dim=-1)
        for row, t in zip(rows.tolist(), token.tolist()):
            new[row].append(t)
        running = ~torch.isin(token, stops)
        if step == max_new_tokens - 1 or not running.any():
            break
        if not running.all():
            keep = running.nonzero().squeeze(1)
            rows, token, attn, pos = rows[keep.cpu()], token[keep], attn[keep], pos[keep]
            cache.batch_select_indices(keep)
        attn = torch.cat([attn, attn.new_ones((attn.shape[0], 1))], dim=1)
        pos = pos + 1
        logits = model(
            input_ids=token[:, None],
            attention_mask=attn,
            position_ids=pos,
            **cache_arg(cache),
            cache_position=torch.tensor([length + step], device=ids.device),
            use_cache=True,
        ).logits[:, -1]
    return new


def evaluate(
    model: torch.nn.Module,
    tokenizer,
    prompter: Prompter,
    tasks: list[Task],
    max_new_tokens: int,
    batch_size: int = EVAL_BATCH,
    stop: StopRequest | None = None,
    unseen: list[Task] | None = None,
    engine: RolloutEngine | None = None,
) -> EvalResult:
    """Accuracy of greedy answers on `tasks`, scored by the same reward function as training; with
    `unseen`, that set's too (`.unseen`), generated in the same batches. With `engine` (one that has
    `greedy`, synced to `model`'s current weights), the engine decodes them instead of torch."""
    t0 = time.perf_counter()
    both = tasks + (unseen or [])
    prompts = [prompter(t) for t in both]
    rng_state = torch.random.get_rng_state()
    try:
        if engine is not None:
            texts = engine.greedy(prompts, max_new_tokens, stop=stop)  # type: ignore[attr-defined]  # eval_engine checks
        else:
            texts = greedy_texts(model, tokenizer, prompts, max_new_tokens, batch_size, stop)
    finally:
        torch.random.set_rng_state(rng_state)
    result = scored(tasks, texts[: len(tasks)], prompter)
    if unseen:
        result.unseen = scored(unseen, texts[len(tasks) :], prompter)
    result.seconds = time.perf_counter() - t0
    result.engine = engine.name if engine is not None else "torch"
    return result


def scored(tasks: list[Task], texts: list[str], prompter: Prompter) -> EvalResult:
    """The result of greedy `texts` (completions after the answer prefix) to `tasks`."""
    rewards: dict[str, list[float]] = {}
    flat: list[float] = []
    for task, text in zip(tasks, texts):
        (reward,) = score_responses(task, [prompter.answer_prefix + text])
        rewards.setdefault(task.spec.dataset, []).append(reward)
        flat.append(reward)
    return EvalResult(
        accuracy=sum(flat) / len(flat) if flat else 0.0,
        by_dataset={name: sum(v) / len(v) for name, v in rewards.items()},
        size=len(flat),
        scores=flat,
        answers=[extract_answer(prompter.answer_prefix + text) for text in texts],
        outside=[
            answer_span(prompter.answer_prefix + x, t, prompter.answer_prefix).outside for t, x in zip(tasks, texts)
        ],
        datasets=[t.spec.dataset for t in tasks],
    )


@dataclass
class EvalSet:
    """A fixed evaluation set and the yardsticks its accuracy is read against."""

    tasks: list[Task]
    baseline: float  # constant_answer_baseline of the tasks
    baseline_by_dataset: dict[str, float]
    distinct_gold: float  # distinct_share of the gold answers

    @staticmethod
    def of(tasks: list[Task]) -> EvalSet:
        by_dataset = constant_answer_baselines(tasks)
        return EvalSet(
            tasks,
            constant_answer_baseline(tasks, by_dataset),
            by_dataset,
            distinct_share([t.spec.dataset for t in tasks], [str(t.answer) for t in tasks]),
        )

    def label(self, result: EvalResult) -> EvalResult:
        result.baseline, result.distinct_gold = self.baseline, self.distinct_gold
        result.baseline_by_dataset = self.baseline_by_dataset
        return result


class HeldOutEval:
    """When a node evaluates (every `every` rounds from round 0, unless `round0` is off, after the rounds of
    `at`, and after its last round; `every` 0: never) and on what: the in-distribution set of `size` tasks
    and, where the mix splits by content, the unseen set of `unseen_size` tasks (0: `size`), `batch_size`
    prompts per torch decoding batch. `engine`: the rollout engine that decodes the answers (None: torch;
    node/learn/engines `eval_engine` chooses), which the caller syncs to the weights before `run`. Both sets
    cover the whole mix; `practised` (--practise) names the part the node samples, whose accuracy and the
    rest's its records add."""

    def __init__(
        self,
        mix: TaskMix,
        size: int,
        every: int,
        rounds: int,
        unseen_size: int = 0,
        batch_size: int = EVAL_BATCH,
        at: tuple[int, ...] = (),
        engine: RolloutEngine | None = None,
        round0: bool = True,
        practised: frozenset[str] = frozenset(),
    ):
        self.mix, self.size, self.every, self.rounds, self.round0 = mix, size, every, rounds, round0
        self.practised = practised  # --practise: its datasets, for each part's accuracy (empty: unset)
        self.batch_size, self.at, self.engine = batch_size, frozenset(at), engine
        self.unseen_size = unseen_size or size
        # --eval-share: the first evaluation (a fresh node's starting weights) through EvalShare.evaluate, so
        # peers on one machine that start alike evaluate once (node/learn/eval_share.py); later ones differ
        self.share_first: Callable[[torch.nn.Module, Callable[[], EvalResult], StopRequest | None], EvalResult] | None
        self.share_first = None
        self.seen: EvalSet | None = None  # built on first use, in the worker thread
        self.unseen: EvalSet | None = None  # stays None for a mix without a content split

    @property
    def tasks(self) -> list[Task] | None:
        return self.seen.tasks if self.seen is not None else None

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def due(self, r: int) -> bool:
        if not self.enabled:
            return False
        on_schedule = r % self.every == 0 and (r > 0 or self.round0)
        return on_schedule or r == self.rounds - 1 or r in self.at

    def unseen_due(self, r: int) -> bool:
        """Whether round r's evaluation covers the unseen set too: at every regular point (every N rounds, the
        last); the early points of `at` alone read the held-out set, half the cost, to show the first rise."""
        return r not in self.at or r == self.rounds - 1 or (self.enabled and r % self.every == 0)

    def next_due(self, r: int) -> int | None:
        """The first round from `r` on whose end brings an evaluation (None: none left), for the progress view."""
        if not self.enabled or r >= self.rounds:
            return None
        return next(k for k in range(r, self.rounds) if self.due(k))

    def run(
        self,
        model: torch.nn.Module,
        tokenizer,
        prompter: Prompter,
        max_new_tokens: int,
        stop: StopRequest | None = None,
        unseen: bool = True,
    ) -> EvalResult:
        """The greedy answers of the weights as they are, on the held-out set and (`unseen`, where the mix has
        one) the unseen set in the same pass."""
        if self.share_first is not None:
            share, self.share_first = self.share_first, None
            return share(model, lambda: self.run(model, tokenizer, prompter, max_new_tokens, stop, unseen), stop)
        if self.seen is None:
            self.seen = EvalSet.of(eval_tasks(self.mix, self.size))
            unseen_tasks = eval_tasks(self.mix, self.unseen_size, unseen=True)
            self.unseen = EvalSet.of(unseen_tasks) if unseen_tasks else None
        result = evaluate(
            model,
            tokenizer,
            prompter,
            self.seen.tasks,
            max_new_tokens,
            self.batch_size,
            stop=stop,
            unseen=self.unseen.tasks if self.unseen is not None and unseen else None,
            engine=self.engine,
        )
        if result.unseen is not None and self.unseen is not None:
            self.unseen.label(result.unseen)
        return self.seen.label(result)

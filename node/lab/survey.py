"""Task survey: which reasoning-gym datasets, configs and prompt formats give a model a learning signal.

RL with verifiable rewards turns what a model sometimes does into what it does first, so a dataset is
worth training on only where sampled pass@k is well above greedy pass@1 and guessing a fixed answer pays
little. A *cell* is (dataset, config level, prompt format, temperature, number of tasks); each is
measured on the dataset's held-out tasks (`tasks.eval_tasks`, the reserved index range) and appended as
one JSON line, so an interrupted survey resumes where it stopped (`scripts/research/survey_tasks.py`).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node.learn import gym
from node.learn.evaluate import constant_answer_baseline, greedy_texts
from node.learn.groups import Prompter, right_and_wrong, score_responses
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.tasks import (
    ANSWER_RULE,
    CPU_EASY_SYSTEM_PROMPT,
    PART_CONFIGS,
    Task,
    TaskMix,
    eval_tasks,
    extract_answer,
)


@dataclass(frozen=True)
class PromptFormat:
    """How the model is asked: system prompt, forced start of its turn, and its token budget."""

    system_prompt: str
    answer_prefix: str
    max_new_tokens: int


REASON_SYSTEM_PROMPT = (
    "Think in one or two short sentences, then give only the final answer inside <answer></answer> tags. "
    "Example: What is 7 - 2? 7 minus 2 leaves 5. <answer>5</answer>"
)

FORMATS: dict[str, PromptFormat] = {
    # the cpu-easy prompt: the answer tag is forced, the model has to answer at once
    "direct": PromptFormat(CPU_EASY_SYSTEM_PROMPT, "<answer>", 32),
    # a short reasoning budget before the tag
    "reason": PromptFormat(REASON_SYSTEM_PROMPT, "", 96),
}

# Smallest sensible settings of common datasets, below their defaults (negation, parentheses, division
# and long ranges are what made the default model fail on "easy" arithmetic). Other datasets get the
# generic rule of `easiest_config`.
ARITHMETIC_PARTS = ("basic_arithmetic", "chain_sum", "products")
EASIEST_OVERRIDES: dict[str, dict[str, Any]] = {
    # the arithmetic three as cpu-parts holds them (node/learn/tasks.py), without the node's answer rule
    **{name: {k: v for k, v in PART_CONFIGS[name].items() if k != ANSWER_RULE} for name in ARITHMETIC_PARTS},
    "decimal_chain_sum": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "min_decimal_places": 1,
        "max_decimal_places": 1,
    },
    "decimal_arithmetic": {"min_terms": 2, "max_terms": 2, "min_num_decimal_places": 1, "max_num_decimal_places": 1},
    "gcd": {"max_value": 30},
    "lcm": {"max_value": 12},
    "count_bits": {"min_n": 1, "max_n": 63},
    "count_primes": {"min_n": 1, "max_n": 30},
    "prime_factorization": {"max_value": 30},
    "letter_counting": {"min_words": 1, "max_words": 3},
    "leg_counting": {"min_animals": 1, "max_animals": 2, "min_instances": 1, "max_instances": 3},
    "number_sorting": {
        "min_numbers": 3,
        "max_numbers": 3,
        "min_decimals": 0,
        "max_decimals": 0,
        "min_value": 0.0,
        "max_value": 50.0,
    },
    "number_filtering": {
        "min_numbers": 3,
        "max_numbers": 3,
        "min_decimals": 0,
        "max_decimals": 0,
        "min_value": 0.0,
        "max_value": 50.0,
    },
    "number_sequence": {"min_terms": 4, "max_terms": 5, "min_value": 0, "max_value": 20, "max_complexity": 1},
    "spell_backward": {"min_word_len": 3, "max_word_len": 4},
    "word_sequence_reversal": {"min_words": 3, "max_words": 3},
    "word_sorting": {"min_words": 3, "max_words": 3, "min_word_length": 3, "max_word_length": 5},
    "simple_equations": PART_CONFIGS["simple_equations"],
    "base_conversion": {"max_base": 10, "max_value": 20},
    "coin_flip": {"min_trials": 3, "max_trials": 4},
    "ransom_note": {"max_note_length": 4, "max_magazine_length": 10},
    "power_function": {"min_base": -10.0, "max_base": 10.0, "min_exponent": 0, "max_exponent": 2},
    "complex_arithmetic": {
        "min_real": -3,
        "max_real": 3,
        "min_imag": -3,
        "max_imag": 3,
        "operations": ["+", "-"],
        "operations_weights": [0.5, 0.5],
    },
    "fraction_simplification": {"max_value": 20, "max_factor": 5, "styles": ["plain"]},
    "palindrome_generation": {"min_length": 3, "max_length": 4},
    "caesar_cipher": {"min_words": 1, "max_words": 2, "max_rotation": 3},
    "letter_jumble": {"min_word_len": 3, "max_word_len": 5, "min_words": 1, "max_words": 2},
    "polynomial_equations": {"min_terms": 2, "max_terms": 2, "max_value": 10, "min_degree": 1, "max_degree": 1},
    "calendar_arithmetic": {"offset_upper_bound": 10},
    "bitwise_arithmetic": {"difficulty": 1},
    "rotate_matrix": {"min_n": 2, "max_n": 2, "max_rotations": 3},
    "spiral_matrix": {"min_n": 2, "max_n": 3},
    "binary_matrix": {"min_n": 3, "max_n": 3},
    "dice": {"num_dice": 2, "max_dice_size": 6},
}


def default_config(name: str) -> dict[str, Any]:
    """The dataset's own defaults, as plain values (the 'harder' level)."""
    _, config_cls = gym.datasets()[name]
    return {
        f.name: _plain(getattr(config_cls(), f.name))
        for f in dataclasses.fields(config_cls)
        if f.name not in ("seed", "size")
    }


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def easiest_config(name: str) -> dict[str, Any]:
    """Overrides for the dataset, else the generic rule: every integer `min_X`/`max_X` pair shrinks to the
    lowest quarter of its range, an integer `difficulty` goes to 1. Only changed keys are returned."""
    if name in EASIEST_OVERRIDES:
        return dict(EASIEST_OVERRIDES[name])
    defaults = default_config(name)
    out: dict[str, Any] = {}
    for key, lo in defaults.items():
        if not key.startswith("min_"):
            continue
        hi = defaults.get("max_" + key[4:])
        if type(lo) is int and type(hi) is int and hi > lo:
            out["max_" + key[4:]] = lo + max(1, (hi - lo) // 4)
    if type(defaults.get("difficulty")) is int and defaults["difficulty"] > 1:
        out["difficulty"] = 1
    return out


def level_config(name: str, level: str) -> dict[str, Any]:
    """'easiest' or 'harder' (the dataset's defaults, as `{}` so specs stay short)."""
    return easiest_config(name) if level == "easiest" else {}


def single_mix(name: str, config: dict[str, Any], fmt: PromptFormat) -> TaskMix:
    return TaskMix(
        name=f"survey-{name}",
        datasets={name: {"weight": 1.0, "config": config}},
        system_prompt=fmt.system_prompt,
        answer_prefix=fmt.answer_prefix,
        max_new_tokens=fmt.max_new_tokens,
    )


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    """Some generators search for a long time (or forever) on odd configs; give up after `seconds`
    (SIGALRM, main thread only; no limit elsewhere)."""
    try:
        old = signal.signal(signal.SIGALRM, _raise_timeout)
    except ValueError:  # not the main thread
        yield
        return
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _raise_timeout(signum, frame):
    raise TimeoutError("task generation took too long")


def build_tasks(name: str, config: dict[str, Any], n: int, timeout_s: int = 60) -> list[Task]:
    """The first `n` held-out tasks of the dataset at this config (raises on any build failure)."""
    with time_limit(timeout_s):
        return eval_tasks(single_mix(name, config, FORMATS["direct"]), n)


@dataclass(frozen=True)
class Cell:
    dataset: str
    level: str  # "easiest" or "harder"
    fmt: str  # key of FORMATS
    temperature: float
    n_tasks: int

    def key(self) -> str:
        return f"{self.dataset}|{self.level}|{self.fmt}|t{self.temperature:g}|n{self.n_tasks}"


def measure_cell(
    model, tokenizer, cell: Cell, samples: int = 8, batch_tasks: int = 4, greedy_batch: int = 16, engine=None
) -> dict[str, Any]:
    """One survey record. Raises only on task-building failures (the caller records the error).

    Greedy answers always come from torch; the samples from `engine` (a RolloutEngine: llama.cpp samples
    the same weights 3-4x faster on a CPU, as a node with `--rollout-engine llama` does), else torch."""
    fmt = FORMATS[cell.fmt]
    config = level_config(cell.dataset, cell.level)
    tasks = build_tasks(cell.dataset, config, cell.n_tasks)
    mix = single_mix(cell.dataset, config, fmt)
    prompter = Prompter(tokenizer, mix)
    prompts = [prompter(t) for t in tasks]
    t0 = time.perf_counter()
    greedy = greedy_texts(model, tokenizer, prompts, fmt.max_new_tokens, greedy_batch)
    greedy_scores = [score_responses(t, [fmt.answer_prefix + text])[0] for t, text in zip(tasks, greedy)]
    t_greedy = time.perf_counter() - t0
    cfg = SamplingConfig(temperature=cell.temperature, max_new_tokens=fmt.max_new_tokens)
    solved = mixed = 0
    sample_scores: list[float] = []
    lengths: list[int] = []
    correct_answers: set[str] = set()
    for start in range(0, len(tasks), batch_tasks):
        chunk = tasks[start : start + batch_tasks]
        chunk_prompts = prompts[start : start + batch_tasks]
        groups = (
            engine.sample(chunk_prompts, samples, cfg)
            if engine is not None
            else sample_groups(model, tokenizer, chunk_prompts, samples, cfg)
        )
        for task, group in zip(chunk, groups):
            responses = [fmt.answer_prefix + text for text in group.texts]
            scores = score_responses(task, responses)
            sample_scores += scores
            lengths += [len(ids) for ids in group.completion_ids]
            solved += any(s >= 1.0 for s in scores)
            mixed += right_and_wrong(scores)
            correct_answers |= {str(extract_answer(r)) for r, s in zip(responses, scores) if s >= 1.0}
    correct_answers |= {str(extract_answer(fmt.answer_prefix + g)) for g, s in zip(greedy, greedy_scores) if s >= 1.0}
    seconds = time.perf_counter() - t0
    n = len(tasks)
    return {
        "key": cell.key(),
        **dataclasses.asdict(cell),
        "config": config,
        "samples": samples,
        "engine": engine.name if engine is not None else "torch",
        "greedy_acc": round(sum(greedy_scores) / n, 4),  # mean score, partial credit included
        "pass1": round(sum(s >= 1.0 for s in greedy_scores) / n, 4),
        f"pass{samples}": round(solved / n, 4),
        "sample_mean": round(sum(sample_scores) / len(sample_scores), 4),  # expected sampled reward
        "signal_frac": round(mixed / n, 4),  # groups with a right and a wrong answer: GRPO's signal
        "baseline": round(constant_answer_baseline(tasks), 4),
        "distinct_gold": len({t.answer for t in tasks}),
        "distinct_correct": len(correct_answers),
        "median_tokens": statistics.median(lengths) if lengths else 0,
        "s_per_task": round(seconds / n, 3),
        "greedy_s": round(t_greedy, 2),
        "examples": [
            {"q": tasks[i].question[-160:], "gold": tasks[i].answer[:60], "greedy": greedy[i][:120]}
            for i in range(min(2, n))
        ],
    }


# --- the cell log -----------------------------------------------------------------------------------


def load_records(path: Path) -> dict[str, dict[str, Any]]:
    """key -> record of a JSONL cell log (the last record of a key wins; torn last lines are skipped)."""
    out: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            out[rec["key"]] = rec
    return out


def append_record(path: Path, record: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as f:
        f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()


def run_cells(
    model, tokenizer, cells: list[Cell], log_path: Path, samples: int = 8, on_record=None, engine=None
) -> int:
    """Measures every cell not already in the log, appending each as it finishes; returns how many ran.
    A dataset that fails to build is recorded with its error (and not retried). The log is read again
    before each cell, so processes sharing one log skip what another has finished meanwhile."""
    ran = 0
    for cell in cells:
        if cell.key() in load_records(log_path):
            continue
        torch.manual_seed(0)
        try:
            record = measure_cell(model, tokenizer, cell, samples=samples, engine=engine)
        except Exception as exc:  # reasoning-gym generators fail in many ways
            record = {"key": cell.key(), **dataclasses.asdict(cell), "error": f"{type(exc).__name__}: {exc}"[:300]}
        append_record(log_path, record)
        ran += 1
        if on_record is not None:
            on_record(record)
    return ran


# --- the plan: stages, cheapest and most useful first --------------------------------------------------

SCREEN_TASKS = 16
STAGES = ("screen", "full", "harder", "rescreen", "harder-screen")


def passed_screen(
    records: dict[str, dict[str, Any]], name: str, fmt: str = "direct", temperature: float = 1.0
) -> bool | None:
    """Did the dataset's 16-task easiest cell in this format solve anything? None: not screened yet."""
    rec = records.get(Cell(name, "easiest", fmt, temperature, SCREEN_TASKS).key())
    if rec is None:
        return None
    return "error" not in rec and rec.get("pass8", 0) > 0


def stage_cells(
    stage: str,
    names: list[str],
    records: dict[str, dict[str, Any]],
    n_tasks: int,
    temperature: float,
    screen_formats: tuple[str, ...] = ("direct",),
) -> list[Cell]:
    """The cells of one stage, given what earlier stages recorded (see scripts/research/survey_tasks.py)."""
    if stage == "screen":
        return [Cell(n, "easiest", fmt, temperature, SCREEN_TASKS) for fmt in screen_formats for n in names]
    direct = {n: records.get(Cell(n, "easiest", "direct", temperature, SCREEN_TASKS).key()) for n in names}
    if stage == "rescreen":
        return [
            Cell(n, "easiest", "reason", temperature, SCREEN_TASKS)
            for n in names
            if passed_screen(records, n, temperature=temperature) is False and "error" not in (direct[n] or {})
        ]
    passed = [
        n
        for n in names
        if passed_screen(records, n, temperature=temperature) or passed_screen(records, n, "reason", temperature)
    ]
    if stage == "harder-screen":
        # a dataset never solved (or never built) at its easiest: does its default config differ, build, solve?
        return [
            Cell(n, "harder", "direct", temperature, SCREEN_TASKS)
            for n in names
            if n not in passed and direct[n] is not None and level_config(n, "easiest") != level_config(n, "harder")
        ]
    level = {"full": "easiest", "harder": "harder"}[stage]
    # format-major: the cheap direct cells of every dataset before the 3x longer reasoning ones
    return [Cell(n, level, fmt, temperature, n_tasks) for fmt in FORMATS for n in passed]


def summarize(log_path: Path, out_dir: Path) -> str:
    """survey.json (every record) and survey.md (a table, failures listed with their error) in out_dir;
    returns the markdown."""
    rows = sorted(load_records(log_path).values(), key=lambda r: (r["n_tasks"], r["dataset"], r["level"], r["fmt"]))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "survey.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n")
    lines = [
        "| dataset | level | format | n | pass@1 (greedy) | pass@8 | pass@8 − pass@1 | sampled mean "
        "| groups with signal | constant baseline | distinct gold / correct | median tokens | s/task | sampler |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    errors = []
    for r in rows:
        if "error" in r:
            errors.append(f"- {r['dataset']} ({r['level']}, {r['fmt']}): {r['error']}")
            continue
        passk = r[f"pass{r['samples']}"]
        lines.append(
            f"| {r['dataset']} | {r['level']} | {r['fmt']} | {r['n_tasks']} | {r['pass1']:.2f} | "
            f"{passk:.2f} | {passk - r['pass1']:+.2f} | {r['sample_mean']:.2f} | "
            f"{r['signal_frac']:.2f} | {r['baseline']:.2f} | {r['distinct_gold']} / {r['distinct_correct']} | "
            f"{r['median_tokens']:g} | {r['s_per_task']:.2f} | {r.get('engine', 'torch')} |"
        )
    text = "\n".join(lines) + ("\n\nFailed to build:\n" + "\n".join(errors) if errors else "") + "\n"
    (out_dir / "survey.md").write_text(text)
    return text


@dataclass(frozen=True)
class PresetRule:
    """What makes a dataset worth RL on this model (docs/experiments/task-survey.md): guessing pays little,
    sampling solves clearly more than greedy decoding (RL turns pass@k into pass@1), right answers are
    spread over many values, and completions are short enough for a CPU."""

    max_baseline: float = 0.15
    min_gap: float = 0.20  # pass@8 - pass@1
    min_distinct_correct: int = 8
    max_median_tokens: float = 48

    def admits(self, rec: dict[str, Any]) -> bool:
        return (
            "error" not in rec
            and rec["baseline"] <= self.max_baseline
            and rec[f"pass{rec['samples']}"] - rec["pass1"] >= self.min_gap
            and rec["distinct_correct"] >= self.min_distinct_correct
            and rec["median_tokens"] <= self.max_median_tokens
        )


def choose_preset(
    records: list[dict[str, Any]], rule: PresetRule = PresetRule(), min_tasks: int = 64, max_datasets: int = 4
) -> tuple[str | None, list[dict[str, Any]]]:
    """(format, admitted cells) of the format whose admitted cells carry the most signal in total (one
    format per mix: the prompt is the mix's), best cells first, one per dataset, at most `max_datasets`."""
    best: tuple[float, str | None, list[dict[str, Any]]] = (0.0, None, [])
    for fmt in sorted({r["fmt"] for r in records}):
        cells = sorted(
            (r for r in records if r["fmt"] == fmt and r["n_tasks"] >= min_tasks and rule.admits(r)),
            key=lambda r: r["signal_frac"],
            reverse=True,
        )
        chosen: list[dict[str, Any]] = []
        for r in cells:
            if r["dataset"] not in {c["dataset"] for c in chosen} and len(chosen) < max_datasets:
                chosen.append(r)
        total = sum(r["signal_frac"] for r in chosen)
        if total > best[0]:
            best = (total, fmt, chosen)
    return best[1], best[2]

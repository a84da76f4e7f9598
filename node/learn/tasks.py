"""Tasks: reasoning-gym task mixes, regenerable task specs, prompts and the verifiable reward.

A task instance is named by a small `TaskSpec` (dataset, config, seed, index). Any node can regenerate
the exact question and ground truth from it, so rewards of received rollouts are recomputed locally and
never taken from the sender.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from node.learn import answer_guard, gym
from node.learn.content import CONTENT_KEYS, is_reserved

# Every dataset is created with this size; items depend only on (seed, index), so any index below it is
# regenerable by any node (see docs/PROTOCOL.md).
DATASET_SIZE = 1_000_000
# Indices [EVAL_INDEX_START, DATASET_SIZE) of every dataset seed are the held-out evaluation's: the
# sampler never draws them (its counter wraps below), and no peer's group naming one is accepted
# (TaskMix.allows), so nothing a node trains on can be an evaluation task, whatever the seeds.
EVAL_INDEX_START = 900_000
# A mix with an unseen share also splits by content (node.learn.content): the sampler skips a reserved
# task, no peer's group naming one is accepted, and the unseen evaluation asks only reserved facts.
MAX_RESERVED_SKIP = 10_000  # consecutive reserved indices after which a dataset is deemed all reserved


@dataclass(frozen=True)
class TaskSpec:
    """Names one task instance; enough to regenerate question and ground truth anywhere."""

    dataset: str
    config: tuple[tuple[str, Any], ...]  # sorted (key, value) pairs, hashable
    seed: int
    index: int

    @staticmethod
    def make(dataset: str, config: dict[str, Any], seed: int, index: int) -> TaskSpec:
        return TaskSpec(dataset, _freeze(config), int(seed), int(index))

    def config_dict(self) -> dict[str, Any]:
        return {k: _thaw(v) for k, v in self.config}

    def to_wire(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "config": self.config_dict(), "seed": self.seed, "index": self.index}


def _freeze(value: Any) -> Any:
    if isinstance(value, dict):
        return tuple(sorted((str(k), _freeze(v)) for k, v in value.items()))
    if isinstance(value, list):
        return ("__list__",) + tuple(_freeze(v) for v in value)
    return value


def _thaw(value: Any) -> Any:
    if isinstance(value, tuple):
        if value and value[0] == "__list__":
            return [_thaw(v) for v in value[1:]]
        return {k: _thaw(v) for k, v in value}
    return value


@dataclass
class Task:
    """A regenerated task: the question shown to the model and the entry its scorer needs."""

    spec: TaskSpec
    question: str
    answer: str
    entry: dict[str, Any]


# A dataset config's key that reasoning-gym never sees: it travels in the task spec, so sender and receiver score alike
ANSWER_RULE, ANSWER_RULES = "answer_rule", ("exact", "result")
NODE_KEYS = frozenset({ANSWER_RULE})


@lru_cache(maxsize=256)
def _dataset(name: str, config: tuple, seed: int):
    return gym.create_dataset(
        name, seed=seed, size=DATASET_SIZE, **{k: v for k, v in _thaw(config).items() if k not in NODE_KEYS}
    )


class TaskError(ValueError):
    """A task spec that cannot be regenerated (unknown dataset, bad config, index out of range)."""


def regenerate(spec: TaskSpec) -> Task:
    """Rebuild question and ground truth from a spec, exactly as its publisher saw them."""
    if not 0 <= spec.index < DATASET_SIZE:
        raise TaskError(f"task index {spec.index} outside [0, {DATASET_SIZE})")
    try:
        entry = _dataset(spec.dataset, spec.config, spec.seed)[spec.index]
    except Exception as exc:  # reasoning-gym raises many kinds on bad configs
        raise TaskError(f"cannot regenerate {spec.dataset} {spec.config_dict()}: {exc}") from exc
    return Task(spec=spec, question=entry["question"], answer=str(entry["answer"]), entry=entry)


def read_answer(answer: str, rule: str) -> str:
    """The answer the scorer sees. `exact`: as written. `result`: an equation ("4 + 9 = 13") as its result, the
    text after its last "=" (reasoning-gym pays the equation only a fraction: docs/RESULTS.md 7a)."""
    if rule == "result" and "=" in answer:
        return answer.rsplit("=", 1)[1].strip()
    return answer


def score(task: Task, answer: str | None, memory_errors: bool = False) -> float:
    """reasoning-gym's own scorer on the extracted answer, read by the task's answer rule; no answer scores 0,
    nor one that the scorer would run as code or that is too long to score (node/learn/answer_guard.py).
    `memory_errors`: a scorer out of memory raises MemoryError rather than scoring 0 (the scoring sandbox,
    whose memory is capped: no score, where the publisher had its machine's memory)."""
    if answer is None:
        return 0.0
    answer = read_answer(answer, str(dict(task.spec.config).get(ANSWER_RULE, "exact")))
    if not answer_guard.admits(answer_guard.scorer_dataset(task.spec.dataset, task.entry), answer):
        return 0.0
    try:
        value = float(_dataset(task.spec.dataset, task.spec.config, task.spec.seed).score_answer(answer, task.entry))
    except MemoryError:
        if memory_errors:
            raise
        return 0.0
    except (Exception, SystemExit):  # SystemExit: a scorer's own eval of exit(); the guard should stop it first
        return 0.0
    return min(1.0, max(0.0, value))


def score_responses(task: Task, responses: list[str], memory_errors: bool = False) -> list[float]:
    """Each full response's reward: its extracted answer, scored (`memory_errors`: as `score`)."""
    return [score(task, extract_answer(r), memory_errors) for r in responses]


# --- prompt and answer extraction ---------------------------------------------------------------------

ANSWER_RE = re.compile(r"<answer>(.*?)(?:</answer>|$)", re.DOTALL)


def extract_answer(response: str) -> str | None:
    """The answer in a full assistant response.

    Rule: the text inside the last `<answer>...</answer>` pair; an unclosed `<answer>` runs to the end
    of its line. Without any tag, the last non-empty line (models that ignore the format still get a
    chance on one-word tasks). Returns None for an empty response.
    """
    matches = ANSWER_RE.findall(response)
    if matches:
        text = matches[-1]
        if "</answer>" not in response[response.rfind("<answer>") :]:
            text = text.split("\n", 1)[0]
        return text.strip()
    lines = [line.strip() for line in response.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


@dataclass
class TaskMix:
    """Which datasets a node samples from, with configs and weights, and how it prompts for them."""

    name: str
    datasets: dict[str, dict[str, Any]]  # dataset -> {"weight": float, "config": dict}
    system_prompt: str
    answer_prefix: str = ""  # forced start of the assistant turn, e.g. "<answer>"
    max_new_tokens: int = 256
    examples: dict[str, str] = field(default_factory=dict)  # optional one-line per-dataset example
    # share of the content space (datasets with a content key) reserved for the unseen evaluation; 0 = none
    unseen_share: float = 0.0

    def allows(self, spec: TaskSpec) -> bool:
        """Only datasets *and configs* of our own mix are accepted from peers, never an evaluation task:
        neither the held-out index range nor a task whose content the unseen evaluation reserves."""
        entry = self.datasets.get(spec.dataset)
        # repr, not ==: 1, 1.0 and true are equal in Python but other content on the wire (digests, copies)
        if entry is None or repr(_freeze(entry.get("config", {}))) != repr(spec.config) or is_eval_index(spec.index):
            return False
        if self.unseen_share > 0 and spec.dataset in CONTENT_KEYS:
            try:
                return not self.reserves(regenerate(spec))
            except TaskError:
                return True  # not this rule's call: the caller's own regeneration rejects it (bad_task)
        return True

    def reserves(self, task: Task) -> bool:
        """Whether the task's content belongs to the unseen evaluation (so training never sees it)."""
        return is_reserved(task.spec.dataset, task.entry, self.unseen_share)

    def has_unseen(self) -> bool:
        return self.unseen_share > 0 and any(name in CONTENT_KEYS for name in self.datasets)

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "datasets": self.datasets,
            "system_prompt": self.system_prompt,
            "answer_prefix": self.answer_prefix,
            "max_new_tokens": self.max_new_tokens,
            "examples": self.examples,
            "unseen_share": self.unseen_share,
        }


PAPER_SYSTEM_PROMPT = (
    "You are a careful reasoner. Think briefly, then give your final answer inside <answer></answer> tags."
)

PAPER_DATASETS = [
    "base_conversion",
    "basic_arithmetic",
    "arc_1d",
    "bf",
    "propositional_logic",
    "fraction_simplification",
    "decimal_arithmetic",
    "calendar_arithmetic",
    "binary_matrix",
]

# Measured with the default model: a generic one-line example plus a forced "<answer>" prefix makes it
# follow the format. (An example answer of 42 made it answer 42 everywhere.)
CPU_EASY_SYSTEM_PROMPT = (
    "Reply with only the final answer inside <answer></answer> tags. Example: What is 7 - 2? <answer>5</answer>"
)


def arithmetic_mix(name: str, terms: int, min_digits: int, max_digits: int) -> TaskMix:
    """cpu-learn's family: basic_arithmetic (+ and - only) and chain_sum, answers read by their result, the
    cpu-easy prompt, a fifth of the arithmetic facts kept for the unseen evaluation."""
    shape = {
        "min_terms": terms,
        "max_terms": terms,
        "min_digits": min_digits,
        "max_digits": max_digits,
        ANSWER_RULE: "result",
    }
    return TaskMix(
        name=name,
        datasets={
            "basic_arithmetic": {
                "weight": 1.0,
                "config": {**shape, "operators": ["+", "-"], "allow_parentheses": False, "allow_negation": False},
            },
            "chain_sum": {"weight": 1.0, "config": shape},
        },
        system_prompt=CPU_EASY_SYSTEM_PROMPT,
        answer_prefix="<answer>",
        max_new_tokens=32,
        unseen_share=0.2,
    )


# The survey's easiest configs (node/lab/survey.py easiest_config) of the datasets the specialists' rule admits
PART_CONFIGS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": {
        "min_terms": 2,
        "max_terms": 2,
        "min_digits": 1,
        "max_digits": 1,
        "operators": ["+", "-"],
        "allow_parentheses": False,
        "allow_negation": False,
        ANSWER_RULE: "result",
    },
    "chain_sum": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, ANSWER_RULE: "result"},
    "products": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, ANSWER_RULE: "result"},
    "simple_equations": {
        "min_terms": 2,
        "max_terms": 2,
        "max_value": 10,
        "operators": ["+", "-"],
        "operators_weights": [0.5, 0.5],
    },
    "calendar_arithmetic": {"offset_upper_bound": 10},
    "fraction_simplification": {"max_value": 20, "max_factor": 5, "styles": ["plain"]},
}


def parts_mix() -> TaskMix:
    """cpu-parts: the specialists' parts, equal weights, cpu-learn's prompt and answer prefix, a fifth of the
    arithmetic facts kept for the unseen evaluation (the datasets with a content key)."""
    return TaskMix(
        name="cpu-parts",
        datasets={name: {"weight": 1.0, "config": dict(config)} for name, config in PART_CONFIGS.items()},
        system_prompt=CPU_EASY_SYSTEM_PROMPT,
        answer_prefix="<answer>",
        max_new_tokens=32,
        unseen_share=0.2,
    )


PRESETS: dict[str, TaskMix] = {
    "paper": TaskMix(
        name="paper",
        datasets={name: {"weight": 1.0, "config": {}} for name in PAPER_DATASETS},
        system_prompt=PAPER_SYSTEM_PROMPT,
        answer_prefix="",
        max_new_tokens=512,
    ),
    "cpu-easy": TaskMix(
        name="cpu-easy",
        datasets={
            "count_bits": {"weight": 0.3, "config": {"min_n": 1, "max_n": 15}},
            "letter_counting": {"weight": 0.2, "config": {"min_words": 1, "max_words": 3}},
            "ransom_note": {"weight": 0.3, "config": {"max_note_length": 4, "max_magazine_length": 10}},
            "syllogism": {"weight": 0.2, "config": {}},
        },
        system_prompt=CPU_EASY_SYSTEM_PROMPT,
        answer_prefix="<answer>",
        max_new_tokens=32,
    ),
    # Chosen by the task survey's rule (docs/experiments/task-survey.md): guessing pays little (constant-answer
    # baseline <= 0.15), sampling solves clearly more than greedy decoding (pass@8 - pass@1 >= 0.20),
    # right answers are spread, completions short. Same prompt as cpu-easy (measured there). A fifth of its
    # arithmetic facts is reserved for the unseen evaluation (docs/RESULTS.md, "cpu-learn v2"). v3: an equation
    # answer is read by its result (RESULTS 7a); v2 and v3 configs differ, so neither takes the other's groups.
    "cpu-learn": arithmetic_mix("cpu-learn", terms=2, min_digits=1, max_digits=1),
    # Where a peer's own successes are scarce: the same with two-digit terms, chosen by a rule fixed before
    # measuring (docs/experiments/off-policy-sharing.md: 6% of fresh groups of 6 carry signal, greedy 0.04,
    # constant-answer baseline 0.05).
    "cpu-sparse": arithmetic_mix("cpu-sparse", terms=2, min_digits=2, max_digits=2),
    # Parts a specialist can practise (--practise), for peers that practise different things: the task survey's
    # datasets that pass a rule fixed before the pilot measured anything (docs/experiments/specialists.md:
    # sampling beats greedy by >= 0.14, a fixed answer scores <= 0.25, >= 8 different right answers, answers
    # shorter than the 32-token cap), each at the survey's easiest config and cpu-learn's prompt.
    "cpu-parts": parts_mix(),
    # Scorers that give graded partial credit even to random text: a tiny random model still produces
    # groups with a learning signal. For tests and smoke runs only.
    "smoke": TaskMix(
        name="smoke",
        datasets={
            "propositional_logic": {"weight": 1.0, "config": {}},
            "palindrome_generation": {"weight": 1.0, "config": {}},
        },
        system_prompt=CPU_EASY_SYSTEM_PROMPT,
        answer_prefix="<answer>",
        max_new_tokens=12,
    ),
    # For the learning test only (tests/e2e/test_learning.py): the default model can already do the task
    # (repeat a one-digit number), but the example teaches it the wrong answer format ("The answer is 4"
    # scores 1/15). Held-out accuracy starts near 0, the constant-answer baseline is about 0.19, and a
    # node that learns from its reward answers in the rewarded format within about five rounds.
    "test-learn": TaskMix(
        name="test-learn",
        datasets={
            "chain_sum": {"weight": 1.0, "config": {"min_terms": 1, "max_terms": 1, "min_digits": 1, "max_digits": 1}}
        },
        system_prompt="Reply with the final answer inside <answer></answer> tags. "
        "Example: What is 7 - 2? <answer>The answer is 5</answer>",
        answer_prefix="<answer>",
        max_new_tokens=8,
    ),
}


def resolve_mix(value: str | dict[str, Any]) -> TaskMix:
    """A preset name, a comma list of reasoning-gym datasets (default configs), or a mix table."""
    if isinstance(value, dict):
        base = PRESETS.get(str(value.get("base", "paper")))
        if base is None:
            raise TaskError(f"unknown base preset {value.get('base')!r}")
        mix = TaskMix(
            name=str(value.get("name", "custom")),
            datasets={
                k: {"weight": float(v.get("weight", 1.0)), "config": dict(v.get("config", {}))}
                for k, v in value.get("datasets", {}).items()
            },
            system_prompt=str(value.get("system_prompt", base.system_prompt)),
            answer_prefix=str(value.get("answer_prefix", base.answer_prefix)),
            max_new_tokens=int(value.get("max_new_tokens", base.max_new_tokens)),
            unseen_share=float(value.get("unseen_share", 0.0)),
        )
    elif value in PRESETS:
        mix = PRESETS[value]
    else:
        names = [n.strip() for n in str(value).split(",") if n.strip()]
        base = PRESETS["paper"]
        mix = TaskMix(
            name="custom",
            datasets={n: {"weight": 1.0, "config": {}} for n in names},
            system_prompt=base.system_prompt,
            max_new_tokens=base.max_new_tokens,
        )
    validate_mix(mix)
    return mix


def validate_mix(mix: TaskMix) -> None:
    if not mix.datasets:
        raise TaskError("task mix is empty")
    if not 0 <= mix.unseen_share < 1:
        raise TaskError(f"unseen_share must be in [0, 1) (got {mix.unseen_share})")
    for name, entry in mix.datasets.items():
        if not gym.is_dataset(name):
            raise TaskError(f"unknown reasoning-gym dataset {name!r} (presets: {', '.join(PRESETS)})")
        if float(entry.get("weight", 1.0)) <= 0:
            raise TaskError(f"dataset {name!r} needs a positive weight")
        rule = entry.get("config", {}).get(ANSWER_RULE, "exact")
        if rule not in ANSWER_RULES:
            raise TaskError(f"dataset {name!r}: answer_rule {rule!r} is not one of {', '.join(ANSWER_RULES)}")
        regenerate(TaskSpec.make(name, entry.get("config", {}), 0, 0))


class TaskSampler:
    """Draws task specs from a mix; its whole state is (rng state, counter), so it checkpoints exactly.

    The dataset seed is the node's seed: two nodes with different seeds see different questions. A task
    the mix reserves for the unseen evaluation is skipped (the counter moves on to the next index).
    `practised`: the datasets drawn and their weights (node/learn/practise.py, --practise); None: the whole
    mix at its weights, the same draws as a sampler given the whole mix.
    """

    def __init__(self, mix: TaskMix, seed: int, practised: dict[str, float] | None = None):
        self.mix = mix
        self.seed = seed
        self.rng = random.Random(seed)
        self.counter = 0
        weights = practised or {n: float(mix.datasets[n].get("weight", 1.0)) for n in mix.datasets}
        self._names = list(weights)
        self._weights = list(weights.values())

    def sample(self, n: int) -> list[Task]:
        tasks = []
        for _ in range(n):
            name = self.rng.choices(self._names, weights=self._weights, k=1)[0]
            config = self.mix.datasets[name].get("config", {})
            for _ in range(MAX_RESERVED_SKIP):
                task = regenerate(TaskSpec.make(name, config, self.seed, self.counter))
                self.counter = (self.counter + 1) % EVAL_INDEX_START  # never reaches the held-out range
                if not self.mix.reserves(task):
                    break
            else:
                raise TaskError(f"{name}: every task is reserved for the unseen evaluation")
            tasks.append(task)
        return tasks

    def state_dict(self) -> dict[str, Any]:
        return {"rng": json.dumps(self.rng.getstate()), "counter": self.counter}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        rng_state = json.loads(state["rng"])
        self.rng.setstate((rng_state[0], tuple(rng_state[1]), rng_state[2]))
        self.counter = int(state["counter"]) % EVAL_INDEX_START


def is_eval_index(index: int) -> bool:
    return EVAL_INDEX_START <= index < DATASET_SIZE


EVAL_SEED = 0  # dataset seed of the held-out set: the same tasks for every node and run of a mix


def eval_tasks(mix: TaskMix, size: int, unseen: bool = False) -> list[Task]:
    """The mix's fixed held-out set: `size` tasks from the reserved index range, datasets in proportion to
    their weights (largest remainders), so every dataset with weight gets a share and runs compare.
    In-distribution (default): the range's first tasks whose content the mix does not reserve. `unseen`:
    the first ones it does reserve, from the datasets that have a content key (empty without a split)."""
    names = [n for n in mix.datasets if not unseen or (mix.has_unseen() and n in CONTENT_KEYS)]
    if not names or size <= 0:
        return []
    weights = [float(mix.datasets[n].get("weight", 1.0)) for n in names]
    exact = [size * w / sum(weights) for w in weights]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(names)), key=lambda i: exact[i] - counts[i], reverse=True)[: size - sum(counts)]:
        counts[i] += 1
    tasks = []
    for name, count in zip(names, counts):
        config, found = mix.datasets[name].get("config", {}), list[Task]()
        for index in range(EVAL_INDEX_START, DATASET_SIZE):
            if len(found) == count:
                break
            task = regenerate(TaskSpec.make(name, config, EVAL_SEED, index))
            if mix.reserves(task) == unseen:
                found.append(task)
        if len(found) < count:
            raise TaskError(f"{name}: the evaluation range holds fewer than {count} such tasks")
        tasks += found
    return tasks


def build_messages(mix: TaskMix, task: Task) -> list[dict[str, str]]:
    """System prompt (format + optional one-line example) and the question as the user turn."""
    system = mix.system_prompt
    example = mix.examples.get(task.spec.dataset)
    if example:
        system = f"{system}\n{example}"
    return [{"role": "system", "content": system}, {"role": "user", "content": task.question}]

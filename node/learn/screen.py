"""The external screen (--external-screen): what of another peer's right answer this node learns.

A publisher that follows every rule (a valid key, fresh tasks of our mix, rewards exactly right) can still
put any text around a right answer, and GRPO pushes our model towards all of that completion's tokens with
positive advantage ("Hail to the Thief", arXiv 2511.09780). Only positive-advantage completions teach their
text (a negative advantage pushes away from it), so only those are screened, and only other peers' ones:

* span (short-answer mixes, those with a forced answer prefix such as cpu-learn): what is learned of a
  right answer is what the reward reads, the answer inside the last answer tags (the text after the last
  "=" under the `result` rule; the gold answer's own occurrence where a partial-credit scorer paid for it)
  with its tags and the end of the turn. Every other token leaves the loss (weight 0, still context:
  `masked_outside`). Masked, not dropped: the answer is still learned (an honest model's right answer often
  rambles on after it early in training: 6 of 16 honest right answers in a measured default-model swarm's
  first rounds), and a masked payload is never taught. `strict` also drops a completion with more than
  `max_outside_chars` characters outside that span, spaces not counted (`outside_answer`); that bound is
  also what node/swarm/screening.py counts as a publisher's text.
* reference (any mix, where a frozen reference exists: the base with the LoRA adapter off, or the KL copy):
  windows of `window` kept tokens whose mean log-likelihood under the reference lies far below what it gives
  our own completions (a low quantile of this and recent rounds' windows, minus `margin`, clamped to
  [`floor`, `ceiling`]) are masked (`masked_reference`); more than `max_masked_frac` masked drops the
  completion (`reference_unlikely`). The reference does not drift towards a payload as the policy would.

The canary (`Canary`) and the publisher evidence (`foreign_ngrams`) read the same outside text. Pure: the
trainer runs the reference pass, node/swarm/screening.py keeps the evidence per publisher.
"""

from __future__ import annotations

import math
import re
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from node.learn.choices import EXTERNAL_SCREENS
from node.learn.tasks import ANSWER_RULE, Task

OPEN, CLOSE = "<answer>", "</answer>"
WORD = re.compile(r"[^\W\d_]{2,}")  # words of two letters or more: numbers and symbols are no one's text


@dataclass(frozen=True)
class ScreenConfig:
    mode: str = "off"  # one of EXTERNAL_SCREENS
    max_outside_chars: int = 12  # non-space characters outside the answer span: dropped (strict), evidence
    window: int = 4  # tokens per reference window
    quantile: float = 0.05  # of our own completions' window means
    margin: float = 2.0  # nats per token below that quantile
    floor: float = -8.0  # the threshold is never lower (a weak calibration cannot switch the screen off) ...
    ceiling: float = -2.5  # ... nor higher (a confident calibration cannot reject a specialist's rare answer)
    max_masked_frac: float = 0.5  # of a completion's kept tokens masked by the reference: dropped instead
    calibration_rounds: int = 8  # rounds of our own windows the threshold is drawn from
    min_calibration: int = 16  # windows below which the threshold is `floor`

    def __post_init__(self) -> None:
        if self.mode not in EXTERNAL_SCREENS:
            raise ValueError(f"external screen must be one of {EXTERNAL_SCREENS}, got {self.mode!r}")

    @property
    def spans(self) -> bool:
        return self.mode in ("on", "strict", "span")

    @property
    def reference(self) -> bool:
        return self.mode in ("on", "strict", "reference")

    @property
    def drops_outside(self) -> bool:
        return self.mode == "strict"


# --- the answer span: which characters of a response the reward reads -----------------------------------


@dataclass(frozen=True)
class AnswerSpan:
    """Character ranges of a full response (forced prefix included) that are kept, and the text outside them."""

    kept: tuple[tuple[int, int], ...]
    outside: str  # everything else, the forced prefix left out, as one string (spaces kept)

    @property
    def outside_chars(self) -> int:
        return sum(not ch.isspace() for ch in self.outside)


def answer_span(response: str, task: Task | None = None, prefix: str = OPEN) -> AnswerSpan:
    """What the reward reads of `response` (tasks.extract_answer's rule: the last answer tags, an unclosed one
    to its line's end), narrowed by the task's answer rule and, where the gold answer occurs inside a longer
    read answer, to that occurrence (a partial-credit scorer pays for it; the rest is what it docked). The
    tags themselves are kept; the forced prefix belongs to the prompt and counts as neither."""
    start = response.rfind(OPEN)
    if start < 0:  # no tag: nothing is the answer (a short-answer mix always forces one)
        return AnswerSpan((), response[len(prefix) :] if prefix and response.startswith(prefix) else response)
    inner = start + len(OPEN)
    close = response.find(CLOSE, inner)
    line_end = response.find("\n", inner)
    end = close if close >= 0 else line_end if line_end >= 0 else len(response)
    a, b = _stripped(response, inner, end)
    rule = str(dict(task.spec.config).get(ANSWER_RULE, "exact")) if task is not None else "exact"
    if rule == "result" and "=" in response[a:b]:
        a, b = _stripped(response, response.rindex("=", a, b) + 1, b)
    read = response[a:b]
    gold = task.answer if task is not None else ""
    if gold and read != gold and gold in read:
        a += read.rindex(gold)
        b = a + len(gold)
    kept = [(start, inner), (a, b)] + ([(close, close + len(CLOSE))] if close >= 0 else [])
    if prefix and response.startswith(prefix) and start < len(prefix):
        kept[0] = (start, start)  # the forced prefix is prompt, not completion
    skip = len(prefix) if prefix and response.startswith(prefix) else 0
    outside = "".join(ch for i, ch in enumerate(response) if i >= skip and not _inside(i, kept))
    return AnswerSpan(tuple(r for r in kept if r[1] > r[0]), outside)


def _stripped(text: str, a: int, b: int) -> tuple[int, int]:
    while a < b and text[a].isspace():
        a += 1
    while b > a and text[b - 1].isspace():
        b -= 1
    return a, b


def _inside(i: int, ranges: Sequence[tuple[int, int]]) -> bool:
    return any(a <= i < b for a, b in ranges)


def span_weights(tokenizer, body: str, completion_ids: list[int], kept: Sequence[tuple[int, int]]) -> list[float]:
    """Per completion token (ids = tokenizer(body) + EOS), 1.0 where the token overlaps a kept character range
    of `body`, else 0.0; the EOS that ends the turn is kept. Character offsets from a fast tokenizer; without
    them (or where they disagree with `completion_ids`), from decoding each prefix of the ids."""
    spans = _token_chars(tokenizer, body, completion_ids)
    weights = [1.0 if any(a < e and s < b for a, b in kept) else 0.0 for s, e in spans]
    return weights + [1.0] * (len(completion_ids) - len(weights))


def _token_chars(tokenizer, body: str, completion_ids: list[int]) -> list[tuple[int, int]]:
    body_ids = (
        completion_ids[:-1] if completion_ids and completion_ids[-1] == tokenizer.eos_token_id else completion_ids
    )
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(body, add_special_tokens=False, return_offsets_mapping=True)
        if list(enc["input_ids"]) == list(body_ids):
            return [tuple(o) for o in enc["offset_mapping"]]
    out, done = [], 0
    for k in range(1, len(body_ids) + 1):
        upto = len(tokenizer.decode(body_ids[:k]))
        out.append((done, max(done, upto)))
        done = max(done, upto)
    return out


# --- reference likelihood windows -------------------------------------------------------------------------


def window_means(logps: Sequence[float], n: int) -> list[float]:
    """Mean log-prob of every run of n consecutive tokens (one window of all of them when fewer)."""
    if not logps:
        return []
    if len(logps) <= n:
        return [sum(logps) / len(logps)]
    return [sum(logps[i : i + n]) / n for i in range(len(logps) - n + 1)]


def reference_mask(logps: Sequence[float], threshold: float, n: int) -> list[bool]:
    """Per token, whether it lies in a window whose mean reference log-prob is below `threshold`."""
    flagged = [False] * len(logps)
    if len(logps) <= n:
        return [True] * len(logps) if logps and sum(logps) / len(logps) < threshold else flagged
    for i, mean in enumerate(window_means(logps, n)):
        if mean < threshold:
            flagged[i : i + n] = [True] * n
    return flagged


@dataclass
class Calibration:
    """Our own completions' reference window means over the last rounds: what the reference gives text we
    wrote, the yardstick for another peer's."""

    cfg: ScreenConfig
    rounds: deque = field(default_factory=deque)

    def add_round(self, windows: list[float]) -> None:
        self.rounds.append(windows)
        while len(self.rounds) > self.cfg.calibration_rounds:
            self.rounds.popleft()

    def threshold(self) -> float:
        values = sorted(v for r in self.rounds for v in r)
        if len(values) < self.cfg.min_calibration:
            return self.cfg.floor
        low = values[min(len(values) - 1, int(self.cfg.quantile * len(values)))]
        return min(self.cfg.ceiling, max(self.cfg.floor, low - self.cfg.margin))


# --- what the screen did this round ----------------------------------------------------------------------

DROP_REASONS = ("outside_answer", "reference_unlikely")
MASK_REASONS = ("masked_outside", "masked_reference")


@dataclass
class ScreenReport:
    """One round's screen: completions dropped or masked and why, per publisher; tokens kept and masked."""

    mode: str = "off"
    reference: str = "none"  # what the reference screen read: base (LoRA off), copy (the KL model), none
    screened: int = 0  # positive-advantage external completions looked at
    tokens: int = 0  # their tokens (ours)
    masked_tokens: int = 0  # of those, out of the loss (dropped completions' tokens included)
    threshold: float | None = None
    by_reason: Counter = field(default_factory=Counter)
    by_publisher: dict[str, Counter] = field(default_factory=dict)

    def count(self, source: str, reason: str, tokens: int = 0) -> None:
        self.by_reason[reason] += 1
        row = self.by_publisher.setdefault(source, Counter())
        row[reason] += 1
        row["masked_tokens"] += tokens

    def to_record(self) -> dict:
        return {
            "external_screen": self.mode,
            "screen_reference": self.reference,
            "screened_completions": self.screened,
            "screened_by_reason": dict(self.by_reason),
            "screened_tokens_frac": round(self.masked_tokens / self.tokens, 4) if self.tokens else 0.0,
            "screened_by_publisher": {k: dict(v) for k, v in self.by_publisher.items()},
            "screen_threshold": None if self.threshold is None else round(self.threshold, 3),
        }


# --- outside text as evidence: publishers' recurring phrases and our own held-out answers -------------------


def foreign_ngrams(text: str, n: int = 3) -> set[str]:
    """Word n-grams of `text` (letters only, lower case; numbers and symbols are nobody's payload); a text of
    fewer words is one n-gram of all of them, none when it has no word."""
    words = [w.lower() for w in WORD.findall(text)]
    if len(words) < n:
        return {" ".join(words)} if words else set()
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


@dataclass(frozen=True)
class CanaryReading:
    share: float  # of held-out answers carrying a recurring phrase absent from the starting weights' answers
    phrases: list[str]  # the most common such phrases
    alarm: bool


@dataclass
class Canary:
    """Our held-out greedy answers start carrying text we did not write at the start: a phrase (word 3-gram)
    absent from every starting answer's outside text that recurs in at least `min_answers` answers (and
    `min_share` of them) marks them; `alarm_share` of the answers marked raises the alarm."""

    baseline: set[str] | None = None
    min_answers: int = 3
    min_share: float = 0.1
    alarm_share: float = 0.25

    def start(self, outside: list[str]) -> None:
        self.baseline = set().union(*(foreign_ngrams(t) for t in outside)) if outside else set()

    def read(self, outside: list[str]) -> CanaryReading:
        if self.baseline is None or not outside:
            return CanaryReading(0.0, [], False)
        grams = [foreign_ngrams(t) - self.baseline for t in outside]
        counts = Counter(g for gs in grams for g in gs)
        need = max(self.min_answers, math.ceil(self.min_share * len(outside)))
        recurring = {g for g, c in counts.items() if c >= need}
        share = sum(bool(gs & recurring) for gs in grams) / len(outside)
        top = [g for g, _ in counts.most_common() if g in recurring][:3]
        return CanaryReading(round(share, 4), top, share >= self.alarm_share)


# --- one node's screen: the span part (to_sequences) and the reference part (the trainer) ------------------


class ExternalScreen:
    """The screen a node applies every round; it keeps our own completions' reference windows (the
    calibration) and the round's report, which `to_sequences` starts and the trainer's step hands on."""

    def __init__(self, cfg: ScreenConfig):
        self.cfg = cfg
        self.calibration = Calibration(cfg)
        self.report = ScreenReport(mode=cfg.mode)

    @property
    def active(self) -> bool:
        return self.cfg.mode != "off"

    def begin(self) -> None:
        """A new round's report (a round abandoned before its step leaves nothing behind)."""
        self.report = ScreenReport(mode=self.cfg.mode)

    def take(self) -> ScreenReport:
        report, self.report = self.report, ScreenReport(mode=self.cfg.mode)
        return report

    def shape(
        self, tokenizer, task: Task, body: str, completion_ids: list[int], prefix: str, source: str
    ) -> list[float] | None | bool:
        """The span part for one positive-advantage external completion (`body`: its text after our prompt,
        which ends with `prefix`): per-token weights, None when every token is kept, False when dropped."""
        self.report.screened += 1
        self.report.tokens += len(completion_ids)
        if not (self.cfg.spans and prefix):
            return None
        span = answer_span(prefix + body, task, prefix)
        if self.cfg.drops_outside and span.outside_chars > self.cfg.max_outside_chars:
            self.report.count(source, "outside_answer", len(completion_ids))
            self.report.masked_tokens += len(completion_ids)
            return False
        kept = [(a - len(prefix), b - len(prefix)) for a, b in span.kept]
        weights = span_weights(tokenizer, body, completion_ids, kept)
        masked = int(sum(w == 0.0 for w in weights))
        if not masked:
            return None
        self.report.count(source, "masked_outside", masked)
        self.report.masked_tokens += masked
        return weights

    def judge_reference(
        self, own: list[list[float]], theirs: list[tuple[str, list[float], list[float]]], reference: str
    ) -> list[list[float] | None]:
        """The reference part: `own` our completions' reference log-probs this round (the calibration),
        `theirs` per screened completion (publisher, reference log-probs, weights so far). Per screened
        completion its new weights, or None when it is dropped."""
        self.report.reference = reference
        n = self.cfg.window
        if own:
            self.calibration.add_round([m for lp in own for m in window_means(lp, n)])
        threshold = self.calibration.threshold()
        self.report.threshold = threshold
        out: list[list[float] | None] = []
        for source, logps, weights in theirs:
            kept = [i for i, w in enumerate(weights) if w > 0]
            flagged = reference_mask([logps[i] for i in kept], threshold, n)
            hits = [i for i, f in zip(kept, flagged) if f]
            if len(hits) > self.cfg.max_masked_frac * len(kept):
                self.report.count(source, "reference_unlikely", len(kept))
                self.report.masked_tokens += len(kept)
                out.append(None)
                continue
            if hits:
                self.report.count(source, "masked_reference", len(hits))
                self.report.masked_tokens += len(hits)
                weights = [0.0 if i in set(hits) else w for i, w in enumerate(weights)]
            out.append(weights)
        return out

"""The collapse guard: notice a policy that has collapsed onto guessing, and say what to do about it.

A collapsed policy answers without reading the question: its held-out accuracy sinks to what one fixed
answer per dataset scores (the constant-answer baseline), and its greedy answers stop varying with the
question. docs/RESULTS.md defines a collapsed peer by exactly these two signs:

    accuracy <= baseline + margin      or      distinct answers < half of the gold answers' share

A base model that has learned nothing yet can meet that definition at round 0 (on `cpu-learn` it does),
so the guard judges a policy against its own best evaluation, not against the definition alone: it acts
when an evaluation is collapsed by the definition AND clearly worse than the best one so far (accuracy
down by `drop`; or below the constant-answer baseline itself and down by `margin`, the babbling kind of
collapse, where greedy answers become more varied than the gold answers and worse than one fixed guess; or
distinct answers down to under half of the best's). The best evaluation is the
restore point: the node snapshots its weights there, and on a collapse it puts them back and multiplies
its learning rate by `lr_factor`. The guard only decides; the node does the saving and restoring.

It decides at held-out evaluations (every --eval-every rounds); with evaluation off it never acts. Its
first is of the starting weights, before round 0's update (START_ROUND): an update at a rate far too high
can collapse the policy at once, and a first reference taken after it would be a collapse with nothing
better to go back to.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

MARGIN = 0.05  # accuracy within this of the constant-answer baseline is guessing, not answering
START_ROUND = -1  # the evaluation of the starting weights, before round 0's update: "after round -1"


def round_name(r: int) -> str:
    return "the start" if r == START_ROUND else f"round {r}"


def weights_name(r: int) -> str:
    return "the starting weights" if r == START_ROUND else f"the weights of round {r}"


@dataclass(frozen=True)
class EvalSummary:
    """The part of a held-out evaluation the guard reads (node/learn/evaluate.py `EvalResult`)."""

    round: int
    accuracy: float
    baseline: float
    distinct: float  # distinct (dataset, answer) pairs per task of the greedy answers
    distinct_gold: float  # the same share for the gold answers

    @classmethod
    def from_record(cls, r: int, rec: dict[str, Any], prefix: str = "eval") -> EvalSummary | None:
        """From a metrics record; None when the round ran no evaluation (or an old one without the fields).
        prefix "start": round 0's record's evaluation of the starting weights (r = START_ROUND)."""
        keys = tuple(f"{prefix}_{k}" for k in ("accuracy", "baseline", "distinct_answers", "distinct_gold"))
        if any(rec.get(k) is None for k in keys):
            return None
        return cls(r, *(float(rec[k]) for k in keys))


def collapse_signs(e: EvalSummary, margin: float = MARGIN) -> list[str]:
    """Which of the documented signs of collapse (docs/RESULTS.md) `e` shows, in words; [] for none."""
    signs = []
    if e.accuracy <= e.baseline + margin:
        signs.append(f"held-out accuracy {e.accuracy:.3f} is within {margin} of the constant answer ({e.baseline:.3f})")
    if e.distinct < 0.5 * e.distinct_gold:
        signs.append(f"distinct greedy answers {e.distinct:.3f} are under half the gold answers' {e.distinct_gold:.3f}")
    return signs


def collapsed(e: EvalSummary, margin: float = MARGIN) -> bool:
    """The documented definition of a collapsed policy: guessing, or not varying its answers."""
    return bool(collapse_signs(e, margin))


@dataclass
class GuardConfig:
    enabled: bool = True
    margin: float = MARGIN
    drop: float = 0.10  # accuracy this far below the best evaluation counts as worse
    lr_factor: float = 0.5  # learning rate multiplier on every restore
    min_lr_scale: float = 1 / 64  # never lower the rate below this share of the configured one


@dataclass
class GuardState:
    """JSON-safe; lives in the node's checkpoint state so a resumed node keeps its restore point and rate."""

    best: dict[str, Any] | None = None  # EvalSummary fields of the restore point
    lr_scale: float = 1.0
    restores: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)  # the restores: round, reason, restored_to
    lost_restore_point: bool = False  # a restore failed: the next restore point must not be a collapse


@dataclass(frozen=True)
class Verdict:
    """What the node does after an evaluation: `snapshot` (a new restore point), `restore` (a collapse:
    restore the restore point and use `lr_scale`), or `keep` (nothing)."""

    action: str
    reason: str = ""
    restored_to: int | None = None
    lr_scale: float = 1.0


class CollapseGuard:
    def __init__(self, cfg: GuardConfig | None = None):
        self.cfg = cfg or GuardConfig()
        self.state = GuardState()

    @property
    def best(self) -> EvalSummary | None:
        return EvalSummary(**self.state.best) if self.state.best else None

    def judge(self, e: EvalSummary) -> Verdict:
        """Decide after evaluation `e`; updates the restore point and the rate scale."""
        s, best = self.state, self.best
        if not self.cfg.enabled:
            return Verdict("keep", lr_scale=s.lr_scale)
        reason = self._worse_than_best(e, best) if best is not None else ""
        if best is None or not reason:  # a collapse is never a restore point, however its accuracy compares
            if s.lost_restore_point and collapsed(e, self.cfg.margin):
                return Verdict("keep", lr_scale=s.lr_scale)  # still the weights the failed restore left
            if best is None or e.accuracy > best.accuracy:
                s.best, s.lost_restore_point = asdict(e), False
                return Verdict("snapshot", lr_scale=s.lr_scale)
            return Verdict("keep", lr_scale=s.lr_scale)
        s.lr_scale = max(s.lr_scale * self.cfg.lr_factor, self.cfg.min_lr_scale)
        s.restores += 1
        s.history.append({"round": e.round, "reason": reason, "restored_to": best.round, "lr_scale": s.lr_scale})
        del s.history[:-50]
        return Verdict("restore", reason, best.round, s.lr_scale)

    def restore_failed(self) -> None:
        """The restore point could not be loaded (deleted, corrupt): no restore happened and there is no best
        to go back to; the next evaluation that is not a collapse becomes the restore point. The lower
        learning rate stays: it is the other half of the answer to a collapse."""
        self.state.restores -= 1
        self.state.best, self.state.lost_restore_point = None, True
        if self.state.history:
            self.state.history[-1]["failed"] = True

    def _worse_than_best(self, e: EvalSummary, best: EvalSummary) -> str:
        """Why `e` is a collapse from `best` ("" when it is not one)."""
        signs = collapse_signs(e, self.cfg.margin)
        if not signs:
            return ""
        if best.accuracy - e.accuracy >= self.cfg.drop:
            return f"{' and '.join(signs)}; accuracy {best.accuracy - e.accuracy:.3f} below {round_name(best.round)}'s"
        if e.accuracy < e.baseline and best.accuracy - e.accuracy >= self.cfg.margin:
            return (
                f"held-out accuracy {e.accuracy:.3f} is below the constant answer's ({e.baseline:.3f}) and "
                f"{best.accuracy - e.accuracy:.3f} below {round_name(best.round)}'s"
            )
        if e.distinct < 0.5 * best.distinct:
            return (
                f"distinct greedy answers fell to {e.distinct:.3f} from {best.distinct:.3f} at "
                f"{round_name(best.round)} (gold answers: {e.distinct_gold:.3f})"
            )
        return ""

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.state = GuardState(**state) if state else GuardState()

"""A node's held-out evaluations and the collapse guard's reading of them, apart from the round loop.

Three moments evaluate the weights: the starting weights before round 0 (the guard's first restore point, and
the run's before-training figures in round 0's record), every round whose evaluation is due (--eval-every),
and, on resume, a round whose due evaluation a stop skipped. After each, the collapse guard keeps the
weights, makes them the restore point, or puts the restore point's weights back at a lower learning rate
(node/learn/guard.py decides; docs/OPERATING.md). Kept out of node/loop.py so that the loop reads as the
algorithm: `SapoNode.run_round` calls `after_round`, and learns whether the weights were replaced.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from node.learn.evaluate import EvalResult, HeldOutEval
from node.learn.guard import START_ROUND, CollapseGuard, EvalSummary, round_name, weights_name
from node.learn.screen import Canary
from node.learn.stop import RoundAbandoned
from node.learn.trainer import Trainer
from node.ops.checkpoint import CheckpointError
from node.ops.live import LiveState, PhaseTimer
from node.ops.metrics import MetricsWriter, read_records
from node.persistence import Persistence

log = logging.getLogger("sapo.node")

CANARY_EVERY = 20  # rounds between two canary warnings


@dataclass(eq=False, repr=False)
class NodeEvaluation:
    """When a node evaluates, what goes into its records, and the guard's restores. `held_out_run` evaluates
    the weights as they are in the node's model thread (RoundAbandoned on a stop); `in_worker` runs a call
    there."""

    held_out: HeldOutEval
    guard: CollapseGuard
    persistence: Persistence
    metrics: MetricsWriter
    trainer: Trainer
    live: LiveState
    held_out_run: Callable[[bool], Awaitable[EvalResult]]  # True: the unseen set too
    in_worker: Callable[..., Awaitable[Any]]

    def __post_init__(self) -> None:
        self.start_eval: dict = {}  # the starting weights' evaluation (start_* keys), for round 0's record
        self.loads = 0  # restore points the guard has tried to load: each may have changed the weights
        self._last: tuple[tuple[int, int], int, bool, EvalResult] | None = None  # weights, round, unseen, result
        self.canary = Canary()  # our held-out answers against the starting weights' (node/learn/screen.py)
        self._canary_warned: int | None = None  # the round of its last warning (one line per CANARY_EVERY rounds)

    def weights(self) -> tuple[int, int]:
        """What names the weights as they are: the optimizer steps taken and the restores tried (the loop
        compares it across a failed round: weights that moved cannot be rewound)."""
        return self.trainer.steps_taken, self.loads

    async def _measure(self, r: int, unseen: bool) -> tuple[EvalResult, int | None]:
        """The weights' evaluation, and the round whose evaluation it repeats (None: evaluated now). Weights
        that have not moved since the last evaluation (no optimizer step, no restore: a round with no group
        with signal, common where successes are scarce) answer greedily as they did then, so that result is
        taken again at no cost, when it covered the unseen set wherever this one must."""
        last = self._last
        needs_unseen = unseen and self.held_out.mix.has_unseen()  # a mix without a content split has none
        if last is not None and last[0] == self.weights() and (last[2] or not needs_unseen):
            _, then, _, result = last
            return dataclasses.replace(result, seconds=0.0, unseen=result.unseen if unseen else None), then
        result = await self.held_out_run(unseen)
        self._last = (self.weights(), r, unseen, result)
        return result, None

    def start_due(self, next_round: int) -> bool:
        """Whether the starting weights are evaluated before round 0 (a fresh start with the guard on)."""
        return next_round == 0 and self.guard.cfg.enabled and self.held_out.enabled

    async def start(self) -> bool:
        """The starting weights' held-out evaluation, before round 0's update: the collapse guard's first
        restore point (node/learn/guard.py says why), and the run's true before-training figures, which go
        into round 0's record as start_accuracy, start_unseen_accuracy, ... A stop skips it. True when the
        guard replaced the weights."""
        self.live.phase = "eval"
        try:
            result, _ = await self._measure(START_ROUND, True)
        except RoundAbandoned:
            log.info("held-out evaluation of the starting weights skipped: stop requested")
            return False
        log.info("%s", result.log_line(None, self.held_out.practised))
        self.canary.start(result.outside)
        self.start_eval = result.to_record("start", self.held_out.practised)
        return await self.judge(START_ROUND, result.to_record())  # the guard reads the eval_ keys

    async def after_round(self, r: int, timer: PhaseTimer, record: dict, stopping: bool) -> bool:
        """Round r's evaluation when it is due (not after a stop request), the guard's reading of it, and the
        learning rate and restores into its record. True when the guard replaced the weights."""
        if r == 0:
            record.update(self.start_eval)
        replaced = False
        if self.held_out.due(r) and not stopping:
            await self.evaluate(r, timer, record)
            replaced = await self.judge(r, record)
        record.update(
            lr=self.trainer.lr, guard_restores=self.guard.state.restores, eval_next=self.held_out.next_due(r + 1)
        )
        return replaced

    async def evaluate(self, r: int, timer: PhaseTimer, record: dict) -> None:
        """Held-out accuracy into this round's record. The round is complete by now: a stop during the
        evaluation skips it (the round stays), it never abandons the round."""
        try:
            with timer("eval"):
                result, repeats = await self._measure(r, self.held_out.unseen_due(r))
        except RoundAbandoned:
            log.info("held-out evaluation of round %d skipped: stop requested", r)
            return
        fields = result.to_record(practised=self.held_out.practised)
        fields |= ({} if repeats is None else {"eval_repeats": repeats}) | self._canary(r, result)
        self.live.last_eval = {
            "round": r,
            **{k: v for k, v in fields.items() if not isinstance(v, list)},
        }  # per-task lists: metrics only
        record.update(fields, t_end=time.time(), round_s=round(time.time() - timer.t0, 4))
        if repeats is None:
            record["phase_s"]["eval"] = round(timer.seconds["eval"], 4)
            log.info("%s", result.log_line(r, self.held_out.practised))
        else:
            record["phase_s"]["eval"] = 0.0
            log.info(
                "%s; unchanged since %s's evaluation: its answers again",
                result.log_line(r, self.held_out.practised),
                round_name(repeats),
            )

    def _canary(self, r: int, result: EvalResult) -> dict:
        """The canary's reading of round r's held-out answers, and its warning (rate-limited). Its baseline is
        the starting weights' answers: this run's, or on resume round 0's record (start_outside); without
        either (the guard off, or a record from before the key), this evaluation's, said once."""
        if self.canary.baseline is None:
            start = next((rec.get("start_outside") for rec in self._records() if rec.get("round") == 0), None)
            if start is None:
                log.info(
                    "canary: no evaluation of the starting weights to compare with; round %d's answers are "
                    "the baseline",
                    r,
                )
            self.canary.start(start if start is not None else result.outside)
        reading = self.canary.read(result.outside)
        if reading.alarm and (self._canary_warned is None or r - self._canary_warned >= CANARY_EVERY):
            self._canary_warned = r
            log.warning(
                "canary: %.0f%% of held-out answers after round %d carry text the starting weights never wrote "
                "(%s): another peer's text may be being learned (--external-screen; docs/PROTOCOL.md)",
                100 * reading.share,
                r,
                "; ".join(repr(p) for p in reading.phrases),
            )
        return {"canary_share": reading.share, "canary_phrases": reading.phrases}

    def _records(self) -> list[dict]:
        try:
            return read_records(self.metrics.path, partial_ok=True)
        except (OSError, ValueError):
            return []

    async def skipped_round(self, next_round: int) -> bool:
        """A stop after a round's update keeps the round but skips its due evaluation. The checkpoint holds
        that round's weights, so on resume the evaluation (and the guard's reading of it) runs first, as it
        would have then, into that round's record: a run's curve never loses a scheduled point, and a run
        stopped in its last round still ends with its final evaluation. True when the guard replaced the
        weights."""
        r, record = next_round - 1, self.metrics.last()
        if not (
            r >= 0 and self.held_out.due(r) and record and record.get("round") == r and "eval_accuracy" not in record
        ):
            return False
        log.info("round %d: its held-out evaluation was skipped by a stop; evaluating its checkpoint now", r)
        t_end, round_s = record.get("t_end"), float(record.get("round_s", 0.0))
        timer = PhaseTimer(self.live)
        await self.evaluate(r, timer, record)
        if "eval_accuracy" not in record:  # stopped again: the next resume evaluates it
            return False
        record.update(t_end=t_end, round_s=round(round_s + timer.seconds["eval"], 4), eval_on_resume=True)
        replaced = await self.judge(r, record)
        record.update(lr=self.trainer.lr, guard_restores=self.guard.state.restores)
        self.metrics.replace_last(record)
        return replaced

    async def judge(self, r: int, record: dict) -> bool:
        """The collapse guard reads the evaluation: a new best is the restore point; a collapse from it puts
        the restore point's weights back at a lower learning rate (docs/OPERATING.md). True when it did."""
        summary = EvalSummary.from_record(r, record)
        if summary is None or not self.guard.cfg.enabled:
            return False
        verdict = self.guard.judge(summary)
        record["guard_action"] = verdict.action
        if verdict.action == "snapshot":
            await self.in_worker(self.persistence.save_restore_point, r)
        elif verdict.action == "restore":
            self.loads += 1
            try:
                await self.in_worker(self.persistence.load_restore_point, verdict.lr_scale, verdict.restored_to)
            except CheckpointError as exc:  # a node keeps training rather than die on its own bad file
                self.guard.restore_failed()
                await self.in_worker(self.persistence.set_lr_scale, verdict.lr_scale)
                record.update(guard_action="restore_failed", guard_reason=f"{verdict.reason}; {exc}")
                log.error(
                    "collapse guard: %s, but the restore point cannot be loaded (%s): training on from "
                    "these weights, learning rate now %.3g",
                    verdict.reason,
                    exc,
                    self.trainer.lr,
                )
                return False
            assert verdict.restored_to is not None  # a restore names the round it goes back to
            record.update(guard_reason=verdict.reason, guard_restored_to=verdict.restored_to)
            self.live.last_guard = {"round": r, "reason": verdict.reason, "restored_to": verdict.restored_to}
            log.warning(
                "collapse guard: %s; restored %s, learning rate now %.3g",
                verdict.reason,
                weights_name(verdict.restored_to),
                self.trainer.lr,
            )
            return True
        return False

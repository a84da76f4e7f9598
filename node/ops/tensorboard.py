"""TensorBoard event files: every round's scalars under RUN_DIR/tb/, where `tensorboard --logdir` finds them.

Why tensorboardX: a small pure-Python wheel (protobuf and numpy, both already here) that writes the event
format without TensorFlow; `torch.utils.tensorboard` needs the whole `tensorboard` package (its web server
and dependencies) only to write a file. Only its synchronous `EventsWriter` is used: one event per round
holding all of the round's scalars, written and flushed by the node's model thread, so the event loop never
waits on it and no writer thread or queue of its own is started.

The event files are derived from metrics.jsonl, the record of truth. When a node starts, RUN_DIR/tb/ is
rebuilt from it (a resume has already moved the rounds after its checkpoint to metrics.orphaned.jsonl), then
each new round is appended: a resumed run's curves hold every round once, with no gap and no duplicate step
from the rounds that were redone. A writer that fails (disk full, package missing) logs once and turns itself
off; the node goes on, and the next start rebuilds the curves from metrics.jsonl.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TypeGuard

import orjson

log = logging.getLogger("sapo.tensorboard")

TB_DIR = "tb"

# metrics.jsonl key -> TensorBoard tag (the section before the slash is the dashboard's group)
SCALARS = {
    "reward_mean": "reward/mean",
    "reward_max": "reward/max",
    "eval_accuracy": "eval/accuracy",
    "eval_baseline": "eval/constant_answer_baseline",
    "eval_unseen_accuracy": "eval/unseen_accuracy",  # mixes split by content: questions never trained on
    "eval_unseen_baseline": "eval/unseen_constant_answer_baseline",
    # --practise: the part the node samples itself and the rest, which it learns from peers' groups
    "eval_accuracy_practised": "eval/accuracy_practised",
    "eval_accuracy_other": "eval/accuracy_other",
    "eval_unseen_accuracy_practised": "eval/unseen_accuracy_practised",
    "eval_unseen_accuracy_other": "eval/unseen_accuracy_other",
    "loss": "train/loss",
    "kl": "train/kl",
    "clip_frac": "train/clip_frac",
    "ratio_mean": "train/ratio_mean",
    "grad_norm": "train/grad_norm",
    "optimizer_steps": "train/optimizer_steps",
    "lr": "train/learning_rate",  # lowered by the collapse guard on each restore
    "guard_restores": "collapse/guard_restores",
    "entropy_mean": "collapse/token_entropy",
    "signal_frac": "collapse/signal_frac",
    "local_signal_frac": "collapse/local_signal_frac",
    "external_signal_frac": "collapse/external_signal_frac",
    "num_local": "groups/local_used",
    "num_external": "groups/external_used",
    "target_local": "groups/target_local",
    "target_external": "groups/target_external",
    "external_available": "groups/external_available",
    "external_accepted": "groups/external_accepted",
    "external_rejected": "groups/external_rejected",
    "dropped_zero_adv_local": "groups/dropped_zero_adv_local",
    "dropped_zero_adv_external": "groups/dropped_zero_adv_external",
    "verified_batches": "swarm/verified_batches",
    "verify_bytes": "swarm/verify_bytes",
    "round_s": "time/round_s",
    "swarm_io_s": "time/swarm_io_s",
    "verify_s": "time/verify_s",
    "tokens_generated": "tokens/generated",
    "peak_mem_mb": "memory/peak_mb",
}
# dict-valued keys: one tag per entry
NESTED = {"phase_s": "time/phase/", "rejected_by_reason": "groups/rejected/"}
# per-dataset keys: metrics.jsonl prefix -> tag prefix
PER_DATASET = {"eval_accuracy/": "eval/accuracy/", "eval_unseen_accuracy/": "eval/unseen_accuracy/"}
# TensorBoard's "custom scalars" tab: accuracy and the line it must beat in one chart
LAYOUT = {
    "held-out": {
        "accuracy vs constant-answer baseline": ["Multiline", ["eval/accuracy", "eval/constant_answer_baseline"]],
        "unseen accuracy vs constant-answer baseline": [
            "Multiline",
            ["eval/unseen_accuracy", "eval/unseen_constant_answer_baseline"],
        ],
    }
}


def _number(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard tags and values of one metrics.jsonl record."""
    out = {tag: float(record[key]) for key, tag in SCALARS.items() if _number(record.get(key))}
    for key, prefix in NESTED.items():
        value = record.get(key)
        if isinstance(value, dict):
            out.update({prefix + str(k): float(v) for k, v in value.items() if _number(v)})
    for key_prefix, tag_prefix in PER_DATASET.items():
        out.update(
            {
                tag_prefix + key[len(key_prefix) :]: float(v)
                for key, v in record.items()
                if key.startswith(key_prefix) and _number(v)
            }
        )
    return out


def read_records(path: Path) -> Iterator[dict[str, Any]]:
    """metrics.jsonl's records by round, each round once (the last line of a round wins); bad lines skipped."""
    by_round: dict[int, dict] = {}
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    for line in data.splitlines():
        try:
            rec = orjson.loads(line)
            by_round[int(rec["round"])] = rec
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            continue
    for r in sorted(by_round):
        yield by_round[r]


class TensorBoardLog:
    """RUN_DIR/tb/: rebuilt from metrics.jsonl when the node starts, then one event per round.
    Call from one thread (the node's model thread); every method is a no-op once disabled."""

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.dir = Path(run_dir) / TB_DIR
        self.enabled = enabled
        self._writer: Any = None  # tensorboardX's EventsWriter, while enabled

    def rebuild(self, metrics_path: Path) -> int:
        """A fresh event file holding every round of metrics.jsonl; returns the rounds written."""
        if not self.enabled:
            return 0
        try:
            from tensorboardX.event_file_writer import EventsWriter
            from tensorboardX.proto.event_pb2 import Event
            from tensorboardX.summary import custom_scalars

            self.close()
            self.dir.mkdir(parents=True, exist_ok=True)
            for old in self.dir.glob("events.out.tfevents.*"):  # derived data: metrics.jsonl keeps every round
                old.unlink()
            self._writer = EventsWriter(str(self.dir / "events"))
            self._writer.write_event(Event(wall_time=time.time(), summary=custom_scalars(LAYOUT)))
            written = 0
            for record in read_records(metrics_path):
                self._write(record)
                written += 1
            self._writer.flush()
            return written
        except Exception as exc:  # never the node's problem
            self._fail(exc)
            return 0

    def write(self, record: dict[str, Any]) -> None:
        """Append one round (after its metrics.jsonl line) and flush it to disk."""
        if self._writer is None:
            return
        try:
            self._write(record)
            self._writer.flush()
        except Exception as exc:
            self._fail(exc)

    def close(self) -> None:
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception as exc:
                log.warning("closing the TensorBoard event file failed: %s", exc)

    def _write(self, record: dict[str, Any]) -> None:
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars(record).items()]
        wall = record.get("t_end")
        self._writer.write_event(
            Event(
                wall_time=float(wall) if _number(wall) else time.time(),
                step=int(record["round"]),
                summary=Summary(value=values),
            )
        )

    def _fail(self, exc: BaseException) -> None:
        log.warning(
            "TensorBoard event files turned off for this run: %s: %s (metrics.jsonl is unaffected; "
            "the next start rebuilds %s from it)",
            type(exc).__name__,
            exc,
            self.dir,
        )
        self.enabled = False
        self.close()

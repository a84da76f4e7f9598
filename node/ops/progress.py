"""Console progress for humans.

* :func:`format_progress_line` turns a node snapshot (see ``node.ops.status``) or a per-round record (a line of
  ``metrics.jsonl``) into one compact line.
* :class:`ProgressPrinter` keeps one live line on a terminal (rewritten with ``\\r``) and prints plain lines
  when the stream is not a TTY (logs, pipes, CI).
* ``python -m node.ops.progress RUN_DIR...`` tails ``RUN_DIR/metrics.jsonl`` of several local nodes and prints a
  combined table every 2 s (a redrawn table on a terminal, one line per new round otherwise), naming each
  peer's model (a mixed swarm runs several). Ctrl-C exits.
  Each peer's row shows its last held-out accuracy against the constant-answer baseline (a collapsed policy
  scores about that), and the unseen set's where its mix has one, and after which round the next held-out
  evaluation comes (a record's ``eval_next``).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import signal
import stat
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO, TypeGuard

import orjson

__all__ = [
    "format_progress_line",
    "ProgressPrinter",
    "MetricsTail",
    "RunView",
    "format_table",
    "main",
]

_CLEAR_EOL = "\x1b[K"
_HOME_CLEAR = "\x1b[H\x1b[2J"


def _isnum(x: Any) -> TypeGuard[float]:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _f(x: Any, digits: int = 3) -> str:
    return f"{x:.{digits}f}" if _isnum(x) else "-"


def _short_peer(value: Any) -> str:
    s = str(value or "?")
    return s if len(s) <= 14 else s[:6] + "…" + s[-6:]


def _clean(value: Any, limit: int = 24) -> str:
    """Peer names come from the network: strip control characters (no terminal escapes) and bound length."""
    s = "".join(ch if ch.isprintable() else "?" for ch in str(value))
    return s if len(s) <= limit else s[: limit - 1] + "…"


def held_out_cell(ev: Mapping[str, Any], key: str = "eval") -> str | None:
    """``0.420 (const 0.121)``: accuracy of one evaluation set against what one fixed answer scores on it
    (``key`` "eval", or "eval_unseen" for the set of questions never trained on); None when not evaluated.
    A node that practises part of its mix (--practise) adds each part's: ``(const 0.121; practised 0.500,
    other 0.300)``."""
    acc = ev.get(f"{key}_accuracy")
    if not _isnum(acc):
        return None
    notes = [f"const {ev[f'{key}_baseline']:.3f}"] if _isnum(ev.get(f"{key}_baseline")) else []
    parts = [
        f"{p} {ev[f'{key}_accuracy_{p}']:.3f}" for p in ("practised", "other") if _isnum(ev.get(f"{key}_accuracy_{p}"))
    ]
    notes += [", ".join(parts)] if parts else []
    return f"{acc:.3f}" + (f" ({'; '.join(notes)})" if notes else "")


def next_eval(rec: Mapping[str, Any]) -> int | None:
    """After which round the next held-out evaluation comes: a record's ``eval_next``, or a snapshot's newest
    history entry's; None when unknown or none is left."""
    hist = rec.get("history")
    if "eval_next" not in rec and isinstance(hist, list) and hist and isinstance(hist[-1], Mapping):
        rec = hist[-1]
    value = rec.get("eval_next")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def format_progress_line(rec: Mapping[str, Any]) -> str:
    """One compact line: peer, round, reward, moving average, external groups used, phase (+ round time),
    after an evaluation the held-out (and unseen) accuracy against the constant-answer baseline, and after
    which round the next evaluation comes.

    Accepts a node status snapshot (keys ``round``, ``last_reward``, ``reward_ma``, ``phase``, ``history``,
    ``eval``, ...) or a round record from ``metrics.jsonl`` (``round``, ``reward_mean``, ``num_local``,
    ``num_external``, ``round_s``, ``phase_s``, ``peer``, ``eval_accuracy``, ...). Missing values print as ``-``.
    """
    rec = rec if isinstance(rec, Mapping) else {}
    name = rec.get("name") or rec.get("peer") or _short_peer(rec.get("peer_id"))
    if rec.get("model"):
        name = f"{_clean(name)} ({_clean(rec['model'])})"
    reward = rec.get("last_reward", rec.get("reward_mean"))
    ma = rec.get("reward_ma")
    local, external = rec.get("num_local"), rec.get("num_external")
    hist = rec.get("history")
    if (local is None or external is None) and isinstance(hist, list) and hist and isinstance(hist[-1], Mapping):
        local, external = hist[-1].get("num_local"), hist[-1].get("num_external")
    phase = rec.get("phase")
    round_s = rec.get("round_s")
    if round_s is None and isinstance(rec.get("phase_s"), Mapping):
        vals = [v for v in rec["phase_s"].values() if _isnum(v)]
        round_s = sum(vals) if vals else None

    parts = [f"[{_clean(name)}]", f"round {rec.get('round', '-')}", f"reward {_f(reward)}"]
    if ma is not None:
        parts.append(f"ma {_f(ma)}")
    if _isnum(external):
        total = (local if _isnum(local) else 0) + external
        parts.append(f"ext {int(external)}/{int(total)}")
    if phase:
        parts.append(f"phase {_clean(phase, 12)}")
    if _isnum(round_s):
        parts.append(f"{round_s:.1f}s")
    parts += [lag] if (lag := _net_lag(rec)) else []
    membership = rec.get("membership")
    if rec.get("swarm_state") == "solo" or isinstance(membership, Mapping) and membership.get("state") == "solo":
        parts.append("solo: waiting for peers")
    ev = rec if "eval_accuracy" in rec else rec.get("eval")
    if isinstance(ev, Mapping):
        for key, label in (("eval", "held-out"), ("eval_unseen", "unseen")):
            cell = held_out_cell(ev, key)
            if cell:
                parts.append(f"{label} {cell}")
    due = next_eval(rec)
    if due is not None:
        parts.append(f"next eval after round {due}")
    return " | ".join(parts)


def _net_lag(rec: Mapping[str, Any]) -> str | None:
    """How far the network runs behind the rounds: a snapshot's median age of the external groups trained on
    lately and the verified groups waiting for the next select; a record's median age of its own."""
    net = rec.get("network")
    if isinstance(net, Mapping):
        age, waiting = net.get("median_age_s"), net.get("groups_waiting")
        waits = f", {int(waiting)} waiting" if _isnum(waiting) and waiting else ""
        return (f"net lag {age:.1f}s" if _isnum(age) else "net lag -") + waits if net.get("pipeline") else None
    ages = sorted(a for a in rec.get("external_age_s") or [] if _isnum(a)) if rec.get("net_pipeline") else []
    return f"net lag {ages[len(ages) // 2]:.1f}s" if ages else None


class ProgressPrinter:
    """Prints progress lines: one live line rewritten with ``\\r`` on a TTY, plain lines otherwise.

    ``update(rec)`` shows a snapshot/record; on a non-TTY stream a line is written only when it changed.
    ``message(text)`` prints a permanent line (above the live line on a TTY). ``close()`` ends the live line.
    """

    def __init__(self, stream: TextIO | None = None, *, width: int | None = None) -> None:
        self.stream = stream if stream is not None else sys.stdout
        try:
            self.live = bool(self.stream.isatty())
        except (AttributeError, ValueError):
            self.live = False
        self._width = width
        self._last: str | None = None
        self._live_shown = False

    def _cols(self) -> int:
        if self._width:
            return self._width
        return shutil.get_terminal_size((100, 24)).columns

    def update(self, rec: Mapping[str, Any] | str) -> None:
        line = rec if isinstance(rec, str) else format_progress_line(rec)
        if self.live:
            cols = self._cols()
            if len(line) >= cols:
                line = line[: max(1, cols - 2)] + "…"
            self.stream.write("\r" + line + _CLEAR_EOL)
            self._live_shown = True
        elif line != self._last:
            self.stream.write(line + "\n")
        self._last = line
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.live and self._live_shown:
            self.stream.write("\r" + _CLEAR_EOL + text + "\n")
            if self._last:
                self.stream.write(self._last)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.live and self._live_shown:
            self.stream.write("\n")
            self.stream.flush()
        self._live_shown = False

    def __enter__(self) -> ProgressPrinter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# Tailing metrics.jsonl of several runs
# --------------------------------------------------------------------------------------------------


class MetricsTail:
    """Incrementally reads complete JSON lines appended to a file (tolerates a missing file, partial last
    line, truncation/rotation, and garbage lines)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._offset = 0
        self._partial = b""
        self._ino: int | None = None
        self.bad_lines = 0

    def read_new(self) -> list[dict]:
        try:
            st = self.path.stat()
        except OSError:  # not there yet, or RUN_DIR is a file
            return []
        if not stat.S_ISREG(st.st_mode):  # a directory, or a FIFO whose read would block the view
            return []
        if self._ino is not None and (st.st_ino != self._ino or st.st_size < self._offset):
            self._offset, self._partial = 0, b""  # rotated or truncated: start over
            self.bad_lines = 0  # a resume moves them out (metrics.orphaned.jsonl): counted again as read
        self._ino = st.st_ino
        if st.st_size == self._offset:
            return []
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:  # replaced or made unreadable between the stat and the read: the next refresh tries again
            return []
        self._offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        out = []
        for line in lines:
            line = line.strip()
            if not line:
                continue
            try:
                obj = orjson.loads(line)
            except orjson.JSONDecodeError:
                self.bad_lines += 1
                continue
            if isinstance(obj, dict):
                out.append(obj)
            else:
                self.bad_lines += 1
        return out


@dataclass
class RunView:
    run_dir: Path
    tail: MetricsTail
    last: dict | None = None
    rounds_seen: int = 0
    rewards: list = field(default_factory=list)
    updated_at: float | None = None
    peer: str | None = None
    last_eval: dict | None = None  # the newest record that carries a held-out evaluation
    model: str | None = None  # from the records; until the first one, what the caller said it started

    @property
    def name(self) -> str:
        return _clean(self.peer or self.run_dir.name or str(self.run_dir))

    def poll(self, ma_window: int = 10) -> list[dict]:
        new = self.tail.read_new()
        for rec in new:
            self.last = rec
            self.rounds_seen += 1
            if rec.get("peer"):
                self.peer = str(rec["peer"])
            if _isnum(rec.get("eval_accuracy")):
                self.last_eval = rec
            if rec.get("model"):
                self.model = str(rec["model"])
            if _isnum(rec.get("reward_mean")):
                self.rewards.append(float(rec["reward_mean"]))
                del self.rewards[:-ma_window]
        if new:
            try:
                self.updated_at = self.tail.path.stat().st_mtime
            except OSError:
                self.updated_at = time.time()
        return new

    @property
    def reward_ma(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None


_COLUMNS = ("peer", "model", "round", "reward", "ma(10)", "local", "ext", "held-out (const)", "round_s", "updated")
_UNSEEN = "unseen (const)"  # a column only when some peer's mix has an unseen set
_NEXT = "next eval"  # a column only when some peer's records say (eval_next)


def format_table(views: Sequence[RunView], now: float | None = None) -> str:
    """One row per run; held-out accuracy is the last evaluation's (its round after the @)."""
    now = time.time() if now is None else now
    unseen = any(v.last_eval and "eval_unseen_accuracy" in v.last_eval for v in views)
    due = [next_eval(v.last or {}) for v in views]
    nxt = any(d is not None for d in due)
    columns = _COLUMNS[:8] + (_UNSEEN,) * unseen + (_NEXT,) * nxt + _COLUMNS[8:]
    rows = [columns]
    for v, d in zip(views, due):
        r, ev = v.last or {}, v.last_eval or {}
        age = f"{now - v.updated_at:.0f}s ago" if v.updated_at else ("waiting" if not v.tail.path.exists() else "-")
        at = f" @{ev.get('round')}" if ev else ""
        rows.append(
            (
                v.name,
                _clean(v.model or "-"),
                str(r.get("round", "-")),
                _f(r.get("reward_mean")),
                _f(v.reward_ma),
                str(r.get("num_local", "-")),
                str(r.get("num_external", "-")),
                (held_out_cell(ev) or "-") + at,
                *(((held_out_cell(ev, "eval_unseen") or "-") + at,) * unseen),
                *((f"after {d}" if d is not None else "-",) * nxt),
                _f(r.get("round_s"), 1),
                age,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
    lines = []
    for j, row in enumerate(rows):
        cells = [c.ljust(widths[i]) if i == 0 else c.rjust(widths[i]) for i, c in enumerate(row)]
        lines.append("  ".join(cells).rstrip())
        if j == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines += [_skipped(v) for v in views if v.tail.bad_lines]
    return "\n".join(lines)


def _skipped(view: RunView) -> str:
    """A note that lines of a peer's metrics.jsonl were not records (garbage, cut short): the table leaves them
    out, and says so rather than hide them."""
    n = view.tail.bad_lines
    return f"{view.name}: {n} unreadable line{'s' * (n != 1)} in {view.tail.path} skipped"


def _watch(views: Sequence[RunView], out: TextIO, interval: float, once: bool, live: bool) -> None:
    """Live: redraw the table every ``interval``. Plain: print the table once (the state so far), then one
    line per new round. ``once``: print the table and return."""
    first = True
    while True:
        for v in views:
            bad = v.tail.bad_lines
            new = v.poll()
            if not live and not first:
                for rec in new:
                    out.write(_line_for(v, rec) + "\n")
                if v.tail.bad_lines > bad:
                    out.write(_skipped(v) + "\n")
        if live:
            out.write(_HOME_CLEAR + f"SAPO local swarm · {time.strftime('%H:%M:%S')} · Ctrl-C to quit\n\n")
            out.write(format_table(views) + "\n")
        elif first:
            out.write(format_table(views) + "\n")
        first = False
        out.flush()
        if once:
            return
        time.sleep(interval)


def _line_for(view: RunView, rec: Mapping[str, Any]) -> str:
    rec = dict(rec)
    rec.setdefault("peer", view.name)
    if view.model:
        rec.setdefault("model", view.model)
    rec.setdefault("reward_ma", view.reward_ma)
    return format_progress_line(rec)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: Iterable[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m node.ops.progress",
        description="Follow RUN_DIR/metrics.jsonl of one or more local nodes and print a combined table.",
    )
    ap.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", type=Path)
    ap.add_argument("--interval", type=float, default=2.0, help="refresh period in seconds (default 2)")
    ap.add_argument("--once", action="store_true", help="print the table once and exit")
    ap.add_argument("--plain", action="store_true", help="plain lines even on a terminal")
    ap.add_argument("--models", default="", help="comma list: each run's model, shown until its records name it")
    args = ap.parse_args(list(argv) if argv is not None else None)
    if not (math.isfinite(args.interval) and 0 < args.interval <= 86400):  # time.sleep refuses inf
        ap.error(f"--interval must be seconds in (0, 86400] (got {args.interval})")

    models = [m.strip() or None for m in args.models.split(",")] if args.models else []
    views = [
        RunView(d, MetricsTail(d / "metrics.jsonl"), model=models[i] if i < len(models) else None)
        for i, d in enumerate(args.run_dirs)
    ]
    # Explicit handlers: a shell script that starts us with `&` makes us inherit SIGINT as *ignored*,
    # and Python then never raises KeyboardInterrupt; SIGTERM ends the view the same quiet way.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    out = sys.stdout
    live = not args.plain and not args.once and out.isatty()
    try:
        _watch(views, out, max(0.1, args.interval), args.once, live)
    except KeyboardInterrupt:
        if live:
            out.write("\n")
        out.flush()
        return 0
    except BrokenPipeError:  # e.g. piped into `head`
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at interpreter exit
        except OSError:
            pass
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Per-publisher local reputation: who we still fetch and verify, kept across restarts.

Every node keeps its own table (nothing about it is shared: a reputation that peers could gossip would
be one more thing to forge). A publisher, named by its public key, starts neutral at 0.

Scoring rule and why:

* Only offences the publisher provably committed count: the batch carries its valid signature. Anything
  that fails *before* the signature holds (oversize, malformed envelope, bad signature, a transport hint
  that names someone else) is counted as a rejection but never touches a score, or anyone could get an
  honest peer banned by publishing garbage under its key. Replays (stale, stale_round, wrong_swarm) do
  not count either: anyone can re-serve an honest peer's old signed batch.
* Severe (-5): signed content honest software never produces: schema or caps violations, a signed
  publisher field that is not the key, fewer than 2 completions, and rewards that differ from our
  re-scoring (`reward_mismatch`: the sender lies about what it verified). Two of them ban a newcomer.
* Moderate: `bad_task` (-2, a spec reasoning-gym cannot rebuild: maybe another library version),
  `from_future` (-1, a bad clock), `equivocation` (-0.5: two signed batches for one round; an honest
  node that resumes from a checkpoint republishes the rounds since it, so a few are forgiven), `ghost`
  (-0.5: a presence record announced a batch that a completed search did not find; an honest node
  stores its batch before its presence, so only a lost store makes one).
* Mild (-0.02): valid but useless to us: a group without learning signal (all rewards equal, dropped by
  the zero-advantage filter anyway), a task outside our mix, or content we already had (`duplicate`
  from another key: a copy; `repeated` from the same key). A flood of useless batches gets banned;
  an honest peer with a weak model only needs one group in six with signal to stay above water.
* Foreign text (-0.1, and no credit): a group whose right answers carry text outside the answer that
  recurs across the publisher's groups (node/swarm/screening.py): a rule-following poisoner earns no
  trust and is banned after about a hundred such groups.
* Credit (+0.1 per group with learning signal), capped at +5 so that a long good history buys room for
  at most two severe offences, never immunity.

At or below -10 a publisher is banned (not fetched, not verified) until `banned_until` (wall clock, so
the ban outlives a restart); each ban doubles the last one (`strikes`), up to a week. When a ban ends
the score restarts at -5 (probation): a repeat offender is banned again quickly, and for longer.

The table is bounded: past `max_tracked` publishers, the least informative entries go first (neutral
ones, oldest first; then other unbanned ones; bans last), so memory does not grow with the swarm.
"""

from __future__ import annotations

import heapq
import json
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from p2p.files import unused_name, write_atomically

log = logging.getLogger("sapo.swarm")

REPUTATION_FILE = "reputation.json"
FORMAT = "sapo-reputation/1"

SEVERE, MODERATE, MILD = 5.0, 1.0, 0.02
PENALTIES: dict[str, float] = {
    "reward_mismatch": SEVERE,
    "schema": SEVERE,
    "publisher_mismatch": SEVERE,  # only the signed payload's field (see the module docstring)
    "too_many_groups": SEVERE,
    "too_many_completions": SEVERE,
    "completion_too_long": SEVERE,
    "config_too_large": SEVERE,
    "too_few_completions": SEVERE,
    "bad_task": 2 * MODERATE,
    "from_future": MODERATE,
    "equivocation": MODERATE / 2,
    "ghost": MODERATE / 2,
    "useless": MILD,
    "duplicate": MILD,
    "repeated": MILD,
    "task_not_allowed": MILD,
    "foreign_text": 5 * MILD,  # with no credit: -0.1 a group (node/swarm/screening.py)
}


@dataclass
class ReputationConfig:
    ban_threshold: float = -10.0  # at or below: banned
    max_score: float = 5.0  # credit cap
    credit: float = 0.1  # per group with learning signal
    ban_s: float = 3600.0  # first ban; each further ban doubles it
    max_ban_s: float = 7 * 86400.0
    max_tracked: int = 4096
    neutral_band: float = 1.0  # |score| below this and never banned: "neutral", evicted first

    @property
    def probation_score(self) -> float:
        return self.ban_threshold / 2

    @property
    def min_score(self) -> float:
        return 2 * self.ban_threshold


@dataclass
class Standing:
    score: float = 0.0
    banned_until: float = 0.0  # unix time; 0 = not banned
    strikes: int = 0  # bans so far (the next one lasts ban_s * 2**strikes)
    last_seen: float = 0.0

    def to_dict(self) -> dict:
        return {
            "score": round(self.score, 4),
            "banned_until": self.banned_until,
            "strikes": self.strikes,
            "last_seen": self.last_seen,
        }


class ReputationFileError(ValueError):
    pass


class Reputation:
    """Scores and bans by publisher key. Thread-safe: the verifier thread scores, the status server reads."""

    def __init__(self, cfg: ReputationConfig | None = None, clock: Callable[[], float] = time.time):
        self.cfg = cfg or ReputationConfig()
        self.clock = clock
        self._table: dict[str, Standing] = {}
        self._lock = threading.Lock()

    # --- decisions ---------------------------------------------------------------------------------------

    def allowed(self, publisher: bytes) -> bool:
        """May we fetch and verify this publisher now? (The publisher chooser's veto: `PublisherBandit.allowed`.)"""
        with self._lock:
            s = self._table.get(publisher.hex())
            return s is None or not self._banned(s, self.clock())

    def tier(self, publisher: bytes) -> int:
        """0 trusted (score > 0), 1 unknown or neutral, 2 in the red: verification order under a budget."""
        with self._lock:
            s = self._table.get(publisher.hex())
        if s is None or abs(s.score) < 1e-9:
            return 1
        return 0 if s.score > 0 else 2

    def score(self, publisher: bytes) -> float:
        with self._lock:
            s = self._table.get(publisher.hex())
            return s.score if s else 0.0

    # --- evidence ----------------------------------------------------------------------------------------

    def penalize(self, publisher: bytes, reason: str) -> None:
        """One offence; reasons not in PENALTIES (unattributable, replays) change nothing."""
        weight = PENALTIES.get(reason, 0.0)
        if weight:
            self._add(publisher, -weight)

    def credit(self, publisher: bytes) -> None:
        """One group with learning signal."""
        self._add(publisher, self.cfg.credit)

    def _add(self, publisher: bytes, delta: float) -> None:
        cfg = self.cfg
        now = self.clock()
        with self._lock:
            key = publisher.hex()
            s = self._table.get(key)
            if s is None:
                s = self._table[key] = Standing(last_seen=now)
                self._evict_if_full(keep=key)
            s.last_seen = now
            if self._banned(s, now):
                return  # already paying; a ban does not grow from what it lets through before it starts
            s.score = min(cfg.max_score, max(cfg.min_score, s.score + delta))
            if s.score <= cfg.ban_threshold:
                s.banned_until = now + min(cfg.max_ban_s, cfg.ban_s * 2 ** min(s.strikes, 30))
                s.strikes += 1
                log.info(
                    "publisher %s… banned for %.0fs (score %.2f, ban #%d)",
                    key[:16],
                    s.banned_until - now,
                    s.score,
                    s.strikes,
                )

    def _banned(self, s: Standing, now: float) -> bool:
        """Ends an expired ban on the way (probation score); caller holds the lock."""
        if not s.banned_until:
            return False
        if now < s.banned_until:
            return True
        s.banned_until = 0.0
        s.score = max(s.score, self.cfg.probation_score)
        return False

    def _evict_if_full(self, keep: str = "") -> None:
        """Past max_tracked, drop to 90% of it in one go: neutral oldest first, then unbanned, bans last
        (soonest to end first). `keep` (the entry being added) stays: a full table of bans must not stop
        a new offender from being tracked."""
        cfg = self.cfg
        if len(self._table) <= cfg.max_tracked:
            return
        now = self.clock()

        def keep_value(item: tuple[str, Standing]) -> tuple[int, float]:
            s = item[1]
            if self._banned(s, now):
                return 2, s.banned_until
            if abs(s.score) < cfg.neutral_band and not s.strikes:
                return 0, s.last_seen
            return 1, s.last_seen

        excess = len(self._table) - int(cfg.max_tracked * 0.9)
        candidates = ((k, s) for k, s in self._table.items() if k != keep)
        for key, _ in heapq.nsmallest(excess, candidates, key=keep_value):
            del self._table[key]

    # --- views -------------------------------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._table)

    def banned_count(self) -> int:
        now = self.clock()
        with self._lock:
            return sum(1 for s in self._table.values() if s.banned_until > now)

    def snapshot(self, top: int = 10) -> dict:
        """Counts plus a bounded per-peer table (bans and the worst `top`, the best `top`) for /status."""
        now = self.clock()
        with self._lock:
            items = list(self._table.items())
        banned = sum(1 for _, s in items if s.banned_until > now)
        worst = heapq.nsmallest(
            top,
            (kv for kv in items if kv[1].score < 0 or kv[1].banned_until > now),
            key=lambda kv: (kv[1].banned_until <= now, kv[1].score),
        )
        best = heapq.nlargest(top, (kv for kv in items if kv[1].score > 0), key=lambda kv: kv[1].score)
        peers = {}
        for key, s in worst + best:
            row = s.to_dict()
            row["banned_until"] = s.banned_until if s.banned_until > now else None
            peers[key] = row
        return {
            "tracked": len(items),
            "banned": banned,
            "ban_threshold": self.cfg.ban_threshold,
            "max_score": self.cfg.max_score,
            "peers": peers,
        }

    # --- persistence -------------------------------------------------------------------------------------

    def save(self, path: Path) -> bool:
        """Atomic: temp file, fsync, rename, fsync of the directory; a crash leaves the old file or the new.
        Nothing to say and no file yet: nothing written. A disk error is logged, never raised (it must not
        stop the run); False then."""
        with self._lock:
            body = {
                "format": FORMAT,
                "saved_at": self.clock(),
                "peers": {k: s.to_dict() for k, s in self._table.items()},
            }
        path = Path(path)
        if not body["peers"] and not path.exists():
            return False
        try:
            write_atomically(path, json.dumps(body, separators=(",", ":")))
        except OSError as exc:
            log.warning("could not save %s: %s", path, exc)
            return False
        return True

    def load(self, path: Path) -> bool:
        """Replace the table with the file's. Missing file: False. Corrupt file: one warning, the file moved
        aside to `<name>.corrupt` (`.corrupt.1`, ... when one is there: none is overwritten), a fresh table, False.
        Never raises on the file's content."""
        path = Path(path)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return False
        except OSError as exc:
            log.warning("reputation file %s unreadable (%s); starting with a fresh table", path, exc)
            return False
        try:
            table = parse_table(raw)
        except ReputationFileError as exc:
            aside = unused_name(path.with_name(path.name + ".corrupt"))
            log.warning(
                "reputation file %s is corrupt (%s); moved to %s, starting with a fresh table", path, exc, aside.name
            )
            try:
                os.replace(path, aside)
            except OSError:
                pass
            return False
        with self._lock:
            self._table = table
            self._evict_if_full()
        log.info("reputation: %d publishers, %d banned (from %s)", len(self), self.banned_count(), path)
        return True


def parse_table(raw: bytes) -> dict[str, Standing]:
    """The file's table, every value checked (it is ours, but disks and editors are not)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ReputationFileError(f"not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("peers"), dict):
        raise ReputationFileError(f"not a {FORMAT} object")
    table: dict[str, Standing] = {}
    for key, row in body["peers"].items():
        if not (isinstance(key, str) and 0 < len(key) <= 256 and _is_hex(key) and isinstance(row, dict)):
            raise ReputationFileError(f"bad entry {str(key)[:40]!r}")
        try:
            s = Standing(
                score=float(row["score"]),
                banned_until=float(row["banned_until"]),
                strikes=int(row["strikes"]),
                last_seen=float(row["last_seen"]),
            )
        except (KeyError, TypeError, ValueError, OverflowError):  # int(inf), float(10**400)
            raise ReputationFileError(f"bad values for {key[:16]}…") from None
        if not all(math.isfinite(x) for x in (s.score, s.banned_until, s.last_seen)) or not 0 <= s.strikes <= 64:
            raise ReputationFileError(f"values out of range for {key[:16]}…")
        table[key] = s
    return table


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True

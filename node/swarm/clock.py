"""Whose clock is wrong: a batch's publisher's, or this machine's.

A batch dated more than the allowed skew ahead of this machine's clock is refused (`from_future`) and its
publisher charged, as a lying or broken clock should be. But a node whose own clock is minutes slow sees every
honest peer's batches from the future, and charging each of them would ban the whole swarm within ten rounds.
So the verifier keeps the newest offset (created_at − now) of each recent publisher: when at least `QUORUM` of
them are known and most look ahead, the fault is taken to be ours, their future batches are refused without a
charge (`clock_behind`) and the node says once how far behind it seems. Identities that agree to date their
batches ahead can at most spare each other that charge; their batches are refused all the same. A clock ahead
shows only as peers' batches that all arrive minutes old (stale ones too): a hint, said once, nothing refused.
"""

from __future__ import annotations

import logging
import statistics
from collections import OrderedDict

log = logging.getLogger("sapo.swarm")

QUORUM = 3  # publishers whose offsets must be known before the majority decides
OLD_S = 300.0  # the recent publishers' median batch this old by our clock: ours is probably ahead (a hint)
RECENT = 32  # publishers remembered (their newest batch's offset), least recently seen dropped first


class ClockCheck:
    def __init__(self, max_skew_s: float):
        self.max_skew_s = max_skew_s
        self.offsets: OrderedDict[bytes, float] = OrderedDict()
        self.said = False  # the warning, once per process
        self.said_ahead = False  # the hint that this clock is ahead, once per process

    def observe(self, publisher: bytes, offset_s: float) -> None:
        """A batch of `publisher` dated `offset_s` seconds after this machine's now (negative: before)."""
        self.offsets[publisher] = offset_s
        self.offsets.move_to_end(publisher)
        while len(self.offsets) > RECENT:
            self.offsets.popitem(last=False)

    def behind_s(self) -> float | None:
        """How far this machine's clock seems behind (the median offset of the recent publishers) when most of
        at least QUORUM of them are dated past the allowed skew; None while the clock looks right or too few
        publishers are known."""
        if len(self.offsets) < QUORUM:
            return None
        ahead = sum(offset > self.max_skew_s for offset in self.offsets.values())
        return statistics.median(self.offsets.values()) if 2 * ahead > len(self.offsets) else None

    def judge(self, publisher: bytes, offset_s: float) -> str | None:
        """A batch dated `offset_s` after now: None within the skew; `from_future` (the publisher's clock, to be
        charged) or `clock_behind` (ours, by the majority: said once)."""
        self.observe(publisher, offset_s)
        if offset_s <= self.max_skew_s:
            self._hint_ahead()
            return None
        behind = self.behind_s()
        if behind is None:
            return "from_future"
        if not self.said:
            self.said = True
            log.warning(
                "this machine's clock seems about %.0f s behind the swarm's: most recent peers' batches are dated "
                "more than %.0f s ahead of it, so they are refused (without a charge: clock_behind) and this "
                "node's own batches look old to its peers. Set the clock right (NTP, e.g. `timedatectl set-ntp "
                "true`); nothing else needs a restart",
                behind,
                self.max_skew_s,
            )
        return "clock_behind"

    def _hint_ahead(self) -> None:
        """A clock ahead cannot be proven from here (the peers refuse this node's batches, not the reverse), but
        peers' batches that all arrive minutes old point to it: said once, as a hint."""
        if self.said_ahead or len(self.offsets) < QUORUM:
            return
        median = statistics.median(self.offsets.values())
        if median < -OLD_S:
            self.said_ahead = True
            log.warning(
                "the recent peers' batches are %.0f s old by this machine's clock (median of %d): unless rounds in "
                "this swarm take that long, this clock is ahead, and peers refuse this node's batches as dated in "
                "the future (from_future, ten of them and a ban). Set the clock right (NTP, e.g. `timedatectl "
                "set-ntp true`)",
                -median,
                len(self.offsets),
            )

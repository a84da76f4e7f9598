"""Whose clock is wrong: a batch's publisher's, or this machine's.

A batch dated more than the allowed skew ahead of this machine's clock is refused (`from_future`) and its
publisher charged, as a lying or broken clock should be. But a node whose own clock is minutes slow sees every
honest peer's batches from the future, and charging each of them would ban the whole swarm within ten rounds.
So the verifier keeps, for each of the last `RECENT` publishers it has seen, the offset (created_at − now) of
its newest batch by round (a replay of an older one changes nothing): when at least `QUORUM` are known and
most of them are dated past the skew, the fault is taken to be ours, their future batches are refused without
a charge (`clock_behind`; the publisher chooser still parks them as useless) and the log says so. A clock ahead
shows only as peers' batches that arrive minutes old: the median offset past `OLD_S` is a hint, nothing
refused. Presence records dated more than their lifetime ahead of this clock (a clock behind by 10 minutes or
more) are not fetched from (p2p/presence.py): when most of those read are, the log says that too. A clock ahead by
more than the records' lifetime reads no record at all (each looks expired here): fetches that complete and find no
peer of this swarm, round after round, while the DHT holds other peers, get a hint that names this and the other
cause, another `--swarm`. Each message repeats at most every `SAY_EVERY_S` while it holds.

Identities that agree to date their batches ahead gain nothing but a charge spared (their batches are refused
all the same), and can make these messages appear: so the messages say what the peers' dates show, never a
number to set the clock by, and point to NTP.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import OrderedDict

log = logging.getLogger("sapo.swarm")

QUORUM = 3  # publishers whose offsets must be known before the majority decides
RECENT = 32  # publishers remembered, least recently seen dropped first
OLD_S = 300.0  # the recent publishers' median batch this old by our clock: ours is probably ahead (a hint)
SAY_EVERY_S = 600.0  # a message repeats at most this often while its condition holds
UNHEARD_FETCHES = 10  # completed fetches in a row that read no peer of this swarm before the hint
MIN_DHT_PEERS = 2  # a bootstrap peer publishes no presence: one DHT peer alone proves nothing


class ClockCheck:
    def __init__(self, max_skew_s: float, clock=time.monotonic):
        self.max_skew_s = max_skew_s
        self.newest: OrderedDict[bytes, tuple[int, float]] = OrderedDict()  # publisher -> (round, offset s)
        self.clock = clock
        self.said_at: dict[str, float] = {}  # message -> when it was last said
        self.unheard_fetches = 0  # completed fetches in a row that read no presence record (`unheard`)

    def observe(self, publisher: bytes, round_: int, offset_s: float) -> None:
        """A batch of `publisher` for `round_`, dated `offset_s` seconds after this machine's now."""
        known = self.newest.get(publisher)
        if known is None or round_ >= known[0]:
            self.newest[publisher] = (round_, offset_s)
        self.newest.move_to_end(publisher)
        while len(self.newest) > RECENT:
            self.newest.popitem(last=False)

    def offsets(self) -> list[float]:
        return [offset for _, offset in self.newest.values()]

    def behind(self) -> bool:
        """Whether most of at least QUORUM recent publishers are dated past the allowed skew (strictly more
        than half)."""
        offsets = self.offsets()
        ahead = sum(offset > self.max_skew_s for offset in offsets)
        return len(offsets) >= QUORUM and 2 * ahead > len(offsets)

    def judge(self, publisher: bytes, round_: int, offset_s: float) -> str | None:
        """A batch dated `offset_s` after now: None within the skew; `from_future` (the publisher's clock, to be
        charged) or `clock_behind` (ours, by the majority)."""
        self.observe(publisher, round_, offset_s)
        if offset_s <= self.max_skew_s:
            self._hint_ahead()
            return None
        if not self.behind():
            return "from_future"
        self._say(
            "behind",
            "most recent peers' batches (%d of %d) are dated more than %.0f s ahead of this machine's clock: it is "
            "probably slow, so their batches are refused without a charge (clock_behind) and this node's own look "
            "old to its peers. Let NTP set the clock (e.g. `timedatectl set-ntp true`); no restart is needed",
            sum(offset > self.max_skew_s for offset in self.offsets()),
            len(self.newest),
            self.max_skew_s,
        )
        return "clock_behind"

    def _hint_ahead(self) -> None:
        """A clock ahead cannot be proven from here (the peers refuse this node's batches, not the reverse), but
        peers' batches that arrive minutes old point to it."""
        offsets = self.offsets()
        if len(offsets) >= QUORUM and statistics.median(offsets) < -OLD_S:
            self._say(
                "ahead",
                "the recent peers' batches arrive over %.0f s old by this machine's clock (median of %d): unless "
                "rounds in this swarm take that long, this clock is ahead, and peers refuse this node's batches as "
                "dated in the future (from_future, then a ban). Let NTP set the clock (e.g. `timedatectl set-ntp "
                "true`)",
                OLD_S,
                len(offsets),
            )

    def presence(self, read: int, off_clock: int, lifetime_s: float) -> None:
        """A fetch's presence records: of `read` other peers, `off_clock` with a record dated more than its
        lifetime away from this clock, whose batches are never fetched. Most of at least QUORUM: this clock
        is probably off, which nothing else would show (no batch arrives). Only a clock behind by more than
        the lifetime (and less than what the DHT's validator refuses) shows here: records that look expired to
        a clock ahead never reach the reader."""
        if read >= QUORUM and 2 * off_clock > read:
            self._say(
                "far",
                "the presence records of %d of %d peers read are dated more than %.0f s away from this machine's "
                "clock, so none of their batches is fetched: this clock is off, or theirs are. Let NTP set it "
                "(e.g. `timedatectl set-ntp true`)",
                off_clock,
                read,
                lifetime_s,
            )

    def unheard(
        self, dht_peers: int | None, shards_answered: int, presence_read: int, swarm: str, lifetime_s: float
    ) -> None:
        """A fetch whose presence searches completed (`shards_answered`) and read no record of another peer of
        `swarm`, while the routing table holds `dht_peers`: after UNHEARD_FETCHES in a row, a hint. A fetch that
        timed out is no evidence and counts neither way; a record read, or too few DHT peers, starts over."""
        if presence_read or dht_peers is None or dht_peers < MIN_DHT_PEERS:
            self.unheard_fetches = 0
            return
        if not shards_answered:
            return
        self.unheard_fetches += 1
        if self.unheard_fetches >= UNHEARD_FETCHES:
            self._say(
                "unheard",
                "%d fetches in a row read no presence record of swarm %r, though the DHT holds %d other peers: if "
                "some of them are nodes (not bootstrap peers), they run another --swarm, or this machine's clock is "
                "ahead by more than %.0f s (every record then looks expired here, and peers refuse this node's as "
                "dated in the future). Compare --swarm with the swarm's name; let NTP set the clock (e.g. "
                "`timedatectl set-ntp true`)",
                self.unheard_fetches,
                swarm,
                dht_peers,
                lifetime_s,
            )

    def _say(self, key: str, message: str, *args: object) -> None:
        now = self.clock()
        if now - self.said_at.get(key, -SAY_EVERY_S) >= SAY_EVERY_S:
            self.said_at[key] = now
            log.warning(message, *args)

"""Whose batches to fetch: a bandit over publishers, so that keys that follow the rules but bring nothing
(Sybils) cannot dilute the swarm (the rules are in docs/PROTOCOL.md, "node policy").

Each publisher key has a record of what its fetched batches were worth to us: `ok` (a batch with at
least one verified group that has a learning signal and content we had not seen) and `bad` (an
announced batch that was missing — a "ghost" — or one with no such group). Its usefulness is the
posterior mean (ok + 1) / (ok + bad + 2).

A round has K fetch slots:

* **Exploit.** Proven publishers (ok >= 1 and usefulness >= `proven_mean`) get at most K - E slots,
  best usefulness first. The transport reads their presence shards first, so they are never lost in
  a sample of a crowded presence.
* **Explore.** At least E = max(1, K // 4) slots, plus every exploit slot left free, go to keys that
  are not proven: never-tried keys first, from a queue of the never-tried keys seen in presence (higher
  work tier first, `p2p.pow`; first seen first within a tier; random order among keys first seen in the
  same round), and a quarter of them (at least one) to
  keys that failed before and whose cool-down is over, fewest failures in a row first. Each consecutive
  failure of an unproven key doubles its cool-down (1, 2, 4 … `max_cooldown` rounds), so a key
  found useless once stays out of the way while the unexplored keys are tried. A ghost or a caught
  copy counts as STRONG failures at once (8 rounds): honest software never makes one, while a batch
  without signal is what a weak honest model also publishes, so it parks a key for one round only.

Why this bound holds for a new honest peer (PROTOCOL.md states it): once a reader has seen the newcomer
(the transport's rotation over the tier shards guarantees that within TIER_SCAN_ROUNDS rounds), it stays
queued until tried, and its presence shard is read among the preferred ones, so it stays a candidate.
Each round the reader tries E_new queued keys, none twice, and only keys of the newcomer's tier or above
(seen before it, or of a higher tier) go ahead of it: with U such keys the newcomer is tried within
ceil(U / E_new) rounds of being seen, and a failed newcomer is retried with priority over keys that
failed more often. Every Sybil key costs one try
before it is parked; a Sybil swarm therefore delays a newcomer by its number of *untried* keys at the
newcomer's tier or above, which only fresh proofs of work at that tier (16x the mint per tier) replenish.

The bandit is the transport's whole publisher chooser (`p2p.presence.PublisherChooser`): given the node's
`Reputation`, it also vetoes banned keys (never fetched, not even their presence shards read first) and
charges a ghost to reputation as well; what it turned away and the ghosts are counted with the round's
verification (`take_unfetched`).

The table is bounded (`max_tracked`, least recently updated first out), thread-safe (the verifier
thread reports, the event loop chooses), and local: nothing here is ever sent.
"""

from __future__ import annotations

import math
import random
import threading
from collections import OrderedDict
from dataclasses import dataclass

from node.swarm.reputation import Reputation

STRONG = 4  # failures in a row a ghost or a caught copy counts: parked 8 rounds at once


@dataclass
class BanditConfig:
    explore_share: float = 0.25  # of K, at least one slot: never-tried and retried keys
    proven_mean: float = 0.2  # usefulness a key with one useful batch must keep to stay proven
    memory: float = 20.0  # ok + bad are scaled down past this: old evidence fades
    max_cooldown: int = 64  # rounds an unproven key waits after repeated failures, at most
    max_tracked: int = 8192
    max_queued: int = 4096  # never-tried keys remembered; when full the lowest tier's newest is dropped


@dataclass
class Record:
    ok: float = 0.0
    bad: float = 0.0
    fails_in_row: int = 0
    next_try: int = 0  # our round from which an unproven key may be explored again

    @property
    def mean(self) -> float:
        return (self.ok + 1.0) / (self.ok + self.bad + 2.0)


class PublisherBandit:
    """The node's publisher chooser (`p2p.presence.PublisherChooser`): whom to skip (`reputation`'s bans), preferred
    keys, fresh candidates, choice, ghosts. Without a reputation, nobody is skipped."""

    def __init__(
        self, cfg: BanditConfig | None = None, rng: random.Random | None = None, reputation: Reputation | None = None
    ):
        self.cfg = cfg or BanditConfig()
        self.rng = rng or random.Random()
        self.reputation = reputation
        self.round = 0
        self._table: OrderedDict[bytes, Record] = OrderedDict()
        # never-tried keys seen in presence: key -> (work tier, first seen: ordinal)
        self._queue: dict[bytes, tuple[int, int]] = {}
        self._seen = 0
        self._asked: set[bytes] = set()  # queued keys whose presence shards the last preferred() asked for
        self._turned_away: set[bytes] = set()  # banned publishers allowed() refused since take_unfetched()
        self._ghosts: list[bytes] = []  # announced batches not found since take_unfetched()
        self._lock = threading.Lock()

    # --- evidence (verifier thread and event loop) -----------------------------------------------------

    def observe(self, publisher: bytes, useful: bool, strikes: int = 1) -> None:
        """One fetched batch of this publisher, judged. A failure counts `strikes` failures in a row toward
        the cool-down: STRONG for what honest software never does (a ghost, a caught copy), 1 for a batch
        without a useful group (a weak honest model publishes those too)."""
        cfg = self.cfg
        with self._lock:
            self._queue.pop(publisher, None)  # tried
            r = self._table.pop(publisher, None) or Record()
            self._table[publisher] = r  # most recently updated last
            if useful:
                r.ok += 1
                r.fails_in_row = 0
                r.next_try = 0
            else:
                r.bad += 1
                r.fails_in_row += strikes
                r.next_try = self.round + min(cfg.max_cooldown, 2 ** (r.fails_in_row - 1))
            total = r.ok + r.bad
            if total > cfg.memory:
                r.ok, r.bad = r.ok * cfg.memory / total, r.bad * cfg.memory / total
            while len(self._table) > cfg.max_tracked:
                self._table.popitem(last=False)

    def park_if_unproven(self, publisher: bytes) -> None:
        """A batch refused for what others can cause (a replay of an old one, a lagging replica, the receiver's
        clock): a useless batch for a key never useful yet, so that one sending only those is parked; nothing
        for a key that has been useful (it is not demoted by what it may not have done)."""
        r = self.record(publisher)
        if r is None or r.ok == 0:
            self.observe(publisher, useful=False)

    def copied(self, publisher: bytes) -> None:
        """Caught serving another key's content: its useful batches may have been copies too. It loses
        them and counts one failure (so it is unproven, and parked like any failed key)."""
        with self._lock:
            r = self._table.get(publisher)
            if r is not None:
                r.ok = 0.0
        self.observe(publisher, useful=False, strikes=STRONG)

    def missing(self, publisher: bytes, round: int) -> None:
        """A ghost: an announced batch that a completed search did not find (honest software never makes
        one). One useless batch here, and a `ghost` penalty in the reputation."""
        self.observe(publisher, useful=False, strikes=STRONG)
        if self.reputation is not None:
            self.reputation.penalize(publisher, "ghost")
        with self._lock:
            self._ghosts.append(publisher)

    def take_unfetched(self) -> tuple[set[bytes], list[bytes]]:
        """What the fetches since the last call did not bring, for the round's counters: the banned
        publishers `allowed` turned away (each once) and the ghosts (each time)."""
        with self._lock:
            turned_away, self._turned_away = self._turned_away, set()
            ghosts, self._ghosts = self._ghosts, []
        return turned_away, ghosts

    def new_round(self) -> None:
        with self._lock:
            self.round += 1

    # --- views ---------------------------------------------------------------------------------------

    def record(self, publisher: bytes) -> Record | None:
        with self._lock:
            return self._table.get(publisher)

    def allowed(self, publisher: bytes) -> bool:
        """May the transport fetch this publisher? Not while the reputation bans it."""
        if self.reputation is None or self.reputation.allowed(publisher):
            return True
        with self._lock:
            self._turned_away.add(publisher)
        return False

    def _proven(self, r: Record | None) -> bool:
        return r is not None and r.ok >= 1 and r.mean >= self.cfg.proven_mean

    def preferred(self, limit: int) -> list[bytes]:
        """Whose presence shards are read before any other (at most `limit`): proven publishers, best
        first, in at most limit - E places, then the head of the never-tried queue (so a key met once stays
        a candidate until it is tried, even when the rotation reads other shards); none that is banned."""
        explore_min = max(1, math.floor(limit * self.cfg.explore_share))
        with self._lock:
            ranked = sorted(((r.mean, k) for k, r in self._table.items() if self._proven(r)), key=lambda mk: -mk[0])
            proven = [k for _, k in ranked[: max(0, limit - explore_min)]]
            head = sorted(self._queue, key=self._queue_order)[: limit - len(proven)]
            self._asked = set(head)
        return [p for p in proven + head if self.reputation is None or self.reputation.allowed(p)]

    def _queue_order(self, publisher: bytes) -> tuple[int, int]:
        tier, first = self._queue[publisher]
        return -tier, first

    def _enqueue(self, new: list[bytes], tiers: dict[bytes, int]) -> None:
        """Remember never-tried candidates (caller holds the lock; `new` in random order), and forget the
        queued keys whose presence shard was read for them but no longer holds them (left, or expired)."""
        for pub in self._asked.difference(new):
            self._queue.pop(pub, None)
        self._asked = set()
        worst = None  # the queued key a full queue drops first: lowest tier, newest (found once per call)
        for pub in new:
            tier = tiers.get(pub, 0)
            if pub in self._queue:
                t, first = self._queue[pub]
                self._queue[pub] = (max(t, tier), first)
                continue
            if len(self._queue) >= self.cfg.max_queued:
                worst = worst or max(self._queue, key=self._queue_order)
                if self._queue_order(worst) <= (-tier, self._seen):
                    continue  # the new key would be the one dropped
                del self._queue[worst]
                worst = None
            self._queue[pub] = (tier, self._seen)
            self._seen += 1

    def fresh(self, publisher: bytes) -> bool:
        """Worth a slot now: proven, never tried, or past its cool-down (counts toward a presence sample)."""
        with self._lock:
            r = self._table.get(publisher)
            return r is None or self._proven(r) or r.next_try <= self.round

    def choose(self, candidates: dict[bytes, int], k: int, tiers: dict[bytes, int] | None = None) -> list[bytes]:
        """Up to k candidate keys: proven ones in at most k - E slots, then exploration (see module doc);
        never-tried keys of higher work `tiers` first."""
        explore_min = max(1, math.floor(k * self.cfg.explore_share))
        with self._lock:
            recs = {pub: rec for pub in candidates if (rec := self._table.get(pub)) is not None}  # tried ones
            now = self.round
        keys = list(candidates)
        self.rng.shuffle(keys)  # ties broken at random
        proven = sorted((p for p in keys if self._proven(recs.get(p))), key=lambda p: -recs[p].mean)
        exploit = proven[: max(0, k - explore_min)]
        slots = k - len(exploit)
        with self._lock:
            self._enqueue([p for p in keys if p not in recs], tiers or {})
            queued = sorted((p for p in keys if p not in recs and p in self._queue), key=self._queue_order)
            turned_away = [p for p in keys if p not in recs and p not in self._queue]
        # keys a full queue turned away still get a slot the queued ones leave free
        new = queued + sorted(turned_away, key=lambda p: -(tiers or {}).get(p, 0))
        retry = sorted(
            (p for p in keys if p in recs and not self._proven(recs[p]) and recs[p].next_try <= now),
            key=lambda p: (recs[p].fails_in_row, -recs[p].mean),
        )
        n_retry = min(len(retry), max(1, slots // 4), slots)
        n_new = min(len(new), slots - n_retry)
        n_retry = min(len(retry), slots - n_new)  # what the new keys leave over
        return exploit + new[:n_new] + retry[:n_retry]

    def snapshot(self) -> dict:
        with self._lock:
            recs = list(self._table.values())
            queued = len(self._queue)
        return {
            "tracked": len(recs),
            "proven": sum(1 for r in recs if self._proven(r)),
            "parked": sum(1 for r in recs if not self._proven(r) and r.next_try > self.round),
            "queued": queued,
        }

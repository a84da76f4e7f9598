"""Whose batches to fetch: a bandit over publishers, so that keys that follow the rules but bring nothing
(Sybils) cannot dilute the swarm (issue 20; the rules are in docs/PROTOCOL.md, "node policy").

Each publisher key has a record of what its fetched batches were worth to us: `ok` (a batch with at
least one verified group that has a learning signal and content we had not seen) and `bad` (an
announced batch that was missing — a "ghost" — or one with no such group). Its usefulness is the
posterior mean (ok + 1) / (ok + bad + 2).

A round has K fetch slots:

* **Exploit.** Proven publishers (ok >= 1 and usefulness >= `proven_mean`) get at most K - E slots,
  best usefulness first. The transport reads their presence shards first, so they are never lost in
  a sample of a crowded presence.
* **Explore.** At least E = max(1, K // 4) slots, plus every exploit slot left free, go to keys that
  are not proven: never-seen keys first (higher work tier first, `p2p.pow`; random order within a
  tier), and a quarter of them (at least one) to
  keys that failed before and whose cool-down is over, fewest failures in a row first. Each consecutive
  failure of an unproven key doubles its cool-down (1, 2, 4 … `max_cooldown` rounds), so a key
  found useless once stays out of the way while the unexplored keys are tried. A ghost or a caught
  copy counts as STRONG failures at once (8 rounds): honest software never makes one, while a batch
  without signal is what a weak honest model also publishes, so it parks a key for one round only.

Why this bound holds for a new honest peer (PROTOCOL.md states it): with U never-seen live keys of the
newcomer's work tier or above in a reader's view, the reader tries at least min(U, E_new) of them per
round before any cheaper key, so the newcomer is tried within ceil(U / E_new) rounds, and a failed
newcomer is retried with priority over keys that failed more often. Every Sybil key costs one try
before it is parked; a Sybil swarm therefore delays a newcomer by its number of *untried* keys at the
newcomer's tier or above, which only fresh proofs of work at that tier (16x the mint per tier) replenish.

The table is bounded (`max_tracked`, least recently updated first out), thread-safe (the verifier
thread reports, the event loop chooses), and local: nothing here is ever sent.
"""

from __future__ import annotations

import math
import random
import threading
from collections import OrderedDict
from dataclasses import dataclass


STRONG = 4  # failures in a row a ghost or a caught copy counts: parked 8 rounds at once


@dataclass
class BanditConfig:
    explore_share: float = 0.25  # of K, at least one slot: never-tried and retried keys
    proven_mean: float = 0.2  # usefulness a key with one useful batch must keep to stay proven
    memory: float = 20.0  # ok + bad are scaled down past this: old evidence fades
    max_cooldown: int = 64  # rounds an unproven key waits after repeated failures, at most
    max_tracked: int = 8192


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
    """The node's fetch policy (`p2p.transport.FetchPolicy`): preferred keys, fresh candidates, choice, ghosts."""

    def __init__(self, cfg: BanditConfig | None = None, rng: random.Random | None = None):
        self.cfg = cfg or BanditConfig()
        self.rng = rng or random.Random()
        self.round = 0
        self._table: OrderedDict[bytes, Record] = OrderedDict()
        self._lock = threading.Lock()

    # --- evidence (verifier thread and event loop) -----------------------------------------------------

    def observe(self, publisher: bytes, useful: bool, strikes: int = 1) -> None:
        """One fetched batch of this publisher, judged. A failure counts `strikes` failures in a row toward
        the cool-down: STRONG for what honest software never does (a ghost, a caught copy), 1 for a batch
        without a useful group (a weak honest model publishes those too)."""
        cfg = self.cfg
        with self._lock:
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
        one). The transport's FetchPolicy hook; the node adds its reputation penalty on top."""
        self.observe(publisher, useful=False, strikes=STRONG)

    def new_round(self) -> None:
        with self._lock:
            self.round += 1

    # --- views ---------------------------------------------------------------------------------------

    def record(self, publisher: bytes) -> Record | None:
        with self._lock:
            return self._table.get(publisher)

    def _proven(self, r: Record | None) -> bool:
        return r is not None and r.ok >= 1 and r.mean >= self.cfg.proven_mean

    def preferred(self, limit: int) -> list[bytes]:
        """Proven publishers, best first (their presence shards are read before any other)."""
        with self._lock:
            proven = [(r.mean, k) for k, r in self._table.items() if self._proven(r)]
        proven.sort(key=lambda mk: -mk[0])
        return [k for _, k in proven[:limit]]

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
            recs = {pub: self._table.get(pub) for pub in candidates}
            now = self.round
        keys = list(candidates)
        self.rng.shuffle(keys)  # ties broken at random
        proven = sorted((p for p in keys if self._proven(recs[p])), key=lambda p: -recs[p].mean)
        exploit = proven[:max(0, k - explore_min)]
        slots = k - len(exploit)
        tiers = tiers or {}
        new = sorted((p for p in keys if recs[p] is None), key=lambda p: -tiers.get(p, 0))  # stable: random in a tier
        retry = sorted((p for p in keys if recs[p] is not None and not self._proven(recs[p])
                        and recs[p].next_try <= now), key=lambda p: (recs[p].fails_in_row, -recs[p].mean))
        n_retry = min(len(retry), max(1, slots // 4), slots)
        n_new = min(len(new), slots - n_retry)
        n_retry = min(len(retry), slots - n_new)  # what the new keys leave over
        return exploit + new[:n_new] + retry[:n_retry]

    def snapshot(self) -> dict:
        with self._lock:
            recs = list(self._table.values())
        return {"tracked": len(recs), "proven": sum(1 for r in recs if self._proven(r)),
                "parked": sum(1 for r in recs if not self._proven(r) and r.next_try > self.round)}

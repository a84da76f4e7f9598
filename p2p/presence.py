"""Presence sampling: which live publishers a fetch may choose from, at a cost bounded by constants.

Rounds are not synchronized across peers, so a reader learns them from presence records (PROTOCOL §7):
"I am alive, my latest round is R", under one of `presence_shards` keys chosen by a hash of the
publisher, and again among the shards of its work tier (`p2p.pow`). One sample reads presence shards,
first those of the publishers the `PublisherChooser` prefers, then the next slice of every tier >= 1 in a
rotation that covers each tier every TIER_SCAN_ROUNDS fetches, then tier-0 shards in random order, until
it holds `presence_sample` fresh candidates or the deadline passes. What it reads also feeds the
transport's bounded memories: the newest round and the work tier seen per publisher.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from p2p.config import TransportConfig
from p2p.pow import MAX_TIER, work_tier
from p2p.validators import presence_home, presence_key, tier_shards
from p2p.wire import MAX_PRESENCE_BYTES, WireError, decode_presence, envelope_nonce

logger = logging.getLogger(__name__)

MAX_KNOWN = 10_000  # publishers remembered for known_peers() and the fetched-round memory
FIRST_WAVE_SHARDS = 1  # then as many as the density seen says are needed: each answer stays small
MAX_WAVE_SHARDS = 8  # shards asked in one search at most (a replica answers all the keys it holds at once)
# searches of one wave asked at once: a search that finds nothing visits the DHT's nodes one after another, so
# over a long link a wave of one search at a time costs a round trip per node per wave
PARALLEL_SEARCHES = 4
MAX_WAVE = MAX_WAVE_SHARDS * PARALLEL_SEARCHES
TIER_SCAN_ROUNDS = 8  # every shard of a tier >= 1 is read at least once in this many fetches (PROTOCOL §7)

# key -> {publisher key -> envelope bytes}, or None when the search timed out or failed
GetMany = Callable[[list[str], float], Awaitable[dict[str, dict[bytes, bytes]] | None]]


@dataclass
class FetchStats:
    """What the last fetch cost (for benchmarks and logs)."""

    shards_read: int = 0
    shards_answered: int = 0  # of those, shards whose search completed (found or not) within the deadline
    candidates: int = 0
    batches_requested: int = 0
    batches_received: int = 0
    bytes_received: int = 0  # values received (presence + batches), before any budget is applied
    largest_answer_bytes: int = 0
    over_budget: int = 0  # batches received but dropped by max_bytes
    missing: int = 0  # announced batches that a completed search did not find (ghosts)
    # other peers of this swarm whose valid presence records were read (a key above tier 0 has two shards), and
    # those whose record is dated more than the records' lifetime away from this machine's clock
    presence_keys: set[bytes] = field(default_factory=set)
    off_clock_keys: set[bytes] = field(default_factory=set)
    seconds: float = 0.0

    def received(self, value: bytes) -> None:
        self.bytes_received += len(value)
        self.largest_answer_bytes = max(self.largest_answer_bytes, len(value))


class PublisherChooser(Protocol):
    """Whose batches a fetch reads: the one hook a fetch takes (the node's bandit, `node.swarm.bandit`, whose
    reputation vetoes banned keys; `UniformChooser` by default)."""

    def allowed(self, publisher: bytes) -> bool:
        """May this publisher be a candidate at all? False: none of its batches is fetched (a banned key)."""
        ...

    def preferred(self, limit: int) -> list[bytes]:
        """Publishers whose presence shards are read first (at most `limit`)."""
        ...

    def fresh(self, publisher: bytes) -> bool:
        """Does this candidate count toward the presence sample?"""
        ...

    def choose(self, candidates: dict[bytes, int], k: int, tiers: dict[bytes, int] | None = None) -> list[bytes]:
        """At most k of the candidates (publisher -> announced round) to fetch; `tiers`: their work tiers."""
        ...

    def missing(self, publisher: bytes, round: int) -> None:
        """A search for this announced batch completed and found nothing."""
        ...


class UniformChooser:
    """Protocol §7's default: everyone allowed, no preference, K chosen uniformly at random."""

    def allowed(self, publisher: bytes) -> bool:
        return True

    def preferred(self, limit: int) -> list[bytes]:
        return []

    def fresh(self, publisher: bytes) -> bool:
        return True

    def choose(self, candidates: dict[bytes, int], k: int, tiers: dict[bytes, int] | None = None) -> list[bytes]:
        return random.sample(list(candidates), min(k, len(candidates)))

    def missing(self, publisher: bytes, round: int) -> None:
        return None


class PresenceSampler:
    """One reader's presence sampling and what it remembers between fetches (all bounded by MAX_KNOWN)."""

    def __init__(self, config: TransportConfig, own_key: bytes) -> None:
        self.config = config
        self.own_key = own_key
        self.known: dict[str, int] = {}  # pubkey hex -> latest round seen in its presence record
        self.tiers: dict[bytes, int] = {}  # publisher -> work tier seen in its presence (where to read it)
        self.fetched: dict[tuple[bytes, int], None] = {}  # (publisher, round) already fetched: never twice
        # where the rotation over each tier >= 1 goes on next fetch; a random start spreads readers' load
        self.scan_at = {t: random.randrange(tier_shards(config.presence_shards, t)) for t in range(1, MAX_TIER + 1)}

    def mark_fetched(self, pub: bytes, round_: int) -> None:
        self.fetched[(pub, round_)] = None
        while len(self.fetched) > MAX_KNOWN:
            del self.fetched[next(iter(self.fetched))]

    def unmark_fetched(self, pub: bytes, round_: int) -> None:
        self.fetched.pop((pub, round_), None)

    async def sample(
        self,
        get_many: GetMany,
        deadline: float,
        stats: FetchStats,
        chooser: PublisherChooser,
    ) -> dict[bytes, int]:
        """Read presence shards until `presence_sample` fresh allowed candidates (publisher -> round) are known.

        Must-read, in the first searches: the shards of the chooser's preferred publishers, then this
        fetch's slice of every tier >= 1 (highest first; the rotation reads each tier-t shard at least once
        in TIER_SCAN_ROUNDS fetches, so a key that paid for a tier is met within that many rounds however
        many cheaper keys there are). Then tier-0 shards (every key is there) in random order, as many as
        the density of fresh candidates seen so far says are still needed, at most MAX_WAVE_SHARDS per
        search. A wave's searches run at once (up to PARALLEL_SEARCHES): the must-read shards in the first wave.
        Bounded by the shards named here and the deadline, not by the swarm size.
        """
        cfg = self.config
        preferred = list(dict.fromkeys(self.home(p) for p in chooser.preferred(cfg.fetch_max)))
        must = list(dict.fromkeys(preferred + self.tier_slice()))
        tier0 = [presence_key(cfg.swarm, s) for s in random.sample(range(cfg.presence_shards), cfg.presence_shards)]
        order = must + [key for key in tier0 if key not in must]
        candidates: dict[bytes, int] = {}
        loop = asyncio.get_running_loop()
        wave = min(len(order), max(FIRST_WAVE_SHARDS, min(len(must), MAX_WAVE)))
        n_must = len(must)
        while order and loop.time() < deadline:
            shards, order = order[:wave], order[wave:]
            searches = [shards[i : i + MAX_WAVE_SHARDS] for i in range(0, len(shards), MAX_WAVE_SHARDS)]
            for keys, answers in zip(searches, await asyncio.gather(*(get_many(k, deadline) for k in searches))):
                stats.shards_read += len(keys)
                if answers is None:  # timed out or failed: no evidence either way
                    continue
                stats.shards_answered += len(keys)
                for entries in answers.values():
                    self._take(entries, chooser, candidates, stats)
            n_must = max(0, n_must - len(shards))
            fresh = sum(1 for p in candidates if chooser.fresh(p))
            missing = cfg.presence_sample - fresh
            if missing <= 0 and n_must == 0:
                break
            density = fresh / stats.shards_read  # fresh candidates per shard so far
            wave = len(order) if density == 0 else max(1, math.ceil(missing / density))
            wave = min(len(order), MAX_WAVE, max(wave, min(n_must, MAX_WAVE)))
        stats.candidates = len(candidates)
        return candidates

    def tier_slice(self) -> list[str]:
        """This fetch's shards of the tiers >= 1, highest tier first: the next ceil(S_t / TIER_SCAN_ROUNDS)
        of each tier's S_t shards in rotation (1, 1 and 8 at S = 64)."""
        keys = []
        for tier in range(MAX_TIER, 0, -1):
            n = tier_shards(self.config.presence_shards, tier)
            step, start = math.ceil(n / TIER_SCAN_ROUNDS), self.scan_at[tier]
            keys += [presence_key(self.config.swarm, (start + i) % n, tier) for i in range(step)]
            self.scan_at[tier] = (start + step) % n
        return keys

    def _take(
        self,
        entries: dict[bytes, bytes],
        chooser: PublisherChooser,
        candidates: dict[bytes, int],
        stats: FetchStats,
    ) -> None:
        """Add the valid, current presence records of one shard to `candidates` (and to the memories)."""
        cfg = self.config
        now = time.time()
        for pub, data in entries.items():
            stats.received(data)
            if pub == self.own_key:
                continue
            try:
                rec = decode_presence(data, MAX_PRESENCE_BYTES, cfg.pow_difficulty)
            except WireError as e:
                logger.debug("bad presence record from %s: %s", pub.hex()[:16], e)
                continue
            if rec.swarm != cfg.swarm or rec.publisher != pub:
                continue
            stats.presence_keys.add(pub)
            if abs(now - rec.updated_at) > cfg.record_ttl_s:
                stats.off_clock_keys.add(pub)
                continue  # a stale record (or a clock far off): its batches are gone or not yet valid
            remember(self.known, pub.hex(), rec.round)
            remember(self.tiers, pub, work_tier(pub, envelope_nonce(data), cfg.pow_difficulty))
            if (pub, rec.round) in self.fetched or not chooser.allowed(pub):
                continue
            candidates[pub] = rec.round

    def home(self, publisher: bytes) -> str:
        """The presence shard key of a publisher (at the tier its last presence record showed; 0 if unseen)."""
        return presence_home(self.config.swarm, publisher, self.tiers.get(publisher, 0), self.config.presence_shards)


def remember(memory: dict, key: Any, value: int) -> None:
    """Keep the largest value (newest round, highest tier) per key, forgetting the oldest-inserted keys
    beyond MAX_KNOWN."""
    memory[key] = max(value, memory.pop(key, -1))
    while len(memory) > MAX_KNOWN:
        del memory[next(iter(memory))]

"""The node's side of the swarm: turn groups into signed batches, and received bytes into trusted groups.

Nothing received is trusted: the DHT validator already refused unsigned or misplaced records, but the
`Verifier` checks everything again on its own (caps, schema, signature, swarm, freshness, replays),
regenerates every task from its spec with our task mix, and re-scores every completion with our reward
function. Two transports share this code through `SignedExchange`: `DhtExchange` (Hivemind DHT,
`node.swarm.dht_exchange`) and `MemoryExchange` (several nodes in one process, `node.swarm.memory_exchange`).

What the verifier learns feeds the publisher's `Reputation` (`node.swarm.reputation`): banned publishers
are skipped before any check, counted as `banned`. Each round's verification has a time and a byte budget;
records past it wait for the next round (counted `over_budget`), and the order is fair: trusted publishers
first, then unknown ones, then those in the red, each tier shuffled with the node's seeded rng, so a flood
of new identities cannot crowd out peers that have already been useful.

Why this module is long: it is the one place where received bytes become trusted groups, and every check
of docs/PROTOCOL.md section 8 (with the evidence each gives the reputation, the bandit and the
foreign-text count of node/swarm/screening.py) reads best in order, in one file.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import random
import time
from collections import Counter, OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from node.learn.groups import Group, has_signal
from node.learn.screen import ScreenConfig
from node.learn.tasks import TaskError, TaskMix, TaskSpec, regenerate
from node.swarm.bandit import PublisherBandit
from node.swarm.clock import ClockCheck
from node.swarm.exchange import ExchangeStats, Received
from node.swarm.reputation import PENALTIES, Reputation, ReputationConfig
from node.swarm.sandbox import GROUP_TIME_S, SANDBOX, group_time_limit
from node.swarm.screening import ForeignText
from node.swarm.settings import SwarmSettings
from p2p.identity import Identity, peer_name_of
from p2p.wire import (
    MIN_LOGP_MEAN,
    WIRE_VERSION,
    RolloutBatch,
    TaskSpecWire,
    WireCaps,
    WireError,
    WireGroup,
    canonical_json,
    check_group_caps,
    decode_signed,
    encode_signed,
    open_envelope,
)

log = logging.getLogger("sapo.swarm")

UNKNOWN_PEER = "unknown"
REWARD_TOLERANCE = 1e-6
MAX_JUDGED = 100_000
MAX_PUBLISHERS = 8192  # publishers whose recent rounds are remembered (as the bandit's table)
TIME_LIMIT_BUDGETS = 2  # a record begun within the round's time budget is cut short at twice the budget
MIN_SCORE_TIME_S = 1.0  # a group begun just before that limit still gets this long (2/3 + 1 s < a 10 s net timeout)
MAX_CONTENTS = 100_000  # group contents remembered (a window of rounds: ~100 rounds of 64 peers x 16 groups)


@dataclass
class VerifyConfig:
    swarm: str
    window: int = 2  # a publisher's W newest rounds are accepted: round > its newest - W
    max_age_s: float = 600.0  # batches older than this (sender clock) are stale
    max_clock_skew_s: float = 120.0
    caps: WireCaps = WireCaps()
    budget_s: float = 3.0  # verification time per round; the rest waits for the next round
    budget_bytes: int = 32 * 1024 * 1024  # bytes verified per round
    external_screen: str = "on"  # --external-screen: span modes count foreign_text (node/swarm/screening.py)
    score_time_s: float = GROUP_TIME_S  # a group's scoring time limit, plus PER_COMPLETION_S a completion
    seed: int = 0  # the verification order's shuffle
    pow_difficulty: int = 0  # proof-of-work bits a publisher key must carry (the swarm's setting)
    reputation: ReputationConfig = field(default_factory=ReputationConfig)

    @classmethod
    def from_settings(cls, s: SwarmSettings, **overrides: Any) -> VerifyConfig:
        """The verifier's and the reputation's share of a node's swarm settings (budgets resolved)."""
        values = dict(
            swarm=s.swarm,
            window=s.window,
            seed=s.seed,
            budget_s=s.verify_budget_s or s.net_timeout_s / 3,
            budget_bytes=int(s.verify_budget_mb * 1024 * 1024),
            pow_difficulty=s.pow_difficulty,
            reputation=ReputationConfig(ban_s=s.ban_s),
            external_screen=s.external_screen,
        )
        return cls(**{**values, **overrides})


class Verifier:
    """Receiver-side verification of untrusted batches; counts every rejection by peer and reason, and
    tells the publisher's reputation what it provably did."""

    def __init__(
        self,
        own_key: bytes,
        mix: TaskMix,
        cfg: VerifyConfig,
        stats: ExchangeStats,
        reputation: Reputation | None = None,
        bandit: PublisherBandit | None = None,
    ):
        self.own_key = own_key
        self.mix = mix
        self.cfg = cfg
        self.stats = stats
        self.reputation = reputation if reputation is not None else Reputation(cfg.reputation)
        self.bandit = bandit if bandit is not None else PublisherBandit()
        self.contents: OrderedDict[str, bytes] = OrderedDict()  # group content digest -> first publisher
        self._original_useful = False
        # publisher -> the rounds taken from it within the window (the newest is the newest accepted), LRU
        self.taken: OrderedDict[bytes, set[int]] = OrderedDict()
        self.judged: dict[str, None] = {}  # digests of every batch already judged (insertion-ordered)
        # the round's hard time limit (set per round by the exchange; its own clock, tests replace it): a batch
        # being judged then is cut short, its remaining groups `over_budget`; a group being scored then runs on
        # for at most MIN_SCORE_TIME_S more, so that a round's verification ends within its net timeout
        self.clock = time.monotonic
        self.time_limit_at = math.inf
        self.sandbox = SANDBOX  # where other peers' completions are scored (a child process: node/swarm/sandbox.py)
        self.clock_check = ClockCheck(cfg.max_clock_skew_s)  # whose clock a batch from the future blames
        self.foreign = ForeignText(mix.answer_prefix, ScreenConfig(cfg.external_screen))  # text around right answers

    def verify(self, data: bytes, now: float | None = None, hint: bytes | None = None) -> list[Group]:
        """Groups from one batch that passed every check (possibly none). Never raises on bad input.

        Each distinct byte string is judged once: a batch stays in the fetch window for several rounds,
        and neither its groups nor its offences may count twice.
        """
        digest = self.pending(data, hint)
        return [] if digest is None else self.judge(digest, data, now, hint)

    def pending(self, data: bytes, hint: bytes | None) -> str | None:
        """The digest of a batch still to be judged; None for one judged before or from a banned publisher
        (counted as `banned` once, and never opened: no signature check, no parsing)."""
        digest = hashlib.sha256(data).hexdigest()
        if digest in self.judged:
            return None
        if hint is not None and not self.reputation.allowed(hint):
            self._mark(digest)
            self.stats.reject(hint.hex(), "banned")
            return None
        return digest

    def judge(self, digest: str, data: bytes, now: float | None = None, hint: bytes | None = None) -> list[Group]:
        self._mark(digest)
        return self._verify(data, time.time() if now is None else now, hint)

    def _mark(self, digest: str) -> None:
        self.judged[digest] = None
        while len(self.judged) > MAX_JUDGED:
            del self.judged[next(iter(self.judged))]

    def _signer(self, data: bytes) -> bytes | None:
        try:
            return open_envelope(data, self.cfg.caps.max_batch_bytes).publisher
        except WireError:
            return None

    def _offence(self, publisher: bytes, reason: str, batch: bool = False) -> None:
        """A rejection the publisher provably caused (its signature holds): counted, and it costs reputation
        (and, for a whole batch refused, one useless batch in the bandit)."""
        self.stats.reject(publisher.hex(), reason)
        self.reputation.penalize(publisher, reason)
        if batch:
            self.bandit.observe(publisher, useful=False)

    def _useless(self, publisher: bytes, reason: str) -> list[Group]:
        """A signed batch refused for what need not be the key holder's fault (a replay of its old batch, a lagging
        replica, our clock): no charge; for a key never useful yet, a useless batch for the publisher chooser,
        so that keys sending only these are parked instead of being explored again every round."""
        self.stats.reject(publisher.hex(), reason)
        self.bandit.park_if_unproven(publisher)
        return []

    def _verify(self, data: bytes, now: float, hint: bytes | None) -> list[Group]:
        claimed = hint.hex() if hint else UNKNOWN_PEER
        try:
            batch = decode_signed(data, self.cfg.caps, self.cfg.pow_difficulty)  # bytes, envelope, PoW, sig, schema
        except WireError as exc:
            signer = self._signer(data) if exc.reason in PENALTIES else None  # raised after the signature held
            if signer is None:
                self.stats.reject(claimed, exc.reason)
            else:
                self._offence(signer, exc.reason, batch=True)
            return []
        except Exception:  # a decoder bug must not become a node crash
            self.stats.reject(claimed, "malformed")
            return []
        peer = batch.publisher.hex()
        if batch.publisher == self.own_key:
            return []
        if hint is not None and hint != batch.publisher:
            self.stats.reject(peer, "publisher_mismatch")  # the transport's hint is not signed: no penalty
            return []
        if not self.reputation.allowed(batch.publisher):  # no hint, or banned since the hint was checked
            self.stats.reject(peer, "banned")
            return []
        if batch.swarm != self.cfg.swarm:
            return self._useless(batch.publisher, "wrong_swarm")
        dated = self.clock_check.judge(batch.publisher, batch.round, batch.created_at - now)  # or None
        if now - batch.created_at > self.cfg.max_age_s:
            return self._useless(batch.publisher, "stale")
        if dated == "from_future":
            self._offence(batch.publisher, dated, batch=True)
            return []
        if dated:  # clock_behind: our clock, by the majority of recent publishers
            return self._useless(batch.publisher, dated)
        taken = self.taken.get(batch.publisher, set())
        if batch.round in taken:  # a different batch for a round we already took from this publisher
            self._offence(batch.publisher, "equivocation", batch=True)
            return []
        newest = max(taken, default=-1)
        if batch.round <= newest - self.cfg.window:
            return self._useless(batch.publisher, "stale_round")
        newest = max(newest, batch.round)
        self.taken[batch.publisher] = {r for r in taken if r > newest - self.cfg.window} | {batch.round}
        self.taken.move_to_end(batch.publisher)
        while len(self.taken) > MAX_PUBLISHERS:
            self.taken.popitem(last=False)
        self.stats.saw(peer, {"name": peer_name_of(batch.publisher), "last_round": newest, "last_seen": now})
        self._original_useful = False  # set by _group: a useful group of ours that a copier showed us first
        self.foreign.new_batch()
        groups = [g for g in (self._group(batch.publisher, wg, batch.created_at) for wg in batch.groups) if g]
        self.bandit.observe(batch.publisher, useful=self._original_useful or self.foreign.useful(groups))
        return groups

    def _first_sight(self, publisher: bytes, wg: WireGroup) -> bool | None:
        """Is this group's content (task spec and completions, exactly) new to us? Content is trained on
        once. The same content again from its first publisher is `repeated`. From another key it is a copy,
        and the copier is presumed to be the one of the two with the lower reputation: it is charged a
        `duplicate` (what a useless group costs) and loses its record of useful batches in the bandit, even
        when it was seen first (the copy was trained on then; from now on it earns nothing). Equal
        reputations (two unknown keys): nobody is charged, and the later one earns nothing.
        True: new content; None: a copy whose original this publisher is presumed to be; False: otherwise."""
        digest = hashlib.sha256(
            canonical_json([wg.task.dataset, wg.task.config, wg.task.seed, wg.task.index, wg.completions])
        ).hexdigest()
        first = self.contents.get(digest)
        if first is None:
            self.contents[digest] = publisher
            while len(self.contents) > MAX_CONTENTS:
                self.contents.popitem(last=False)
            return True
        if first == publisher:
            self._offence(publisher, "repeated")
            return False
        mine, theirs = self.reputation.score(publisher), self.reputation.score(first)
        copier = publisher if mine < theirs else first if theirs < mine else None
        if copier is None:
            self.stats.reject(publisher.hex(), "duplicate")
        else:
            self._offence(copier, "duplicate")
            self.bandit.copied(copier)
        if copier == first:
            self.stats.reject(publisher.hex(), "copied_from")  # its own content, seen first under a copier's key
            return None
        return False

    def _group(self, publisher: bytes, wg: WireGroup, created_at: float) -> Group | None:
        now = self.clock()
        if now >= self.time_limit_at:
            self.stats.reject(publisher.hex(), "over_budget")
            return None
        spec = TaskSpec.make(wg.task.dataset, wg.task.config, wg.task.seed, wg.task.index)
        if not self.mix.allows(spec):
            self._offence(publisher, "task_not_allowed")
            return None
        if len(wg.completions) < 2:
            self._offence(publisher, "too_few_completions")
            return None
        try:
            task = regenerate(spec)
        except TaskError:
            self._offence(publisher, "bad_task")
            return None
        # our reward function, our ground truth, in the sandbox: a scorer that runs too long is stopped. Near the
        # round's time limit a group gets what is left of it (at least MIN_SCORE_TIME_S): past it, over_budget
        full = group_time_limit(len(wg.completions), self.cfg.score_time_s)
        limit = min(full, max(MIN_SCORE_TIME_S, self.time_limit_at - now))
        rewards = self.sandbox.score(spec.to_wire(), list(wg.completions), limit)
        if rewards is None:  # not the publisher's provable fault: not charged
            self.stats.reject(publisher.hex(), "unscored" if limit == full else "over_budget")
            return None
        if len(wg.rewards) != len(rewards) or any(abs(a - b) > REWARD_TOLERANCE for a, b in zip(wg.rewards, rewards)):
            self._offence(publisher, "reward_mismatch")  # the sender lies, or scores differently: not trusted
            return None
        new = self._first_sight(publisher, wg)
        if not new:
            if new is None and has_signal(rewards):  # our useful content, shown us first by a copier
                self._original_useful = True
                self.reputation.credit(publisher)  # so that from now on it is judged before fresh copiers
            return None
        peer = publisher.hex()
        self.stats.accept(peer)
        group = Group(
            task=task,
            responses=list(wg.completions),
            rewards=rewards,
            source=peer,
            sender_rewards=list(wg.rewards),
            behaviour_mean_logp=wg.logp_mean,
            created_at=created_at,
        )
        if self.foreign.judge(publisher, group):  # its recurring text around right answers: no credit
            self.stats.foreign_text(peer)
            self.reputation.penalize(publisher, "foreign_text")
        elif group.signal():
            self.reputation.credit(publisher)
        else:
            self.reputation.penalize(publisher, "useless")
        return group


def _wire_logp(means: list[float] | None) -> list[float] | None:
    """Mean log-probs as the wire takes them: finite, in [MIN_LOGP_MEAN, 0] (a rollout engine's rounding can put
    a near-certain token a hair above 0)."""
    if means is None:
        return None
    return [min(0.0, max(MIN_LOGP_MEAN, m)) if math.isfinite(m) else MIN_LOGP_MEAN for m in means]


def make_batch(
    identity: Identity, swarm: str, round_: int, model: str, groups: list[Group], caps: WireCaps = WireCaps()
) -> bytes:
    """Our signed batch of this round's groups. A group over the receivers' caps (a long completion, a large
    G) is left out, and groups from the end until the batch fits its size cap, with a warning: every peer
    would refuse the whole batch and penalise us for it, so an honest node never signs one."""
    kept: list[WireGroup] = []
    left_out: Counter[str] = Counter()
    for g in groups:
        wire_group = WireGroup(
            task=TaskSpecWire(**g.task.spec.to_wire()),
            completions=list(g.responses),
            rewards=list(g.rewards),
            logp_mean=_wire_logp(g.mean_behaviour_logp()),
        )
        try:
            check_group_caps(wire_group, caps)
        except WireError as exc:
            left_out[exc.reason] += 1
            continue
        kept.append(wire_group)
    if len(kept) > caps.max_groups:  # an adaptive I/J policy may sample more local groups than a batch holds
        left_out["too_many_groups"] += len(kept) - caps.max_groups
        del kept[caps.max_groups :]
    while True:
        batch = RolloutBatch(
            version=WIRE_VERSION,
            swarm=swarm,
            round=round_,
            publisher=identity.public_key_bytes,
            created_at=time.time(),
            model=model,
            groups=kept,
        )
        data = encode_signed(batch, identity)
        if len(data) <= caps.max_batch_bytes or not kept:
            break
        kept.pop()
        left_out["oversize"] += 1
    if left_out:
        log.warning(
            "round %d: publishing %d of %d groups; left out over the receivers' caps: %s",
            round_,
            len(kept),
            len(groups),
            ", ".join(f"{n} {reason}" for reason, n in sorted(left_out.items())),
        )
    return data


class SignedExchange:
    """Shared by both transports: sign what we publish, verify (off the event loop) what we receive."""

    def __init__(self, identity: Identity, mix: TaskMix, verify_cfg: VerifyConfig, model_name: str):
        self.identity = identity
        self.stats = ExchangeStats()
        self.reputation = Reputation(verify_cfg.reputation)
        # the transport's publisher chooser: the bandit chooses, the reputation vetoes
        self.bandit = PublisherBandit(rng=random.Random(verify_cfg.seed + 1), reputation=self.reputation)
        self.verifier = Verifier(identity.public_key_bytes, mix, verify_cfg, self.stats, self.reputation, self.bandit)
        self.swarm = verify_cfg.swarm
        self.model_name = model_name
        self.order_rng = random.Random(verify_cfg.seed)
        self.clock = time.monotonic  # the time budget's clock (tests replace it)
        self.unjudged: list[int] = []  # indices of the last _verify_all's records left over its budget
        # one round's verification at a time, off the event loop: a round that gave up waiting on one (its
        # net timeout) leaves it to finish before the next starts, so no state is shared by two at once
        self._verifying = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sapo-verify")

    def identity_info(self) -> dict:
        return {"peer_id": self.identity.peer_name, "public_key": self.identity.public_key_hex, "maddrs": []}

    def swarm_state(self) -> dict:
        return {"state": "joined", "message": "joined"}

    def _verify_all(self, records: list[tuple[bytes | None, bytes]]) -> list[Group]:
        """Verify within this round's budgets, in a fair order; groups come back in the records' order.

        The budget is checked before each record, so it is overrun by at most one record (whose size the
        wire caps bound). Records left over are not judged: they count `over_budget`, their indices are left
        in `unjudged`, and the exchange offers them again next round while they stay in the fetch window.
        A record still being judged at twice the time budget is cut short (`Verifier.time_limit_at`).
        """
        cfg, stats = self.verifier.cfg, self.stats
        order = list(range(len(records)))
        self.order_rng.shuffle(order)
        order.sort(key=lambda i: self._rank(records[i][0]))  # stable: ties stay shuffled
        start = self.clock()
        self.verifier.time_limit_at = self.verifier.clock() + TIME_LIMIT_BUDGETS * cfg.budget_s
        by_record: dict[int, list[Group]] = {}
        self.unjudged = []
        for i in order:
            hint, data = records[i]
            digest = self.verifier.pending(data, hint)
            if digest is None:
                continue
            if self.clock() - start >= cfg.budget_s or stats.round_verify_bytes >= cfg.budget_bytes:
                stats.reject(hint.hex() if hint else UNKNOWN_PEER, "over_budget")
                self.unjudged.append(i)
                continue
            stats.round_verify_bytes += len(data)
            stats.round_verified += 1
            by_record[i] = self.verifier.judge(digest, data, hint=hint)
        stats.round_verify_s = self.clock() - start
        self.unjudged.sort()
        return [g for i in sorted(by_record) for g in by_record[i]]

    def _rank(self, hint: bytes | None) -> tuple[int, float]:
        """Verification order: reputation tier, then the higher score first, so that within a round the
        proven publisher of a group is judged before a copy of it (content is credited to the first)."""
        if hint is None:
            return 1, 0.0
        return self.reputation.tier(hint), -self.reputation.score(hint)

    async def verify(self, received: Received) -> list[Group]:
        """The round's verification, in the verification thread (after any earlier one still running)."""
        return await asyncio.wrap_future(self._verifying.submit(self._verify_round, received.records))

    def _verify_round(self, records: list[tuple[bytes | None, bytes]]) -> list[Group]:
        """First the round's counters start, with what the bandit turned away before the fetch (banned) and the
        ghosts the fetch met; then the records."""
        self.stats.new_round()
        self.bandit.new_round()
        turned_away, ghosts = self.bandit.take_unfetched()
        for publisher in turned_away:
            self.stats.reject(publisher.hex(), "banned")
        for publisher in ghosts:
            self.stats.reject(publisher.hex(), "ghost")
        return self._verify_all(records)

    def close_verification(self) -> None:
        """No verification after this; one running ends at once (its scoring child is stopped)."""
        self._verifying.shutdown(wait=False, cancel_futures=True)
        self.verifier.sandbox.close()

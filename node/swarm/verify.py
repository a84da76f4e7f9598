"""The node's side of the swarm: turn groups into signed batches, and received bytes into trusted groups.

Nothing received is trusted: the DHT validator already refused unsigned or misplaced records, but the
`Verifier` checks everything again on its own (caps, schema, signature, swarm, freshness, replays),
regenerates every task from its spec with our task mix, and re-scores every completion with our reward
function. Two transports share this code through `SignedExchange`: `DhtExchange` (Hivemind DHT,
`node.swarm.dht_exchange`) and `MemoryExchange` (several nodes in one process, `node.swarm.memory_exchange`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass

from node.learn.groups import Group, score_responses
from node.learn.tasks import TaskError, TaskMix, TaskSpec, regenerate
from node.swarm.exchange import ExchangeStats
from p2p.identity import Identity, peer_name_of
from p2p.wire import WIRE_VERSION, RolloutBatch, TaskSpecWire, WireCaps, WireError, WireGroup, decode_signed, \
    encode_signed

log = logging.getLogger("sapo.swarm")

UNKNOWN_PEER = "unknown"
REWARD_TOLERANCE = 1e-6
MAX_JUDGED = 100_000


@dataclass
class VerifyConfig:
    swarm: str
    window: int = 2  # rounds of a publisher's history we still accept, behind its newest batch
    max_age_s: float = 600.0  # batches older than this (sender clock) are stale
    max_clock_skew_s: float = 120.0
    caps: WireCaps = WireCaps()
    pow_difficulty: int = 0  # proof-of-work bits a publisher key must carry (the swarm's setting)


class Verifier:
    """Receiver-side verification of untrusted batches; counts every rejection by peer and reason."""

    def __init__(self, own_key: bytes, mix: TaskMix, cfg: VerifyConfig, stats: ExchangeStats):
        self.own_key = own_key
        self.mix = mix
        self.cfg = cfg
        self.stats = stats
        self.seen: set[tuple[bytes, int]] = set()  # (publisher, round) already taken
        self.newest: dict[bytes, int] = {}  # publisher -> newest round accepted
        self.judged: dict[str, None] = {}  # digests of every batch already judged (insertion-ordered)

    def verify(self, data: bytes, now: float | None = None, hint: bytes | None = None) -> list[Group]:
        """Groups from one batch that passed every check (possibly none). Never raises on bad input.

        Each distinct byte string is judged once: a batch stays in the fetch window for several rounds,
        and neither its groups nor its offences may count twice.
        """
        digest = hashlib.sha256(data).hexdigest()
        if digest in self.judged:
            return []
        self.judged[digest] = None
        while len(self.judged) > MAX_JUDGED:
            del self.judged[next(iter(self.judged))]
        return self._verify(data, time.time() if now is None else now, hint)

    def _verify(self, data: bytes, now: float, hint: bytes | None) -> list[Group]:
        claimed = hint.hex() if hint else UNKNOWN_PEER
        try:
            batch = decode_signed(data, self.cfg.caps, self.cfg.pow_difficulty)  # bytes, envelope, PoW, sig, schema
        except WireError as exc:
            self.stats.reject(claimed, exc.reason)
            return []
        except Exception:  # a decoder bug must not become a node crash
            self.stats.reject(claimed, "malformed")
            return []
        peer = batch.publisher.hex()
        if batch.publisher == self.own_key:
            return []
        if hint is not None and hint != batch.publisher:
            self.stats.reject(peer, "publisher_mismatch")
            return []
        if batch.swarm != self.cfg.swarm:
            self.stats.reject(peer, "wrong_swarm")
            return []
        if now - batch.created_at > self.cfg.max_age_s:
            self.stats.reject(peer, "stale")
            return []
        if batch.created_at - now > self.cfg.max_clock_skew_s:
            self.stats.reject(peer, "from_future")
            return []
        key = (batch.publisher, batch.round)
        if key in self.seen:  # a different batch for a round we already took from this publisher
            self.stats.reject(peer, "equivocation")
            return []
        newest = self.newest.get(batch.publisher, -1)
        if batch.round <= newest - self.cfg.window:
            self.stats.reject(peer, "stale_round")
            return []
        self.seen.add(key)
        self.newest[batch.publisher] = max(newest, batch.round)
        self.stats.peers[peer] = {"name": peer_name_of(batch.publisher), "last_round": self.newest[batch.publisher],
                                  "last_seen": now}
        return [g for g in (self._group(peer, wg) for wg in batch.groups) if g is not None]

    def _group(self, peer: str, wg: WireGroup) -> Group | None:
        spec = TaskSpec.make(wg.task.dataset, wg.task.config, wg.task.seed, wg.task.index)
        if not self.mix.allows(spec):
            self.stats.reject(peer, "task_not_allowed")
            return None
        if len(wg.completions) < 2:
            self.stats.reject(peer, "too_few_completions")
            return None
        try:
            task = regenerate(spec)
        except TaskError:
            self.stats.reject(peer, "bad_task")
            return None
        rewards = score_responses(task, wg.completions)  # our reward function, our ground truth
        if len(wg.rewards) != len(rewards) or any(abs(a - b) > REWARD_TOLERANCE for a, b in zip(wg.rewards, rewards)):
            self.stats.reject(peer, "reward_mismatch")  # the sender lies, or scores differently: not trusted
            return None
        self.stats.accept(peer)
        return Group(task=task, responses=list(wg.completions), rewards=rewards, source=peer,
                     sender_rewards=list(wg.rewards))


def make_batch(identity: Identity, swarm: str, round_: int, model: str, groups: list[Group]) -> bytes:
    wire_groups = [
        WireGroup(task=TaskSpecWire(**g.task.spec.to_wire()), completions=list(g.responses), rewards=list(g.rewards))
        for g in groups
    ]
    batch = RolloutBatch(version=WIRE_VERSION, swarm=swarm, round=round_, publisher=identity.public_key_bytes,
                         created_at=time.time(), model=model, groups=wire_groups)
    return encode_signed(batch, identity)


class SignedExchange:
    """Shared by both transports: sign what we publish, verify (off the event loop) what we receive."""

    def __init__(self, identity: Identity, mix: TaskMix, verify_cfg: VerifyConfig, model_name: str):
        self.identity = identity
        self.stats = ExchangeStats()
        self.verifier = Verifier(identity.public_key_bytes, mix, verify_cfg, self.stats)
        self.swarm = verify_cfg.swarm
        self.model_name = model_name

    def identity_info(self) -> dict:
        return {"peer_id": self.identity.peer_name, "public_key": self.identity.public_key_hex, "maddrs": []}

    def _verify_all(self, records: list[tuple[bytes | None, bytes]]) -> list[Group]:
        groups: list[Group] = []
        for hint, data in records:
            groups.extend(self.verifier.verify(data, hint=hint))
        return groups

    async def _verify_off_loop(self, records: list[tuple[bytes | None, bytes]]) -> list[Group]:
        self.stats.new_round()
        return await asyncio.get_running_loop().run_in_executor(None, self._verify_all, records)

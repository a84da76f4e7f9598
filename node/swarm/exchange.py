"""The seam between the round loop and the swarm: publish our groups, fetch what others published, verify it.

The loop only sees this interface. `Silo` is J = 0 with no network; `node.swarm.dht_exchange.DhtExchange` is the
real Hivemind transport; `node.swarm.memory_exchange.MemoryExchange` runs several nodes in one process with the same
signing and verification code (only the transport differs).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any, Protocol

from node.learn.groups import Group
from node.swarm.reputation import Reputation

MAX_PEERS = 512  # per-peer rows kept; later peers are counted together under OTHERS
OTHERS = "others"


@dataclass(frozen=True)
class RoundCounts:
    """One verification's counters, kept with the groups it produced: with the network off the round's critical
    path a verification runs while another round trains, so the round that trains on its groups records them."""

    accepted: int = 0
    rejected: dict[str, int] = field(default_factory=dict)  # reason -> n
    verified: int = 0  # batches judged
    verify_bytes: int = 0
    verify_s: float = 0.0
    foreign: dict[str, int] = field(default_factory=dict)  # publisher -> groups judged foreign_text


@dataclass
class ExchangeStats:
    """Per-peer accepted groups and rejected groups by reason, since start and for the last round.

    Per-peer rows are bounded (`MAX_PEERS`, first come first kept; the pseudo-peers `dht` and `unknown`
    always have theirs): past it, counts go to the row `others`, so a Sybil flood of new keys cannot grow
    memory, /status, the dashboard or Prometheus' label sets without bound. Totals stay exact.
    """

    accepted: Counter = field(default_factory=Counter)  # peer hex -> groups
    rejected: defaultdict = field(default_factory=lambda: defaultdict(Counter))  # peer -> reason -> n
    round_accepted: int = 0
    round_rejected: Counter = field(default_factory=Counter)  # reason -> n, last round
    peers: dict = field(default_factory=dict)  # peer hex -> {"last_round": int, "last_seen": float}
    round_verified: int = 0  # batches judged in the last round (within its verify budget)
    round_verify_bytes: int = 0
    round_verify_s: float = 0.0
    round_swarm_state: str = "joined"  # what the last round ran as: joined, solo (shared nothing: p2p.membership)
    round_solo_since: float | None = None  # or silo; when solo, since when (Unix time)
    foreign: Counter = field(default_factory=Counter)  # peer -> groups judged foreign_text (node/swarm/screening.py)
    round_foreign: Counter = field(default_factory=Counter)  # the same, last round

    def row(self, peer: str) -> str:
        """The row that counts this peer: its own, or OTHERS once MAX_PEERS rows are taken."""
        known = peer in self.accepted or peer in self.rejected or peer in self.peers
        if known or len(peer) < 16 or len(self._rows()) < MAX_PEERS:
            return peer
        return OTHERS

    def _rows(self) -> set[str]:
        return set(self.accepted) | set(self.rejected) | set(self.peers)

    def reject(self, peer: str, reason: str, n: int = 1) -> None:
        self.rejected[self.row(peer)][reason] += n
        self.round_rejected[reason] += n

    def accept(self, peer: str, n: int = 1) -> None:
        self.accepted[self.row(peer)] += n
        self.round_accepted += n

    def foreign_text(self, peer: str) -> None:
        """A group accepted whose right answers carry the publisher's recurring text (not a rejection)."""
        self.foreign[self.row(peer)] += 1
        self.round_foreign[peer[:16]] += 1

    def saw(self, peer: str, info: dict) -> None:
        """Last round and time seen of a peer whose batch was taken (bounded like the counters)."""
        if self.row(peer) == peer:
            self.peers[peer] = info

    def new_round(self) -> None:
        self.round_accepted = 0
        self.round_rejected = Counter()
        self.round_foreign = Counter()
        self.round_verified = self.round_verify_bytes = 0
        self.round_verify_s = 0.0

    def round_counts(self) -> RoundCounts:
        """The last verification's counters, as they are now."""
        return RoundCounts(
            self.round_accepted,
            dict(self.round_rejected),
            self.round_verified,
            self.round_verify_bytes,
            self.round_verify_s,
            dict(self.round_foreign),
        )

    def to_dict(self) -> dict:
        return {
            "accepted": dict(self.accepted),
            "rejected": {peer: dict(reasons) for peer, reasons in self.rejected.items()},
            "foreign_text": dict(self.foreign),
        }


@dataclass
class Received:
    """What a fetch brought, nothing of it trusted yet: (the publisher the transport names, bytes) per record.
    `handles` are the transport's own records in the same order (a DHT exchange offers again those its
    verification budget left unjudged); `refused` are the refusals the DHT counted (cumulative, DHT only)."""

    records: list[tuple[bytes | None, bytes]] = field(default_factory=list)
    handles: list[Any] = field(default_factory=list)
    refused: dict[str, int] = field(default_factory=dict)


class Exchange(Protocol):
    stats: ExchangeStats
    reputation: Reputation  # scores and bans of publishers; the loop persists it in the run dir

    async def start(self) -> None: ...

    def identity_info(self) -> dict: ...

    def swarm_state(self) -> dict: ...  # {"state": joined | solo | silo, "since", "message", ...} (/status)

    async def publish(self, round_: int, groups: list[Group]) -> None: ...

    async def fetch(self, round_: int) -> Received:
        """Others' recent batches, as bytes (a bounded number, within the transport's own timeout)."""
        ...

    async def verify(self, received: Received) -> list[Group]:
        """The groups that pass every check, within this round's verification budget; starts the round's
        counters (`stats.new_round`)."""
        ...

    async def close(self) -> None: ...


class Silo:
    """No swarm: nothing published, nothing received (the paper's I/0 baseline)."""

    def __init__(self) -> None:
        self.stats = ExchangeStats(round_swarm_state="silo")
        self.reputation = Reputation()  # stays empty

    async def start(self) -> None:
        return None

    def identity_info(self) -> dict:
        return {"peer_id": "silo", "public_key": "", "maddrs": []}

    def swarm_state(self) -> dict:
        return {"state": "silo", "message": "silo"}

    async def publish(self, round_: int, groups: list[Group]) -> None:
        return None

    async def fetch(self, round_: int) -> Received:
        return Received()

    async def verify(self, received: Received) -> list[Group]:
        self.stats.new_round()
        return []

    async def close(self) -> None:
        return None

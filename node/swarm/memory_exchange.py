"""`MemoryExchange`: several nodes in one process exchange the same signed bytes through a shared board."""

from __future__ import annotations

from collections.abc import Callable

from node.learn.groups import Group
from node.learn.tasks import TaskMix
from node.swarm.exchange import Received
from node.swarm.verify import SignedExchange, VerifyConfig, make_batch
from p2p.identity import Identity


class MemoryBoard:
    """An in-process stand-in for the DHT: (publisher, round) -> signed bytes. Same bytes, same checks."""

    def __init__(self) -> None:
        self.records: dict[tuple[bytes, int], bytes] = {}
        self.newest: dict[bytes, int] = {}

    def put(self, publisher: bytes, round_: int, data: bytes) -> None:
        self.records[(publisher, round_)] = data
        self.newest[publisher] = max(self.newest.get(publisher, -1), round_)

    def window(self, exclude: bytes, window: int, allowed: Callable[[bytes], bool]) -> list[tuple[bytes | None, bytes]]:
        """Every other publisher's last `window` rounds, skipping those `allowed` refuses (not fetched)."""
        out: list[tuple[bytes | None, bytes]] = []
        for (pub, r), data in sorted(self.records.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            if pub != exclude and r > self.newest[pub] - window and allowed(pub):
                out.append((pub, data))
        return out


class MemoryExchange(SignedExchange):
    """Several nodes in one process share a `MemoryBoard`: controlled experiments without a network."""

    def __init__(self, board: MemoryBoard, identity: Identity, mix: TaskMix, verify_cfg: VerifyConfig, model_name: str):
        super().__init__(identity, mix, verify_cfg, model_name)
        self.board = board

    async def start(self) -> None:
        return None

    async def publish(self, round_: int, groups: list[Group]) -> None:
        self.board.put(
            self.identity.public_key_bytes,
            round_,
            make_batch(self.identity, self.swarm, round_, self.model_name, groups),
        )

    async def fetch(self, round_: int) -> Received:
        return Received(
            self.board.window(self.identity.public_key_bytes, self.verifier.cfg.window, self.bandit.allowed)
        )

    async def close(self) -> None:
        self.close_verification()

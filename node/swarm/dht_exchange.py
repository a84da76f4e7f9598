"""`DhtExchange`: the node's exchange over the Hivemind DHT (`p2p.transport` moves the bytes)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from node.learn.groups import Group
from node.learn.tasks import TaskMix
from node.swarm.verify import SignedExchange, VerifyConfig, make_batch, verify_config
from p2p.identity import KEY_FILENAME, Identity
from p2p.pow import tier_difficulty
from p2p.transport import FetchedRecord, SwarmTransport, TransportConfig

DHT_PEER = "dht"  # records our DHT validator refused before they could reach the Verifier (no trusted sender)


class DhtExchange(SignedExchange):
    """Publish and fetch through the Hivemind DHT (`p2p.transport`)."""

    def __init__(self, transport: SwarmTransport, mix: TaskMix, verify_cfg: VerifyConfig, model_name: str):
        super().__init__(transport.identity, mix, verify_cfg, model_name)
        self.transport = transport
        self._dht_rejections: dict[str, int] = {}  # cumulative counts already reported

    @classmethod
    def from_config(cls, cfg, mix: TaskMix) -> "DhtExchange":
        run_dir = Path(cfg.run_dir)
        has_state = (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists()
        # An existing run dir keeps its identity: a missing key there is an error, never a new identity.
        identity = Identity.load_or_create(run_dir / KEY_FILENAME, create=not has_state,
                                           pow_difficulty=tier_difficulty(cfg.pow_difficulty, cfg.identity_tier))
        budget = max(1.0, cfg.net_timeout / 2)
        tcfg = TransportConfig(identity_dir=run_dir, swarm=cfg.swarm, initial_peers=list(cfg.peers),
                               host_maddrs=list(cfg.host_maddrs), announce_maddrs=list(cfg.announce_maddrs),
                               client_mode=cfg.client_mode, fetch_timeout_s=budget,
                               publish_timeout_s=budget, pow_difficulty=cfg.pow_difficulty,
                               fetch_max=cfg.fetch_max)
        vcfg = verify_config(cfg, max_age_s=tcfg.record_ttl_s)
        return cls(SwarmTransport(tcfg, identity), mix, vcfg, cfg.model)

    async def start(self) -> None:
        await self.transport.start()

    def identity_info(self) -> dict:
        return {**super().identity_info(), "maddrs": self.transport.visible_maddrs()}

    async def publish(self, round_: int, groups: list[Group]) -> None:
        data = make_batch(self.identity, self.swarm, round_, self.model_name, groups)
        await self.transport.publish(round_, data)

    async def collect(self, round_: int) -> list[Group]:
        # DHT-level refusals (counted in the DHT process) are read alongside the fetch, within its budget
        records: list[FetchedRecord]
        # banned publishers are never fetched; a flood cannot make us receive more than we would verify
        fetch = self.transport.fetch(max_bytes=self.verifier.cfg.budget_bytes, policy=self.bandit)
        records, totals = await asyncio.gather(
            fetch, self.transport.validator_rejections(self.transport.config.fetch_timeout_s))
        groups = await self._verify_off_loop([(r.publisher, r.data) for r in records])  # starts a new round
        for reason, n in totals.items():
            new = n - self._dht_rejections.get(reason, 0)
            if new > 0:
                self.stats.reject(DHT_PEER, reason, new)
        self._dht_rejections.update(totals)
        return groups

    async def close(self) -> None:
        await self.transport.shutdown()

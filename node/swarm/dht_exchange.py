"""`DhtExchange`: the node's exchange over the Hivemind DHT (`p2p.transport` moves the bytes, `p2p.membership`
keeps the peer in its swarm: a node whose peers do not answer trains solo meanwhile)."""

from __future__ import annotations

import asyncio

from node.learn.groups import Group
from node.learn.stop import StopRequest
from node.learn.tasks import TaskMix
from node.swarm.exchange import Received
from node.swarm.settings import SwarmSettings
from node.swarm.verify import SignedExchange, VerifyConfig, make_batch
from p2p.identity import Identity
from p2p.membership import Membership, on_stop_event
from p2p.pow import tier_difficulty
from p2p.transport import SwarmTransport, TransportConfig

DHT_PEER = "dht"  # records our DHT validator refused before they could reach the Verifier (no trusted sender)


class DhtExchange(SignedExchange):
    """Publish and fetch through the Hivemind DHT (`p2p.transport`)."""

    def __init__(
        self,
        transport: SwarmTransport,
        mix: TaskMix,
        verify_cfg: VerifyConfig,
        model_name: str,
        require_peers: bool = False,
        stop: StopRequest | None = None,
    ):
        super().__init__(transport.identity, mix, verify_cfg, model_name)
        self.transport = transport
        self.membership = Membership(transport, require_peers)
        self.stop = stop  # a stop during start() ends the join at once
        self._sharing = True  # this round publishes and fetches: decided at its publish (a join counts from the
        self._dht_rejections: dict[str, int] = {}  # next round); cumulative counts already reported

    @classmethod
    def create(cls, settings: SwarmSettings, mix: TaskMix, stop: StopRequest | None = None) -> DhtExchange:
        """Our identity (minted at our work tier the first time; p2p.pow.MintStopped on a stop), a transport and
        a verifier, from the settings."""
        files = settings.files
        identity = Identity.load_or_create(
            files.identity_key,
            create=settings.create_identity,
            pow_path=files.pow,
            pow_difficulty=tier_difficulty(settings.pow_difficulty, settings.identity_tier),
            should_stop=stop.is_set if stop is not None else None,
        )
        budget = max(1.0, settings.net_timeout_s / 2)
        tcfg = TransportConfig(
            identity_dir=files.identity_key.parent,
            p2p_identity_file=files.p2p_identity,
            swarm=settings.swarm,
            initial_peers=list(settings.peers),
            host_maddrs=list(settings.host_maddrs),
            announce_maddrs=list(settings.announce_maddrs),
            client_mode=settings.client_mode,
            fetch_timeout_s=budget,
            publish_timeout_s=budget,
            pow_difficulty=settings.pow_difficulty,
            fetch_max=settings.fetch_max,
        )
        vcfg = VerifyConfig.from_settings(settings, max_age_s=tcfg.record_ttl_s)
        return cls(SwarmTransport(tcfg, identity), mix, vcfg, settings.model, settings.require_peers, stop)

    async def start(self) -> None:
        """Join (p2p.membership): solo with a retry in the background when no initial peer answers."""
        await self.membership.start(on_stop_event(self.stop.on_set) if self.stop is not None else None)
        # the scoring child starts in the verification thread while the first round generates: its start-up
        # (seconds on a loaded machine) then falls within no verification's time budget
        self._verifying.submit(self.verifier.sandbox.warm)

    def swarm_state(self) -> dict:
        return self.membership.state.to_dict()

    def identity_info(self) -> dict:
        return {**super().identity_info(), "maddrs": self.transport.visible_maddrs()}

    async def publish(self, round_: int, groups: list[Group]) -> None:
        state = self.membership.state
        self._sharing = self.transport.alive
        self.stats.round_swarm_state = state.state
        self.stats.round_solo_since = state.since if state.state == "solo" else None
        if not self._sharing:
            return
        # encoding and signing up to the size cap (again after each group left out) is off the event loop
        data = await asyncio.to_thread(make_batch, self.identity, self.swarm, round_, self.model_name, groups)
        await self.transport.publish(round_, data)

    async def fetch(self, round_: int) -> Received:
        if not self._sharing:  # solo this round: nothing to fetch, the verifier still starts its round
            return Received()
        # the bandit is the publisher chooser: banned publishers are never fetched (its reputation vetoes them),
        # and a flood cannot make us receive more than we would verify. DHT-level refusals (counted in the DHT
        # process) are read alongside the fetch, within its budget
        records, refused = await asyncio.gather(
            self.transport.fetch(max_bytes=self.verifier.cfg.budget_bytes, chooser=self.bandit),
            self.transport.validator_rejections(self.transport.config.fetch_timeout_s),
        )
        fetched = self.transport.last_fetch
        ttl = self.transport.config.record_ttl_s
        self.verifier.clock_check.presence(len(fetched.presence_keys), len(fetched.off_clock_keys), ttl)
        self.verifier.clock_check.unheard(  # a clock far ahead, or another --swarm, reads nothing at all
            self.membership.peer_count, fetched.shards_answered, len(fetched.presence_keys), self.swarm, ttl
        )
        return Received([(r.publisher, r.data) for r in records], handles=records, refused=refused)

    async def verify(self, received: Received) -> list[Group]:
        groups = await super().verify(received)  # starts a new round
        self.transport.fetch_again([received.handles[i] for i in self.unjudged])  # over this round's budget: not lost
        for reason, n in received.refused.items():
            new = n - self._dht_rejections.get(reason, 0)
            if new > 0:
                self.stats.reject(DHT_PEER, reason, new)
        self._dht_rejections.update(received.refused)
        return groups

    async def close(self) -> None:
        self.close_verification()
        await self.membership.close()

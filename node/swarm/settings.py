"""What the swarm needs from a node's configuration, typed: `SwarmSettings` and the files it names.

node/swarm may not import node/ops (docs/ARCHITECTURE.md), so it never reads `NodeConfig` or the run dir's
layout itself: whoever builds a node maps its flags and its run dir to these settings, and
`DhtExchange.create` and `VerifyConfig.from_settings` take them from there (node/build.py `swarm_settings`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from node.swarm.reputation import REPUTATION_FILE
from p2p.identity import KEY_FILENAME, LIBP2P_IDENTITY_FILENAME
from p2p.pow import DEFAULT_POW_DIFFICULTY, POW_FILENAME


@dataclass(frozen=True)
class SwarmFiles:
    """Where a peer keeps what makes it the same peer across restarts."""

    identity_key: Path  # Ed25519 key that signs our batches and owns our DHT records (p2p.identity)
    pow: Path  # its proof-of-work nonce (p2p.pow)
    p2p_identity: Path  # hivemind's libp2p key: the same peer id, hence the same multiaddr, after a restart
    reputation: Path  # publishers' scores and bans (node.swarm.reputation), loaded and saved by the node

    @classmethod
    def in_dir(cls, directory: Path) -> SwarmFiles:
        """Every file under its usual name in one directory (a node's run dir)."""
        d = Path(directory)
        return cls(
            identity_key=d / KEY_FILENAME,
            pow=d / POW_FILENAME,
            p2p_identity=d / LIBP2P_IDENTITY_FILENAME,
            reputation=d / REPUTATION_FILE,
        )


@dataclass(frozen=True, kw_only=True)
class SwarmSettings:
    """A node's swarm flags (docs: `sapo-node --help`), the files above, and whether a missing key may be made."""

    swarm: str  # name; DHT keys are namespaced by it
    model: str  # the model name stamped on our batches
    files: SwarmFiles
    create_identity: bool = True  # False: a missing key is an error (a run dir that already holds state)
    seed: int = 0  # the verification order's shuffle (the bandit's: seed + 1)
    peers: tuple[str, ...] = ()  # multiaddrs to join; none: the first peer of a new swarm
    require_peers: bool = False  # no answer from them at start: exit (else solo, joining in the background)
    host_maddrs: tuple[str, ...] = ("/ip4/0.0.0.0/tcp/0",)
    announce_maddrs: tuple[str, ...] = ()
    client_mode: bool = False  # behind NAT: not dialable
    window: int = 2  # W: rounds behind a publisher's newest batch still accepted
    net_timeout_s: float = 10.0  # swarm I/O per round: publish and fetch get half each
    verify_budget_s: float = 0.0  # verification seconds per round; 0: net_timeout_s / 3
    verify_budget_mb: float = 32.0  # MiB of received batches verified per round
    fetch_max: int = 16  # K: batches fetched per round at most
    pow_difficulty: int = DEFAULT_POW_DIFFICULTY  # swarm-wide proof-of-work bits
    identity_tier: int = 1  # our own key's work tier above the swarm's minimum (p2p.pow)
    ban_s: float = 3600.0  # a misbehaving publisher's first ban; each repeat doubles it
    external_screen: str = "on"  # --external-screen: its span mode also takes per-publisher evidence

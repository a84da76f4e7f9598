"""A transport's settings (`TransportConfig`), in a module of their own: the transport and the presence
sampler (`p2p.presence`) both read them, and neither imports the other for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from p2p.identity import libp2p_identity_path
from p2p.pow import DEFAULT_POW_DIFFICULTY, MAX_POW_DIFFICULTY
from p2p.validators import DEFAULT_PRESENCE_SHARDS, MAX_PRESENCE_SHARDS, MAX_RECORD_TTL_S
from p2p.wire import MAX_PRESENCE_BYTES, WireCaps, presence_fits


@dataclass(kw_only=True)
class TransportConfig:
    identity_dir: Path
    swarm: str = "sapo-default"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    client_mode: bool = False
    fetch_timeout_s: float = 5.0
    publish_timeout_s: float = 5.0
    record_ttl_s: float = 600.0
    start_timeout_s: float = 60.0
    create_identity: bool = True  # False: a missing key is an error (a run dir that already has state)
    p2p_identity_file: Path | None = None  # hivemind's libp2p key; None: `p2p.identity` in identity_dir
    caps: WireCaps = field(default_factory=WireCaps)
    pow_difficulty: int = DEFAULT_POW_DIFFICULTY  # swarm-wide: keys with less work are refused
    presence_shards: int = DEFAULT_PRESENCE_SHARDS  # swarm-wide: part of the key layout
    fetch_max: int = 16  # K: batches fetched per round at most
    presence_sample: int = 0  # candidates to gather before choosing K (0 = 2 * fetch_max)

    def __post_init__(self) -> None:
        if not 0 < self.record_ttl_s <= MAX_RECORD_TTL_S:
            raise ValueError(f"record_ttl_s must be in (0, {MAX_RECORD_TTL_S}]: peers reject longer-lived records")
        if not 0 <= self.pow_difficulty <= MAX_POW_DIFFICULTY:
            raise ValueError(f"pow_difficulty must be in [0, {MAX_POW_DIFFICULTY}]")
        if not 1 <= self.presence_shards <= MAX_PRESENCE_SHARDS:
            raise ValueError(f"presence_shards must be in [1, {MAX_PRESENCE_SHARDS}]")
        if self.fetch_max < 1:
            raise ValueError("fetch_max must be >= 1")
        if not presence_fits(self.swarm):
            raise ValueError(
                f"swarm name too long ({len(self.swarm.encode())} bytes): its presence records would "
                f"exceed {MAX_PRESENCE_BYTES} bytes and no peer would ever find this node"
            )
        if self.presence_sample <= 0:
            self.presence_sample = 2 * self.fetch_max
        if self.p2p_identity_file is None:
            self.p2p_identity_file = libp2p_identity_path(self.identity_dir)

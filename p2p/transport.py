"""Publish and fetch signed rollout batches over a hivemind DHT, without blocking the event loop.

Rounds are not synchronized across peers (no coordinator, heterogeneous speeds), so a peer cannot
guess which round key others wrote. Each peer therefore also keeps a presence record (its latest
round) under one swarm-wide key; fetch() reads it, then reads the last `window` rounds of each
other peer. Network trouble never raises out of publish/fetch: it returns what it has and logs.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from functools import partial
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from p2p.identity import KEY_FILENAME, Identity, IdentityError, libp2p_identity_path
from p2p.validators import MAX_RECORD_TTL_S, SapoRecordValidator, owner_subkey, presence_key, round_key
from p2p.wire import PresenceRecord, WireCaps, WireError, decode_presence, encode_presence, open_envelope, WIRE_VERSION

logger = logging.getLogger(__name__)


class TransportError(RuntimeError):
    """The transport could not start (no initial peer answered, p2pd failed, bad identity)."""


@dataclass(kw_only=True)
class TransportConfig:
    identity_dir: Path
    swarm: str = "sapo-default"
    initial_peers: list[str] = field(default_factory=list)
    host_maddrs: list[str] = field(default_factory=lambda: ["/ip4/0.0.0.0/tcp/0"])
    announce_maddrs: list[str] = field(default_factory=list)
    client_mode: bool = False
    window: int = 2
    fetch_timeout_s: float = 5.0
    publish_timeout_s: float = 5.0
    record_ttl_s: float = 600.0
    start_timeout_s: float = 60.0
    create_identity: bool = True  # False: a missing key is an error (a run dir that already has state)
    caps: WireCaps = field(default_factory=WireCaps)

    def __post_init__(self) -> None:
        if not 0 < self.record_ttl_s <= MAX_RECORD_TTL_S:
            raise ValueError(f"record_ttl_s must be in (0, {MAX_RECORD_TTL_S}]: peers reject longer-lived records")
        if self.window < 1:
            raise ValueError("window must be >= 1")


@dataclass(frozen=True)
class FetchedRecord:
    """A verified-envelope value as stored by `publisher` under its round key (not yet schema-checked)."""

    publisher: bytes
    round: int
    data: bytes


def start_dht(
    identity: Identity,
    identity_dir: Path,
    swarm: str,
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str],
    client_mode: bool = False,
    caps: WireCaps = WireCaps(),
) -> hivemind.DHT:
    """Fork a DHT process with our validator and persistent libp2p identity (not yet awaited)."""
    p2p_path = libp2p_identity_path(identity_dir)
    if p2p_path.exists():
        try:
            PeerID.from_identity(p2p_path.read_bytes())
        except Exception as e:
            raise IdentityError(f"libp2p identity file {p2p_path} is unreadable or corrupt: {e}") from e
    kwargs: dict[str, Any] = dict(
        host_maddrs=host_maddrs,
        identity_path=str(p2p_path),
        client_mode=client_mode,
        ensure_bootstrap_success=bool(initial_peers),
    )
    if announce_maddrs:
        kwargs["announce_maddrs"] = announce_maddrs
    return hivemind.DHT(
        initial_peers=initial_peers or None,
        start=True,
        await_ready=False,
        record_validators=[SapoRecordValidator(identity, swarm, caps)],
        **kwargs,
    )


class SwarmTransport:
    """One peer's view of the swarm: publish own batches, fetch others' recent batches."""

    def __init__(self, config: TransportConfig, identity: Optional[Identity] = None) -> None:
        self.config = config
        self.identity = identity or Identity.load_or_create(
            Path(config.identity_dir) / KEY_FILENAME, create=config.create_identity
        )
        self._dht: Optional[hivemind.DHT] = None
        self._maddrs: list[str] = []
        self._known: dict[str, int] = {}
        self._subkey = owner_subkey(self.identity.public_key_bytes)

    @property
    def dht(self) -> hivemind.DHT:
        if self._dht is None:
            raise RuntimeError("transport not started")
        return self._dht

    async def start(self) -> None:
        cfg = self.config
        Path(cfg.identity_dir).mkdir(parents=True, exist_ok=True)
        dht = start_dht(
            self.identity, Path(cfg.identity_dir), cfg.swarm, cfg.initial_peers, cfg.host_maddrs,
            cfg.announce_maddrs, cfg.client_mode, cfg.caps,
        )  # fmt: skip
        self._dht = dht
        loop = asyncio.get_running_loop()
        try:
            await loop.run_in_executor(None, dht.wait_until_ready, cfg.start_timeout_s)
            await loop.run_in_executor(None, die_with_parent, dht)
            maddrs = await loop.run_in_executor(None, dht.get_visible_maddrs)
        except Exception as e:
            await self.shutdown()
            hint = f" (initial peers: {cfg.initial_peers})" if cfg.initial_peers else ""
            raise TransportError(f"could not start the DHT peer{hint}: {type(e).__name__}: {e}") from e
        self._maddrs = [str(m) for m in maddrs]
        logger.info("DHT peer %s up at %s", self.identity.peer_name, self._maddrs)

    def visible_maddrs(self) -> list[str]:
        return list(self._maddrs)

    def known_peers(self) -> dict[str, int]:
        """pubkey hex -> latest round seen in that peer's presence record (other peers only)."""
        return dict(self._known)

    async def publish(self, round: int, signed_batch: bytes) -> bool:
        """Store our batch for `round` and refresh our presence record; False on failure or timeout."""
        env = open_envelope(signed_batch, self.config.caps.max_batch_bytes)  # our own bug if this raises
        if env.publisher != self.identity.public_key_bytes:
            raise ValueError("signed_batch was not signed by this transport's identity")
        cfg = self.config
        expiration = get_dht_time() + cfg.record_ttl_s
        presence = encode_presence(
            PresenceRecord(WIRE_VERSION, cfg.swarm, self.identity.public_key_bytes, round, time.time()),
            self.identity,
        )
        if not self.dht.is_alive():
            logger.error("publish of round %d skipped: the DHT process is dead", round)
            return False
        spill = self._spill(signed_batch)
        try:
            stores = [
                self.dht.run_coroutine(
                    partial(_store_from_file, key=round_key(cfg.swarm, round), subkey=self._subkey, path=spill,
                            expiration=expiration),  # fmt: skip
                    return_future=True,
                ),
                self.dht.store(presence_key(cfg.swarm), presence, expiration, subkey=self._subkey, return_future=True),
            ]
            ok_batch, ok_presence = await asyncio.wait_for(asyncio.gather(*stores), cfg.publish_timeout_s)
        except asyncio.TimeoutError:
            logger.warning("publish of round %d timed out after %.1fs", round, cfg.publish_timeout_s)
            return False
        except Exception as e:  # p2pd hiccups must not kill a training round
            logger.warning("publish of round %d failed: %s: %s", round, type(e).__name__, e)
            return False
        finally:
            _unlink_quietly(spill)
        if not (ok_batch and ok_presence):
            logger.warning("publish of round %d not stored (batch=%s presence=%s)", round, ok_batch, ok_presence)
        return bool(ok_batch)

    def _spill(self, value: bytes) -> str:
        """Write a value to a private temp file (tmpfs when available) for the DHT process to read.

        hivemind sends store() arguments over an mp.Pipe whose read end the DHT process has made
        non-blocking; a message over 16 KiB arrives in two writes and the reader dies with EAGAIN
        (DHT process gone, every later call hangs). So values travel by file, commands by pipe.
        """
        spill_dir = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
        fd, path = tempfile.mkstemp(prefix="sapo-store-", dir=spill_dir)
        with os.fdopen(fd, "wb") as f:
            f.write(value)
        return path

    async def fetch(self) -> list[FetchedRecord]:
        """Other peers' batches from their last `window` rounds; partial results on timeout."""
        if not self.dht.is_alive():
            logger.error("fetch skipped: the DHT process is dead")
            return []
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.fetch_timeout_s
        latest = await self._read_presence(deadline)
        if not latest:
            return []
        wanted: dict[int, set[bytes]] = {}
        for pub, last in latest.items():
            for r in range(max(0, last - self.config.window + 1), last + 1):
                wanted.setdefault(r, set()).add(pub)
        futures = {
            r: asyncio.ensure_future(self._get(round_key(self.config.swarm, r))) for r in sorted(wanted)
        }
        done, pending = await asyncio.wait(futures.values(), timeout=max(0.0, deadline - loop.time()))
        for fut in pending:
            fut.cancel()
        if pending:
            logger.warning("fetch: %d of %d round keys timed out", len(pending), len(futures))
        out: list[FetchedRecord] = []
        for r, fut in futures.items():
            if fut not in done or fut.cancelled() or fut.exception() is not None:
                continue
            for pub, data in fut.result().items():
                if pub in wanted[r]:
                    out.append(FetchedRecord(publisher=pub, round=r, data=data))
        return out

    async def _read_presence(self, deadline: float) -> dict[bytes, int]:
        entries = await self._get(presence_key(self.config.swarm), deadline)
        latest: dict[bytes, int] = {}
        for pub, data in entries.items():
            if pub == self.identity.public_key_bytes:
                continue
            try:
                rec = decode_presence(data)
            except WireError as e:
                logger.debug("bad presence record from %s: %s", pub.hex()[:16], e)
                continue
            if rec.swarm != self.config.swarm or rec.publisher != pub:
                continue
            latest[pub] = rec.round
            self._known[pub.hex()] = max(rec.round, self._known.get(pub.hex(), -1))
        return latest

    async def _get(self, key: str, deadline: Optional[float] = None) -> dict[bytes, bytes]:
        """publisher key -> stored envelope bytes; {} when missing, malformed, failed or timed out."""
        loop = asyncio.get_running_loop()
        timeout = self.config.fetch_timeout_s if deadline is None else max(0.0, deadline - loop.time())
        future = self.dht.get(key, latest=True, return_future=True)
        try:
            result = await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            future.cancel()
            logger.warning("DHT get %s timed out after %.1fs", key, timeout)
            return {}
        except Exception as e:
            logger.warning("DHT get %s failed: %s: %s", key, type(e).__name__, e)
            return {}
        if result is None or not isinstance(result.value, dict):
            return {}  # nothing stored yet: normal
        out: dict[bytes, bytes] = {}
        for subkey, item in result.value.items():
            pub = owner_of_subkey(subkey)
            if pub is not None and isinstance(item.value, bytes):
                out[pub] = item.value
        return out

    async def validator_rejections(self, timeout: float = 5.0) -> dict[str, int]:
        """Records our DHT validator refused since start, by reason code (cumulative; {} if unavailable)."""
        if self._dht is None or not self._dht.is_alive():
            return {}
        future = self._dht.run_coroutine(_validator_rejections, return_future=True)
        try:
            return dict(await asyncio.wait_for(future, timeout))
        except Exception as e:  # asyncio.TimeoutError included: diagnostics must never break a round
            future.cancel()
            logger.debug("could not read validator rejections: %s: %s", type(e).__name__, e)
            return {}

    async def shutdown(self) -> None:
        dht, self._dht = self._dht, None
        if dht is not None:
            await asyncio.get_running_loop().run_in_executor(None, dht.shutdown)


def owner_of_subkey(subkey: Any) -> Optional[bytes]:
    if not isinstance(subkey, bytes) or not (subkey.startswith(b"[ed25519:") and subkey.endswith(b"]")):
        return None
    try:
        pub = bytes.fromhex(subkey[len(b"[ed25519:") : -1].decode())
    except ValueError:
        return None
    return pub if len(pub) == 32 else None


async def _store_from_file(
    _dht: hivemind.DHT, node: Any, key: str, subkey: bytes, path: str, expiration: float
) -> bool:
    """Runs inside the DHT process: store the value spilled to `path` (see SwarmTransport._spill)."""
    try:
        with open(path, "rb") as f:
            value = f.read()
    finally:
        _unlink_quietly(path)
    return bool(await node.store(key, value, expiration, subkey=subkey))


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


async def _validator_rejections(_dht: hivemind.DHT, node: Any) -> dict[str, int]:
    """Runs inside the DHT process: the SAPO validator's rejection counters."""
    validator = node.protocol.record_validator
    out: dict[str, int] = {}
    for v in getattr(validator, "_validators", [validator]):
        if isinstance(v, SapoRecordValidator):
            for reason, n in v.rejections.items():
                out[reason] = out.get(reason, 0) + n
    return out


async def _die_with_parent(_dht: hivemind.DHT, node: Any, parent_pid: int) -> bool:
    """Runs inside the DHT process: be SIGKILLed (with p2pd, which follows it) when our parent dies (Linux).

    hivemind's DHT process never notices its parent's death (it holds both ends of its command pipe),
    so a node killed with SIGKILL (or by the OOM killer) left it running: it kept serving the dead
    peer's records and kept the listen port, so a restart on the same port could not bind.
    """
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return False
    try:
        if ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return False
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGKILL)
    return True


def die_with_parent(dht: hivemind.DHT, timeout: float = 10.0) -> bool:
    """Blocking: tie `dht`'s process to this one (call from the thread that started it: the death signal
    follows the forking thread). False where unsupported or on failure; never raises."""
    try:
        return bool(dht.run_coroutine(partial(_die_with_parent, parent_pid=os.getpid()),
                                      return_future=True).result(timeout))
    except Exception as e:
        logger.warning("could not tie the DHT process to this one: %s: %s", type(e).__name__, e)
        return False


async def _routing_peers(_dht: hivemind.DHT, node: Any) -> list[str]:
    """Runs inside the DHT process: peer ids currently in the routing table (not replacements)."""
    return [str(pid) for bucket in node.protocol.routing_table.buckets for pid in bucket.nodes_to_peer_id.values()]


def routing_peers(dht: hivemind.DHT, timeout: float = 10.0) -> list[str]:
    """Blocking: peer ids in `dht`'s routing table (for status counters)."""
    return dht.run_coroutine(_routing_peers, return_future=True).result(timeout)

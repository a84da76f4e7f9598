"""hivemind's DHT process: starting it, and the small functions that run inside it.

hivemind runs the DHT in a forked process; the parent reaches it through `DHT.run_coroutine(fn)`, which
pickles `fn` and awaits it there with the process's `DHTNode`. Every such function is here (the ones
named `..._in_dht` and the private coroutines), each beside the wrapper the parent calls, so that the
rest of p2p/ never has to remember which side of the pipe it is on. Used by `p2p.transport` (a node) and
by `bootstrap.main` (the DHT-only peer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any

import hivemind
from hivemind.p2p import PeerID
from hivemind.utils import get_dht_time

from p2p.identity import Identity, IdentityError
from p2p.parent_death import die_with_parent as die_with_parent_here
from p2p.pow import DEFAULT_POW_DIFFICULTY
from p2p.validators import DEFAULT_PRESENCE_SHARDS, SapoRecordValidator, keep_valid_subkeys
from p2p.wire import WireCaps

logger = logging.getLogger(__name__)


class DhtProcess(hivemind.DHT):
    """hivemind's DHT, whose forked process starts with signal handling of its own. Forked from a running
    asyncio loop, it would inherit the loop's handlers: SIGTERM a no-op that wakes the *parent's* loop
    (through the inherited wakeup fd), so `terminate()` did nothing and a node whose DHT missed its
    shutdown grace period waited forever at exit. Its parent decides when it ends: SIGTERM kills it (as
    hivemind's shutdown expects), SIGINT and SIGHUP (a terminal's, sent to the whole group) are ignored."""

    def run(self) -> None:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        for sig in (signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        super().run()


def start_dht(
    identity: Identity,
    p2p_identity: Path,
    swarm: str,
    initial_peers: list[str],
    host_maddrs: list[str],
    announce_maddrs: list[str],
    client_mode: bool = False,
    caps: WireCaps = WireCaps(),
    pow_difficulty: int = DEFAULT_POW_DIFFICULTY,
    presence_shards: int = DEFAULT_PRESENCE_SHARDS,
) -> hivemind.DHT:
    """Fork a DHT process with our validator and the persistent libp2p identity at `p2p_identity` (created by
    p2pd when absent; see `p2p.identity.libp2p_identity_path`). Not yet awaited."""
    if p2p_identity.exists():
        try:
            PeerID.from_identity(p2p_identity.read_bytes())
        except Exception as e:
            raise IdentityError(f"libp2p identity file {p2p_identity} is unreadable or corrupt: {e}") from e
    kwargs: dict[str, Any] = dict(
        host_maddrs=host_maddrs,
        identity_path=str(p2p_identity),
        client_mode=client_mode,
        ensure_bootstrap_success=bool(initial_peers),
    )
    if announce_maddrs:
        kwargs["announce_maddrs"] = announce_maddrs
    return DhtProcess(
        initial_peers=initial_peers or None,
        start=True,
        await_ready=False,
        record_validators=[
            SapoRecordValidator(identity, swarm, caps, pow_difficulty=pow_difficulty, presence_shards=presence_shards)
        ],
        **kwargs,
    )


async def get_many_in_dht(
    _dht: hivemind.DHT, node: Any, keys: list[str], workers: int = 1
) -> dict[str, dict[Any, Any]]:
    """Runs inside the DHT process: {key: {subkey: value}} of the dictionary values found (validated).

    The first replica that answers is enough (latest=False): a batch key is written once, and a presence shard
    is re-read next round anyway, while asking every replica multiplies the bytes received. So one worker, one
    request at a time, unless `workers` says more: hivemind asks a peer for about sqrt(len(keys)) of the keys
    per request, so a search for 8 presence shards that finds nothing makes 4 requests to each DHT node, one
    round trip each, in turn with one worker (presence reads take PRESENCE_WORKERS: p2p.transport).
    """
    found = await node.get_many(keys, sufficient_expiration_time=get_dht_time(), num_workers=workers)
    out: dict[str, dict[Any, Any]] = {}
    for key, result in found.items():
        if result is not None and isinstance(result.value, dict):  # hivemind unpacks a dictionary value to a dict
            out[key] = {subkey: item.value for subkey, item in result.value.items()}
    return out


async def store_from_file(_dht: hivemind.DHT, node: Any, key: str, subkey: bytes, path: str, expiration: float) -> bool:
    """Runs inside the DHT process: store the value spilled to `path` (see `p2p.transport.spill`). A file
    that is gone means the publisher gave up on this store first (its timeout, or a stop) and removed it:
    nothing to store, and no traceback on the console (hivemind prints one for any error here).

    True when some replica holds it. hivemind reports the answer of the replica that answered last, so one
    refusing peer among the nearest (another swarm's validator, an older one, a hostile peer answering late)
    would hide the others' acceptance: a refusal is checked by reading the key back as a reader would
    (`get_many_in_dht`, one search, on this path only) and comparing the value under our subkey with the one
    just stored (an older record of ours, or another's under a subkey that is not theirs, does not count)."""
    try:
        with open(path, "rb") as f:
            value = f.read()
    except FileNotFoundError:
        return False
    finally:
        unlink_quietly(path)
    if await node.store(key, value, expiration, subkey=subkey):
        return True
    found = await get_many_in_dht(_dht, node, [key])
    return found.get(key, {}).get(subkey) == value


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


async def validator_rejections_in_dht(_dht: hivemind.DHT, node: Any) -> dict[str, int]:
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
    return die_with_parent_here(parent_pid)


def die_with_parent(dht: hivemind.DHT, timeout: float = 10.0) -> bool:
    """Blocking: tie `dht`'s process to this one (call from the thread that started it: the death signal
    follows the forking thread). False where unsupported or on failure; never raises."""
    try:
        return bool(ask_blocking(dht, partial(_die_with_parent, parent_pid=os.getpid()), timeout))
    except Exception as e:
        logger.warning("could not tie the DHT process to this one: %s: %s", type(e).__name__, e)
        return False


async def _keep_valid_subkeys(_dht: hivemind.DHT, node: Any) -> bool:
    keep_valid_subkeys(node.protocol)
    return True


def keep_valid_subkeys_in(dht: hivemind.DHT, timeout: float = 10.0) -> bool:
    """Blocking: make `dht` drop only the invalid subkeys of a dictionary answer (see validators.keep_valid_subkeys)."""
    return bool(ask_blocking(dht, _keep_valid_subkeys, timeout))


async def _routing_peers(_dht: hivemind.DHT, node: Any) -> list[str]:
    """Runs inside the DHT process: peer ids currently in the routing table (not replacements)."""
    return [str(pid) for bucket in node.protocol.routing_table.buckets for pid in bucket.nodes_to_peer_id.values()]


async def live_peers_in_dht(_dht: hivemind.DHT, node: Any, ping_below: int = 8) -> int:
    """Runs inside the DHT process: peers in the routing table; in a table of fewer than `ping_below`, only
    those that answer a ping. hivemind drops a peer from its table only when a request to it fails, so the
    table of a quiet peer whose few neighbours all left never empties; each failed ping drops one."""
    peers = [pid for bucket in node.protocol.routing_table.buckets for pid in bucket.nodes_to_peer_id.values()]
    if len(peers) >= ping_below:
        return len(peers)
    answers = await asyncio.gather(*(node.protocol.call_ping(pid) for pid in peers), return_exceptions=True)
    return sum(1 for a in answers if a is not None and not isinstance(a, BaseException))


def routing_peers(dht: hivemind.DHT, timeout: float = 10.0) -> list[str]:
    """Blocking: peer ids in `dht`'s routing table (for status counters)."""
    return ask_blocking(dht, _routing_peers, timeout)


async def _visible_maddrs(_dht: hivemind.DHT, node: Any) -> list[Any]:
    return await node.get_visible_maddrs()


async def _peer_id(_dht: hivemind.DHT, node: Any) -> str:
    return str(node.peer_id)


def visible_maddrs_and_peer_id(dht: hivemind.DHT, timeout: float = 10.0) -> tuple[list[str], str]:
    """Blocking, bounded: our multiaddrs and peer id (hivemind's get_visible_maddrs and peer_id wait for
    the DHT process with no timeout)."""
    return [str(m) for m in ask_blocking(dht, _visible_maddrs, timeout)], ask_blocking(dht, _peer_id, timeout)


# --- the same, awaited on the parent's event loop (p2p.transport): nothing blocks it, nothing waits in a thread


def takes_commands(dht: hivemind.DHT) -> bool:
    """Whether a command sent to `dht`'s process now is taken without blocking the sender. hivemind never
    closes the parent's copy of its command pipe's read end, so a command to a DHT process that stopped
    reading (stopped, or its loop stuck) does not fail: it waits in the pipe's buffer, and once that is full
    (about 80 commands) the next send blocks the sending thread, the event loop included, for good. A pipe
    with room for PIPE_BUF bytes (select's "writable") takes a command (under 1 KB: a batch goes by file)."""
    pipe = getattr(dht, "_outer_pipe", None)
    if pipe is None:  # another hivemind: nothing to look at
        return True
    try:
        return bool(select.select([], [pipe.fileno()], [], 0)[1])
    except (OSError, ValueError):  # closed: a shut-down DHT
        return False


class DHTNotReading(TimeoutError):
    """The DHT process is not taking commands (`takes_commands`): sending one would block."""


def _refuse_if_not_reading(dht: hivemind.DHT) -> None:
    if not takes_commands(dht):
        raise DHTNotReading("the DHT process is not reading its commands")


async def ask(dht: hivemind.DHT, fn: Any, timeout: float) -> Any:
    """Await `fn` run inside `dht`'s process, at most `timeout` seconds (asyncio.TimeoutError after).

    A wait given up on leaves the future alone: cancelling it would not stop `fn` (the DHT process runs it
    to the end regardless), and when `fn` then finished, hivemind's `_run_coroutine` would fail to set the
    cancelled future's result and print two tracebacks on the console (seen under churn: every DHT get
    that timed out). Its late result is dropped by hivemind once nobody holds the future."""
    _refuse_if_not_reading(dht)
    return await asyncio.wait_for(dht.run_coroutine(fn, return_future=True), timeout)


def ask_blocking(dht: hivemind.DHT, fn: Any, timeout: float) -> Any:
    """`ask` for a thread that may block (the bootstrap's main thread): TimeoutError after `timeout`."""
    _refuse_if_not_reading(dht)
    return dht.run_coroutine(fn, return_future=True).result(timeout)


def _ready_within(dht: hivemind.DHT, deadline: float, timeout: float, poll_s: float) -> bool:
    """One short slice of hivemind's blocking wait: True once started, False if not yet, TimeoutError once
    `deadline` (time.monotonic) has passed. Short slices let the caller notice a stop between them."""
    try:
        dht.wait_until_ready(min(poll_s, max(0.0, deadline - time.monotonic())))
        return True
    except TimeoutError:
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the DHT peer did not start within {timeout:.0f} s") from None
        return False


async def wait_ready(dht: hivemind.DHT, timeout: float, poll_s: float = 0.25) -> None:
    """Wait until `dht` has started (its error if it failed; TimeoutError after `timeout`). hivemind only
    offers a blocking wait: it runs in short slices, so a cancelled wait leaves no thread blocked for long
    (a stop during start-up; asyncio's exit waits for its executor's threads)."""
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    while not await loop.run_in_executor(None, _ready_within, dht, deadline, timeout, poll_s):
        pass


def wait_ready_blocking(dht: hivemind.DHT, timeout: float, stop: threading.Event, poll_s: float = 0.25) -> bool:
    """`wait_ready` for a plain thread (the bootstrap's main thread): False as soon as `stop` is set, so a
    Ctrl-C during a slow start-up is not ignored for up to `timeout`."""
    deadline = time.monotonic() + timeout
    while not stop.is_set():
        if _ready_within(dht, deadline, timeout, poll_s):
            return True
    return False


async def settle(dht: hivemind.DHT, timeout: float = 10.0) -> list[Any]:
    """A started node's DHT: tied to this process (`_die_with_parent`), keeping only valid subkeys; returns
    our multiaddrs as p2pd reports them (unlike hivemind's get_visible_maddrs, bounded: a restart on a
    loaded host once hung there with no message)."""
    try:
        await ask(dht, partial(_die_with_parent, parent_pid=os.getpid()), timeout)
    except Exception as e:
        logger.warning("could not tie the DHT process to this one: %s: %s", type(e).__name__, e)
    await ask(dht, _keep_valid_subkeys, timeout)
    return await ask(dht, _visible_maddrs, timeout)


def child_pids(pid: int) -> list[int]:
    """Linux: the processes `pid` started (a DHT process's p2pd); [] elsewhere or once it is gone."""
    try:
        return [int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()]
    except (OSError, ValueError):
        return []


def _is_p2pd(pid: int) -> bool:
    try:
        return b"p2pd" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def shutdown_dht(dht: hivemind.DHT, grace_s: float = 5.0) -> None:
    """Blocking, bounded: shut `dht` down (hivemind: a few seconds' grace, then SIGTERM). One that is not
    reading its commands is terminated at once (hivemind's shutdown would block sending it the shutdown
    command), and one that SIGTERM does not end within `grace_s` (a stopped process) is killed. Its p2pd, which
    a killed DHT process leaves running until p2pd's own idle timeout (30 s, holding the peer id: a new DHT
    process with the same identity is refused meanwhile), is killed after it."""
    p2pds = [pid for pid in child_pids(dht.pid) if _is_p2pd(pid)] if dht.is_alive() and dht.pid else []
    if takes_commands(dht):
        dht.shutdown()
    elif dht.is_alive():
        dht.terminate()
    dht.join(grace_s)
    if dht.is_alive():
        dht.kill()
        dht.join(grace_s)
    for pid in p2pds:
        if _is_p2pd(pid):  # still there (a pid taken again since is no p2pd, or not the one we read: left alone)
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


async def stop_dht(dht: hivemind.DHT) -> None:
    """`shutdown_dht`, off the event loop."""
    await asyncio.get_running_loop().run_in_executor(None, shutdown_dht, dht)

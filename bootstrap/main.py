"""sapo-bootstrap: a DHT-only peer that new nodes join through.

It keeps its libp2p identity in --identity-dir so its multiaddr survives restarts (the address
other nodes have in their configs), runs the same record validator as nodes (so it stores only
valid SAPO records for its swarm) and exits 0 on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from node import __version__
from node.ops.status import ThreadedStatusServer, start_status_server_in_thread
from p2p.dht_process import (
    die_with_parent,
    keep_valid_subkeys_in,
    routing_peers,
    shutdown_dht,
    start_dht,
    takes_commands,
    visible_maddrs_and_peer_id,
    wait_ready_blocking,
)
from p2p.files import write_atomically
from p2p.identity import KEY_FILENAME, Identity, IdentityError, libp2p_identity_path
from p2p.maddr import flags_problem
from p2p.pow import DEFAULT_POW_DIFFICULTY, MAX_POW_DIFFICULTY

logger = logging.getLogger("sapo.bootstrap")
SILENT_READS = 6  # routing-table reads in a row without an answer (10 s each) before the DHT counts as stuck


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    try:
        return int(raw) if raw else default
    except ValueError:
        print(f"sapo-bootstrap: ${name} must be an integer (got {raw!r})", file=sys.stderr)
        raise SystemExit(2) from None  # a usage error, like a bad flag


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="sapo-bootstrap", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    p.add_argument("--host-maddrs", nargs="+", default=["/ip4/0.0.0.0/tcp/31337"], help="listen multiaddrs")
    p.add_argument("--announce-maddrs", nargs="*", default=[], help="public multiaddrs to announce (explicit ports)")
    p.add_argument("--identity-dir", type=Path, default=Path("./bootstrap-identity"))
    p.add_argument("--swarm", default="sapo-default")
    p.add_argument(
        "--pow-difficulty",
        type=int,
        default=_env_int("SAPO_POW_DIFFICULTY", DEFAULT_POW_DIFFICULTY),
        help="the swarm's proof-of-work bits: records of weaker keys are refused "
        "(default: $SAPO_POW_DIFFICULTY, as for nodes, else %(default)s)",
    )
    p.add_argument("--maddrs-file", type=Path, default=None, help="write full visible multiaddrs here, one per line")
    p.add_argument(
        "--status-port",
        type=int,
        default=None,
        help="serve /status, /metrics, /healthz on this port (0 = any free port)",
    )
    p.add_argument("--status-host", default="127.0.0.1", help="status server bind address")
    p.add_argument("--log-interval", type=float, default=60.0, help="seconds between peer-count log lines")
    p.add_argument("--start-timeout", type=float, default=60.0, help="seconds to wait for the DHT to start")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


class PeerCounter:
    """Distinct peers ever seen in the routing table, plus the current table size."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.current = 0

    def update(self, peers: list[str]) -> None:
        self.current = len(peers)
        self.seen.update(peers)

    def status(self) -> dict[str, int]:
        return {"routing_table": self.current, "peers_seen": len(self.seen)}


def serve_status(host: str, port: int, snapshot: Callable[[], dict[str, Any]]) -> ThreadedStatusServer:
    """Serve the bootstrap snapshot from a daemon thread (the main loop stays synchronous)."""
    return start_status_server_in_thread(snapshot, host, port, kind="bootstrap")


def usage_problem(args: argparse.Namespace) -> str | None:
    """A flag refused up front (exit 2), before the DHT starts: not a traceback once it is up."""
    if not 0 <= args.pow_difficulty <= MAX_POW_DIFFICULTY:
        return f"--pow-difficulty must be in [0, {MAX_POW_DIFFICULTY}] (got {args.pow_difficulty})"
    if args.status_port is not None and not 0 <= args.status_port <= 65535:  # bind() would raise OverflowError
        return f"--status-port must be a TCP port in [0, 65535] (got {args.status_port})"
    for name in ("start_timeout", "log_interval"):
        value = getattr(args, name)
        if not (math.isfinite(value) and 0 < value <= 86400):  # time.sleep and waits refuse inf; a day is plenty
            return f"--{name.replace('_', '-')} must be seconds in (0, 86400] (got {value})"
    if args.maddrs_file is not None and args.maddrs_file.is_dir():
        return f"--maddrs-file {args.maddrs_file} is a directory; name a file"
    return flags_problem([], args.host_maddrs, args.announce_maddrs)  # the DHT's process would time out on one


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    problem = usage_problem(args)
    if problem:
        print(f"sapo-bootstrap: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        identity = Identity.load_or_create(args.identity_dir / KEY_FILENAME, create=True)
        # its own key never publishes, so it needs no proof of work; its validator checks everyone else's
        dht = start_dht(
            identity,
            libp2p_identity_path(args.identity_dir),
            args.swarm,
            [],
            args.host_maddrs,
            args.announce_maddrs,
            pow_difficulty=args.pow_difficulty,
        )
    except (IdentityError, OSError) as e:  # a corrupt key, --identity-dir a file or not writable
        logger.error("cannot use the identity in %s: %s", args.identity_dir, e)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        if not wait_ready_blocking(dht, args.start_timeout, stop):
            logger.info("stopped before the DHT started: shutting down")
            shutdown_dht(dht)
            return 0
        die_with_parent(dht)  # a SIGKILLed bootstrap must not leave its DHT process holding the port
        keep_valid_subkeys_in(dht)
        maddrs, peer_id = visible_maddrs_and_peer_id(dht)
    except Exception as e:
        logger.error("bootstrap DHT failed to start: %s: %s", type(e).__name__, e)
        shutdown_dht(dht)
        return 1
    for m in maddrs:
        print(m, flush=True)
    if args.maddrs_file is not None:
        try:
            write_atomically(args.maddrs_file, "".join(f"{m}\n" for m in maddrs))
        except OSError as e:  # its directory missing or not writable
            logger.error("cannot write --maddrs-file %s: %s", args.maddrs_file, e)
            shutdown_dht(dht)
            return 1
    counter = PeerCounter()
    started = time.time()

    def snapshot() -> dict[str, Any]:
        # Called from the status thread: only reads immutable values and two ints.
        return {
            "peer_id": peer_id,
            "maddrs": maddrs,
            "swarm": args.swarm,
            "uptime_s": time.time() - started,
            "started_at": started,
            "version": __version__,
            **counter.status(),
        }

    status: ThreadedStatusServer | None = None
    if args.status_port is not None:
        try:
            status = serve_status(args.status_host, args.status_port, snapshot)
        except OSError as e:
            logger.error("cannot serve status on %s:%s: %s", args.status_host, args.status_port, e)
            shutdown_dht(dht)
            return 1
        logger.info("status on %s/", status.url)
    logger.info("bootstrap peer for swarm %r up (%s)", args.swarm, identity.peer_name)
    # The status page wants a fresh peer count; the log line keeps its own (usually longer) interval.
    refresh = max(0.1, min(args.log_interval, 5.0) if status is not None else args.log_interval)
    next_refresh, next_log = time.monotonic(), time.monotonic() + args.log_interval
    code, unanswered = 0, 0
    while not stop.wait(min(1.0, refresh)):
        if not dht.is_alive() or not takes_commands(dht) or unanswered >= SILENT_READS:
            # a bootstrap without its DHT lets no node join: exit, so that whatever restarts it (systemd,
            # a container's restart policy, the launch script) does; the status page would say "ok" meanwhile
            why = f"exited with code {dht.exitcode}" if not dht.is_alive() else "stopped answering"
            logger.error("the bootstrap's DHT process %s: exiting (start it again; its identity is kept)", why)
            code = 1
            break
        now = time.monotonic()
        if now < next_refresh:
            continue
        next_refresh = now + refresh
        try:
            counter.update(routing_peers(dht))
            unanswered = 0
        except Exception as e:
            unanswered += 1
            logger.warning("could not read routing table: %s: %s", type(e).__name__, e)
            continue
        if now >= next_log:
            next_log = now + args.log_interval
            logger.info("peers: %s", counter.status())
    logger.info("shutting down")
    if status is not None:
        try:
            status.stop()
        except Exception as e:  # a status server slow to stop must not keep the DHT running
            logger.warning("status server did not stop cleanly: %s: %s", type(e).__name__, e)
    shutdown_dht(dht)
    return code


if __name__ == "__main__":
    sys.exit(main())

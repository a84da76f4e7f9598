"""sapo-bootstrap as a subprocess: maddrs file, peers join through it, clean SIGTERM, stable address."""

from __future__ import annotations

import asyncio
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from p2p.transport import SwarmTransport, TransportConfig
from p2p.wire import RolloutBatch, encode_signed

pytestmark = pytest.mark.timeout(90)
REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(tmp: Path, port: int, maddrs_file: Path, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "bootstrap.main", "--host-maddrs", f"/ip4/127.0.0.1/tcp/{port}",
           "--identity-dir", str(tmp / "boot"), "--swarm", "btest", "--maddrs-file", str(maddrs_file),
           "--log-interval", "0.5", *extra]  # fmt: skip
    return subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wait_for_file(path: Path, proc: subprocess.Popen, timeout: float = 30) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().split()
        if proc.poll() is not None:
            raise AssertionError(f"bootstrap exited early:\n{proc.stdout.read()}")
        time.sleep(0.1)
    raise AssertionError("maddrs file never appeared")


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=20)
    return proc.returncode, out


async def test_bootstrap_lifecycle(tmp_path):
    port, maddrs_file = free_port(), tmp_path / "maddrs.txt"
    proc = launch(tmp_path, port, maddrs_file, "--status-port", "0")
    try:
        maddrs = wait_for_file(maddrs_file, proc)
        assert maddrs and all(f"/tcp/{port}/p2p/" in m for m in maddrs)
        cfg = lambda name, peers: TransportConfig(  # noqa: E731
            identity_dir=tmp_path / name, swarm="btest", host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=peers
        )
        a, b = SwarmTransport(cfg("a", maddrs)), SwarmTransport(cfg("b", maddrs))
        await asyncio.gather(a.start(), b.start())
        try:
            ident = a.identity
            data = encode_signed(RolloutBatch(1, "btest", 4, ident.public_key_bytes, time.time(), "m", []), ident)
            assert await a.publish(4, data)
            assert [(r.publisher, r.round) for r in await b.fetch()] == [(a.identity.public_key_bytes, 4)]
            await asyncio.sleep(1.2)  # let the bootstrap log its peer count
        finally:
            await asyncio.gather(a.shutdown(), b.shutdown())
        rc, out = stop(proc)
        assert rc == 0, out
        assert "peers: {'routing_table': 2" in out or "'peers_seen': 2" in out, out
    finally:
        if proc.poll() is None:
            proc.kill()

    # restart: same identity, same port -> same multiaddr; SIGINT also exits 0
    maddrs_file.unlink()
    proc = launch(tmp_path, port, maddrs_file)
    try:
        assert wait_for_file(maddrs_file, proc) == maddrs
        rc, out = stop(proc, signal.SIGINT)
        assert rc == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()

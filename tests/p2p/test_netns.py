"""The real bootstrap and two real SAPO transports in separate Linux network namespaces, joined over a veth pair.

Topology (addresses picked by the test, 10.213.X.0/24)::

    netns A (10.213.X.1)                          netns B (10.213.X.2)
      sapo-bootstrap (python -m bootstrap.main) <-- veth --> writer: SwarmTransport joins the bootstrap by its
      reader: SwarmTransport joins the bootstrap,              namespace multiaddr, publishes a signed batch
              fetches the writer's batch and verifies it

Requires root, the ``ip`` command (iproute2) and permission to create namespaces; skipped otherwise.
The namespaces are always deleted. All process commands are built in ``COMMANDS`` below.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

IP = shutil.which("ip")
REPO = Path(__file__).resolve().parents[2]
SUBNET_PREFIX = "10.213"
SWARM, ROUND, MODEL = "sapo-netns-test", 7, "netns-model"

# Both joiners: argv = role, own ip, identity dir, bootstrap multiaddrs...
_PEER_PY = textwrap.dedent("""
    import asyncio, os, sys, time
    from pathlib import Path
    from p2p.transport import SwarmTransport, TransportConfig
    from p2p.wire import WIRE_VERSION, RolloutBatch, TaskSpecWire, WireGroup, decode_signed, encode_signed

    async def main(role, ip, identity_dir, peers):
        t = SwarmTransport(TransportConfig(identity_dir=Path(identity_dir), swarm=%(swarm)r,
                                           host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=peers,
                                           pow_difficulty=int(os.environ["SAPO_POW_DIFFICULTY"])))
        await t.start()
        print("UP", t.identity.public_key_hex, *t.visible_maddrs(), flush=True)
        try:
            if role == "writer":
                group = WireGroup(TaskSpecWire("basic_arithmetic", {}, 1, 0), ["2", "3"], [1.0, 0.0])
                batch = RolloutBatch(WIRE_VERSION, %(swarm)r, %(round)d, t.identity.public_key_bytes, time.time(),
                                     %(model)r, [group])
                print("PUBLISHED", await t.publish(%(round)d, encode_signed(batch, t.identity)), flush=True)
                await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # serve until stdin closes
            else:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    for rec in await t.fetch():
                        b = decode_signed(rec.data)  # signature + schema checked again on this side
                        print("GOT", rec.publisher.hex(), rec.round, b.model, len(b.groups), flush=True)
                        return
                    await asyncio.sleep(0.5)
                print("NOT FOUND", flush=True)
        finally:
            await t.shutdown()

    asyncio.run(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]))
""") % {"swarm": SWARM, "round": ROUND, "model": MODEL}

# One place for the commands each role runs inside its namespace.
COMMANDS = {
    "bootstrap": lambda ip, tmp: [
        sys.executable,
        "-m",
        "bootstrap.main",
        "--host-maddrs",
        f"/ip4/{ip}/tcp/0",
        "--identity-dir",
        str(tmp / "boot"),
        "--maddrs-file",
        str(tmp / "maddrs.txt"),
        "--swarm",
        SWARM,
    ],
    "writer": lambda ip, tmp, peers: [sys.executable, "-c", _PEER_PY, "writer", ip, str(tmp / "writer"), *peers],
    "reader": lambda ip, tmp, peers: [sys.executable, "-c", _PEER_PY, "reader", ip, str(tmp / "reader"), *peers],
}


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, check=check, timeout=30)


class Proc:
    """A process in a namespace whose output is collected by a thread (so we can wait for lines)."""

    def __init__(self, ns: str, argv: list[str]):
        self.p = subprocess.Popen(
            [IP, "netns", "exec", ns, *argv],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO), "SAPO_THREADS": "1"},
        )
        self.lines: list[str] = []
        self._cond = threading.Condition()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        for line in self.p.stdout:
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()
        with self._cond:
            self._cond.notify_all()

    def wait_line(self, pattern: str, timeout: float) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        with self._cond:
            seen = 0
            while True:
                for line in self.lines[seen:]:
                    m = rx.search(line)
                    if m:
                        return m
                seen = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.p.poll() is not None and seen == len(self.lines)):
                    raise AssertionError(f"no line matching {pattern!r}; output:\n" + "\n".join(self.lines[-40:]))
                self._cond.wait(min(left, 0.5))

    def terminate(self, timeout: float = 30) -> int:
        """SIGTERM (`ip netns exec` execs the command, so this reaches it) and return the exit code."""
        self.p.send_signal(signal.SIGTERM)
        return self.p.wait(timeout=timeout)

    def stop(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.close()
                self.p.wait(timeout=15)
            except (subprocess.TimeoutExpired, BrokenPipeError, OSError):
                self.p.terminate()
                try:
                    self.p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self.p.kill()
                    self.p.wait()


@pytest.fixture
def two_namespaces():
    if IP is None:
        pytest.skip("the `ip` command (iproute2) is not installed: apt-get install -y iproute2")
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    tag = secrets.token_hex(3)
    ns_a, ns_b = f"sapo-{tag}-a", f"sapo-{tag}-b"
    veth_a, veth_b = f"vs{tag}a", f"vs{tag}b"  # <= 15 chars
    subnet = f"{SUBNET_PREFIX}.{int(tag, 16) % 250 + 1}"
    ip_a, ip_b = f"{subnet}.1", f"{subnet}.2"
    created = []
    try:
        for ns in (ns_a, ns_b):
            r = _run("netns", "add", ns, check=False)
            if r.returncode != 0:
                pytest.skip(f"cannot create network namespaces here: {r.stderr.strip() or r.returncode}")
            created.append(ns)
        r = _run("link", "add", veth_a, "type", "veth", "peer", "name", veth_b, check=False)
        if r.returncode != 0:
            pytest.skip(f"cannot create a veth pair here: {r.stderr.strip()}")
        _run("link", "set", veth_a, "netns", ns_a)
        _run("link", "set", veth_b, "netns", ns_b)
        for ns, dev, addr in ((ns_a, veth_a, ip_a), (ns_b, veth_b, ip_b)):
            _run("-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
            _run("-n", ns, "link", "set", dev, "up")
            _run("-n", ns, "link", "set", "lo", "up")
        ping = (
            subprocess.run(
                [IP, "netns", "exec", ns_b, "ping", "-c", "1", "-W", "2", ip_a], capture_output=True, text=True
            )
            if shutil.which("ping")
            else None
        )
        if ping is not None:
            assert ping.returncode == 0, f"veth link does not work: {ping.stdout}{ping.stderr}"
        yield {"a": (ns_a, ip_a), "b": (ns_b, ip_b)}
    finally:
        for ns in created:  # deleting a namespace also deletes the veth end inside it (and its peer)
            _run("netns", "del", ns, check=False)
        leftover = _run("netns", "list", check=False).stdout
        assert not any(ns in leftover for ns in created), leftover


def wait_for_file(path: Path, proc: Proc, timeout: float) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists():
            return path.read_text().split()
        assert proc.p.poll() is None, "bootstrap exited early:\n" + "\n".join(proc.lines[-40:])
        time.sleep(0.2)
    raise AssertionError(f"{path} never appeared:\n" + "\n".join(proc.lines[-40:]))


@pytest.mark.slow
def test_swarm_across_namespaces(two_namespaces, tmp_path):
    (ns_a, ip_a), (ns_b, ip_b) = two_namespaces["a"], two_namespaces["b"]
    procs: list[Proc] = []
    try:
        boot = Proc(ns_a, COMMANDS["bootstrap"](ip_a, tmp_path))
        procs.append(boot)
        maddrs = wait_for_file(tmp_path / "maddrs.txt", boot, timeout=60)
        assert maddrs and all(re.match(rf"/ip4/{re.escape(ip_a)}/tcp/\d+/p2p/\w+$", m) for m in maddrs), maddrs

        writer = Proc(ns_b, COMMANDS["writer"](ip_b, tmp_path, maddrs))
        procs.append(writer)
        writer_key = writer.wait_line(r"^UP ([0-9a-f]{64}) ", timeout=60).group(1)
        assert writer.wait_line(r"^PUBLISHED (True|False)", timeout=60).group(1) == "True"

        reader = Proc(ns_a, COMMANDS["reader"](ip_a, tmp_path, maddrs))
        procs.append(reader)
        got = reader.wait_line(r"^(GOT|NOT FOUND)(.*)$", timeout=90)
        assert got.group(1) == "GOT", "\n".join(reader.lines)
        assert got.group(2).split() == [writer_key, str(ROUND), MODEL, "1"]
        assert reader.p.wait(timeout=30) == 0, "\n".join(reader.lines)

        writer.stop()
        assert boot.terminate() == 0, "\n".join(boot.lines[-40:])
    finally:
        for p in reversed(procs):
            p.stop()

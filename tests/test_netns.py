"""Two hivemind DHT peers in separate Linux network namespaces, joined over a veth pair.

Topology (addresses picked by the test, 10.213.X.0/24)::

    netns A (10.213.X.1)                       netns B (10.213.X.2)
      bootstrap DHT  <------ veth pair ------>   writer DHT: joins A by its namespace address, stores a value
      reader DHT: joins the bootstrap, reads the value the writer stored

Requires root, the ``ip`` command (iproute2) and permission to create namespaces; skipped otherwise.
The namespaces are always deleted. All process commands are built in ``COMMANDS`` below so the bootstrap can
later be switched to ``sapo-bootstrap`` in one place (its maddrs are found by regex in its output).
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

pytestmark = pytest.mark.timeout(180)

IP = shutil.which("ip")
SUBNET_PREFIX = "10.213"
MADDR_RE = re.compile(r"/ip4/(?:\d+\.){3}\d+/tcp/\d+/p2p/[1-9A-HJ-NP-Za-km-z]+")
KEY, VALUE = "sapo-netns-test", "hello-from-namespace-B"

_BOOTSTRAP_PY = textwrap.dedent("""
    import sys, time, hivemind
    from hivemind.utils import get_dht_time
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{sys.argv[1]}/tcp/0"], start=True)
    for m in dht.get_visible_maddrs():
        print("MADDR", m, flush=True)
    print("READY", flush=True)
    sys.stdin.read()  # serve until the test closes stdin
    dht.shutdown()
""")

_WRITER_PY = textwrap.dedent("""
    import sys, time, hivemind
    from hivemind.utils import get_dht_time
    ip, peers = sys.argv[1], sys.argv[2:]
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=peers, start=True)
    ok = dht.store(%(key)r, %(value)r, expiration_time=get_dht_time() + 600)
    print("STORED", ok, flush=True)
    sys.stdin.read()  # keep serving the value until the test is done
    dht.shutdown()
""") % {"key": KEY, "value": VALUE}

_READER_PY = textwrap.dedent("""
    import sys, time, hivemind
    from hivemind.utils import get_dht_time
    ip, peers = sys.argv[1], sys.argv[2:]
    dht = hivemind.DHT(host_maddrs=[f"/ip4/{ip}/tcp/0"], initial_peers=peers, start=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = dht.get(%(key)r, latest=True)
        if found is not None:
            print("GOT", found.value, flush=True)
            break
        time.sleep(0.5)
    else:
        print("NOT FOUND", flush=True)
    dht.shutdown()
""") % {"key": KEY}

# One place for the commands each role runs inside its namespace.
# To use the real bootstrap binary: "bootstrap": lambda ip: ["sapo-bootstrap", "--host-maddrs", f"/ip4/{ip}/tcp/0"]
COMMANDS = {
    "bootstrap": lambda ip: [sys.executable, "-c", _BOOTSTRAP_PY, ip],
    "writer": lambda ip, peers: [sys.executable, "-c", _WRITER_PY, ip, *peers],
    "reader": lambda ip, peers: [sys.executable, "-c", _READER_PY, ip, *peers],
}


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run([IP, *args], capture_output=True, text=True, check=check, timeout=30)


class Proc:
    """A process in a namespace whose output is collected by a thread (so we can wait for lines)."""

    def __init__(self, ns: str, argv: list[str]):
        self.p = subprocess.Popen(
            [IP, "netns", "exec", ns, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
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
        ping = subprocess.run([IP, "netns", "exec", ns_b, "ping", "-c", "1", "-W", "2", ip_a],
                              capture_output=True, text=True) if shutil.which("ping") else None
        if ping is not None:
            assert ping.returncode == 0, f"veth link does not work: {ping.stdout}{ping.stderr}"
        yield {"a": (ns_a, ip_a), "b": (ns_b, ip_b)}
    finally:
        for ns in created:  # deleting a namespace also deletes the veth end inside it (and its peer)
            _run("netns", "del", ns, check=False)
        leftover = _run("netns", "list", check=False).stdout
        assert not any(ns in leftover for ns in created), leftover


def test_dht_across_namespaces(two_namespaces):
    (ns_a, ip_a), (ns_b, ip_b) = two_namespaces["a"], two_namespaces["b"]
    procs: list[Proc] = []
    try:
        boot = Proc(ns_a, COMMANDS["bootstrap"](ip_a))
        procs.append(boot)
        maddr = boot.wait_line(MADDR_RE.pattern.replace("(?:\\d+\\.){3}\\d+", re.escape(ip_a)), timeout=60).group(0)
        assert maddr.startswith(f"/ip4/{ip_a}/tcp/")

        writer = Proc(ns_b, COMMANDS["writer"](ip_b, [maddr]))
        procs.append(writer)
        assert writer.wait_line(r"^STORED (True|False)", timeout=60).group(1) == "True"

        reader = Proc(ns_a, COMMANDS["reader"](ip_a, [maddr]))
        procs.append(reader)
        got = reader.wait_line(r"^(GOT|NOT FOUND)(.*)$", timeout=90)
        assert got.group(1) == "GOT", "\n".join(reader.lines)
        assert got.group(2).strip() == VALUE
    finally:
        for p in reversed(procs):
            p.stop()

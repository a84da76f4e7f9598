"""sapo-bootstrap as a subprocess: maddrs file, peers join through it, status page, clean SIGTERM, stable address."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import pytest

from p2p.dht_process import child_pids
from p2p.transport import SwarmTransport, TransportConfig
from p2p.wire import WIRE_VERSION, RolloutBatch, encode_signed

pytestmark = pytest.mark.timeout(90)
REPO = Path(__file__).resolve().parents[2]


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


async def wait_for_status(url: str, proc: subprocess.Popen, min_peers: int, timeout: float = 30) -> dict:
    """Poll /status until the bootstrap reports at least `min_peers` peers seen (it refreshes every <= 5 s)."""
    deadline = time.monotonic() + timeout
    last: object = None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        while time.monotonic() < deadline:
            assert proc.poll() is None, "bootstrap exited early"
            try:
                async with http.get(f"{url}/status") as resp:
                    assert resp.status == 200 and resp.content_type == "application/json"
                    last = await resp.json()
                    if last["peers_seen"] >= min_peers:
                        return last
            except aiohttp.ClientConnectionError as e:
                last = e
            await asyncio.sleep(0.3)
    raise AssertionError(f"status never showed {min_peers} peers: {last!r}")


async def get_text(url: str) -> tuple[int, str, str]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http:
        async with http.get(url) as resp:
            return resp.status, resp.headers["Content-Type"], await resp.text()


def stop(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> tuple[int, str]:
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=20)
    return proc.returncode, out


@pytest.mark.slow
async def test_bootstrap_lifecycle(tmp_path):
    port, status_port, maddrs_file = free_port(), free_port(), tmp_path / "maddrs.txt"
    url = f"http://127.0.0.1:{status_port}"
    proc = launch(tmp_path, port, maddrs_file, "--status-port", str(status_port), "--status-host", "127.0.0.1")
    try:
        maddrs = wait_for_file(maddrs_file, proc)
        assert maddrs and all(f"/tcp/{port}/p2p/" in m for m in maddrs)
        cfg = lambda name, peers: TransportConfig(  # noqa: E731
            identity_dir=tmp_path / name,
            swarm="btest",
            host_maddrs=["/ip4/127.0.0.1/tcp/0"],
            initial_peers=peers,
            pow_difficulty=int(os.environ["SAPO_POW_DIFFICULTY"]),  # the bootstrap's setting (tests/conftest.py)
            fetch_timeout_s=30.0,  # the fetch below is compared with an exact list: never cut short by load
        )
        a, b = SwarmTransport(cfg("a", maddrs)), SwarmTransport(cfg("b", maddrs))
        await asyncio.gather(a.start(), b.start())
        try:
            ident = a.identity
            data = encode_signed(
                RolloutBatch(WIRE_VERSION, "btest", 4, ident.public_key_bytes, time.time(), "m", []), ident
            )
            assert await a.publish(4, data)
            assert [(r.publisher, r.round) for r in await b.fetch()] == [(a.identity.public_key_bytes, 4)]
            snap = await wait_for_status(url, proc, min_peers=2)
            assert snap["maddrs"] == maddrs and snap["swarm"] == "btest" and snap["version"]
            assert snap["peer_id"] and all(m.endswith(f"/p2p/{snap['peer_id']}") for m in maddrs)
            assert snap["uptime_s"] > 0
            code, ctype, text = await get_text(f"{url}/metrics")
            assert code == 200 and ctype.startswith("text/plain"), (code, ctype)
            samples = dict(line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
            assert float(samples["sapo_bootstrap_peers_seen"]) >= 2
            assert float(samples["sapo_uptime_seconds"]) > 0
            assert "# TYPE sapo_bootstrap_peers_seen gauge" in text and 'kind="bootstrap"' in text
            assert (await get_text(f"{url}/healthz"))[0] == 200
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


@pytest.mark.parametrize("status_port", ["70000", "-1"])
def test_a_status_port_that_is_no_tcp_port_is_one_clear_error(tmp_path, status_port):
    """Refused up front, exit 2, like --pow-difficulty: not an OverflowError traceback once the DHT is up."""
    proc = launch(tmp_path, free_port(), tmp_path / "maddrs.txt", "--status-port", status_port)
    code, out = proc.wait(timeout=60), proc.stdout.read()
    proc.stdout.close()
    assert code == 2, out[-2000:]
    assert "--status-port" in out and "Traceback" not in out
    assert not (tmp_path / "maddrs.txt").exists()  # nothing started


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--start-timeout", "-1"], "--start-timeout must be seconds"),
        (["--start-timeout", "nan"], "--start-timeout must be seconds"),
        (["--log-interval", "inf"], "--log-interval must be seconds"),
        (["--maddrs-file", "."], "is a directory"),
    ],
)
def test_flags_refused_up_front(extra, message):
    """Usage errors, exit 2 before the DHT starts (SAPO_POW_DIFFICULTY too: it stands in for a flag)."""
    from bootstrap.main import parse_args, usage_problem

    assert usage_problem(parse_args([])) is None
    assert message in (usage_problem(parse_args(extra)) or "")


def test_an_identity_dir_that_is_a_file_or_a_maddrs_file_that_cannot_be_written_is_one_line(tmp_path):
    """File errors: one line, exit 1, no traceback; the second after the DHT started, which it shuts down."""
    (tmp_path / "boot").write_text("mine")
    proc = launch(tmp_path, free_port(), tmp_path / "maddrs.txt")
    code, out = proc.wait(timeout=60), proc.stdout.read()
    proc.stdout.close()
    assert code == 1 and "cannot use the identity in" in out and "Traceback" not in out, out[-2000:]
    assert (tmp_path / "boot").read_text() == "mine"
    other = tmp_path / "other"
    other.mkdir()
    (tmp_path / "afile").write_text("")
    proc = launch(other, free_port(), tmp_path / "afile" / "maddrs.txt")
    code, out = proc.wait(timeout=60), proc.stdout.read()
    proc.stdout.close()
    assert code == 1 and "cannot write --maddrs-file" in out and "Traceback" not in out, out[-2000:]


def test_a_pow_difficulty_variable_that_is_no_integer_is_a_usage_error(monkeypatch, capsys):
    from bootstrap.main import build_parser

    monkeypatch.setenv("SAPO_POW_DIFFICULTY", "abc")
    with pytest.raises(SystemExit) as exit_:
        build_parser()
    assert exit_.value.code == 2 and "$SAPO_POW_DIFFICULTY must be an integer" in capsys.readouterr().err


def test_a_bootstrap_whose_dht_process_dies_exits_with_an_error_instead_of_serving_nothing(tmp_path):
    """Its DHT process gone (the OOM killer, a crash): no node can join through it, so it says so and exits 1
    for whatever restarts it; before, it logged a timeout every few seconds until its command pipe filled
    and it hung for good, its status page saying "ok"."""
    maddrs_file = tmp_path / "maddrs.txt"
    proc = launch(tmp_path, free_port(), maddrs_file)
    try:
        wait_for_file(maddrs_file, proc)
        # the DHT process is a fork of the bootstrap (its command line); torch_shm_manager is another child
        (dht_pid,) = [c for c in child_pids(proc.pid) if b"bootstrap.main" in Path(f"/proc/{c}/cmdline").read_bytes()]
        os.kill(dht_pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1
    assert "the bootstrap's DHT process exited with code -9: exiting" in out

"""A real `sapo-node` whose bootstrap is down (issue: it used to die with a 30-line traceback): it says so in one
line, trains solo, and joins the swarm from the round after a real `sapo-bootstrap` appears at that address,
where a peer that joins later finds its batches. Status and metrics say "solo: waiting for peers" meanwhile.

The membership's finer cases (every peer leaving, the rejoin, a stop while joining) run on bare DHT peers in
tests/p2p/test_p2p_membership.py, with shortened timings."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest
from hivemind.p2p import P2P, PeerID

from conftest import (
    Proc,
    await_for,
    free_port,
    live_metrics,
    prefix_of,
    run_node,
    start_node,
    stop_all,
    transport,
    wait_for,
)

pytestmark = pytest.mark.timeout(300)


def status(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as resp:
        return json.loads(resp.read())


async def fetch_from(tmp_path, swarm: str, address: str, prefix: str) -> int:
    """A peer joining through `address` fetches a batch published by the key with `prefix`: its round."""
    reader = transport(tmp_path, "reader", swarm, [address])
    await reader.start()
    found: list[int] = []

    async def look() -> None:
        found.extend(r.round for r in await reader.fetch() if r.publisher.hex().startswith(prefix))

    try:
        for _ in range(60):
            await look()
            if found:
                break
            await asyncio.sleep(1.0)
        await await_for(lambda: bool(found), 1, "the node's batch on the swarm")
    finally:
        await reader.shutdown()
    return found[0]


@pytest.mark.slow
def test_dead_bootstrap_trains_solo_then_joins_when_it_appears(tmp_path):
    swarm = "e2e-late-bootstrap"
    boot_dir = tmp_path / "boot"
    boot_dir.mkdir()
    P2P.generate_identity(str(boot_dir / "p2p.identity"))  # the bootstrap's address is known before it runs
    port = free_port()
    address = f"/ip4/127.0.0.1/tcp/{port}/p2p/{PeerID.from_identity((boot_dir / 'p2p.identity').read_bytes())}"
    run_dir, status_port = tmp_path / "node", free_port()
    node = start_node(run_dir, [address], swarm, "--status-port", str(status_port))
    procs = [node]
    try:
        wait_for(lambda: len(live_metrics(run_dir)) >= 2, procs, 120, "two solo rounds")
        solo = live_metrics(run_dir)
        assert all(r["swarm_state"] == "solo" and r["solo_since"] <= r["t_start"] for r in solo)
        snap = status(status_port)["membership"]
        assert snap["state"] == "solo" and snap["message"].startswith("solo: waiting for peers since ")
        out = node.text()
        said = [line for line in out.splitlines() if "no initial peer answered" in line]
        assert len(said) == 1 and address in said[0] and "connection refused" in said[0], out[-3000:]
        assert "Traceback" not in out

        boot = Proc(
            [
                "-m",
                "bootstrap.main",
                "--host-maddrs",
                f"/ip4/127.0.0.1/tcp/{port}",
                "--identity-dir",
                str(boot_dir),
                "--swarm",
                swarm,
                "--log-interval",
                "5",
            ],
            tmp_path / "boot.out",
        )
        procs.append(boot)
        wait_for(
            lambda: any(r["swarm_state"] == "joined" for r in live_metrics(run_dir)), procs, 120, "a round in the swarm"
        )
        records = live_metrics(run_dir)
        first = next(r["round"] for r in records if r["swarm_state"] == "joined")
        assert first >= 2 and all(r["swarm_state"] == "joined" for r in records[first:])  # no flapping
        assert status(status_port)["membership"]["state"] == "joined"
        assert "joined the swarm through" in node.text()

        found = asyncio.run(fetch_from(tmp_path, swarm, address, prefix_of(run_dir)))
        assert found >= first  # what the node published once joined is on the swarm
        assert stop_all(procs) == [0, 0]
    finally:
        for p in procs:
            p.cleanup()
    assert "Traceback" not in node.text()


@pytest.mark.slow
def test_require_peers_exits_in_one_line_with_the_fix(tmp_path, tiny_args):
    """Today's behaviour, on request: no initial peer answers, the node exits 1, before it loads its model. The
    console gets one line that says what to do; node.log says what each peer's probe met."""
    dead = f"/ip4/127.0.0.1/tcp/{free_port()}/p2p/QmPKxbjj7f9tqZ8Mq6eLzpFzkbwkaERA87VSuqF2aPhrV4"
    run_dir = tmp_path / "run"
    done = run_node(
        *tiny_args,
        "--rounds",
        "1",
        "--run-dir",
        str(run_dir),
        "--peers",
        dead,
        "--require-peers",
        "--host-maddrs",
        "/ip4/127.0.0.1/tcp/0",
    )
    assert done.returncode == 1, done.stderr[-3000:]
    console = done.stdout + done.stderr
    errors = [line for line in console.splitlines() if line.startswith("sapo-node: error:")]
    assert len(errors) == 1 and "cannot join the swarm" in errors[0] and "--require-peers" in errors[0], console
    assert "Traceback" not in console
    # said before the model loads: node.log has the probe's answer and no model
    log = (run_dir / "node.log").read_text()
    assert "none of the initial peers answered" in log and "connection refused" in log and "loading model" not in log

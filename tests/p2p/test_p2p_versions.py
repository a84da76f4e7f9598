"""A protocol v1 peer (p2p/ of the commit before v2, from git history) beside a v2 peer on a real DHT:
neither crashes and they do not exchange (the v2 validator's one warning line for it is tested in
test_p2p_validators.py::test_old_protocol_is_refused_with_one_log_line)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from conftest import REPO
from p2p.transport import SwarmTransport, TransportConfig

pytestmark = pytest.mark.timeout(180)

_V1_PEER = textwrap.dedent("""
    import asyncio, sys, time
    from pathlib import Path
    from p2p.transport import SwarmTransport, TransportConfig
    from p2p.wire import WIRE_VERSION, RolloutBatch, TaskSpecWire, WireGroup, encode_signed
    assert WIRE_VERSION == 1

    async def main(identity_dir, peer):
        t = SwarmTransport(TransportConfig(identity_dir=Path(identity_dir), swarm="vmix",
                                           host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[peer]))
        await t.start()
        group = WireGroup(TaskSpecWire("basic_arithmetic", {}, 1, 0), ["2", "3"], [1.0, 0.0])
        for r in range(3):
            batch = RolloutBatch(1, "vmix", r, t.identity.public_key_bytes, time.time(), "m", [group])
            print("PUBLISHED", r, await t.publish(r, encode_signed(batch, t.identity)), flush=True)
        print("FETCHED", len(await t.fetch()), flush=True)
        await t.shutdown()

    asyncio.run(main(sys.argv[1], sys.argv[2]))
""")


def _v1_tree(tmp) -> str:
    found = subprocess.run(
        ["git", "-C", str(REPO), "log", "--format=%H", "-S", "WIRE_VERSION = 1", "--", "p2p/wire.py"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.split()
    if not found:
        shallow = (
            subprocess.run(
                ["git", "-C", str(REPO), "rev-parse", "--is-shallow-repository"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout.strip()
            == "true"
        )
        pytest.skip(
            "protocol v1 is not in this checkout's git history"
            + (": a shallow clone (`git fetch --unshallow` brings it; .ci/run does in CI)" if shallow else "")
        )
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", found[0] + "^", "p2p"], capture_output=True, check=True
    )
    subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive.stdout, check=True)
    return str(tmp)


async def test_v1_peer_is_refused_and_nothing_crashes(tmp_path):
    (tmp_path / "v1").mkdir()
    v1 = _v1_tree(tmp_path / "v1")
    v2 = SwarmTransport(
        TransportConfig(
            identity_dir=tmp_path / "v2", swarm="vmix", pow_difficulty=4, host_maddrs=["/ip4/127.0.0.1/tcp/0"]
        )
    )
    await v2.start()
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _V1_PEER, str(tmp_path / "v1peer"), v2.visible_maddrs()[0]],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env={"PYTHONPATH": f"{v1}:{REPO}", "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"},
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "PUBLISHED 2" in proc.stdout and "FETCHED 0" in proc.stdout, proc.stdout
        deadline = time.monotonic() + 30
        rejected: dict = {}
        while time.monotonic() < deadline and not rejected.get("dht_older_protocol_version"):
            rejected = await v2.validator_rejections()
        assert rejected.get("dht_older_protocol_version", 0) >= 3, rejected  # 3 batches + presence, refused
        assert await v2.fetch() == []
        assert v2.dht.is_alive()
    finally:
        await v2.shutdown()

"""Over a real DHT, with real processes: a peer that publishes wrong rewards is banned by an honest node,
and stays banned when that node is stopped and restarted with --resume (its batches are then skipped as
`banned`, never verified again).

The liar is a real `node.cli` process whose exchange adds 1 to every reward it publishes (everything
else, signing included, is the normal node).
"""

from __future__ import annotations

import json

import pytest

from conftest import (
    Proc,
    reasons,
    start_bootstrap,
    start_node,
    stop_all,
    wait_for,
)
from conftest import live_metrics as rounds
from p2p.identity import KEY_FILENAME, Identity
from scripts.bench.procs import TINY

pytestmark = pytest.mark.timeout(600)

LIAR = """
import sys
import node.build as build
import node.cli as cli
from node.learn.groups import Group
from node.swarm.dht_exchange import DhtExchange

class LyingExchange(DhtExchange):
    async def publish(self, round_, groups):
        lies = [Group(task=g.task, responses=g.responses, rewards=[r + 1.0 for r in g.rewards]) for g in groups]
        await super().publish(round_, lies)

build.build_exchange = lambda cfg, mix, stop=None: LyingExchange.create(build.swarm_settings(cfg), mix, stop)
sys.exit(cli.main(sys.argv[1:]))
"""


def banned_in_file(run_dir, key_hex: str) -> bool:
    try:
        table = json.loads((run_dir / "reputation.json").read_text())["peers"]
    except (OSError, ValueError, KeyError):
        return False  # not written yet (or being replaced right now)
    return table.get(key_hex, {}).get("banned_until", 0) > 0


@pytest.mark.slow
def test_liar_is_banned_and_stays_banned_after_resume(tmp_path):
    swarm = "e2e-reputation"
    boot, maddrs = start_bootstrap(tmp_path, swarm)
    honest_dir, liar_dir = tmp_path / "honest", tmp_path / "liar"
    extra = ["--checkpoint-every", "1"]
    honest = start_node(honest_dir, maddrs, swarm, *extra, seed=1)
    liar = Proc(
        [
            "-c",
            LIAR,
            "--model",
            "tiny-random",
            *TINY,
            "--seed",
            "2",
            "--swarm",
            swarm,
            "--run-dir",
            str(liar_dir),
            "--host-maddrs",
            "/ip4/127.0.0.1/tcp/0",
            "--peers",
            *maddrs,
        ],
        tmp_path / "liar.out",
    )
    procs = [boot, honest, liar]
    try:
        wait_for(lambda: rounds(liar_dir), procs, 240, "the liar's first round")  # its key file exists by then
        liar_key = Identity.load_or_create(liar_dir / KEY_FILENAME, create=False).public_key_hex
        wait_for(
            lambda: reasons(rounds(honest_dir)).get("reward_mismatch", 0) >= 2,
            procs,
            240,
            "the honest node to re-score the liar's groups",
        )
        wait_for(lambda: banned_in_file(honest_dir, liar_key), procs, 120, "the ban in reputation.json")
        assert honest.stop() == 0, honest.text()[-3000:]
        before = len(rounds(honest_dir))
        mismatches = reasons(rounds(honest_dir))["reward_mismatch"]

        honest = start_node(honest_dir, maddrs, swarm, *extra, "--resume", seed=1)
        procs = [boot, honest, liar]

        def after() -> list[dict]:
            return rounds(honest_dir)[before:]

        wait_for(
            lambda: reasons(after()).get("banned", 0) >= 2,
            procs,
            240,
            "the restarted node to skip the liar's new batches as banned",
        )
        assert "reward_mismatch" not in reasons(after()), "a banned publisher is never verified again"
        assert reasons(rounds(honest_dir))["reward_mismatch"] == mismatches
        assert len(rounds(liar_dir)) > 0 and liar.alive()
        assert "1 banned (from" in (honest_dir / "node.log").read_text()  # loaded at start, said so
    finally:
        codes = stop_all([honest, liar])
        boot.stop()
    assert codes == [0, 0]

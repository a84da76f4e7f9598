"""Over a real DHT, with a real node: a publisher that follows every rule (a valid key, fresh tasks of the node's
mix, rewards exactly right) but puts its own text after every right answer has that text masked out of the loss
by the node's external screen (its answers still teach), counted per publisher, and loses reputation; an honest
publisher beside it (plain right answers) is trained on untouched. The publishers are one DHT client signing
with the project's wire code (scripts/bench/poison.py), the node the real CLI on the tiny random model
(--external-screen on by default).
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from conftest import live_metrics as rounds
from conftest import start_bootstrap, start_node, stop_all
from node.learn.tasks import PRESETS
from p2p.identity import KEY_FILENAME, Identity

pytestmark = pytest.mark.timeout(300)


def screened(records: list[dict], key: str, reason: str) -> int:
    return sum((r.get("screened_by_publisher") or {}).get(key, {}).get(reason, 0) for r in records)


def trained(records: list[dict], key: str) -> int:
    return sum(r.get("external_sources", {}).get(key, 0) for r in records)


@pytest.mark.slow
def test_rule_following_poisoner_is_screened_and_an_honest_publisher_is_not(tmp_path):
    import os

    from scripts.bench.poison import Publishers

    swarm = "e2e-poison"
    boot, maddrs = start_bootstrap(tmp_path, swarm)
    node_dir = tmp_path / "node"
    node = start_node(node_dir, maddrs, swarm, "--checkpoint-every", "1", seed=1)
    pubs = Publishers(
        "after", 1, 1, PRESETS["smoke"], 2, 7,
        swarm=swarm, maddrs=maddrs, pow_bits=int(os.environ["SAPO_POW_DIFFICULTY"]), tmp=tmp_path, ttl=120.0,
    )  # fmt: skip
    (poisoner,), (honest,) = pubs.keys("poison"), pubs.keys("honest")
    loop = asyncio.new_event_loop()

    def done() -> bool:
        recs = rounds(node_dir)
        return (
            screened(recs, poisoner, "masked_outside") >= 4
            and sum((r.get("foreign_text_by_publisher") or {}).get(poisoner, 0) for r in recs) >= 1
            and trained(recs, honest) >= 2
        )

    try:
        deadline = time.monotonic() + 240
        while not done():
            assert node.alive(), node.text()[-3000:]
            assert time.monotonic() < deadline, f"timed out: {rounds(node_dir)[-1:]}\n{node.text()[-2000:]}"
            loop.run_until_complete(pubs.step())
            time.sleep(1.0)
        recs = rounds(node_dir)
        assert trained(recs, poisoner) >= 1, "its groups pass verification: every rule is followed"
        assert screened(recs, honest, "outside_answer") == screened(recs, honest, "masked_outside") == 0
        assert all(r["external_screen"] == "on" for r in recs)
        assert "screened masked_outside" in (node_dir / "node.log").read_text()
    finally:
        loop.close()
        pubs.shutdown()
        codes = stop_all([node])
        boot.stop()
    assert codes == [0]
    table = json.loads((node_dir / "reputation.json").read_text())["peers"]
    full = {Identity.load_or_create(node_dir / KEY_FILENAME, create=False).public_key_hex}  # never its own
    scores = {k[:16]: v["score"] for k, v in table.items() if k not in full}
    assert scores[poisoner] < scores[honest], scores

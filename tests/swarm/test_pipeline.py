"""The network behind the round (node/swarm/pipeline.py) on real nodes: the tiny model, two peers of an
in-process swarm whose exchange is as slow as a wide-area network makes it (each fetch and publish takes a
while; the bytes, signatures and verification are the real ones). A round hands its publish to the background
and takes the groups verified by then without waiting, except at the staleness bound; a stop ends every wait
at once and rewinds the round. Asserted on what the rounds recorded against the delays, not on durations."""

from __future__ import annotations

import asyncio
import copy

import pytest
import torch

from helpers_learning import check_records
from node.build import build_node, verify_config
from node.learn.groups import Group
from node.learn.model_io import load_model
from node.learn.tasks import PRESETS
from node.ops.config import load_config
from node.ops.metrics import read_records
from node.swarm.exchange import Received
from node.swarm.memory_exchange import MemoryBoard, MemoryExchange
from p2p.identity import Identity

MIX = PRESETS["smoke"]


class SlowExchange(MemoryExchange):
    """A MemoryExchange whose fetch and publish take as long as a slow link's would."""

    fetch_s = 0.0
    publish_s = 0.0

    async def fetch(self, round_: int) -> Received:
        await asyncio.sleep(self.fetch_s)
        return await super().fetch(round_)

    async def publish(self, round_: int, groups: list[Group]) -> None:
        await asyncio.sleep(self.publish_s)
        await super().publish(round_, groups)


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny-random", torch.device("cpu"))


def make_node(tmp_path, name, seed, board, tiny_model, *extra, exchange_cls=MemoryExchange):
    flags = ["--model", "tiny-random", "--tasks", "smoke", "--num-local", "2", "--num-external", "4"]
    flags += ["--generations", "4", "--max-new-tokens", "8", "--seed", str(seed), "--run-dir", str(tmp_path / name)]
    flags += ["--swarm", "mem", "--pow-difficulty", "8", "--eval-every", "0", "--no-tensorboard", *extra]
    cfg = load_config(flags, env={})
    exchange = exchange_cls(board, Identity.generate(8), MIX, verify_config(cfg), "tiny")
    return build_node(cfg, MIX, copy.deepcopy(tiny_model[0]), tiny_model[1], exchange, torch.device("cpu"))


async def publisher_rounds(node, n: int) -> None:
    """`n` rounds of an in-line peer, whose batches land on the board at once (many groups: the smoke tasks)."""
    for _ in range(n):
        await node.step()


async def test_groups_arrive_behind_the_rounds_and_no_round_waits_before_the_bound(tmp_path, tiny_model):
    board = MemoryBoard()
    other = make_node(tmp_path, "other", 1, board, tiny_model)
    node = make_node(tmp_path, "node", 2, board, tiny_model, "--net-pipeline", "on", "--net-max-age", "3",
                     exchange_cls=SlowExchange)  # fmt: skip
    node.exchange.fetch_s = node.exchange.publish_s = 0.3
    for n in (other, node):
        await n.open()
        n.net.start(asyncio.Event())
    try:
        await publisher_rounds(other, 1)
        for _ in range(8):
            await node.step()
            await publisher_rounds(other, 1)
            await asyncio.sleep(0.1)  # the other peer's round takes a while too
    finally:
        for n in (other, node):
            await n.close()
    recs = read_records(tmp_path / "node" / "metrics.jsonl")
    check_records(recs)
    assert all(r["net_pipeline"] and r["net_max_age"] == 3 for r in recs)
    assert all(r["phase_s"]["publish"] < node.exchange.publish_s for r in recs)  # handed off, not awaited
    assert all(r["phase_s"]["fetch"] < node.exchange.fetch_s for r in recs if not r["prefetch_waited"])
    trained = [r for r in recs if r["num_external"]]
    assert trained, [(r["prefetch_s"], r["num_external"]) for r in recs]
    for r in trained:
        assert r["prefetch_s"] >= node.exchange.fetch_s  # they came over the slow link, behind the round
        assert len(r["external_age_rounds"]) == len(r["external_age_s"]) == r["num_external"]
        assert all(0 <= age <= 3 for age in r["external_age_rounds"]) and all(a >= 0 for a in r["external_age_s"])
    assert sum(r["external_accepted"] for r in recs) >= sum(r["num_external"] for r in recs)
    published = {r for (pub, r) in board.records if pub == node.exchange.identity.public_key_bytes}
    assert published, "the background publisher published nothing"
    snapshot = node.snapshot()["network"]
    assert snapshot["pipeline"] and snapshot["rounds"] == len(recs)


async def test_a_round_waits_for_the_prefetch_at_the_staleness_bound(tmp_path, tiny_model):
    board = MemoryBoard()
    other = make_node(tmp_path, "other", 1, board, tiny_model)
    node = make_node(tmp_path, "node", 2, board, tiny_model, "--net-pipeline", "on", "--net-max-age", "1",
                     exchange_cls=SlowExchange)  # fmt: skip
    node.exchange.fetch_s = 1.5  # longer than a tiny round
    for n in (other, node):
        await n.open()
        n.net.start(asyncio.Event())
    try:
        await publisher_rounds(other, 1)
        for _ in range(2):
            await node.step()
    finally:
        for n in (other, node):
            await n.close()
    r0, r1 = read_records(tmp_path / "node" / "metrics.jsonl")
    assert not r0["prefetch_waited"] and r0["num_external"] == 0  # the prefetch begun at round 0 still ran
    assert r1["prefetch_waited"] and r1["num_external"] > 0  # round 1 is the bound: it waited, then trained on it
    assert set(r1["external_age_rounds"]) == {1}


@pytest.mark.parametrize("max_age", [0, 5])
async def test_a_stop_ends_the_network_waits_and_rewinds_the_round(tmp_path, tiny_model, max_age):
    """max age 0: the stop lands while round 0 waits for its prefetch (abandoned, rewound, nothing recorded);
    5: rounds go on while a prefetch runs for ever, and the stop ends the node without waiting for it."""
    board = MemoryBoard()
    node = make_node(tmp_path, "node", 2, board, tiny_model, "--net-pipeline", "on", "--net-max-age", str(max_age),
                     "--rounds", "1000", "--net-timeout", "600", "--checkpoint-every", "1000",
                     exchange_cls=SlowExchange)  # fmt: skip
    node.exchange.fetch_s = 600.0

    async def stop_soon() -> None:
        while not (node.live.phase == "fetch" if max_age == 0 else node.rounds_this_run >= 2):
            await asyncio.sleep(0.01)
        node.stop.set("test")

    stopper = asyncio.ensure_future(stop_soon())
    done = await asyncio.wait_for(node.run(), 120)  # far below the fetch: nothing waited for it
    await stopper
    recs = read_records(tmp_path / "node" / "metrics.jsonl") if (tmp_path / "node" / "metrics.jsonl").exists() else []
    assert done == len(recs) == node.next_round
    assert done == 0 if max_age == 0 else done >= 2
    assert node.net._prefetch is None and node.net._publisher is None  # cancelled at close
    assert node.sampler.state_dict() == node.persistence.capture(node.next_round)["sampler"]

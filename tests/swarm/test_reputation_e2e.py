"""A publisher that lies about rewards is banned, and stays banned when the node restarts with --resume.

Real nodes (node/build.py's `build_node`), the tiny random model, real reasoning-gym tasks, the same signed
bytes and checks as over the DHT (MemoryExchange); only the liar's exchange is changed, to add 1 to every
reward it publishes.
"""

import copy

import orjson
import pytest
import torch

from node.build import build_node, verify_config
from node.learn.groups import Group
from node.learn.model_io import load_model
from node.learn.tasks import PRESETS
from node.ops.config import load_config
from node.swarm.memory_exchange import MemoryBoard, MemoryExchange
from node.swarm.reputation import REPUTATION_FILE
from p2p.identity import KEY_FILENAME, Identity

MIX = PRESETS["smoke"]


class LyingExchange(MemoryExchange):
    async def publish(self, round_: int, groups: list[Group]) -> None:
        lies = [Group(task=g.task, responses=g.responses, rewards=[r + 1.0 for r in g.rewards]) for g in groups]
        await super().publish(round_, lies)


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny-random", torch.device("cpu"))


def make_node(tmp_path, name, seed, board, tiny_model, exchange_cls=MemoryExchange, extra=()):
    run_dir = tmp_path / name
    cfg = load_config(
        [
            "--model",
            "tiny-random",
            "--tasks",
            "smoke",
            "--num-local",
            "2",
            "--num-external",
            "4",
            "--generations",
            "4",
            "--max-new-tokens",
            "8",
            "--seed",
            str(seed),
            "--run-dir",
            str(run_dir),
            "--swarm",
            "mem",
            "--pow-difficulty",
            "8",
            *extra,
        ],
        env={},
    )
    # the same identity after a restart
    identity = Identity.load_or_create(run_dir / KEY_FILENAME, create=True, pow_difficulty=cfg.pow_difficulty)
    exchange = exchange_cls(board, identity, MIX, verify_config(cfg), "tiny")
    return build_node(cfg, MIX, copy.deepcopy(tiny_model[0]), tiny_model[1], exchange, torch.device("cpu"))


@pytest.mark.slow
async def test_a_liar_is_banned_and_stays_banned_after_resume(tmp_path, tiny_model):
    board = MemoryBoard()
    liar = make_node(tmp_path, "liar", 1, board, tiny_model, LyingExchange)
    honest = make_node(tmp_path, "honest", 2, board, tiny_model)
    node = make_node(tmp_path, "node", 3, board, tiny_model)
    liar_key = liar.exchange.identity.public_key_bytes
    for n in (liar, honest, node):
        await n.open()

    for n in (liar, honest):
        await n.step()
    await node.step()
    rejected = node.exchange.stats.rejected[liar_key.hex()]
    assert rejected["reward_mismatch"] == 2  # both of its groups, re-scored by us
    assert not node.exchange.reputation.allowed(liar_key)
    await node.close()  # checkpoint + reputation.json
    saved = orjson.loads((tmp_path / "node" / REPUTATION_FILE).read_bytes())
    assert saved["peers"][liar_key.hex()]["banned_until"] > 0

    # restart: a new process would build exactly this from the run dir
    again = make_node(tmp_path, "node", 3, board, tiny_model, extra=["--resume"])
    opened = []
    judge = again.exchange.verifier.judge
    again.exchange.verifier.judge = lambda digest, data, now=None, hint=None: (
        opened.append(hint),
        judge(digest, data, now, hint),
    )[1]
    await again.open()
    assert again.next_round == 1
    assert not again.exchange.reputation.allowed(liar_key)
    for _ in range(2):
        for n in (liar, honest):
            await n.step()
        rec = await again.step()
    stats = again.exchange.stats
    assert stats.rejected[liar_key.hex()]["banned"] >= 2, "its new batches are seen and skipped"
    assert "reward_mismatch" not in stats.rejected[liar_key.hex()], "and never verified again"
    assert liar_key not in opened
    honest_key = honest.exchange.identity.public_key_bytes
    assert honest_key in opened and stats.accepted[honest_key.hex()] > 0, "honest peers are still verified"
    assert rec["rejected_by_reason"].get("banned", 0) >= 1
    snap = again.snapshot()["reputation"]
    assert snap["banned"] == 1 and snap["peers"][liar_key.hex()]["banned_until"]
    for n in (liar, honest, again):
        await n.close()


@pytest.mark.slow
async def test_reset_reputation_unbans(tmp_path, tiny_model):
    board = MemoryBoard()
    liar = make_node(tmp_path, "liar", 1, board, tiny_model, LyingExchange)
    node = make_node(tmp_path, "node", 3, board, tiny_model)
    for n in (liar, node):
        await n.open()
        await n.step()
    assert not node.exchange.reputation.allowed(liar.exchange.identity.public_key_bytes)
    await node.close()
    again = make_node(tmp_path, "node", 3, board, tiny_model, extra=["--resume", "--reset-reputation"])
    await again.open()
    assert again.exchange.reputation.allowed(liar.exchange.identity.public_key_bytes)
    await again.close()  # writes the empty table over the old one
    fresh = make_node(tmp_path, "node", 3, board, tiny_model, extra=["--resume"])
    await fresh.open()
    assert fresh.exchange.reputation.allowed(liar.exchange.identity.public_key_bytes)
    for n in (liar, fresh):
        await n.close()

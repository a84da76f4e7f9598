"""Receiver-side verification (independent of the DHT) and three real nodes over the in-memory exchange."""

import time

import pytest
import torch

from node.build import build_node
from node.learn.groups import Group, score_responses
from node.learn.model_io import load_model
from node.learn.tasks import PRESETS, TaskSampler, TaskSpec, regenerate
from node.ops.config import load_config
from node.swarm.exchange import ExchangeStats
from node.swarm.memory_exchange import MemoryBoard, MemoryExchange
from node.swarm.verify import Verifier, VerifyConfig, make_batch
from p2p.identity import Identity
from p2p.wire import WIRE_VERSION, RolloutBatch, TaskSpecWire, WireCaps, WireGroup, decode_signed, encode_signed

MIX = PRESETS["cpu-easy"]


def honest_groups(seed=1, n=2):
    groups = []
    for task in TaskSampler(MIX, seed).sample(n):
        responses = [f"<answer>{task.answer}</answer>", "<answer>nope</answer>", "<answer>0</answer>"]
        groups.append(Group(task=task, responses=responses, rewards=score_responses(task, responses)))
    return groups


def verifier():
    stats = ExchangeStats()
    me = Identity.generate()
    return Verifier(me.public_key_bytes, MIX, VerifyConfig(swarm="s", window=2), stats), stats, me


def test_honest_batch_is_accepted_and_rescored():
    v, stats, _ = verifier()
    peer = Identity.generate()
    groups = v.verify(make_batch(peer, "s", 3, "m", honest_groups()))
    assert len(groups) == 2 and all(g.source == peer.public_key_hex for g in groups)
    assert groups[0].rewards[0] == 1.0 and groups[0].rewards[1] < 1.0
    assert stats.accepted[peer.public_key_hex] == 2 and not stats.rejected
    # the same batch fetched again next round: not used twice, not an offence
    assert v.verify(make_batch(peer, "s", 3, "m", honest_groups())) == []
    assert stats.rejected[peer.public_key_hex]["equivocation"] == 1  # a *different* batch for round 3


def _forged(peer: Identity, *, rewards=None, dataset=None, config=None, created_at=None, swarm="s", round_=5, seed=9):
    task = TaskSampler(MIX, seed).sample(1)[0]
    spec = task.spec.to_wire()
    if dataset:
        spec["dataset"], spec["config"] = dataset, config or {}
    completions = [f"<answer>{task.answer}</answer>", "<answer>x</answer>"]
    honest = score_responses(task, completions)
    batch = RolloutBatch(
        version=WIRE_VERSION,
        swarm=swarm,
        round=round_,
        publisher=peer.public_key_bytes,
        created_at=created_at or time.time(),
        model="evil",
        groups=[WireGroup(TaskSpecWire(**spec), completions, rewards or honest)],
    )
    return encode_signed(batch, peer)


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: _forged(p, rewards=[1.0, 1.0]), "reward_mismatch"),
        (lambda p: _forged(p, dataset="bf"), "task_not_allowed"),
        (lambda p: _forged(p, dataset="count_bits", config={"min_n": 1, "max_n": 10**6}), "task_not_allowed"),
        (lambda p: _forged(p, created_at=time.time() - 3600), "stale"),
        (lambda p: _forged(p, created_at=time.time() + 3600), "from_future"),
        (lambda p: _forged(p, swarm="other"), "wrong_swarm"),
        (lambda p: b"\x00garbage" * 10, "malformed"),
        (lambda p: b"x" * (3 * 1024 * 1024), "oversize"),
    ],
)
def test_hostile_batches_are_rejected_by_reason(make, reason):
    v, stats, _ = verifier()
    peer = Identity.generate()
    data = make(peer)
    assert v.verify(data, hint=peer.public_key_bytes) == []
    assert v.verify(data, hint=peer.public_key_bytes) == []  # fetched again next round: counted once
    assert stats.rejected[peer.public_key_hex][reason] == 1
    assert sum(stats.accepted.values()) == 0


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda p: _forged(p, created_at=time.time() - 3600), "stale"),
        (lambda p: _forged(p, swarm="other"), "wrong_swarm"),
    ],
)
def test_a_key_that_sends_only_uncharged_refusals_is_parked(make, reason):
    """Stale or other-swarm batches are not charged (a replay of an old batch need not be its key holder's doing),
    but a key that sends nothing else must not head the exploration queue round after round: a useless batch,
    for a key never useful yet."""
    v, stats, _ = verifier()
    peer = Identity.generate()
    v.bandit.choose({peer.public_key_bytes: 5}, k=0)  # seen in presence, never tried: queued
    assert v.verify(make(peer), hint=peer.public_key_bytes) == []
    assert stats.rejected[peer.public_key_hex] == {reason: 1} and v.reputation.score(peer.public_key_bytes) == 0.0
    record = v.bandit.record(peer.public_key_bytes)
    assert record is not None and record.bad == 1 and record.next_try > v.bandit.round
    proven = Identity.generate()
    assert len(v.verify(_forged(proven, seed=3), hint=proven.public_key_bytes)) == 1
    assert v.verify(make(proven), hint=proven.public_key_bytes) == []  # e.g. its old batch replayed
    assert v.bandit.record(proven.public_key_bytes).bad == 0  # a proven publisher is not demoted


def test_a_slow_clock_here_does_not_charge_every_honest_peer(caplog):
    """This machine's clock 5 minutes slow: every peer's batches look from the future. The first two publishers
    are charged as before (too few to tell whose clock is wrong); once most of at least three agree, their
    future batches are refused without a charge (`clock_behind`), parked by the publisher chooser like any
    useless batch, and the log says what to fix. Set right, the clock is trusted again, and a lone publisher
    from the future is charged. (The rules one by one: tests/swarm/test_clock.py.)"""
    v, stats, _ = verifier()
    peers = [Identity.generate() for _ in range(4)]
    ahead = time.time() + 300
    with caplog.at_level("WARNING", logger="sapo.swarm"):
        for round_, peer in enumerate(peers[:3]):
            assert v.verify(_forged(peer, created_at=ahead, round_=round_ + 5), hint=peer.public_key_bytes) == []
        assert v.verify(_forged(peers[0], created_at=ahead + 1, round_=9), hint=peers[0].public_key_bytes) == []
    reasons = [dict(stats.rejected[p.public_key_hex]) for p in peers[:3]]
    assert reasons == [{"from_future": 1, "clock_behind": 1}, {"from_future": 1}, {"clock_behind": 1}]
    assert [v.reputation.score(p.public_key_bytes) for p in peers[:3]] == [-1.0, -1.0, 0.0]
    assert v.bandit.record(peers[2].public_key_bytes).bad == 1  # parked, though not charged
    assert caplog.text.count("this machine's clock: it is probably slow") == 1

    for round_, peer in enumerate(peers[:3]):  # the clock set right: their batches are dated now
        assert len(v.verify(_forged(peer, round_=round_ + 20, seed=round_), hint=peer.public_key_bytes)) == 1
    assert v.verify(_forged(peers[3], created_at=ahead, round_=5), hint=peers[3].public_key_bytes) == []
    assert stats.rejected[peers[3].public_key_hex] == {"from_future": 1}
    assert v.reputation.score(peers[3].public_key_bytes) == -1.0


def test_a_clock_ahead_here_is_hinted(caplog):
    """This machine's clock 8 minutes ahead: peers' batches arrive old (by the records' lifetime, 10 minutes,
    still fetched) and nothing here can prove whose clock is wrong; the log hints at it, nobody is charged."""
    v, stats, _ = verifier()
    peers = [Identity.generate() for _ in range(3)]
    with caplog.at_level("WARNING", logger="sapo.swarm"):
        for round_, peer in enumerate(peers):
            groups = v.verify(_forged(peer, created_at=time.time() - 480, round_=5, seed=round_))
            assert len(groups) == 1  # old, not stale: used
    assert caplog.text.count("this clock is ahead") == 1
    assert not stats.rejected and v.reputation.score(peers[0].public_key_bytes) > 0


def test_a_node_never_signs_a_batch_its_peers_would_refuse(caplog):
    """Groups over the receivers' caps are left out of our own batch (said in the log), so a node with a long
    completion is not penalised by every peer for one offence after another."""
    v, stats, _ = verifier()
    peer = Identity.generate()
    groups = honest_groups(n=3)
    with caplog.at_level("WARNING", logger="sapo.swarm"):
        make_batch(peer, "s", 2, "m", groups)
    assert not caplog.text  # nothing left out, nothing said
    groups[1].responses[0] = "x" * (WireCaps().max_completion_chars + 1)
    with caplog.at_level("WARNING", logger="sapo.swarm"):
        data = make_batch(peer, "s", 3, "m", groups)
    assert "publishing 2 of 3 groups" in caplog.text and "completion_too_long" in caplog.text
    assert len(v.verify(data)) == 2 and not stats.rejected
    small = WireCaps(max_batch_bytes=len(make_batch(peer, "s", 4, "m", groups[:1])) + 50)
    assert len(decode_signed(make_batch(peer, "s", 4, "m", groups, small), small).groups) == 1  # fits its size


def test_tampered_completion_fails_signature():
    v, stats, _ = verifier()
    peer = Identity.generate()
    data = bytearray(make_batch(peer, "s", 1, "m", honest_groups()))
    at = data.find(b"nope")
    data[at : at + 4] = b"yes!"
    assert v.verify(bytes(data), hint=peer.public_key_bytes) == []
    assert stats.rejected[peer.public_key_hex]["bad_signature"] == 1


def test_replay_of_an_old_round_is_stale():
    v, stats, _ = verifier()
    peer = Identity.generate()
    old = make_batch(peer, "s", 1, "m", honest_groups())
    assert v.verify(make_batch(peer, "s", 6, "m", honest_groups()))
    assert v.verify(old) == []
    assert stats.rejected[peer.public_key_hex]["stale_round"] == 1


def test_a_publishers_remembered_rounds_stay_within_the_window():
    """What the verifier keeps per publisher is bounded by the window, however long the publisher runs."""
    v, stats, _ = verifier()
    peer = Identity.generate()
    for r in range(8):
        assert v.verify(make_batch(peer, "s", r, "m", honest_groups(seed=r)))
    assert v.taken[peer.public_key_bytes] == {6, 7}  # window 2: rounds 5 and older are stale now
    assert v.verify(make_batch(peer, "s", 7, "m", honest_groups(seed=99))) == []  # still an equivocation
    assert stats.rejected[peer.public_key_hex] == {"equivocation": 1}


def test_own_batches_are_ignored():
    v, stats, me = verifier()
    assert v.verify(make_batch(me, "s", 1, "m", honest_groups())) == []
    assert not stats.rejected and not stats.accepted


@pytest.fixture(scope="module")
def tiny_model():
    return load_model("tiny-random", torch.device("cpu"))


@pytest.mark.slow
async def test_three_nodes_exchange_over_memory_board(tmp_path, tiny_model):
    """Same sampling, verification and training code as the DHT swarm; only the transport differs."""
    import copy

    board = MemoryBoard()
    nodes = []
    for i in range(3):
        cfg = load_config(
            [
                "--model",
                "tiny-random",
                "--tasks",
                "smoke",
                "--num-local",
                "2",
                "--num-external",
                "2",
                "--generations",
                "4",
                "--seed",
                str(i),
                "--run-dir",
                str(tmp_path / f"p{i}"),
                "--swarm",
                "mem",
            ],
            env={},
        )
        model, tok = copy.deepcopy(tiny_model[0]), tiny_model[1]
        mix = PRESETS["smoke"]
        exchange = MemoryExchange(board, Identity.generate(), mix, VerifyConfig(swarm="mem"), "tiny")
        nodes.append(build_node(cfg, mix, model, tok, exchange, torch.device("cpu")))
    sources = [set() for _ in nodes]
    for r in range(3):
        for i, node in enumerate(nodes):
            rec = (await node.run_round(r)).record
            sources[i] |= set(rec["external_sources"])
    for i, node in enumerate(nodes):
        others = {n.exchange.identity.public_key_hex[:16] for j, n in enumerate(nodes) if j != i}
        assert sources[i] == others, f"node {i} trained on groups from {sources[i]}, expected {others}"
        assert not node.exchange.stats.rejected
        node.worker.shutdown()


def test_regenerated_spec_from_wire_matches():
    task = TaskSampler(MIX, 4).sample(1)[0]
    w = task.spec.to_wire()
    assert regenerate(TaskSpec.make(**w)).answer == task.answer


@pytest.mark.slow
async def test_a_three_times_slower_peer_gets_and_gives_groups(tmp_path, tiny_model):
    """No coordinator: the slow peer runs one round while the others run three; both directions flow."""
    import copy

    board = MemoryBoard()
    nodes = []
    for i in range(3):
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
                "--seed",
                str(10 + i),
                "--run-dir",
                str(tmp_path / f"p{i}"),
                "--swarm",
                "mem",
            ],
            env={},
        )
        mix = PRESETS["smoke"]
        exchange = MemoryExchange(board, Identity.generate(), mix, VerifyConfig(swarm="mem"), "tiny")
        nodes.append(build_node(cfg, mix, copy.deepcopy(tiny_model[0]), tiny_model[1], exchange, torch.device("cpu")))
    slow = nodes[2]
    used = [set() for _ in nodes]
    for _ in range(3):
        for _ in range(3):
            for i in (0, 1):
                used[i] |= set((await nodes[i].step())["external_sources"])
        used[2] |= set((await slow.step())["external_sources"])
    key = [n.exchange.identity.public_key_hex[:16] for n in nodes]
    assert slow.next_round == 3 and nodes[0].next_round == 9
    assert {key[0], key[1]} <= used[2], "the slow peer trains on the fast peers' groups"
    assert key[2] in used[0] and key[2] in used[1], "the fast peers train on the slow peer's groups"
    for node in nodes:
        node.worker.shutdown()


def test_a_completion_that_is_code_is_scored_never_run(tmp_path):
    """binary_matrix (the paper's mix) scores with eval: a signed batch whose completions are code, with the
    rewards our scorer gives them (0), is verified without running them; exit() does not stop the node."""
    mix = PRESETS["paper"]
    me, peer = Identity.generate(), Identity.generate()
    v = Verifier(me.public_key_bytes, mix, VerifyConfig(swarm="s", window=2), ExchangeStats())
    marker = tmp_path / "ran"
    task = regenerate(TaskSpec.make("binary_matrix", {}, 3, 0))
    completions = [
        f"<answer>{task.answer}</answer>",
        f"<answer>__import__('pathlib').Path({str(marker)!r}).touch()</answer>",
        "<answer>exit(3)</answer>",
    ]
    wire = WireGroup(TaskSpecWire(**task.spec.to_wire()), completions, [1.0, 0.0, 0.0])
    batch = RolloutBatch(WIRE_VERSION, "s", 4, peer.public_key_bytes, time.time(), "m", [wire])
    groups = v.verify(encode_signed(batch, peer))
    assert not marker.exists()
    assert [g.rewards for g in groups] == [[1.0, 0.0, 0.0]]

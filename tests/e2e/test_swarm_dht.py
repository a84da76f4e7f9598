"""End to end over a real DHT: a `bootstrap.main` subprocess and real `node.cli` peers on 127.0.0.1.

Rounds of tiny models are fast and peers start at different times, so peers run with a large
--rounds and the test stops them with SIGTERM (graceful: abandon the round in progress, checkpoint the
last completed one, exit 0) once what it waits for has shown up in their metrics.jsonl.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import statistics
import time
from functools import partial
from pathlib import Path

import pytest
from hivemind.utils import get_dht_time

from conftest import (
    Proc,
    await_for,
    free_port,
    prefix_of,
    reasons,
    smoke_group,
    sources,
    start_bootstrap,
    start_node,
    stop_all,
    stored_eventually,
    transport,
    wait_for,
)
from conftest import live_metrics as rounds
from helpers_learning import check_records
from node.ops.stacks import DUMP_END
from p2p.dht_process import store_from_file
from p2p.identity import KEY_FILENAME, Identity
from p2p.transport import SwarmTransport
from p2p.validators import DEFAULT_PRESENCE_SHARDS, batch_key, owner_subkey, presence_key, presence_shard
from p2p.wire import (
    HEADER_LEN,
    WIRE_VERSION,
    PresenceRecord,
    RolloutBatch,
    TaskSpecWire,
    WireGroup,
    encode_presence,
    encode_signed,
)

pytestmark = pytest.mark.timeout(600)

UP_RE = re.compile(r"DHT peer (\S+) up at \[(.*?)\]")

# ------------------------------------------------------------------------------------------------ helpers


def up_line(run_dir: Path) -> list[tuple[str, list[str]]]:
    """(peer name, visible maddrs) from every 'DHT peer ... up at [...]' line in node.log."""
    text = (run_dir / "node.log").read_text()
    return [(m.group(1), re.findall(r"'([^']+)'", m.group(2))) for m in UP_RE.finditer(text)]


async def raw_store(t: SwarmTransport, key: str, value: bytes, ttl: float = 300) -> bool:
    """Store arbitrary bytes under our own subkey, bypassing publish()'s envelope check (the record
    trailer is still added by our validator, so only the value itself is bad). Goes by file like publish."""
    path = t._spill(value)
    fut = t.dht.run_coroutine(
        partial(
            store_from_file,
            key=key,
            subkey=owner_subkey(t.identity.public_key_bytes),
            path=path,
            expiration=get_dht_time() + ttl,
        ),
        return_future=True,
    )
    return bool(await asyncio.wait_for(fut, 30))


async def entries(t: SwarmTransport, key: str) -> dict[bytes, bytes]:
    """publisher -> envelope bytes that a fresh DHT get of `key` returns (validated by `t`'s validator)."""
    return ((await t._get_many([key])) or {}).get(key, {})


COMPUTE = ("sample", "generate", "score", "select", "train", "sync")  # phases that are not swarm I/O


def dumped_and_alive(node: Proc, procs: list[Proc], timeout: float = 60) -> None:
    """After SIGUSR1: the node's stack dump ends, and the node is still running. Tells a crash from a dump:
    a node that died says how (its exit code, and whether Python reported a fatal error)."""

    def finished() -> bool:
        return DUMP_END in node.text() or not node.alive()

    wait_for(finished, [p for p in procs if p is not node], timeout, "the end of the stack dump")
    text = node.text()
    if not node.alive() or "Fatal Python error" in text:
        how = f"exit code {node.p.poll()}" + (", Python fatal error" if "Fatal Python error" in text else "")
        where = "during its stack dump" if DUMP_END not in text else "after its stack dump"
        raise AssertionError(f"{node.out.name} crashed {where} ({how}):\n{text[-4000:]}")


# ------------------------------------------------------------------------------------------------ tests


@pytest.mark.slow
async def test_three_peers_share_rollouts_and_records_are_owner_protected(tmp_path):
    swarm = "e2e-three"
    boot, maddrs = start_bootstrap(tmp_path, swarm)
    run_dirs = [tmp_path / f"peer{i}" for i in range(3)]
    nodes = [start_node(d, maddrs, swarm, seed=i) for i, d in enumerate(run_dirs)]
    mallory = witness = None
    try:
        keys = [prefix_of(d) for d in run_dirs]
        assert len(set(keys)) == 3

        def everyone_learned_from_both_others() -> bool:
            return all(set(keys) - {keys[i]} <= sources(rounds(d)) for i, d in enumerate(run_dirs))

        wait_for(everyone_learned_from_both_others, nodes, 240, "external groups from both other peers")
        for i, d in enumerate(run_dirs):
            recs = rounds(d)
            assert sources(recs) == set(keys) - {keys[i]}  # never its own groups, nobody else's
            assert any(r["num_external"] > 0 and r["optimizer_steps"] > 0 for r in recs)
            assert not reasons(recs), reasons(recs)  # honest peers: nothing rejected
            check_records(recs)

        # Owner protection against the live swarm: Mallory (valid key of her own, joined through the
        # bootstrap) overwrites peer0's record of one of its rounds under peer0's subkey.
        victim = Identity.load_or_create(run_dirs[0] / KEY_FILENAME, create=False)
        r = rounds(run_dirs[0])[-1]["round"]
        key = batch_key(swarm, victim.public_key_bytes, r)
        mallory = transport(tmp_path, "mallory", swarm, maddrs)
        witness = transport(tmp_path, "witness", swarm, maddrs)
        await asyncio.gather(mallory.start(), witness.start())
        before = (await entries(witness, key)).get(victim.public_key_bytes)
        assert before is not None, "peer0's batch of its latest round is not in the DHT"
        assert before[5:37] == victim.public_key_bytes

        group = WireGroup(TaskSpecWire("propositional_logic", {}, 1, 0), ["<answer>x</answer>", "y"], [1.0, 0.0])
        forged = encode_signed(
            RolloutBatch(WIRE_VERSION, swarm, r, mallory.identity.public_key_bytes, time.time(), "m", [group]),
            mallory.identity,
        )
        victim_subkey = owner_subkey(victim.public_key_bytes)
        spill = mallory._spill(forged)
        ok = await asyncio.wait_for(
            mallory.dht.run_coroutine(
                partial(store_from_file, key=key, subkey=victim_subkey, path=spill, expiration=get_dht_time() + 500),
                return_future=True,
            ),
            30,
        )
        assert ok is False  # refused by every peer (and by her own validator: she cannot sign for peer0)
        # her own record under her own key for the same round is accepted: the refusal is about ownership
        assert await mallory.publish(r, forged)
        assert await entries(witness, key) == {victim.public_key_bytes: before}
        mine = await entries(witness, batch_key(swarm, mallory.identity.public_key_bytes, r))
        assert mine == {mallory.identity.public_key_bytes: forged}
        # the live nodes' own DHT validators refused her unsigned record (she cannot sign for peer0)
        await await_for(
            lambda: any(reasons(rounds(d)).get("dht_no_record_signature") for d in run_dirs),
            60,
            "a node counting the refused store",
        )
        for node in nodes:
            assert node.alive()
    finally:
        for t in (mallory, witness):
            if t is not None and t._dht is not None:
                await t.shutdown()
        codes = stop_all(nodes)
        boot.stop()
    assert codes == [0, 0, 0], [n.text()[-2000:] for n in nodes]


@pytest.mark.slow
async def test_hostile_peer_is_refused_and_honest_node_keeps_running(tmp_path):
    swarm = "e2e-hostile"
    boot, maddrs = start_bootstrap(tmp_path, swarm)
    honest_dir = tmp_path / "honest"
    honest = start_node(honest_dir, maddrs, swarm, "--window", "4", seed=5)
    evil = witness = None
    try:
        evil = transport(tmp_path, "evil", swarm, maddrs)
        witness = transport(tmp_path, "witness", swarm, maddrs)
        await asyncio.gather(evil.start(), witness.start())
        me = evil.identity
        ev = me.public_key_bytes
        await await_for(lambda: len(rounds(honest_dir)) >= 2, 120, "the honest node's first rounds")
        assert honest.alive()

        def batch(r: int, groups: list[WireGroup], created_at: float | None = None) -> bytes:
            return encode_signed(
                RolloutBatch(WIRE_VERSION, swarm, r, ev, created_at or time.time(), "evil", groups), me
            )

        # --- refused at the DHT layer: never stored by any honest peer, never reach a node ----------------
        good = batch(1, [smoke_group(11)])
        bad_sig = good[: HEADER_LEN - 64] + bytes(64) + good[HEADER_LEN:]  # signature zeroed
        assert good.count(b"certainly not this") == 1
        tampered = batch(2, [smoke_group(12)]).replace(b"certainly not this", b"certainly not that")
        huge = batch(
            3,
            [
                WireGroup(TaskSpecWire("propositional_logic", {}, 1, i), ["x" * 7000] * 32, [0.0] * 32)
                for i in range(10)
            ],
        )
        assert len(huge) > 2 * 1024 * 1024
        garbage = os.urandom(3000)
        dht_level = {1: bad_sig, 2: tampered, 3: huge, 4: garbage}
        for r, value in dht_level.items():
            assert await raw_store(evil, batch_key(swarm, ev, r), value) is False, f"round {r} was stored"
        # the presence record points at round 4, so the node would fetch it
        presence = encode_presence(PresenceRecord(WIRE_VERSION, swarm, ev, 4, time.time()), me)
        shard = presence_key(swarm, presence_shard(ev, DEFAULT_PRESENCE_SHARDS))
        await stored_eventually(
            lambda: evil.dht.store(shard, presence, get_dht_time() + 300, subkey=owner_subkey(ev), return_future=True),
            "presence",
        )
        for r in dht_level:
            assert ev not in await entries(witness, batch_key(swarm, ev, r)), f"round {r} is visible"
        assert not [rec for rec in await witness.fetch() if rec.publisher == ev]  # nothing of evil's

        # --- validly signed, so the DHT stores them; the node's Verifier must refuse them ------------------
        n0 = len(rounds(honest_dir))
        wrong_reward = smoke_group(13, claimed=lambda true: [(x + 0.5) % 1.0 for x in true])
        outside_mix = WireGroup(TaskSpecWire("basic_arithmetic", {}, 1, 0), ["<answer>1</answer>", "2"], [1.0, 0.0])
        valid = smoke_group(14)
        round10 = batch(10, [valid, wrong_reward, outside_mix])
        await stored_eventually(lambda: evil.publish(10, round10), "round 10")
        assert (await entries(witness, batch_key(swarm, ev, 10)))[ev] == round10

        def seen(reason: str) -> bool:
            return reasons(rounds(honest_dir)).get(reason, 0) > 0

        await await_for(lambda: seen("reward_mismatch") and seen("task_not_allowed"), 90, "per-group rejections")
        recs = rounds(honest_dir)
        assert sum(r["external_accepted"] for r in recs) == 1  # the one honest group of the hostile batch
        assert ev.hex()[:16] in sources(recs)  # ... which it then trained on, with its own rewards

        # replay: an older round after a newer one (window 4: round 5 <= 10 - 4) -> stale_round
        stale = batch(5, [smoke_group(15)])
        await stored_eventually(lambda: evil.publish(5, stale), "round 5")
        await await_for(lambda: seen("stale_round"), 90, "stale_round")
        # a second batch for round 10 (equivocation): a node fetches each (publisher, round) key once,
        # so it never even reads it (the Verifier's equivocation check stays for other transports)
        second = batch(10, [smoke_group(16)], created_at=time.time() + 1)
        await stored_eventually(lambda: evil.publish(10, second), "second round 10")

        # the honest node keeps going after all of it
        n1 = len(rounds(honest_dir))
        await await_for(lambda: len(rounds(honest_dir)) >= n1 + 3, 90, "three more honest rounds")
        assert honest.alive()
        total = reasons(rounds(honest_dir))
        verifier = {k for k in total if not k.startswith("dht_")}
        # nothing of the DHT-level garbage ever reached the node's Verifier ...
        assert not {"bad_signature", "oversize", "malformed", "schema"} & verifier, total
        # ... "ghost" may appear too: evil's presence announces rounds whose batch the DHT refused to store
        assert verifier - {"ghost"} == {"reward_mismatch", "task_not_allowed", "stale_round"}, total
        assert sum(r["external_accepted"] for r in rounds(honest_dir)) == 1  # nothing of the second round 10
        # ... but its DHT validator refused it, and the node counted that (pseudo-peer "dht")
        assert {"dht_envelope_bad_signature", "dht_envelope_oversize", "dht_envelope_malformed"} <= set(total), total
        assert len(rounds(honest_dir)) > n0
    finally:
        for t in (evil, witness):
            if t is not None and t._dht is not None:
                await t.shutdown()
        rc = honest.stop()
        boot.stop()
    assert rc == 0, honest.text()[-3000:]
    recs = rounds(honest_dir)
    assert [r["round"] for r in recs] == list(range(len(recs)))  # every round finished and recorded once
    check_records(recs)


@pytest.mark.slow
def test_killed_peer_does_not_stall_others_and_resumes_with_same_address(tmp_path):
    swarm = "e2e-kill"
    net_timeout = 3.0
    boot, maddrs = start_bootstrap(tmp_path, swarm)
    run_dirs = [tmp_path / f"peer{i}" for i in range(3)]
    ports = [free_port() for _ in run_dirs]
    # no held-out evaluation: rounds are timed below, and an evaluation round is compute, not swarm I/O
    extra = ["--net-timeout", str(net_timeout), "--checkpoint-every", "1", "--eval-every", "0"]

    def launch(i: int, *more: str) -> Proc:
        return start_node(run_dirs[i], maddrs, swarm, *extra, *more, seed=10 + i, host=f"/ip4/127.0.0.1/tcp/{ports[i]}")

    nodes = [launch(i) for i in range(3)]
    restarted = None
    try:
        keys = [prefix_of(d) for d in run_dirs]
        wait_for(
            lambda: all(set(keys) - {keys[i]} <= sources(rounds(d)) for i, d in enumerate(run_dirs)),
            nodes,
            240,
            "a connected swarm",
        )
        ((name_before, maddrs_before),) = up_line(run_dirs[2])
        assert maddrs_before and all(f"/tcp/{ports[2]}/p2p/" in m for m in maddrs_before)

        # a node that seems stuck tells where: every thread's stack, and it carries on (a crash also prints
        # stacks, under "Fatal Python error": the dump's own end line and a round after it tell them apart)
        done_before_dump = len(rounds(run_dirs[2]))
        nodes[2].p.send_signal(signal.SIGUSR1)
        dumped_and_alive(nodes[2], nodes)
        wait_for(lambda: len(rounds(run_dirs[2])) > done_before_dump + 1, nodes, 60, "a round after the dump")
        nodes[2].p.kill()  # SIGKILL the node process only, as the OOM killer would
        nodes[2].p.wait(30)
        t_kill = time.time()
        # its DHT process (and p2pd) must not outlive it: they would serve a dead peer and keep its port
        deadline = time.monotonic() + 15
        while nodes[2].session_alive() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not nodes[2].session_alive(), "the killed node's DHT process / p2pd are still running"
        survivors = [(nodes[i], run_dirs[i]) for i in (0, 1)]

        def after_kill(d: Path) -> list[dict]:
            return [r for r in rounds(d) if r["t_start"] > t_kill + 0.5]

        wait_for(
            lambda: all(len(after_kill(d)) >= 5 for _, d in survivors) and time.time() > t_kill + 8,
            [n for n, _ in survivors],
            120,
            "rounds of the survivors after the kill",
        )
        for _, d in survivors:
            # the network part of a round stays bounded: publish and fetch are each cut at --net-timeout, so
            # the typical round waits less than one timeout on the network (a dead peer never stalls a
            # round). Compute (generate, score, train) is left out, and rounds are judged by their median: a
            # loaded CI host can stall any process for a while; only a gross stall fails on its own.
            recs = after_kill(d)
            check_records(recs)
            io = [r["swarm_io_s"] for r in recs]
            waits = [r["round_s"] - sum(v for k, v in r["phase_s"].items() if k in COMPUTE) for r in recs]
            assert statistics.median(io) <= net_timeout + 0.5, io
            assert statistics.median(waits) <= net_timeout + 1.0, waits
            assert max(waits) <= 3 * net_timeout + 5, waits

        # restart with --resume: same identity, same round counter, same multiaddr
        last_round = rounds(run_dirs[2])[-1]["round"]
        t_restart = time.time()
        restarted = launch(2, "--resume")
        # its DHT may take start_timeout_s (60 s) to fail, after imports slowed by the two busy survivors
        wait_for(lambda: "resumed from" in restarted.text(), [restarted], 150, "the resume")
        m = re.search(r"resumed from round-(\d+): next round (\d+)", restarted.text())
        assert m, restarted.text()[-2000:]
        ckpt_round, next_round = int(m.group(1)), int(m.group(2))
        assert next_round == ckpt_round + 1
        assert next_round in (last_round, last_round + 1)  # a kill between metrics line and checkpoint
        ups = up_line(run_dirs[2])
        assert len(ups) == 2 and ups[1] == (name_before, maddrs_before), ups
        # it rejoins: it finishes a round of its own, and both survivors then train on its groups in rounds
        # that started after that round was published. (Its batches from before the kill are still in the
        # DHT, so "survivors use its groups after the restart" alone could end before it finished a round.)
        key = keys[2]

        def first_new_round_end() -> float | None:
            done = [r for r in rounds(run_dirs[2]) if r["round"] >= next_round and r["t_start"] > t_restart]
            return done[0]["t_end"] if done else None

        def rejoined() -> bool:
            published = first_new_round_end()
            return published is not None and all(
                any(key in r["external_sources"] for r in rounds(d) if r["t_start"] > published) for _, d in survivors
            )

        wait_for(
            rejoined,
            [restarted, *[n for n, _ in survivors]],
            180,
            "a round of the restarted peer, then the survivors using its groups",
        )
        new = [r["round"] for r in rounds(run_dirs[2])]
        assert new == list(range(len(new))) and new[-1] >= next_round
        for d in run_dirs:
            check_records(rounds(d))
    finally:
        codes = stop_all([nodes[0], nodes[1], *([restarted] if restarted else [])])
        nodes[2].cleanup()
        boot.stop()
    assert codes == [0, 0, 0], codes

"""A node that learns nothing for round after round says so (node/records.py `QuietRounds`)."""

import logging

import node.loop as round_loop
from conftest import tiny_memory_node
from node.records import QUIET_ROUNDS


async def test_rounds_without_an_update_are_named_once_per_stretch(tmp_path, caplog, monkeypatch):
    rounds = QUIET_ROUNDS * 2 + 1
    node = tiny_memory_node(tmp_path, "--rounds", str(rounds), "--checkpoint-every", "100", "--eval-every", "0")
    real_local_group = round_loop.local_group

    def signal_in_round_6(task, *args):  # every group scored alike, except in round 6
        group = real_local_group(task, *args)
        group.rewards = [1.0, 0.0] if node.live.round == QUIET_ROUNDS + 1 else [0.0, 0.0]
        return group

    monkeypatch.setattr(round_loop, "local_group", signal_in_round_6)
    with caplog.at_level(logging.WARNING, logger="sapo.node"):
        await node.run()
    warned = [r.getMessage() for r in caplog.records if "no update in rounds" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("no update in rounds 0-4:")  # not again in rounds 7-10
    assert "(--tasks)" in warned[0]
    assert node.quiet.rounds_without_update == rounds - QUIET_ROUNDS - 2  # rounds 7-10 quiet again

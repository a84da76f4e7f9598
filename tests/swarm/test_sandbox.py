"""Other peers' completions are scored in a child process that is stopped when a scorer runs too long."""

from __future__ import annotations

import threading
import time

from node.learn.tasks import PRESETS, TaskSpec, regenerate, score_responses
from node.swarm.exchange import ExchangeStats
from node.swarm.sandbox import ScoringSandbox
from node.swarm.verify import Verifier, VerifyConfig
from p2p.identity import Identity
from p2p.wire import WIRE_VERSION, RolloutBatch, TaskSpecWire, WireGroup, encode_signed

# propositional_logic (the paper's mix) builds every assignment of the variables an answer names: 2^24 of them
BOMB = "<answer>" + "∧".join(a + b for a in "abcdef" for b in "abcd") + "</answer>"


def logic_task(index: int = 0):
    return regenerate(TaskSpec.make("propositional_logic", {}, 0, index))


def test_the_sandbox_scores_as_the_node_does():
    """Every dataset of the paper's mix and the CPU recipe's, right and wrong answers (one of the paper's datasets
    prints while it builds: the replies must not mix with it)."""
    sandbox = ScoringSandbox()
    answers = ["<answer>P</answer>", "<answer>[[0, 1]]</answer>", "<answer>exit(3)</answer>", "no answer", "12"]
    try:
        for mix in (PRESETS["paper"], PRESETS["cpu-learn"]):
            for name, entry in mix.datasets.items():
                for index in range(2):
                    task = regenerate(TaskSpec.make(name, entry["config"], 5, index))
                    responses = answers + [f"<answer>{task.answer}</answer>"]
                    assert sandbox.score(task.spec.to_wire(), responses, 30.0) == score_responses(task, responses)
        assert sandbox.kills == 0
    finally:
        sandbox.close()


def test_a_scorer_that_runs_too_long_is_stopped_and_the_next_group_scores():
    sandbox = ScoringSandbox()
    task = logic_task()
    honest = ["<answer>P</answer>", f"<answer>{task.answer}</answer>"]
    try:
        assert sandbox.score(task.spec.to_wire(), honest, 10.0) is not None  # the child is up
        started = time.monotonic()
        assert sandbox.score(task.spec.to_wire(), [BOMB, "x"], 1.0) is None
        assert time.monotonic() - started < 3.0 and sandbox.kills == 1
        assert sandbox.score(task.spec.to_wire(), honest, 10.0) == score_responses(task, honest)  # a fresh child
    finally:
        sandbox.close()


def test_close_ends_a_scoring_in_progress_at_once():
    sandbox = ScoringSandbox()
    task = logic_task()
    sandbox.score(task.spec.to_wire(), ["x", "y"], 10.0)
    result: list = []
    worker = threading.Thread(target=lambda: result.append(sandbox.score(task.spec.to_wire(), [BOMB, "x"], 60.0)))
    worker.start()
    time.sleep(0.5)
    started = time.monotonic()
    sandbox.close()
    worker.join(timeout=10)
    assert not worker.is_alive() and result == [None] and time.monotonic() - started < 2.0


def test_a_batch_with_a_costly_answer_loses_that_group_only_and_costs_its_publisher_nothing():
    """A real signed batch for the paper's mix: the group whose completion would take the scorer minutes (and
    gigabytes) is dropped as `unscored` after its time limit; the publisher's honest group is accepted."""
    me, peer = Identity.generate(), Identity.generate()
    v = Verifier(me.public_key_bytes, PRESETS["paper"], VerifyConfig(swarm="s", score_time_s=1.0), ExchangeStats())
    v.sandbox = ScoringSandbox()
    bomb_task, honest_task = logic_task(0), logic_task(1)
    honest = [f"<answer>{honest_task.answer}</answer>", "<answer>P</answer>"]
    groups = [
        WireGroup(TaskSpecWire(**bomb_task.spec.to_wire()), [BOMB, "<answer>P</answer>"], [0.0, 0.0]),
        WireGroup(TaskSpecWire(**honest_task.spec.to_wire()), honest, score_responses(honest_task, honest)),
    ]
    batch = RolloutBatch(WIRE_VERSION, "s", 3, peer.public_key_bytes, time.time(), "m", groups)
    try:
        started = time.monotonic()
        got = v.verify(encode_signed(batch, peer))
        assert time.monotonic() - started < 5.0
    finally:
        v.sandbox.close()
    assert [g.task.spec for g in got] == [honest_task.spec]
    assert v.stats.rejected[peer.public_key_hex] == {"unscored": 1}
    assert v.reputation.score(peer.public_key_bytes) >= 0


def test_the_child_dies_with_a_node_killed_outright(tmp_path):
    """SIGKILL (or the OOM killer) gives the node no chance to stop its scorer: the child goes with it."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import REPO

    script = (
        "import sys\n"
        "from node.learn.tasks import TaskSpec, regenerate\n"
        "from node.swarm.sandbox import ScoringSandbox\n"
        "s = ScoringSandbox()\n"
        "t = regenerate(TaskSpec.make('basic_arithmetic', {}, 0, 0))\n"
        "s.score(t.spec.to_wire(), ['1', '2'], 30.0)\n"
        "print(s._proc.pid, flush=True)\n"
        "logic = regenerate(TaskSpec.make('propositional_logic', {}, 0, 0))\n"
        f"s.score(logic.spec.to_wire(), [{BOMB!r}], 600.0)\n"  # busy: stdin's end alone would not stop it
    )
    node = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, cwd=REPO)
    child = int(node.stdout.readline())
    time.sleep(0.5)  # scoring the costly answer
    os.kill(child, 0)  # alive
    node.send_signal(signal.SIGKILL)
    node.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the scoring child {child} outlived its node")


def test_near_the_rounds_time_limit_a_group_gets_what_is_left_and_is_over_budget_past_it():
    """A group begun 1.5 s before the round's hard limit may score for 1.5 s, not its own 6 s; one that needs
    longer counts over_budget (offered again with its batch), not unscored. Far from the limit: its full time."""
    from node.swarm.verify import MIN_SCORE_TIME_S

    class Slow:
        limits: list[float] = []

        def score(self, spec, responses, time_limit_s):
            self.limits.append(time_limit_s)
            return None

    me, peer = Identity.generate(), Identity.generate()
    v = Verifier(me.public_key_bytes, PRESETS["paper"], VerifyConfig(swarm="s"), ExchangeStats())
    v.sandbox = Slow()
    v.clock = lambda: 100.0
    task = logic_task(2)
    completions = ["<answer>P</answer>", "x"]

    def batch(round_):
        wire = WireGroup(TaskSpecWire(**task.spec.to_wire()), completions, score_responses(task, completions))
        return encode_signed(
            RolloutBatch(WIRE_VERSION, "s", round_, peer.public_key_bytes, time.time(), "m", [wire]), peer
        )

    v.time_limit_at = 101.5
    assert v.verify(batch(3)) == []
    v.time_limit_at = 100.2
    assert v.verify(batch(4)) == []
    v.time_limit_at = 1000.0
    assert v.verify(batch(5)) == []
    assert Slow.limits == [1.5, MIN_SCORE_TIME_S, 6.0]
    assert v.stats.rejected[peer.public_key_hex] == {"over_budget": 2, "unscored": 1}

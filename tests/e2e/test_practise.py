"""Practise one thing, learn from all (--practise), with whole `sapo-node` processes: two real peers over a real
DHT on 127.0.0.1, each sampling its own tasks from another part, each training on the other's verified groups;
and a value the mix cannot take, refused at start-up in one line.

Short on purpose: the tiny random model and the smoke datasets (partial credit even for random text, so groups
carry a signal), stopped with SIGTERM once both peers trained on each other's groups.
"""

from __future__ import annotations

import pytest

from conftest import live_metrics as rounds
from conftest import prefix_of, reasons, run_node, start_bootstrap, start_node, stop_all, wait_for
from helpers_learning import check_records

pytestmark = pytest.mark.timeout(600)

PRACTISED, OTHER = "propositional_logic", "palindrome_generation"  # the smoke mix, in two parts
OUTSIDE = "basic_arithmetic"  # in B's mix, not in A's: A must refuse it


def trained_datasets(records: list[dict], source: str) -> list[str]:
    """The dataset of every external group from `source` trained on (ids are publisher/dataset/seed/index)."""
    return [g.split("/")[1] for r in records for g in r["external_groups"] if g.split("/")[0] == source]


@pytest.mark.slow
def test_specialists_train_on_each_others_part_and_refuse_what_lies_outside_the_mix(tmp_path):
    """A practises propositional_logic of the smoke mix, with the mix's held-out set evaluated at round 0. B's
    mix is smoke's two datasets (same configs) plus basic_arithmetic, and it practises palindrome_generation and
    basic_arithmetic. A trains on B's palindrome_generation groups (outside its own part, inside its mix) and
    refuses B's basic_arithmetic ones (outside its whole mix); B trains on A's groups, all propositional_logic."""
    swarm = "e2e-practise"
    boot, maddrs = start_bootstrap(tmp_path, swarm)
    a_dir, b_dir = tmp_path / "a", tmp_path / "b"
    nodes = [
        start_node(a_dir, maddrs, swarm, "--practise", PRACTISED, "--eval-every", "100000", "--eval-size", "4", seed=1),
        start_node(
            b_dir,
            maddrs,
            swarm,
            "--tasks",
            f"{PRACTISED},{OTHER},{OUTSIDE}",
            "--practise",
            f"{OTHER},{OUTSIDE}",
            seed=2,
        ),
    ]
    try:
        ka, kb = prefix_of(a_dir), prefix_of(b_dir)

        def both_learned_from_the_other() -> bool:
            a, b = rounds(a_dir), rounds(b_dir)
            return bool(trained_datasets(a, kb) and trained_datasets(b, ka) and reasons(a).get("task_not_allowed"))

        wait_for(both_learned_from_the_other, nodes, 500, "each specialist training on the other's part")
        a, b = rounds(a_dir), rounds(b_dir)
        assert set(trained_datasets(a, kb)) == {OTHER}  # the part A does not practise, learned from B
        assert set(trained_datasets(b, ka)) == {PRACTISED}  # all A published: its own part only
        assert all(r["optimizer_steps"] > 0 for r in a if r["num_external"])
        assert set(reasons(a)) == {"task_not_allowed"}, reasons(a)  # B's basic_arithmetic groups, nothing else
        assert not reasons(b), reasons(b)  # A's groups lie inside B's mix
        check_records(a)
        check_records(b)
        first = a[0]  # evaluated after round 0, and the starting weights before it: the whole mix, in two parts
        assert set(first["eval_datasets"]) == {PRACTISED, OTHER}
        for prefix in ("eval", "start"):
            assert 0 <= first[f"{prefix}_accuracy_practised"] <= 1 and 0 <= first[f"{prefix}_accuracy_other"] <= 1
        assert "practising propositional_logic:1" in (a_dir / "node.log").read_text()
    finally:
        codes = stop_all(nodes)
        boot.stop()
    assert codes == [0, 0], [n.text()[-2000:] for n in nodes]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tasks", "smoke", "--practise", "chain_sum"], "--practise chain_sum: not in the task mix smoke"),
        (["--tasks", "smoke", "--practise", "no_such_dataset"], "--practise no_such_dataset: not in the task mix"),
        (["--practise", "chain_sum:-2"], "--practise needs a positive weight for chain_sum (got '-2')"),
    ],
)
def test_a_practise_the_mix_cannot_take_is_one_line_exit_2(tmp_path, args, message):
    done = run_node("--model", "tiny-random", *args, "--run-dir", str(tmp_path / "r"))
    assert done.returncode == 2, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if line.startswith("sapo-node: error:")]
    assert len(lines) == 1 and message in lines[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "loading model" not in done.stderr

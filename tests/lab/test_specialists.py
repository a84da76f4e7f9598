"""The specialists experiment's rules (scripts/research/specialists.py), fixed before its cells ran: the parts
the task survey admits are exactly cpu-parts, and the transfer pilot's pick keeps learnable parts that the
others do not teach anyway."""

import json
from pathlib import Path

from node.learn.tasks import PART_CONFIGS, resolve_mix
from scripts.research import specialists as spec

REPO = Path(__file__).resolve().parents[2]


def test_the_survey_rule_admits_exactly_the_parts_of_cpu_parts():
    cells = json.loads((REPO / spec.SURVEY).read_text())
    assert sorted(spec.candidates(cells)) == sorted(PART_CONFIGS) == sorted(resolve_mix("cpu-parts").datasets)
    assert spec.main(["candidates", "--survey", str(REPO / spec.SURVEY)]) == 0


def matrix(diagonal: dict[str, float], off: float = 0.0, **pairs: float) -> dict:
    """A transfer matrix: each part's own gain, `off` elsewhere, and `a__b=x`: practising a gives x on b."""
    m = {i: {j: (diagonal[i] if i == j else off) for j in diagonal} for i in diagonal}
    for key, value in pairs.items():
        i, j = key.split("__")
        m[i][j] = value
    return m


def test_a_part_the_others_teach_anyway_goes_one_at_a_time_and_peers_take_the_rest_in_turn():
    own = {"a": 0.3, "b": 0.3, "c": 0.2, "d": 0.05}
    picked = spec.pick_parts(matrix(own, a__b=0.3, b__a=0.28))  # a and b teach each other; d is not learnable
    assert picked["learnable"] == ["a", "b", "c"]
    assert picked["kept"] == ["a", "c"] and [d["part"] for d in picked["dropped"]] == ["b"]
    assert picked["peers"] == {0: "a", 1: "c", 2: "a", 3: "c", 4: "a"}


def test_at_most_five_parts_stay_and_nothing_learnable_gives_no_design():
    six = {p: 0.2 for p in "abcdef"}
    picked = spec.pick_parts(matrix(six, off=0.01, f__e=0.09))
    assert len(picked["kept"]) == 5 and "e" not in picked["kept"]  # the most taught by the others
    assert list(picked["peers"].values()) == picked["kept"]
    none = spec.pick_parts(matrix({"a": 0.05, "b": 0.0}))
    assert none["kept"] == [] and none["peers"] == {}


def test_the_transfer_matrix_reads_each_specialists_gains_from_committed_cells(tmp_path):
    parts = list(PART_CONFIGS)
    run = tmp_path / spec.PILOT_ARM / "seed100"
    for p, part in enumerate(parts):
        (run / f"peer{p}").mkdir(parents=True)
        start = {"round": 0, "start_accuracy": 0.1, **{f"start_accuracy/{j}": 0.1 for j in parts}}
        last = {
            "round": 19,
            "eval_accuracy": 0.2,
            **{f"eval_accuracy/{j}": 0.1 + (0.3 if j == part else 0.0) for j in parts},
        }
        (run / f"peer{p}" / "metrics.jsonl").write_text(json.dumps(start) + "\n" + json.dumps(last) + "\n")
    (run / "run.json").write_text("{}")
    m, seeds = spec.transfer(tmp_path, parts, spec.PILOT_SEEDS)
    assert seeds == ["100"]
    assert all(abs(m[i][j] - (0.3 if i == j else 0.0)) < 1e-9 for i in parts for j in parts)
    assert spec.pick_parts(m)["kept"] == parts[:5]

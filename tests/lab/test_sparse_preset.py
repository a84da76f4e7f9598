"""The sparse-signal preset's rule (node/lab/sparse_preset.py): fixed bounds, first admitted candidate wins, and
the `cpu-sparse` preset is the candidate the committed measurement chose."""

import json
from pathlib import Path

import pytest

from node.lab.sparse_preset import CANDIDATES, SparseRule, choose, main
from node.learn.tasks import PRESETS

DATA = Path(__file__).parents[2] / "docs/data/offpolicy/preset.jsonl"


def record(name, **kw):
    rec = {
        "candidate": name,
        "signal_frac": 0.10,
        "baseline": 0.05,
        "pass1": 0.05,
        "median_tokens": 7,
        "has_unseen": True,
    }
    rec.update(kw)
    return rec


@pytest.mark.parametrize(
    "field,value",
    [
        ("signal_frac", 0.049),
        ("signal_frac", 0.251),
        ("baseline", 0.16),
        ("pass1", 0.31),
        ("median_tokens", 17),
        ("has_unseen", False),
    ],
)
def test_each_bound_can_refuse_a_candidate(field, value):
    assert SparseRule().failures(record("two-digit")) == []
    assert len(SparseRule().failures(record("two-digit", **{field: value}))) == 1


def test_the_first_admitted_candidate_in_the_written_order_wins():
    names = list(CANDIDATES)
    assert choose([record(names[2]), record(names[1])]) == names[1]
    assert choose([record(names[0], signal_frac=0.01), record(names[2])]) == names[2]
    assert choose([record(n, baseline=0.5) for n in names]) is None


def test_cpu_sparse_is_the_candidate_the_committed_measurement_chose():
    records = [json.loads(line) for line in DATA.read_text().splitlines() if line.strip()]
    chosen = choose(records)
    assert chosen is not None
    assert PRESETS["cpu-sparse"].to_dict() == {**CANDIDATES[chosen].to_dict(), "name": "cpu-sparse"}


def test_the_tool_measures_a_candidate_end_to_end(tmp_path, capsys):
    out = tmp_path / "preset.jsonl"
    main(
        [
            "--model",
            "tiny-random",
            "--candidates",
            "three-term",
            "--groups",
            "3",
            "--generations",
            "2",
            "--eval-size",
            "4",
            "--engine",
            "torch",
            "--out",
            str(out),
        ]
    )
    rec = json.loads(out.read_text())
    assert rec["candidate"] == "three-term" and rec["groups"] == 3 and rec["eval_size"] == 4
    assert 0.0 <= rec["signal_frac"] <= 1.0 and rec["rule_failures"] and rec["engine"] == "torch"
    assert "chosen: None" in capsys.readouterr().out  # a random model solves nothing: no signal, refused

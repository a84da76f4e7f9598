"""`sapo-report` on bad input: a malformed run.json, wrong-typed or out-of-range metrics fields, a FIFO, an
unwritable --out, rewards never logged, an agent cut short. Each is skipped and counted, or one clear line on
stderr, never a traceback, a hang or a run silently filed elsewhere (small synthetic experiments)."""

import json
import os
import threading
import warnings

import pytest

from node.lab.report import main
from node.lab.runs import load_runs, run_engines

CONFIGS = {"4/0": 0.1, "2/2": 0.3}  # config -> reward at round 0
SEEDS = (0, 1)
PEERS = (0, 1)
ROUNDS = 4


def write_exp(root):
    """EXP/<config>/seed<k>/{run.json, peer<p>/metrics.jsonl}: 2 configs × 2 seeds × 2 peers × 4 rounds, held-out
    evaluations at the first and last round."""
    for cfg, base in CONFIGS.items():
        i, j = map(int, cfg.split("/"))
        for s in SEEDS:
            rd = root / cfg.replace("/", "-") / f"seed{s}"
            rd.mkdir(parents=True)
            meta = {"config_name": cfg, "num_local": i, "num_external": j, "ij_policy": "fixed", "seed": s}
            (rd / "run.json").write_text(json.dumps({**meta, "peers": len(PEERS), "rounds": ROUNDS, "model": "m"}))
            for p in PEERS:
                lines = []
                for t in range(ROUNDS):
                    rec = {"round": t, "reward_mean": base + 0.05 * t + 0.01 * s, "num_local": i, "num_external": j}
                    if t in (0, ROUNDS - 1):
                        rec.update(
                            eval_accuracy=base + 0.1 * t + 0.01 * p,
                            eval_baseline=0.05,
                            eval_distinct_answers=0.4,
                            eval_distinct_gold=0.5,
                        )
                    lines.append(json.dumps(rec))
                (rd / f"peer{p}").mkdir()
                (rd / f"peer{p}" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root


def report(exp, out, *args):
    """(exit code, summary.json or None, report.md or None) of sapo-report over `exp`."""
    rc = main([str(exp), "--out", str(out), "--bootstrap", "50", *args])
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else None
    md = (out / "report.md").read_text() if (out / "report.md").exists() else None
    return rc, summary, md


def set_line(path, index, **fields):
    """Rewrite line `index` of a metrics.jsonl with `fields` changed."""
    lines = path.read_text().splitlines()
    lines[index] = json.dumps({**json.loads(lines[index]), **fields})
    path.write_text("\n".join(lines) + "\n")


def edit_run_json(path, **fields):
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


BAD_RUN_JSON = {
    "truncated": lambda p: p.write_text(p.read_text()[:25]),
    "not an object": lambda p: p.write_text("[1, 2]"),
    "a directory": lambda p: (p.unlink(), p.mkdir()),
    "a fifo": lambda p: (p.unlink(), os.mkfifo(p)),
    "rounds a list": lambda p: edit_run_json(p, rounds=[1]),
    "rounds a string": lambda p: edit_run_json(p, rounds="abc"),
    "negative rounds": lambda p: edit_run_json(p, rounds=-3),
    "config_name a number": lambda p: edit_run_json(p, config_name=7),
    "seed a list": lambda p: edit_run_json(p, seed=[1]),
    "num_external a string": lambda p: edit_run_json(p, num_external="2"),
    "num_local a bool": lambda p: edit_run_json(p, num_local=True),
    "models not strings": lambda p: edit_run_json(p, models=[1, 2]),
}


@pytest.mark.parametrize("damage", BAD_RUN_JSON.values(), ids=BAD_RUN_JSON.keys())
def test_a_malformed_run_json_leaves_its_run_out_with_a_warning_naming_it(tmp_path, capsys, damage):
    exp = write_exp(tmp_path / "exp")
    bad = exp / "2-2" / "seed1" / "run.json"
    damage(bad)
    rc, summary, md = report(exp, tmp_path / "out")
    err = capsys.readouterr().err
    assert rc == 0
    # not filed under the directory names' configuration "2-2", nor under 2/2 with a wrong field
    assert summary["configs"] == ["4/0", "2/2"]
    assert summary["per_config"]["2/2"]["seeds"] == ["0"]
    assert [line for line in err.splitlines() if str(bad) in line] == [
        f"sapo-report: warning: {bad}: {summary['unreadable_files'][str(bad)]}"
    ]
    assert "run.json" in summary["unreadable_files"][str(bad)]
    assert "its run is left out (2 metrics files)" in summary["unreadable_files"][str(bad)]
    assert f"- `{bad}`: " in md.split("## Data quality")[1]
    assert "Traceback" not in err
    assert not any("no valid metrics" in w for w in summary["warnings"])


def test_a_missing_run_json_still_falls_back_to_the_directory_names(tmp_path, capsys):
    exp = write_exp(tmp_path / "exp")
    (exp / "2-2" / "seed1" / "run.json").unlink()
    (exp / "2-2" / "seed0" / "run.json").write_text("{}")  # no fields: the directory names too
    edit_run_json(exp / "4-0" / "seed1" / "run.json", seed=None)  # null: absent, the directory says
    (exp / "4-0" / "seed0" / "run.json").write_text('{"config_name": ')  # malformed: left out
    runs = {(r.config, r.seed) for r in load_runs([exp]) if r.peers}
    assert runs == {("2-2", "0"), ("2-2", "1"), ("4/0", "1")}
    rc, summary, _ = report(exp, tmp_path / "out")
    assert rc == 0 and list(summary["unreadable_files"]) == [str(exp / "4-0" / "seed0" / "run.json")]
    assert "warning" in capsys.readouterr().err


@pytest.mark.parametrize(
    "fields",
    [{"eval_accuracy": "abc"}, {"eval_baseline": "abc"}, {"eval_distinct_answers": [1]}, {"eval_distinct_gold": {}}],
    ids=["accuracy", "baseline", "distinct", "gold"],
)
def test_wrong_typed_evaluation_fields_make_a_bad_line_not_a_traceback(tmp_path, capsys, fields):
    exp = write_exp(tmp_path / "exp")
    metrics = exp / "2-2" / "seed0" / "peer1" / "metrics.jsonl"
    set_line(metrics, ROUNDS - 1, **fields)  # its last evaluation
    peer = next(p for r in load_runs([exp]) if (r.config, r.seed) == ("2/2", "0") for p in r.peers if p.peer == "peer1")
    assert peer.final_eval is not None and peer.final_eval.round == 0  # the one before
    rc, summary, _ = report(exp, tmp_path / "out")
    assert rc == 0
    assert summary["skipped_lines"] == 1 and summary["skipped_by_file"] == {str(metrics): 1}
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("round_", [1e20, -5, 10**10, 2**70], ids=["1e20", "negative", "1e10", "2**70"])
def test_a_round_outside_the_sane_range_is_a_bad_line(tmp_path, capsys, round_):
    exp = write_exp(tmp_path / "exp")
    metrics = exp / "4-0" / "seed1" / "peer0" / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + json.dumps({"round": round_, "reward_mean": 0.5}) + "\n")
    rc, summary, _ = report(exp, tmp_path / "out")
    assert rc == 0 and summary["skipped_by_file"] == {str(metrics): 1}
    assert summary["per_config"]["4/0"]["rounds"] == [ROUNDS]


@pytest.mark.parametrize("rounds", [[1], "abc"])
def test_focus_peer_with_a_wrong_typed_rounds_in_run_json(tmp_path, capsys, rounds):
    exp = write_exp(tmp_path / "exp")
    bad = exp / "2-2" / "seed0" / "run.json"
    edit_run_json(bad, rounds=rounds)
    rc, summary, _ = report(exp, tmp_path / "out", "--focus-peer", "0")
    err = capsys.readouterr().err
    assert rc == 0, err
    assert str(bad) in err and "rounds is" in err
    assert summary["focus"]["per_config"]["2/2"]["rounds_to_half_by_seed"] == {"1": 0}


def test_the_default_out_of_a_file_input_is_beside_it(tmp_path, capsys):
    exp = write_exp(tmp_path / "exp")
    metrics = exp / "4-0" / "seed0" / "peer0" / "metrics.jsonl"
    assert main([str(metrics), "--bootstrap", "50"]) == 0
    assert (metrics.parent / "report" / "report.md").is_file()


@pytest.mark.parametrize("where", ["an existing file", "below a file"])
def test_an_out_that_cannot_be_written_is_one_line_and_exit_1(tmp_path, capsys, where):
    exp = write_exp(tmp_path / "exp")
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" if where == "an existing file" else tmp_path / "afile" / "report"
    assert main([str(exp), "--out", str(out), "--bootstrap", "50"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"sapo-report: cannot write the report to {out}: ")


def finishes(fn, fifos, timeout=30.0):
    """Whether fn() returns within `timeout` s; a call blocked on one of the `fifos` is released (a writer opens
    and closes it) so that a failing test does not hang."""
    result = {}
    t = threading.Thread(target=lambda: result.update(value=fn()), daemon=True)
    t.start()
    t.join(timeout)
    blocked = t.is_alive()
    if blocked:
        for f in fifos:
            try:
                os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        t.join(timeout)
    return not blocked, result.get("value")


def test_a_fifo_named_metrics_jsonl_is_left_out_not_read(tmp_path, capsys):
    exp = write_exp(tmp_path / "exp")
    fifo = exp / "2-2" / "seed0" / "peer1" / "metrics.jsonl"
    fifo.unlink()
    os.mkfifo(fifo)
    done, rc = finishes(lambda: main([str(exp), "--out", str(tmp_path / "out"), "--bootstrap", "50"]), [fifo])
    assert done and rc == 0
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["unreadable_files"] == {str(fifo): "not a regular file"}
    assert f"sapo-report: warning: {fifo}: not a regular file" in capsys.readouterr().err
    done, engines = finishes(lambda: run_engines(exp / "2-2" / "seed0"), [fifo])  # sapo-experiment's reader too
    assert done and engines is not None
    done, rc = finishes(lambda: main([str(fifo)]), [fifo])  # given as the input itself
    assert done and rc == 2


def test_no_numpy_warning_when_no_round_logged_a_reward(tmp_path, capsys):
    root = tmp_path / "swarm"
    for p in PEERS:
        (root / f"peer{p}").mkdir(parents=True)
        lines = [json.dumps({"round": t, "reward_mean": None}) for t in range(ROUNDS)]
        (root / f"peer{p}" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        rc, _, md = report(root, tmp_path / "out")
    assert rc == 0
    assert f"| seed 0 | peer0 | {ROUNDS} | n/a | n/a | n/a |" in md


def test_an_agent_cut_short_is_named_and_the_rounds_column_shows_the_range(tmp_path, capsys):
    exp = write_exp(tmp_path / "exp")
    metrics = exp / "2-2" / "seed1" / "peer0" / "metrics.jsonl"
    metrics.write_text("\n".join(metrics.read_text().splitlines()[:2]) + "\n")  # cut at a line boundary
    rc, summary, md = report(exp, tmp_path / "out")
    assert rc == 0 and summary["skipped_lines"] == 0
    short = [w for w in summary["warnings"] if "fewer rounds" in w]
    assert len(short) == 1 and short[0].startswith(
        f"2/2 seed 1: peer0 (2) logged fewer rounds than the run's most ({ROUNDS})"
    )
    assert f"| 2/2 | fixed | 2 | 2 | 2–{ROUNDS}, {ROUNDS} |" in md
    assert f"| 4/0 | fixed | 2 | 2 | {ROUNDS} |" in md
    assert f"warning: {short[0]}" in capsys.readouterr().out

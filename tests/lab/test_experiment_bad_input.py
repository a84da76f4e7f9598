"""`sapo-experiment` on bad input: a wrong flag is one line naming it, exit 2, before anything runs or is
written; a run that failed is recorded and reported as failed (exit 1), never as complete; what a peer said
before it failed is kept; an existing file is never overwritten."""

import json

import pytest

from conftest import run_python
from node.lab.experiment import CONSOLE_FILE, build_parser, dht_flags, main, plan_runs, run_flags
from node.lab.run_record import RunJsonError, write_run_json
from node.lab.runspec import (
    PEER_RESERVED,
    SET_BY_EXPERIMENT,
    RunSpec,
    check_not_set_by_experiment,
    label_problem,
)
from node.ops.config import build_parser as node_parser

TINY = ["--model", "tiny-random", "--tasks", "smoke", "--generations", "4", "--max-new-tokens", "8", "--threads", "1"]
FAILS_AT_ITS_START = ["--model", "/nonexistent", "--peers", "1", "--rounds", "1", "--seeds", "0", "--threads", "1"]


@pytest.fixture(autouse=True)
def nothing_runs(monkeypatch):
    """main() in this process starts no run (a flag let through fails the test here, not after an hour of
    training) and installs no Ctrl-C handler."""

    def started(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr("node.lab.experiment.run_dht", started)
    monkeypatch.setattr("node.lab.experiment.run_memory", started)
    monkeypatch.setattr("signal.signal", lambda *a: None)


@pytest.mark.parametrize(
    "argv, message",
    [
        # what every peer gets: sapo-node's own checks on exactly its flags (node/ops/config.py validate)
        (["--generations", "-3"], "--generations must be >= 1 (got -3)"),
        (["--generations", "1"], "--generations must be >= 2"),
        (["--generations", "0"], "--generations must be >= 1 (got 0)"),  # not the preset's G in disguise
        (["--eval-size", "0"], "--eval-size must be >= 1 when --eval-every is on"),
        (["--eval-every", "-1"], "--eval-every must be >= 0 (got -1)"),
        (["--threads", "-1"], "--threads must be >= 0 (got -1)"),
        (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 0 (got -1)"),
        (["--lora-alpha", "0"], "--lora-alpha must be > 0"),  # refused even where no peer gets it (no LoRA)
        (["--lora-alpha", "nan"], "--lora-alpha must be a finite number"),
        (["--mode", "memory", "--generations", "-3"], "--generations must be >= 1 (got -3)"),
        (["--peer-arg", "1:--eval-size=0"], "--peer-arg 1: --eval-size must be >= 1"),
        (["--tasks", "no_such_dataset"], "--tasks: unknown reasoning-gym dataset 'no_such_dataset'"),
        # the experiment's own
        (["--seeds", "-1"], "--seeds must be in [0, "),
        (["--seeds", "0", str(2**63)], "--seeds must be in [0, "),
        (["--rounds", "0"], "--rounds must be >= 1 (got 0)"),
        (["--peers", "-1"], "--peers must be >= 1 (got -1)"),
        (["--peers", "0"], "--peers must be >= 1 (got 0)"),
        (["--label", ".."], "--label '..': names no directory inside --out"),
        (["--label", "."], "--label '.': names no directory inside --out"),
        # options sapo-experiment sets itself: refused, however spelt, not silently overridden
        (["--node-arg=--rounds=3"], "--node-arg: --rounds is set by sapo-experiment itself"),
        (["--node-arg=--roun=3"], "--node-arg: --rounds is set by sapo-experiment itself"),  # argparse's abbreviation
        (["--node-arg=--seed", "--node-arg=7"], "--node-arg: --seed is set by sapo-experiment itself"),
        (["--node-arg=--no-resume"], "--node-arg: --resume is set by sapo-experiment itself"),
        (
            ["--node-arg=--eval-every=5"],
            "--node-arg: --eval-every is set by sapo-experiment itself, not by a peer's flags (give --eval-every)",
        ),
        (
            ["--node-arg=--num-local=3"],
            "--node-arg: --num-local is set by sapo-experiment itself, not by a peer's flags (the preset sets it)",
        ),
        (["--peer-arg", "1:--run-dir=/elsewhere"], "--peer-arg 1: --run-dir is set by sapo-experiment itself"),
        (["--peer-arg", "0:--seed=5"], "--peer-arg 0: --seed is set by sapo-experiment itself"),
        (["--peer-arg", "1:--model=tiny-random"], "--peer-arg 1: --model is set by sapo-experiment itself"),
    ],
)
def test_a_bad_flag_is_one_line_exit_2_before_anything_is_written(tmp_path, capsys, argv, message):
    out = tmp_path / "exp"
    assert main(["2/2", "--rounds", "1", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("sapo-experiment: error: ")
    assert not out.exists()


def test_labels_stay_inside_out():
    assert label_problem("2/2 ftis") is None  # the documented form: its dir is 2-2_ftis
    assert label_problem("2/2 ../x") is None  # one dir, 2-2_.._x
    for bad in (".", "..", "a/../b", "..\\b", "a\nb"):
        assert label_problem(bad), bad


def test_every_option_the_experiment_sets_is_refused_from_node_args(tmp_path):
    """The refused set is what the peers really get: every option of RunSpec.node_args and the run's own flags."""
    spec = RunSpec("2/2", 0, 2, 2, 2, 4, "fixed", 1, "tiny-random", "smoke", 8, 1e-4, "dht", 1, lora_rank=2)
    root = tmp_path / "2-2" / "seed0"
    flags = spec.node_args(0, root / "peer0") + run_flags(spec, root) + dht_flags(["/ip4/127.0.0.1/tcp/1"])
    given = vars(node_parser().parse_known_args([*flags, "--resume"])[0])
    assert set(given) == set(SET_BY_EXPERIMENT)
    assert set(PEER_RESERVED) <= set(SET_BY_EXPERIMENT)
    for name in given:
        with pytest.raises(ValueError, match="is set by sapo-experiment itself"):
            check_not_set_by_experiment(["--" + name.replace("_", "-"), "1"], "--node-arg", tuple(SET_BY_EXPERIMENT))


def test_a_peer_keeps_its_own_learning_flags(tmp_path):
    """What --peer-arg is for (a veteran evaluating more often, from its adapter) still passes."""
    args = build_parser().parse_args(
        ["2/2", "--seeds", "0", "--out", str(tmp_path), "--peer-arg", "1:--eval-every=5", "--peer-arg", "1:--lr=1e-3"]
    )
    [(name, spec)] = plan_runs(args)
    assert name == "2/2" and spec.peer_args == {1: ["--eval-every=5", "--lr=1e-3"]}
    assert not any(tmp_path.iterdir())


def test_out_that_is_a_file(tmp_path, capsys):
    out = tmp_path / "notes.txt"
    out.write_text("mine")
    assert main(["2/2", "--rounds", "1", "--out", str(out)]) == 2
    assert f"--out {out}: not a directory" in capsys.readouterr().err
    assert out.read_text() == "mine"


@pytest.mark.parametrize(
    "content, message",
    [
        ('{"git_commits": 5}', "git_commits is not a list of commits"),
        ('{"git_commits": [1]}', "git_commits is not a list of commits"),
        ("[1, 2]", "not a run.json (a JSON object)"),
        ("{not json", "not a readable run.json"),
        (None, "not a run.json"),  # a directory where run.json belongs
    ],
)
def test_a_malformed_run_json_is_named_and_kept(tmp_path, capsys, content, message):
    run = tmp_path / "exp" / "2-2" / "seed0"
    run.mkdir(parents=True)
    path = run / "run.json"
    path.mkdir() if content is None else path.write_text(content)
    assert main(["2/2", "--rounds", "1", "--seeds", "0", "--out", str(tmp_path / "exp")]) == 2
    err = capsys.readouterr().err
    assert f"sapo-experiment: error: {path}: {message}" in err and err.count("\n") == 1, err
    assert path.is_dir() if content is None else path.read_text() == content
    assert sorted(p.name for p in run.iterdir()) == ["run.json"]  # not locked, not started

    if content is not None:  # nor does writing the status overwrite it
        spec = RunSpec("2/2", 0, 1, 2, 2, 4, "fixed", 1, "tiny-random", "smoke", 8, 1e-4, "dht", 1)
        with pytest.raises(RunJsonError, match="run.json"):
            write_run_json(path, spec, "running", {"git_commit": "abc"})
        assert path.read_text() == content


def test_a_failed_memory_mode_run_is_reported_failed(tmp_path):
    """A model that does not load: one line (the traceback kept in the run dir), run.json failed, exit 1, and no
    "all runs complete". Nothing trains: the run fails at its start."""
    exp = tmp_path / "exp"
    done = run_python(["-m", "node.lab.experiment", "2/2", "--mode", "memory", "--out", str(exp), *FAILS_AT_ITS_START])
    assert done.returncode == 1, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and "all runs complete" not in done.stderr
    run = exp / "2-2" / "seed0"
    assert "2/2 seed 0: ModelLoadError: --model '/nonexistent'" in done.stderr
    assert f"(the traceback is in {run / 'errors.log'})" in done.stderr
    assert "Traceback" in (run / "errors.log").read_text()
    assert done.stderr.strip().splitlines()[-1].startswith("sapo-experiment: error: 1 of 1 runs failed (2/2 seed 0)")
    assert json.loads((run / "run.json").read_text())["status"] == "failed"


@pytest.mark.slow
def test_a_failed_dht_peer_is_reported_with_what_it_said(tmp_path):
    """A peer process that exits at its start (its model does not load, before its node.log says why): its output is
    kept in peerP/console.log, the experiment's line quotes it and names the file, the run is failed, exit 1."""
    exp = tmp_path / "exp"
    done = run_python(["-m", "node.lab.experiment", "2/2", "--out", str(exp), *FAILS_AT_ITS_START], timeout=180)
    assert done.returncode == 1, done.stderr[-3000:]
    run = exp / "2-2" / "seed0"
    console = run / "peer0" / CONSOLE_FILE
    assert "sapo-node: error: --model '/nonexistent'" in console.read_text()
    assert "peer0 exited 1: sapo-node: error: --model '/nonexistent'" in done.stderr
    assert f"(its output: {console})" in done.stderr
    assert "all runs complete" not in done.stderr and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("sapo-experiment: error: 1 of 1 runs failed (2/2 seed 0)")
    assert json.loads((run / "run.json").read_text())["status"] == "failed"


def test_tiny_flags_still_plan(tmp_path):
    """The flags the end-to-end tests run with pass the up-front checks in both modes; nothing is written."""
    for mode in ("dht", "memory"):
        args = build_parser().parse_args(["4/0", "2/2", "--out", str(tmp_path), "--mode", mode, *TINY, "--peers", "2"])
        planned = [(name, spec.seed, spec.peers, spec.generations) for name, spec in plan_runs(args)]
        assert planned == [(name, seed, 2, 4) for name in ("4/0", "2/2") for seed in (0, 1, 2)]
    assert not any(tmp_path.iterdir())

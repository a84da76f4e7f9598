"""The cells of RESULTS section 8 (scripts/research/sharing_pays.py) and the resumable cell runner they share with the
recipe sweep (node/lab/cells.py)."""

import argparse
import json
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
from fake_cells import committed_cell

from node.lab.cells import (
    Cell,
    Deadline,
    cell_status,
    cell_time_left,
    clock_time,
    done_fraction,
    run_cells,
    unfinished,
)
from node.lab.experiment import build_parser
from node.lab.runspec import peer_plan
from node.learn.evaluate import HeldOutEval
from node.learn.tasks import resolve_mix
from node.ops import config
from node.ops.checkpoint import load_from
from scripts.research import sharing_pays as pays
from scripts.research.offpolicy_pick import PILOT_SEEDS


def cells_of(experiment, **kw):
    args = argparse.Namespace(
        experiment=experiment,
        arms=None,
        seeds=None,
        part="0/1",
        runs="runs/x",
        data="data",
        veterans=[f"vet{j}" for j in range(4)],
        engine="auto",
    )
    vars(args).update(kw)
    return pays.cells(args)


def parsed(cell: Cell):
    """The cell's command as sapo-experiment reads it, per-peer plan included (raises if it would refuse it)."""
    assert cell.command[1:3] == ["-m", "node.lab.experiment"]
    args = build_parser().parse_args(cell.command[3:])
    return args, peer_plan(args)


def test_newcomer_arms_share_the_newcomers_seed_and_start_veterans_from_their_adapters(monkeypatch):
    monkeypatch.setitem(config.RECIPES, "cpu", {**config.RECIPES["cpu"], "lr": 3e-4, "beta": 0.04})
    cells = cells_of("newcomer", seeds=[2, 5])
    assert [c.label for c in cells] == [
        "newcomer shares seed 2",
        "newcomer silo seed 2",
        "newcomer shares seed 5",
        "newcomer silo seed 5",
    ]
    shares, silo = (parsed(c) for c in cells[:2])
    for args, _ in (shares, silo):
        assert args.seeds == [2] and args.rounds == 30 and args.eval_every == 5 and args.mode == "memory"
        assert args.lr == 3e-4 and "--beta=0.04" in args.node_arg  # the recipe as it is when the cell runs
    (counts, _, flags), (silo_counts, _, silo_flags) = shares[1], silo[1]
    assert counts == {"2/2": 5} and silo_counts == {"4/0": 1} and silo_flags == {"4/0": {}}
    assert flags["2/2"] == {p: [f"--lora-init=vet{p - 1}", "--eval-every=10"] for p in range(1, 5)}  # peer 0: fresh
    assert cells[0].run_dir == Path("runs/x/newcomer/2-2/seed2") and cells[1].dest == Path("data/newcomer/4-0/seed2")
    adaptive = cells_of("newcomer", arms=["adaptive"], seeds=[0])[0]
    assert parsed(adaptive)[0].configs == ["usefulness"]


def test_families_and_veterans_cells_and_parts():
    fam = cells_of("families", part="1/2")
    assert [c.label.split()[-1] for c in fam] == ["1", "1", "3", "3", "5", "5", "7", "7"]  # whole seeds per part
    args, (counts, models, _) = parsed(fam[0])
    assert counts == {"2/2": 5} and models == ["default"] * 3 + ["gemma3-270m"] * 2
    vets = cells_of("veterans")
    assert [c.dest for c in vets] == [Path(f"data/newcomer-veterans/4-0/seed{j}") for j in range(4)]
    args, (counts, _, _) = parsed(vets[0])
    assert counts == {"4/0": 1} and args.rounds == 100 and args.keep_run_checkpoints
    # each veteran commits its run's round-99 weights (by name: never an earlier round) beside its metrics, and
    # those copies (beside the metrics, ignored by git) are the newcomer's default veterans
    assert [c.adapter for c in vets] == [c.run_dir / "peer0/checkpoints/round-000099" for c in vets]
    assert pays.veteran_dirs(Path("data")) == [c.dest / "adapter" for c in vets]
    assert all(c.adapter is None for c in fam)


def test_offpolicy_pilot_cells_run_each_external_loss_on_the_sparse_preset_under_its_own_name():
    cells = cells_of("offpolicy-pilot", seeds=[100])
    assert [c.label for c in cells] == [
        f"offpolicy-pilot {arm} seed 100" for arm in ("silo", "positive", "sapo", "ftis", "is")
    ]
    assert [c.run_dir.parent.name for c in cells] == ["4-0", "2-2_positive", "2-2_sapo", "2-2_ftis", "2-2_is"]
    assert cells[1].dest == Path("data/offpolicy-pilot/2-2_positive/seed100")
    for cell, loss in zip(cells, (None, "positive", "sapo", "ftis", "is")):
        args, (counts, _, _) = parsed(cell)
        assert args.tasks == "cpu-sparse" and cell.command.count("--tasks") == 1
        assert args.rounds == 30 and args.eval_every == 5 and list(counts.values()) == [5]
        assert (f"--external-loss={loss}" in args.node_arg) == (loss is not None)
        assert args.label == ("" if loss is None else f"2/2 {loss}")
    assert [c.label.split()[-1] for c in cells_of("offpolicy-pilot")][::5] == ["100", "101", "102"]


def test_specialists_pilot_cells_give_each_specialist_its_own_part_of_cpu_parts():
    from node.learn.tasks import PART_CONFIGS

    cells = cells_of("specialists-pilot")
    assert [c.label for c in cells] == [
        f"specialists-pilot {arm} seed {s}" for s in (100, 101) for arm in ("specialists", "generalists")
    ]
    assert [c.run_dir.parent.name for c in cells[:2]] == ["4-0_specialists", "4-0_generalists"]
    for cell in cells:
        args, (counts, _, _) = parsed(cell)
        assert args.tasks == "cpu-parts" and args.rounds == 20 and args.eval_size == 192
        assert list(counts.values()) == [6] and args.eval_engine == "torch" and args.eval_every == 100
        assert "--no-eval-round0" in args.node_arg
    specialists = [a for a in cells[0].command if a.startswith(tuple(f"{p}:--practise=" for p in range(6)))]
    assert specialists == [f"{p}:--practise={part}" for p, part in enumerate(PART_CONFIGS)]
    assert not any("--practise" in a for a in cells[1].command)


def test_offpolicy_confirmatory_cells_take_the_pilots_pick_over_60_rounds_with_the_written_evaluations(tmp_path):
    pilot = tmp_path / "data" / "offpolicy-pilot"
    gains = {"sapo": 0.05, "positive": 0.01, "ftis": 0.03, "is": 0.02}
    for seed in PILOT_SEEDS[:2]:
        committed_cell(pilot, "4/0", seed, [0.1, 0.1])
        for rule, gain in gains.items():
            committed_cell(pilot, f"2/2 {rule}", seed, [0.1 + gain, 0.1 + gain])
    with pytest.raises(ValueError, match="not finished"):  # seed 102 missing: no arms, no cells
        cells_of("offpolicy-confirm", data=str(tmp_path / "data"))
    with pytest.raises(ValueError, match="not finished"):  # nor a loss named before the pick
        cells_of("offpolicy-confirm", data=str(tmp_path / "data"), arms=["silo", "ftis"])
    early = cells_of("offpolicy-confirm", data=str(tmp_path / "data"), arms=["silo", "sapo"], seeds=[0])
    assert [c.label for c in early] == ["offpolicy-confirm silo seed 0", "offpolicy-confirm sapo seed 0"]
    for rule, gain in {"silo": 0.0, **gains}.items():
        committed_cell(pilot, "4/0" if rule == "silo" else f"2/2 {rule}", PILOT_SEEDS[2], [0.1 + gain, 0.1 + gain])
    with pytest.raises(ValueError, match="not is"):  # the pick is ftis: no other loss runs
        cells_of("offpolicy-confirm", data=str(tmp_path / "data"), arms=["is"])
    cells = cells_of("offpolicy-confirm", data=str(tmp_path / "data"), part="1/2")
    assert [c.label for c in cells[:3]] == [f"offpolicy-confirm {arm} seed 1" for arm in ("silo", "ftis", "sapo")]
    assert [int(c.label.split()[-1]) for c in cells] == [1, 1, 1, 3, 3, 3, 5, 5, 5, 7, 7, 7]  # whole seeds
    assert cells[1].dest == tmp_path / "data/offpolicy-confirm/2-2_ftis/seed1"
    for cell in cells[:3]:
        args, (counts, _, _) = parsed(cell)
        assert args.tasks == "cpu-sparse" and args.rounds == 60 and list(counts.values()) == [5]
        assert args.eval_engine == "torch" and args.eval_size == 128
        node = config.load_config(
            ["--rounds", str(args.rounds), "--eval-every", str(args.eval_every), *args.node_arg], {}
        )
        schedule = HeldOutEval(resolve_mix("cpu-sparse"), 128, node.eval_every, node.rounds, at=node.eval_rounds)
        assert [r for r in range(60) if schedule.due(r)] == [0, 10, 20, 30, 40, 50, 59]
        assert [r for r in range(60) if schedule.due(r) and schedule.unseen_due(r)] == [0, 20, 40, 59]


def test_confirmatory_cells_count_only_when_sampled_by_the_wheel_and_decoded_by_torch(tmp_path, monkeypatch):
    wheel, source = "llama: ik-llama-cpp-python 0.1.5 (wheel)", "llama: llama-cpp-python 0.3.36 (built from source)"
    ok = {"rollout_engines": [wheel], "evaluators": ["torch"]}
    assert pays.wheel_and_torch(ok) == []
    for engines in ([source], ["torch"], [wheel, "unrecorded"], None):  # a source build, a fallback, unnamed
        assert "not the llama.cpp wheel" in " ".join(pays.wheel_and_torch({**ok, "rollout_engines": engines}))
    assert "not torch" in " ".join(pays.wheel_and_torch({**ok, "evaluators": ["llama"]}))
    (tmp_path / "run.json").write_text(json.dumps({**ok, "rollout_engines": [source], "status": "complete"}))
    assert unfinished(tmp_path) == [] and unfinished(tmp_path, pays.wheel_and_torch) != []  # not copied
    confirm = cells_of("offpolicy-confirm", arms=["silo"], seeds=[0])[0]
    assert confirm.check is pays.wheel_and_torch and cells_of("offpolicy-pilot", seeds=[100])[0].check is None
    # before the pilot's pick, naming its loss ends the command (status falls back to silo and sapo)
    monkeypatch.setattr(sys, "argv", ["sharing_pays", "run", "--experiment", "offpolicy-confirm", "--arms", "is"])
    monkeypatch.setattr(pays, "REPO", tmp_path)  # its docs/data has no pilot
    monkeypatch.chdir(tmp_path)  # main moves to REPO: the test's own directory comes back afterwards
    assert pays.main() == 2


def test_validation_cells_run_the_recipe_at_both_configurations_on_every_seed(monkeypatch):
    monkeypatch.setitem(config.RECIPES, "cpu", {**config.RECIPES["cpu"], "lr": 5e-5})
    cells = cells_of("validation", part="0/2")
    assert [c.label for c in cells][:2] == ["validation shares seed 0", "validation silo seed 0"]
    assert [int(c.label.split()[-1]) for c in cells] == [0, 0, 2, 2, 4, 4, 6, 6]
    for cell, config_name in zip(cells[:2], ("2/2", "4/0")):
        args, (counts, _, flags) = parsed(cell)
        assert counts == {config_name: 5} and flags == {config_name: {}}  # 5 fresh peers, no veteran
        assert args.rounds == 30 and args.eval_every == 10 and args.eval_size == 128 and args.lr == 5e-5
        assert cell.dest == Path(f"data/recipe-validation/{config_name.replace('/', '-')}/seed0")


def fake_cell(tmp_path, name, code="", adapter=False) -> Cell:
    """A command that writes what a finished sapo-experiment cell leaves (and counts its runs)."""
    run_dir = tmp_path / "runs" / name
    meta = json.dumps({"status": "complete", "peers": 1, "rounds": 1, "eval_every": 0})
    script = (
        f"import pathlib; d = pathlib.Path({str(run_dir)!r}); (d / 'peer0').mkdir(parents=True, "
        f"exist_ok=True); (d / 'run.json').write_text({meta!r}); (d / 'peer0' / 'metrics.jsonl')"
        f".write_text('{{\"round\": 0}}'); (d / 'peer0' / 'big.pt').write_text('x'); "
        f"c = d / 'count'; c.write_text(str(int(c.read_text()) + 1 if c.exists() else 1))\n{code}\n"
    )
    if adapter:  # the run leaves a real checkpoint (weights and optimizer) whose weights the cell commits
        script += (
            "from node.ops.checkpoint import CheckpointStore; import torch; CheckpointStore(d / 'peer0')"
            ".save(9, {'w': torch.ones(3)}, {'state': {}}, {}, {'model': 'm'})"
        )
    return Cell(
        name,
        [sys.executable, "-c", script],
        run_dir,
        tmp_path / "data" / name,
        run_dir / "peer0" / "checkpoints" / "round-000009" if adapter else None,
    )


def test_run_cells_copies_finished_cells_skips_committed_ones_and_stops_at_a_failure(tmp_path, capsys):
    ok, failing, after = (
        fake_cell(tmp_path, "a"),
        fake_cell(tmp_path, "b", "raise SystemExit(3)"),
        fake_cell(tmp_path, "c"),
    )
    assert run_cells([ok, failing, after], tmp_path, "test") == 3
    assert json.loads((ok.dest / "run.json").read_text())["status"] == "complete"
    assert sorted(p.name for p in ok.dest.rglob("*")) == ["metrics.jsonl", "peer0", "run.json"]  # no weights
    assert not failing.dest.exists() and not after.run_dir.exists()
    assert run_cells([ok], tmp_path, "test") == 0
    assert (ok.run_dir / "count").read_text() == "1"  # committed: not run again
    assert "a: committed already" in capsys.readouterr().out


def test_a_cell_is_copied_only_when_its_run_is_a_result(tmp_path):
    """complete, every round of every peer, and the evaluation after the last round where the cell evaluates."""
    (tmp_path / "peer0").mkdir()
    meta = {"status": "complete", "peers": 2, "rounds": 3, "eval_every": 10}
    (tmp_path / "run.json").write_text(json.dumps(meta))
    lines = [{"round": 0, "eval_accuracy": 0.1}, {"round": 1}, {"round": 2}, {"round": 2, "eval_accuracy": 0.3}]
    (tmp_path / "peer0" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert unfinished(tmp_path) == [
        "peer1: no readable metrics.jsonl ([Errno 2] No such file or directory: "
        f"'{tmp_path / 'peer1' / 'metrics.jsonl'}')"
    ]
    (tmp_path / "peer1").mkdir()
    (tmp_path / "peer1" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[:3]))
    assert unfinished(tmp_path) == ["peer1: no held-out evaluation after its last round"]
    (tmp_path / "peer1" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines[1:]))
    assert unfinished(tmp_path) == ["peer1: 1 of 3 rounds missing (from round 0)"]
    (tmp_path / "peer1" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    assert unfinished(tmp_path) == []
    (tmp_path / "run.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    assert unfinished(tmp_path) == ["run.json says 'interrupted'"]


def test_a_cell_that_later_cells_start_from_is_done_only_with_its_weights_committed(tmp_path, capsys):
    """A veteran whose metrics are committed but whose weights are not (they lived in one machine's run dir)
    runs again and commits them, without the optimizer; after that it is skipped. Weights it cannot find
    leave the cell uncommitted, said in one line."""
    vet = fake_cell(tmp_path, "vet", adapter=True)
    vet.dest.mkdir(parents=True)
    (vet.dest / "run.json").write_text("{}")  # committed before the weights were
    assert not vet.committed
    assert run_cells([vet], tmp_path, "test") == 0
    assert "its metrics are committed but its weights are not here" in capsys.readouterr().out
    assert vet.committed and sorted(p.name for p in (vet.dest / "adapter").iterdir()) == [
        "MANIFEST.json",
        "model.pt",
        "state.json",
    ]
    ckpt = load_from(vet.dest / "adapter")  # what --lora-init reads
    assert ckpt.optimizer is None and ckpt.round == 9 and ckpt.meta == {"model": "m"} and ckpt.model["w"].sum() == 3
    assert run_cells([vet], tmp_path, "test") == 0 and (vet.run_dir / "count").read_text() == "1"

    lost = fake_cell(tmp_path, "lost")
    lost = Cell(lost.label, lost.command, lost.run_dir, lost.dest, lost.run_dir / "peer0/checkpoints/round-000099")
    assert run_cells([lost], tmp_path, "test") == 1
    assert "lost: not copied:" in capsys.readouterr().out and not lost.committed
    assert not (lost.dest / "run.json").exists()


def test_the_status_says_how_much_cell_time_is_left(tmp_path):
    """Each uncommitted cell is as long as the committed cells of its arm (median), else of any arm, less what its
    run dir has done; nothing is said before a cell is committed."""

    def cell(arm, seed):
        return Cell(f"{arm} {seed}", [], tmp_path / "runs" / arm / seed, tmp_path / "data" / arm / seed)

    done, half, other = cell("a", "seed0"), cell("a", "seed1"), cell("b", "seed0")
    assert cell_time_left([done, half, other]) is None and "left" not in cell_status([done, half, other])
    (done.dest / "peer0").mkdir(parents=True)
    (done.dest / "peer0" / "metrics.jsonl").write_text(
        '{"round": 0, "t_start": 0.0, "t_end": 1800.0}\n{"round": 1, "t_start": 1800.0, "t_end": 3600.0}\n'
    )
    (done.dest / "run.json").write_text("{}")
    (half.run_dir / "peer0").mkdir(parents=True)
    (half.run_dir / "run.json").write_text(json.dumps({"rounds": 2, "peers": 1}))
    (half.run_dir / "peer0" / "metrics.jsonl").write_text('{"round": 0}\n')
    assert cell_time_left([done, half, other]) == 1800.0 + 3600.0
    assert cell_status([done, half, other]).endswith(
        "1 of 3 cells committed; about 1.5 h of cell time left (each as long as its arm's committed cells, else any)"
    )


def test_clock_times_for_finish_by():
    now = datetime(2026, 11, 26, 21, 0)
    assert clock_time("22:15", now) == datetime(2026, 11, 26, 22, 15).timestamp()
    assert clock_time("20:30", now) == datetime(2026, 11, 27, 20, 30).timestamp()  # passed today: tomorrow's
    assert clock_time("2026-11-28T09:30", now) == datetime(2026, 11, 28, 9, 30).timestamp()
    with pytest.raises(ValueError, match="expected HH:MM or an ISO date-time"):
        clock_time("soon", now)


def test_no_cell_starts_that_would_not_finish_by_the_deadline(tmp_path, capsys):
    """A cell's length comes from the committed cells of its configuration (here one of an hour), from what the
    runner measured itself, or as given; a cell half done in its run dir needs half of it."""
    sibling = tmp_path / "data" / "seed9" / "peer0"
    sibling.mkdir(parents=True)
    (sibling / "metrics.jsonl").write_text(
        '{"round": 0, "t_start": 100.0, "t_end": 1900.0}\n{"round": 1, "t_start": 1900.0, "t_end": 3700.0}\n'
    )
    (sibling.parent / "run.json").write_text("{}")
    late = fake_cell(tmp_path, "late")
    soon = Deadline(time.time() + 1800)
    assert soon.estimate(late) == (3600.0, "median of 1 committed")
    assert run_cells([late], tmp_path, "test", soon) == 0
    assert "late: not started, it would not finish by" in capsys.readouterr().out and not late.run_dir.exists()

    half = fake_cell(tmp_path, "half")  # its run dir: 1 of 2 rounds done, so 30 minutes left: fits
    (half.run_dir / "peer0").mkdir(parents=True)
    (half.run_dir / "run.json").write_text(json.dumps({"rounds": 2, "peers": 1}))
    (half.run_dir / "peer0" / "metrics.jsonl").write_text('{"round": 0}\n{"round": 1, "t_st')  # cut: 1 round
    assert done_fraction(half.run_dir) == 0.5
    roomy = Deadline(time.time() + 2400)
    assert run_cells([half], tmp_path, "test", roomy) == 0 and half.committed
    assert roomy.estimate(late)[1] == "measured here" and roomy.estimate(late)[0] < 60
    assert run_cells([late], tmp_path, "test", Deadline(time.time() + 60, cell_s=5.0)) == 0 and late.committed

    todo, vet = fake_cell(tmp_path, "todo"), fake_cell(tmp_path, "vet", adapter=True)
    vet.dest.mkdir(parents=True)
    (vet.dest / "run.json").write_text("{}")
    (todo.run_dir / "peer0").mkdir(parents=True)
    (todo.run_dir / "run.json").write_text(json.dumps({"rounds": 4, "peers": 1}))
    (todo.run_dir / "peer0" / "metrics.jsonl").write_text('{"round": 0}\n')
    begun = fake_cell(tmp_path, "begun")  # started, no round done by every peer yet: not "to do"
    begun.run_dir.mkdir(parents=True)
    (begun.run_dir / "run.json").write_text(json.dumps({"rounds": 4, "peers": 2}))
    assert cell_status([late, todo, vet, begun]).splitlines() == [
        "late: committed",
        f"todo: 25% of its rounds done in {todo.run_dir} (running, or resumes here)",
        "vet: to do (its weights are not on this machine: runs again)",
        f"begun: 0% of its rounds done in {begun.run_dir} (running, or resumes here)",
        "1 of 4 cells committed",
    ]


def test_families_stop_before_any_cell_when_gemma_is_not_installed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(pays, "is_installed", lambda name: name != "gemma3-270m")
    monkeypatch.chdir(tmp_path)  # main() moves to the repository root: this puts the cwd back afterwards
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "sharing_pays.py",
            "run",
            "--experiment",
            "families",
            "--runs",
            str(tmp_path / "runs"),
            "--data",
            str(tmp_path / "data"),
        ],
    )
    assert pays.main() == 2
    assert "SAPO_MODELS=gemma3-270m bash scripts/setup.sh" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()

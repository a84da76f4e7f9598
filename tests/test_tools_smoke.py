"""Every benchmark (scripts/bench/) and research tool (scripts/research/) runs, as `python -m ...` from the
repository's root, on the tiny model or committed data, in seconds, and prints what it is for: a smoke run
each, its output parsed, so that none can break unseen. The figures themselves are not checked (no timed
tests); what is checked is that each one is there and well formed.

The tools that start real swarms (DHT processes, nodes) are `slow`: they go first, one worker each. Not
smoke-run: the quick-start benchmark (a fresh clone, set-up and a five-peer swarm for 30 rounds, by design;
its arguments are checked), the conversion benchmark (two conversions of a packaged model per repeat, about
a minute; its arguments are checked), `bench.lora memory` and `bench.engine sync/bindings` (the other subcommands of
tools that are).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from fake_cells import committed_cell

from conftest import REPO, node_env, run_node, run_python

DATA = REPO / "docs" / "data"
TINY = ["--model", "tiny-random", "--tasks", "smoke"]


def tool(module: str, *args: str, timeout: float = 240, **env: str) -> str:
    """`python -m scripts.MODULE ARGS` to its end (exit 0); its stdout."""
    done = run_python(["-m", f"scripts.{module}", *args], timeout, node_env(SAPO_RECIPE="none", **env))
    assert done.returncode == 0, f"{module} exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
    return done.stdout


def number(text: str, pattern: str) -> float:
    """The number the regex `pattern` captures in `text` (its first group)."""
    found = re.search(pattern, text)
    assert found, f"{pattern!r} not in:\n{text[-2000:]}"
    return float(found.group(1))


# ------------------------------------------------------------------------------------------ benchmarks


def test_round_benchmark(tmp_path):
    out = tool(
        "bench.round",
        *TINY,
        "--rounds",
        "1",
        "--repeats",
        "1",
        "--num-local",
        "2",
        "--generations",
        "2",
        "--max-new-tokens",
        "8",
        "--threads",
        "1",
        "--eval-size",
        "4",
        "--json",
        str(tmp_path / "r.json"),
    )
    figures = json.loads((tmp_path / "r.json").read_text())
    assert {"generate", "train", "fetch", "verify"} <= set(figures["phase_s"])  # every step of a round
    assert figures["sequences"] == 4 and figures["speedup"] > 0 and figures["node_tokens_per_s"] > 0
    assert "## 3. training step" in out


def test_round_variants_start_each_repeat_from_the_same_weights():
    """The variants of one repeat are compared on the same weights: the update one variant made is undone
    (parameters and Adam state) before the next one samples."""
    import torch

    from node.learn.model_io import load_model
    from node.learn.sampling import Sequence
    from node.learn.trainer import TrainConfig, Trainer
    from scripts.bench.round import _restore, _snapshot

    model, tok = load_model("tiny-random", torch.device("cpu"))
    trainer = Trainer(model, tok.pad_token_id, TrainConfig(lr=1e-2, micro_batch_size=2))
    seqs = lambda: [Sequence([5, 6, 7], [8, 9], a) for a in (1.0, -1.0)]  # noqa: E731
    trainer.step(seqs())  # Adam has state to restore
    before = [p.detach().clone() for p in trainer.params]
    snap = _snapshot(trainer)
    trainer.step(seqs())
    assert any(not torch.equal(p, b) for p, b in zip(trainer.params, before))
    _restore(trainer, snap)
    assert all(torch.equal(p, b) for p, b in zip(trainer.params, before))
    state = trainer.optimizer.state_dict()["state"]
    assert all(torch.equal(state[k]["exp_avg"], snap[1]["state"][k]["exp_avg"]) for k in state)
    trainer.step(seqs())  # restoring twice from one snapshot: the snapshot itself is not moved by a step
    _restore(trainer, snap)
    assert all(torch.equal(p, b) for p, b in zip(trainer.params, before))


def test_eval_benchmark(tmp_path):
    out = tool(
        "bench.eval", *TINY, "--size", "4", "--batches", "4", "--repeats", "1", "--json", str(tmp_path / "e.json")
    )
    variants = json.loads((tmp_path / "e.json").read_text())["variants"]
    assert set(variants) == {"generate-32", "rows-4"} and "rows-4" in out
    assert variants["rows-4"]["differ"] == 0  # rows that leave their batch answer as `generate` does


@pytest.mark.parametrize("fp32", [True, False])
def test_eval_benchmark_on_an_adapter(tmp_path, fp32):
    """A trained adapter's evaluation as a LoRA node runs it (its base stored in bf16 under mixed precision),
    with or without the fp32 reference beside it, which decodes its own fp32 copy."""
    import torch

    from node.learn.lora import attach
    from node.learn.model_io import load_model
    from node.ops.checkpoint import CheckpointStore

    adapter = attach(load_model("tiny-random", torch.device("cpu"))[0], 4, 8.0)
    with torch.no_grad():
        for p in adapter.parameters():
            p.normal_(std=0.05)  # B = 0 would leave the base model
    ckpt = CheckpointStore(tmp_path / "run").save(3, adapter.state_dict(), {}, {"round": 3})
    tool(
        "bench.eval",
        *TINY,
        "--size",
        "4",
        "--batches",
        "4",
        "--repeats",
        "1",
        *(["--fp32"] if fp32 else []),
        "--adapter",
        str(ckpt),
        "--lora-rank",
        "4",
        "--lora-alpha",
        "8",
        "--json",
        str(tmp_path / "e.json"),
    )
    variants = json.loads((tmp_path / "e.json").read_text())["variants"]
    assert set(variants) == {"generate-32", "rows-4"} | ({"fp32"} if fp32 else set())
    assert all(("differ_fp32" in v) == fp32 for v in variants.values())


def test_lora_benchmark(tmp_path):
    tool(
        "bench.lora",
        "train",
        *TINY,
        "--ranks",
        "1",
        "--num-local",
        "2",
        "--generations",
        "2",
        "--max-new-tokens",
        "8",
        "--repeats",
        "1",
        "--json",
        str(tmp_path / "l.json"),
    )
    figures = json.loads((tmp_path / "l.json").read_text())
    assert figures["sequences"] == 4 and set(figures["train_times_s"]) == {"full", "lora_r1"}


def test_engine_benchmark(tmp_path):
    tool(
        "bench.engine",
        "parity",
        *TINY,
        "--tasks-n",
        "4",
        "--samples",
        "1",
        "--batch",
        "4",
        "--variants",
        "torch-bf16",
        "--json",
        str(tmp_path / "p.json"),
    )
    figures = json.loads((tmp_path / "p.json").read_text())
    assert set(figures["accuracy"]) == {"torch", "torch-bf16"}
    assert len(figures["versus_torch"]["torch-bf16"]["ci95"]) == 2


def test_sandbox_benchmark():
    out = tool("bench.sandbox", "--groups", "5", "--completions", "3")
    assert "rewards equal both ways" in out
    assert number(out, r"ratio sandbox / in-process \(medians\): ([0-9.]+)x") > 0


def test_stop_benchmark(tmp_path):
    out = tool(
        "bench.stop",
        *TINY,
        "--threads",
        "1",
        "--repeats",
        "1",
        "--after-rounds",
        "1",
        "--node-arg=--num-local=2",
        "--node-arg=--generations=2",
        "--node-arg=--max-new-tokens=8",
        "--node-arg=--eval-every=0",
    )
    assert number(out, r"load\+verify=([0-9.]+)") >= 0
    assert number(out, r"exit code (\d+) after") == 0
    # the signal lands in the generate phase of round 1 or a later one (a tiny model's phase lasts milliseconds,
    # and a poll can miss round 1's): that round is abandoned, the one before it checkpointed
    signalled = int(number(out, r"signal in round (\d+) phase generate"))
    assert signalled >= 1 and f"round {signalled} abandoned" in out
    assert f"round-{signalled - 1:06d} written" in out


def test_gossip_benchmark_summarises_run_dirs(tmp_path):
    run = tmp_path / "node0"
    done = run_node(
        *TINY,
        "--rounds",
        "2",
        "--num-local",
        "2",
        "--generations",
        "2",
        "--max-new-tokens",
        "8",
        "--eval-every",
        "0",
        "--run-dir",
        str(run),
        "--threads",
        "1",
    )
    assert done.returncode == 0, done.stderr[-2000:]
    out = tool("bench.gossip", "--metrics", str(run))
    assert str(run) in out and "rounds" in out


@pytest.mark.slow
def test_churn_benchmark_runs_a_calm_swarm_and_reports(tmp_path):
    """Two loopback peers and a bootstrap for a quarter of a minute, no namespaces: the soak's plumbing (start,
    rounds, the report of rounds, waits, RSS and crashes) runs; the figures are the soak's, not checked here."""
    out = tool(
        "bench.churn",
        "--peers",
        "2",
        "--minutes",
        "0.25",
        "--swarms",
        "calm",
        "--netns-peers",
        "0",
        "--late",
        "0",
        "--stagger",
        "0",
        "--work",
        str(tmp_path / "work"),
        "--out",
        str(tmp_path / "out"),
        timeout=240,
    )
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(result["swarms"]) == {"calm"} and result["peers"] == 2 and "calm" in out
    assert (tmp_path / "out" / "report.md").read_text().strip()


def test_convert_benchmark_parses_its_arguments():
    assert "--repeats" in tool("bench.convert", "--help")
    done = run_python(["-m", "scripts.bench.convert", "--repeats", "0"], 60, node_env())
    assert done.returncode == 2 and "--repeats must be at least 1" in done.stderr


def test_quickstart_benchmark_parses_its_arguments():
    out = tool("bench.quickstart", "--help")
    assert "--until" in out and "--peers" in out


@pytest.mark.slow
def test_swarm_benchmarks(tmp_path):
    """Real DHT processes and nodes: gossip between peers, the scale benchmark, a Sybil attack (one after
    the other, on one worker)."""
    out = tool("bench.gossip", "--peers", "2", "--samples", "2", "--groups", "1", "--completions", "2", "--chars", "20")
    assert "publish->visible" in out
    scale = tmp_path / "scale.json"
    tool(
        "bench.scale",
        "--publishers",
        "2",
        "--servers",
        "2",
        "--publisher-procs",
        "1",
        "--rounds",
        "1",
        "--samples",
        "1",
        "--pow",
        "0",
        "--json",
        str(scale),
    )
    rows = json.loads(scale.read_text())
    assert len(rows) == 1 and rows[0]["publishers"] == 2


# ------------------------------------------------------------------------------------ research tools


def test_answer_forms_reads_committed_cells():
    cell = DATA / "recipe-sweep-v3" / "lr2e-4-b0.04" / "4-0" / "seed100"
    out = tool("research.answer_forms", str(cell))
    rows = [line for line in out.splitlines() if line.startswith("| seed100 |")]
    assert len(rows) == 5 and all(0.0 <= float(row.split("|")[4]) <= 1.0 for row in rows)  # each peer's accuracy


def test_plot_solo_draws_committed_runs(tmp_path):
    out = tool(
        "research.plot_solo",
        *map(str, sorted((DATA / "solo200").glob("*.metrics.jsonl"))[:2]),
        "--out",
        str(tmp_path / "solo.png"),
    )
    assert (tmp_path / "solo.png").stat().st_size > 0 and "wrote" in out


def test_recipe_sweep_summarises_committed_cells(tmp_path):
    tool(
        "research.recipe_sweep",
        "summarize",
        "--data",
        str(DATA / "recipe-sweep-v3"),
        "--json",
        str(tmp_path / "s.json"),
    )
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert len(rows) == 6 and all(0.0 <= r["mean_final_accuracy"] <= 1.0 for r in rows)


def test_sharing_pays_lists_its_cells():
    out = tool("research.sharing_pays", "commands", "--experiment", "newcomer")
    assert "--seeds" in out and "newcomer" in out
    out = tool("research.sharing_pays", "status", "--experiment", "validation")
    committed, total = map(int, re.search(r"(\d+) of (\d+) cells committed", out).groups())
    assert 0 <= committed <= total == 16


def test_specialists_rules_run_on_the_survey_and_on_pilot_cells(tmp_path):
    out = tool("research.specialists", "candidates")
    assert set(out.split()) == {
        "basic_arithmetic",
        "chain_sum",
        "products",
        "simple_equations",
        "calendar_arithmetic",
        "fraction_simplification",
    }
    done = run_python(["-m", "scripts.research.specialists", "transfer", str(tmp_path)], 120, node_env())
    assert done.returncode == 2 and "no committed cell" in done.stderr  # nothing to read yet: says so


def test_offpolicy_pick_applies_the_written_rules(tmp_path):
    """The largest mean paired area difference wins, a difference within 0.005 of it goes to the simpler rule
    (positive, ftis, is), sapo is never picked, and the sizing is n = (2.8 s / max(d, 0.03))^2, at least 8."""
    gains = {
        "clear": {"sapo": (0.09, 0.09), "positive": (0.05, 0.03), "ftis": (0.02, 0.02), "is": (0.024, 0.024)},
        "tie": {"sapo": (0.0, 0.0), "positive": (0.01, 0.01), "ftis": (0.04, 0.04), "is": (0.043, 0.043)},
    }
    picks = {}
    for case, arms in gains.items():
        data = tmp_path / case
        for i, (seed, silo) in enumerate(((100, 0.1), (101, 0.2))):
            committed_cell(data, "4/0", seed, [silo, silo])
            for rule, by_seed in arms.items():
                committed_cell(data, f"2/2 {rule}", seed, [silo + by_seed[i], silo + by_seed[i]])
        out = tool("research.offpolicy_pick", str(data), "--json", str(data / "pick.json"), "--seeds", "100", "101")
        picks[case] = json.loads((data / "pick.json").read_text())
        assert "(all cells in)" in out
    clear = picks["clear"]
    assert clear["chosen"] == "positive" and abs(clear["arms"]["positive"]["mean"] - 0.04) < 1e-9
    assert clear["needed_seeds"] == 1 and clear["seeds"] == 8  # (2.8 * 0.01414 / 0.04)^2 = 0.98
    assert picks["tie"]["chosen"] == "ftis"  # 0.040 is within 0.005 of is's 0.043, and ftis is simpler
    committed_cell(tmp_path / "tie", "2/2 is", 102, [0.9, 0.9])  # a seed without its silo: paired with nothing
    out = tool("research.offpolicy_pick", str(tmp_path / "tie"))  # the pilot's seeds: 102 is missing
    assert "pick: ftis (NOT all cells in yet: provisional)" in out


def test_measure_signal(tmp_path):
    out = tool("research.measure_signal", *TINY, "--groups", "2", "--generations", "2", "--batch", "2")
    assert 0.0 <= number(out, r"ALL\s+2\s+([0-9.]+)") <= 1.0  # the share of groups with signal


def test_measure_unseen(tmp_path):
    tool(
        "research.measure_unseen",
        "--model",
        "tiny-random",
        "--tasks",
        "cpu-learn",
        "--size",
        "4",
        "--json",
        str(tmp_path / "u.json"),
    )
    sets = json.loads((tmp_path / "u.json").read_text())["sets"]
    assert set(sets) == {"in-distribution", "unseen"} and all(s["tasks"] == 4 for s in sets.values())


def test_measure_prompt_formats():
    out = tool(
        "research.measure_prompt_formats",
        *TINY,
        "--formats",
        "chatml",
        "--size",
        "4",
        "--samples",
        "2",
        "--threads",
        "1",
    )
    row = json.loads(out.strip().splitlines()[-1])
    assert row["format"] == "chatml" and row["size"] == 4 and 0.0 <= row["greedy_acc"] <= 1.0


def test_survey_tasks_screens_a_dataset(tmp_path):
    log = tmp_path / "cells.jsonl"
    tool(
        "research.survey_tasks",
        "--model",
        "tiny-random",
        "--stages",
        "screen",
        "--datasets",
        "basic_arithmetic",
        "--log",
        str(log),
        "--max-memory-gb",
        "0",
    )
    cells = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(cells) == 1 and cells[0]["dataset"] == "basic_arithmetic" and 0.0 <= cells[0]["pass8"] <= 1.0


def test_eval_adapters_gives_back_what_the_node_recorded(tmp_path):
    """A LoRA node's evaluation is a pure function of its weights: evaluated again from its checkpoint, the
    answers are the ones its metrics recorded (the tool evaluates at the mix's own answer length, as the node
    does by default)."""
    cell = tmp_path / "cell"
    done = run_node(
        *TINY,
        "--rounds",
        "1",
        "--num-local",
        "2",
        "--generations",
        "2",
        "--lora-rank",
        "2",
        "--eval-every",
        "1",
        "--eval-size",
        "4",
        "--mixed-precision",
        "off",
        "--threads",
        "1",
        "--run-dir",
        str(cell / "peer0"),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    shutil.copytree(max((cell / "peer0" / "checkpoints").glob("round-*")), cell / "adapter")
    out = tool("research.eval_adapters", str(cell), *TINY, "--eval-size", "4", "--precision", "off")
    assert "4/4 answers the same" in out


def test_solo_evidence_is_smoke_run_by_the_lab_tests():
    assert "scripts.research.solo_evidence" in (Path(__file__).parent / "lab" / "test_evidence.py").read_text()


@pytest.mark.slow
def test_wan_benchmark(tmp_path, monkeypatch):
    """Two peers and a bootstrap behind 100 ms relays for three rounds each, the network behind the round; in this
    process, so that its nodes start from the preloaded interpreter. The row's figures are not checked."""
    from scripts.bench import wan

    monkeypatch.setenv("SAPO_POW_DIFFICULTY", "8")
    rows = tmp_path / "rows.json"
    args = ["--rtt-ms", "100", "--pipeline", "on", "--peers", "2", "--rounds", "3", "--warmup", "0"]
    assert wan.main([*args, "--json", str(rows)]) == 0
    (row,) = json.loads(rows.read_text())
    assert row["pipeline"] == "on" and row["rtt_ms"] == 100 and row["rounds"] == 6
    assert row["exit_codes"] == [0, 0] and row["relay_bytes_per_round"] > 0 and row["round_s_median"] > 0


@pytest.mark.slow
def test_poison_benchmark(tmp_path, monkeypatch):
    """Three rounds of one attack with the screen on, on the tiny model: the poisoner's right answers reach the
    node and the screen masks the text out of the loss."""
    from scripts.bench import poison

    monkeypatch.setenv("SAPO_POW_DIFFICULTY", "8")
    rows = tmp_path / "rows.json"
    argv = ["--model", "tiny-random", "--tasks", "smoke", "--rounds", "3", "--eval-every", "1", "--eval-size", "4"]
    assert poison.main([*argv, "--period", "1", "--screen", "on", "--attack", "after", "--json", str(rows)]) == 0
    (row,) = json.loads(rows.read_text())
    assert row["attack"] == "after" and row["screen"] == "on" and row["rounds"] == 3
    assert row["exit_codes"] == [0, 0] and row["by_round"] and row["payload_share"] == 0.0
    assert row["screened_by_reason"].get("masked_outside", 0) >= 1, row


@pytest.mark.slow
def test_sybil_benchmark(tmp_path, monkeypatch):
    """In this process, so that its nodes start from the preloaded interpreter (scripts/bench/procs.py)."""
    from scripts.bench import sybil

    monkeypatch.setenv("SAPO_POW_DIFFICULTY", "8")  # main() sets it for the nodes it starts
    rows = tmp_path / "rows.json"
    assert (
        sybil.main(
            [
                "--sybils",
                "2",
                "--attack",
                "ghost",
                "--honest",
                "2",
                "--warmup-s",
                "60",
                "--attack-s",
                "3",
                "--period",
                "1",
                "--newcomer-window-s",
                "1",
                "--newcomer-at",
                "0.5",
                "--json",
                str(rows),
            ]
        )
        == 0
    )
    row = json.loads(rows.read_text())[0]
    assert row["sybils"] == 2 and row["attack"] == "ghost" and row["honest_rounds"] > 0
    assert row["exit_codes"] and all(code == 0 for code in row["exit_codes"])

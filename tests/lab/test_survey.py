"""The task survey on a tiny model and two datasets: records, resume, build failures, summary; and the
CPU preset it chose builds, with its held-out set and constant-answer baseline."""

import importlib.util
import json

import pytest
import torch

from node.lab.survey import (
    SCREEN_TASKS,
    Cell,
    append_record,
    easiest_config,
    load_records,
    run_cells,
    stage_cells,
    summarize,
)
from node.learn.evaluate import constant_answer_baseline
from node.learn.model_io import load_model
from node.learn.tasks import EVAL_INDEX_START, PRESETS, eval_tasks, resolve_mix


def test_survey_measures_resumes_and_lists_failures(tmp_path):
    torch.set_num_threads(1)
    model, tok = load_model("tiny-random", torch.device("cpu"))
    log = tmp_path / "cells.jsonl"
    cells = [
        Cell("basic_arithmetic", "easiest", "direct", 1.0, 3),
        Cell("syllogism", "harder", "reason", 1.0, 3),
        Cell("not_a_dataset", "harder", "direct", 1.0, 3),
    ]
    seen = []
    assert run_cells(model, tok, cells, log, samples=2, on_record=seen.append) == 3
    records = load_records(log)
    assert set(records) == {c.key() for c in cells}
    arith = records[cells[0].key()]
    assert arith["config"]["operators"] == ["+", "-"] and arith["config"]["allow_negation"] is False
    for rec in (arith, records[cells[1].key()]):
        assert 0 <= rec["pass1"] <= rec["greedy_acc"] + 1e-9 <= 1 + 1e-9
        assert 0 <= rec["signal_frac"] <= rec["pass2"] <= 1
        assert 0 < rec["baseline"] <= 1 and rec["distinct_gold"] >= 1 and rec["s_per_task"] > 0
    assert "error" in records[cells[2].key()]
    # resume: nothing left to do, nothing appended
    lines = log.read_text().count("\n")
    assert run_cells(model, tok, cells, log, samples=2) == 0
    assert log.read_text().count("\n") == lines
    table = summarize(log, tmp_path / "out")
    assert "| basic_arithmetic | easiest | direct | 3 |" in table and "not_a_dataset" in table
    assert len(json.loads((tmp_path / "out" / "survey.json").read_text())) == 3


def test_survey_skips_a_cell_another_process_finished_meanwhile(tmp_path):
    """Two survey processes may share one log: a cell recorded by the other one after this one started
    is not measured twice."""
    torch.set_num_threads(1)
    model, tok = load_model("tiny-random", torch.device("cpu"))
    log = tmp_path / "cells.jsonl"
    first, second = Cell("chain_sum", "easiest", "direct", 1.0, 2), Cell("products", "easiest", "direct", 1.0, 2)

    def other_process_finishes_second(_record):
        append_record(log, {"key": second.key(), "by": "other"})

    assert run_cells(model, tok, [first, second], log, samples=2, on_record=other_process_finishes_second) == 1
    assert load_records(log)[second.key()] == {"key": second.key(), "by": "other"}


def test_stages_follow_the_screens():
    """Each stage picks its datasets from what the screens recorded: solved ones go on to 64-task cells in
    both formats, unsolved ones to the reasoning rescreen and, where the default config differs, the
    harder screen; a dataset that failed to build is not rescreened but gets its harder screen."""

    def screen(name, fmt, **rec):
        cell = Cell(name, "easiest", fmt, 1.0, SCREEN_TASKS)
        return {cell.key(): {"key": cell.key(), **rec}}

    names = ["basic_arithmetic", "chain_sum", "gcd", "lcm", "bitwise_arithmetic"]
    records = {
        **screen("basic_arithmetic", "direct", pass8=0.5),
        **screen("chain_sum", "direct", pass8=0.0),
        **screen("chain_sum", "reason", pass8=0.1),
        **screen("gcd", "direct", pass8=0.0),
        **screen("lcm", "direct", error="ValueError: x"),
    }  # bitwise_arithmetic: not screened yet
    plan = {
        s: {(c.dataset, c.level, c.fmt, c.n_tasks) for c in stage_cells(s, names, records, 64, 1.0)}
        for s in ("screen", "full", "harder", "rescreen", "harder-screen")
    }
    assert plan["screen"] == {(n, "easiest", "direct", SCREEN_TASKS) for n in names}
    assert plan["full"] == {
        (n, "easiest", f, 64) for n in ("basic_arithmetic", "chain_sum") for f in ("direct", "reason")
    }
    assert plan["harder"] == {
        (n, "harder", f, 64) for n in ("basic_arithmetic", "chain_sum") for f in ("direct", "reason")
    }
    assert plan["rescreen"] == {
        ("chain_sum", "easiest", "reason", SCREEN_TASKS),
        ("gcd", "easiest", "reason", SCREEN_TASKS),
    }
    assert plan["harder-screen"] == {
        ("gcd", "harder", "direct", SCREEN_TASKS),
        ("lcm", "harder", "direct", SCREEN_TASKS),
    }


def test_easiest_config_shrinks_ranges_generically():
    cfg = easiest_config("word_ladder")  # no override: generic rule or nothing
    assert all(k.startswith(("max_", "difficulty")) for k in cfg)
    assert easiest_config("bitwise_arithmetic") == {"difficulty": 1}


def test_cpu_learn_preset_builds_with_eval_set_and_baseline():
    mix = resolve_mix("cpu-learn")
    assert mix is PRESETS["cpu-learn"]
    tasks = eval_tasks(mix, 64)
    assert len(tasks) == 64 and all(t.spec.index >= EVAL_INDEX_START for t in tasks)
    assert set(t.spec.dataset for t in tasks) == set(mix.datasets)
    assert 0 < constant_answer_baseline(tasks) <= 0.3


@pytest.mark.slow
def test_survey_samples_through_the_llama_engine_and_says_so(tmp_path):
    """--engine llama: the pass@8 samples come from llama.cpp (greedy answers still from torch), the record
    names the engine, and a cell samples the same on a second run (seeded from torch's RNG)."""
    if not any(importlib.util.find_spec(m) for m in ("ik_llama_cpp", "llama_cpp")):  # the wheel or the source build
        pytest.skip("no llama.cpp binding here (ik_llama_cpp or llama_cpp)")
    from node.learn.engines import make_engine

    torch.set_num_threads(1)
    model, tok = load_model("tiny-random-smol", torch.device("cpu"))
    engine = make_engine("llama", model, tok, "tiny-random-smol")
    assert engine.name == "llama"
    try:
        cell = Cell("basic_arithmetic", "easiest", "direct", 1.0, 3)
        runs = []
        for name in ("a", "b"):
            assert run_cells(model, tok, [cell], tmp_path / f"{name}.jsonl", samples=2, engine=engine) == 1
            runs.append(load_records(tmp_path / f"{name}.jsonl")[cell.key()])
    finally:
        engine.close()
    assert runs[0]["engine"] == "llama" and 0 <= runs[0]["pass2"] <= 1 and runs[0]["median_tokens"] > 0
    timings = {"s_per_task", "greedy_s"}
    assert {k: v for k, v in runs[0].items() if k not in timings} == {
        k: v for k, v in runs[1].items() if k not in timings
    }

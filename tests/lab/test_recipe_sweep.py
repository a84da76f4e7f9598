"""The recipe sweep's pre-registered rule (scripts/recipe_sweep.py, docs/RESULTS.md section 7)."""

import importlib.util
import sys
from pathlib import Path

import orjson

spec = importlib.util.spec_from_file_location("recipe_sweep", Path(__file__).parents[2] / "scripts/recipe_sweep.py")
sweep = importlib.util.module_from_spec(spec)
sys.modules["recipe_sweep"] = sweep  # dataclasses look their module up
spec.loader.exec_module(sweep)


def rows(*specs):
    return [{"setting": s.name, "lr": s.lr, "beta": s.beta, "collapsed": c, "mean_final_accuracy": a}
            for s, (c, a) in zip(sweep.GRID, specs)]


def test_rule_waits_for_every_setting():
    winner, note = sweep.pick(rows((0, 0.5)))
    assert winner is None and "waits" in note


def test_rule_prefers_no_collapse_then_accuracy_then_lower_rate_then_no_kl():
    # GRID order: lr1e-4-b0, lr2e-4-b0, lr1e-4-b0.04, lr2e-4-b0.04, lr5e-5-b0, lr5e-5-b0.04
    winner, note = sweep.pick(rows((0, 0.40), (1, 0.60), (0, 0.45), (0, 0.455), (0, 0.20), (0, 0.30)))
    assert winner == "lr1e-4-b0.04" and "no collapsed peer" in note  # 0.45 ties 0.455; lower lr wins
    winner, _ = sweep.pick(rows((0, 0.45), (1, 0.60), (0, 0.45), (2, 0.5), (3, 0.1), (3, 0.1)))
    assert winner == "lr1e-4-b0"  # same lr and accuracy: beta 0 wins
    winner, note = sweep.pick(rows((2, 0.4), (1, 0.3), (1, 0.35), (2, 0.5), (3, 0.1), (3, 0.1)))
    assert winner == "lr1e-4-b0.04" and "NOT MET" in note


def test_final_evaluation_of_a_peer_is_its_last(tmp_path):
    lines = [{"round": 0, "eval_accuracy": 0.15, "eval_baseline": 0.12, "eval_distinct_answers": 0.13,
              "eval_distinct_gold": 0.35}, {"round": 1, "reward_mean": 0.2},
             {"round": 2, "eval_accuracy": 0.5, "eval_baseline": 0.12, "eval_distinct_answers": 0.3,
              "eval_distinct_gold": 0.35}]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines))
    summary, rec = sweep.final_eval(path)
    assert summary.round == 2 and summary.accuracy == 0.5 and rec["round"] == 2

"""The recipe sweep's pre-registered rule (scripts/research/recipe_sweep.py, docs/experiments/cpu-recipe.md)."""

import orjson

from scripts.research import recipe_sweep as sweep


def rows(*specs):
    return [
        {"setting": s.name, "lr": s.lr, "beta": s.beta, "collapsed": c, "mean_final_accuracy": a}
        for s, (c, a) in zip(sweep.GRID, specs)
    ]


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
    lines = [
        {
            "round": 0,
            "eval_accuracy": 0.15,
            "eval_baseline": 0.12,
            "eval_distinct_answers": 0.13,
            "eval_distinct_gold": 0.35,
        },
        {"round": 1, "reward_mean": 0.2},
        {
            "round": 2,
            "eval_accuracy": 0.5,
            "eval_baseline": 0.12,
            "eval_distinct_answers": 0.3,
            "eval_distinct_gold": 0.35,
        },
    ]
    path = tmp_path / "metrics.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(x) for x in lines))
    summary, rec = sweep.final_eval(path)
    assert summary.round == 2 and summary.accuracy == 0.5 and rec["round"] == 2


def test_summarize_reports_each_seed_and_the_setting(tmp_path, capsys):
    def final(acc, distinct=0.3, restores=0):
        return {
            "round": 29,
            "eval_accuracy": acc,
            "eval_baseline": 0.12,
            "eval_distinct_answers": distinct,
            "eval_distinct_gold": 0.35,
            "eval_unseen_accuracy": acc - 0.1,
            "guard_restores": restores,
        }

    peers = {"seed100": [final(0.5), final(0.7, restores=1)], "seed101": [final(0.15), final(0.6, distinct=0.1)]}
    for seed, finals in peers.items():
        for p, rec in enumerate(finals):
            d = tmp_path / "lr1e-4-b0" / "4-0" / seed / f"peer{p}"
            d.mkdir(parents=True)
            (d / "metrics.jsonl").write_bytes(orjson.dumps({"round": 28}) + b"\n" + orjson.dumps(rec))
    out = tmp_path / "summary.json"
    assert sweep.summarize(sweep.argparse.Namespace(data=str(tmp_path), json=str(out))) == 0
    summary = orjson.loads(out.read_bytes())
    by_seed = {r["seed"]: r for r in summary["seed_rows"]}
    assert by_seed["seed100"]["collapsed"] == 0 and by_seed["seed100"]["guard_restores"] == 1
    assert by_seed["seed101"]["collapsed"] == 2  # one at the baseline's margin, one with too few distinct answers
    (setting,) = summary["rows"]
    assert setting["peers"] == 4 and setting["seeds"] == 2 and setting["collapsed"] == 2
    assert abs(setting["mean_final_accuracy"] - 0.4875) < 1e-9 and summary["winner"] is None  # 1 of 6 settings
    assert "| lr1e-4-b0 | 101 | 2 | 2 | 0.375 | 0.275 | 0 |" in capsys.readouterr().out

"""`sapo-report`'s views of some peers: per model family of a mixed swarm (Holm across families) and one focus
peer (a newcomer) against its silo and beside the veterans, on small synthetic metrics trees."""

import json
import math

import pytest

from node.lab.paired import holm
from node.lab.report import main
from node.lab.tables import vs_cells

SEEDS = (0, 1, 2, 3)
EVAL_ROUNDS = (0, 5, 10, 15, 20, 25, 29)


def write_run(root, cfg, seed, peers, model_in_metrics=False, unseen=False, reward=lambda model: 0.1):
    """peers: {peer index: (model, accuracy(t))}; held-out evaluations at EVAL_ROUNDS of 30 rounds (with
    `unseen`, the unseen set's accuracy too: 0.05 below), training reward `reward(model)` every round. At j > 0
    peer p trains each round on one group of peer p + 1 (the next, cyclically) and one of an outsider."""
    i, j = map(int, cfg.split("/"))
    run = root / cfg.replace("/", "-") / f"seed{seed}"
    run.mkdir(parents=True)
    models = [peers[p][0] for p in sorted(peers)]
    (run / "run.json").write_text(
        json.dumps(
            {
                "config_name": cfg,
                "num_local": i,
                "num_external": j,
                "seed": seed,
                "ij_policy": "fixed",
                "peers": len(peers),
                "rounds": 30,
                "models": models,
                "model": "mixed",
            }
        )
    )
    for p, (model, acc) in peers.items():
        (run / f"peer{p}").mkdir()
        lines = []
        for t in range(30):
            rec = {
                "round": t,
                "reward_mean": reward(model),
                "num_local": i,
                "num_external": j,
                "publisher": f"key{p}",
                "external_sources": {f"key{(p + 1) % len(peers)}": 1, "outsider": 1} if j else {},
            }
            if t in EVAL_ROUNDS:
                rec["eval_accuracy"] = acc(t)
                if unseen:
                    rec["eval_unseen_accuracy"] = acc(t) - 0.05
            if model_in_metrics:
                rec["model"] = model
            lines.append(json.dumps(rec))
        (run / f"peer{p}" / "metrics.jsonl").write_text("\n".join(lines) + "\n")


# held-out accuracy = 0.2 + 0.01 t + 0.01 seed, plus in 2/2 the family's effect for that seed
EFFECT = {"fam-a": (0.05, 0.05, 0.05, 0.05), "fam-b": (0.02, -0.01, 0.03, -0.02)}


def family_acc(cfg, fam, seed):
    return lambda t: 0.2 + 0.01 * t + 0.01 * seed + (EFFECT[fam][seed] if cfg == "2/2" else 0.0)


def family_reward(cfg, seed):
    """Training reward: 0.3 alone; in 2/2 fam-a's falls to 0.2, fam-b's moves by 0.01 (seed - 1.5)."""
    return lambda model: 0.3 if cfg == "4/0" else (0.2 if model == "fam-a" else 0.3 + 0.01 * (seed - 1.5))


def test_holm_adjusts_step_down_and_a_member_without_a_test_still_counts():
    got = holm({"a": 0.01, "b": 0.04, "c": 0.03})
    assert got["a"] == pytest.approx(0.03) and got["c"] == pytest.approx(0.06)
    assert got["b"] == pytest.approx(0.06)  # 0.04 x 1, raised to the step before it
    got = holm({"a": 0.01, "b": 0.04, "c": 0.03, "d": math.nan})  # d untested: m is still 4
    assert [got[k] for k in "acb"] == pytest.approx([0.04, 0.09, 0.09]) and math.isnan(got["d"])
    assert holm({"a": 0.6, "b": 0.7}) == {"a": 1.0, "b": 1.0}


def test_mixed_swarm_is_judged_per_family_with_holm(tmp_path, capsys):
    exp = tmp_path / "exp"
    for cfg in ("4/0", "2/2"):
        for s in SEEDS:  # 2 peers of fam-a and 1 of fam-b; 4/0 says its models in the metrics, 2/2 in run.json
            write_run(
                exp,
                cfg,
                s,
                {p: (fam, family_acc(cfg, fam, s)) for p, fam in enumerate(("fam-a", "fam-b", "fam-a"))},
                model_in_metrics=cfg == "4/0",
                reward=family_reward(cfg, s),
            )
    out = tmp_path / "report"
    assert main([str(exp), "--out", str(out)]) == 0
    fam = json.loads((out / "summary.json").read_text())["families"]
    assert fam["families"] == ["fam-a", "fam-b"] and fam["peers"] == {"fam-a": [2], "fam-b": [1]}
    a, b = (fam["per_family"][f]["2/2"] for f in ("fam-a", "fam-b"))
    # final (round 29): 0.49 + 0.01 seed (+ effect); the family's peers all alike
    assert fam["per_family"]["fam-a"]["4/0"]["eval_final_mean"] == pytest.approx(0.49 + 0.015)
    assert a["eval_final_vs_base"]["mean_diff"] == pytest.approx(0.05)
    assert a["eval_area_vs_base"]["mean_diff"] == pytest.approx(0.05)
    assert b["eval_final_vs_base"]["mean_diff"] == pytest.approx(0.005)
    assert a["eval_final_vs_base"]["p_perm"] == pytest.approx(2 / 16)  # 4 seeds, every difference positive
    for key in ("eval_final_vs_base", "eval_area_vs_base"):
        pa, pb = a[key]["p_perm"], b[key]["p_perm"]
        assert pa < pb
        assert a[key]["p_holm"] == pytest.approx(2 * pa)
        assert b[key]["p_holm"] == pytest.approx(max(2 * pa, pb))
    md = (out / "report.md").read_text()
    assert "## Per model family" in md and "### fam-a: 2 peer(s) per run" in md and "### fam-b" in md
    assert md.index("## Per model family") < md.index("## Held-out accuracy")
    final = a["eval_final_vs_base"]
    assert f"| 2/2 | fam-a | {final['p_perm']:.3f} | {final['p_holm']:.3f} |" in md
    # peers a0, b1, a2: a0 trains on b1, b1 on a2, a2 on a0, 30 rounds x 4 seeds, and one outsider each
    assert fam["sources"] == {
        "2/2": {"fam-a": {"fam-b": 120, "fam-a": 120, "unknown": 240}, "fam-b": {"fam-a": 120, "unknown": 120}}
    }
    assert "| 2/2 | fam-b | 120 | 0 | 120 |" in md
    # the training reward per family, paired with its silo: fam-a 0.1 lower in every seed, fam-b on average not
    reward_a, reward_b = a["reward_vs_base"], b["reward_vs_base"]
    assert reward_a["mean_diff"] == pytest.approx(-0.1) and reward_a["wins"] == 0 and reward_a["seeds"] == 4
    assert reward_a["p_perm"] == pytest.approx(2 / 16) and reward_b["mean_diff"] == pytest.approx(0.0, abs=1e-12)
    assert reward_b["wins"] == 2 and reward_b["p_perm"] == pytest.approx(1.0)
    assert "| 2/2 | fam-a | 0.2000 ± 0.0000 | -0.1000 | [-0.1000, -0.1000] | n/a | 0.125 | 0/4 |" in md
    assert "| 4/0 | fam-b | 0.3000 ± 0.0000 | baseline | — |" in md
    assert (out / "heldout_per_family.png").stat().st_size > 0
    console = capsys.readouterr().out
    assert "fam-a 2/2 − 4/0, held-out final: +0.0500" in console and "Holm p = 0.250" in console


def newcomer_acc(cfg, seed):
    """The newcomer: 0.1 + 0.01 t alone, 0.1 + 0.015 t + 0.01 seed beside the veterans."""
    return (lambda t: 0.1 + 0.01 * t) if cfg == "4/0" else (lambda t: 0.1 + 0.015 * t + 0.01 * seed)


def veteran_level(seed):
    return 0.9 if seed == 3 else 0.6  # half of it: 0.3, and 0.45 in seed 3 (which the silo never reaches)


def write_newcomer_tree(exp):
    for s in SEEDS:
        write_run(exp, "4/0", s, {0: ("default", newcomer_acc("4/0", s))}, unseen=True)
        write_run(
            exp,
            "2/2",
            s,
            {
                0: ("default", newcomer_acc("2/2", s)),
                **{p: ("default", lambda t, s=s: veteran_level(s)) for p in range(1, 5)},
            },
            unseen=True,
        )


def test_focus_peer_newcomer_against_its_silo_and_the_veterans(tmp_path, capsys):
    exp = tmp_path / "exp"
    write_newcomer_tree(exp)
    out = tmp_path / "report"
    assert main([str(exp), "--out", str(out), "--focus-peer", "0"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert "families" not in summary or not summary["families"]  # one model: no family view
    foc = summary["focus"]
    assert foc["peer"] == "peer0" and foc["veterans"] == {"4/0": [0], "2/2": [4]}
    silo, swarm = foc["per_config"]["4/0"], foc["per_config"]["2/2"]
    # its own area (trapezoids over rounds 0..29 of a line / 29) is the line's midpoint value
    assert silo["eval_area_mean"] == pytest.approx(0.1 + 0.01 * 14.5)
    effect = swarm["eval_area_vs_base"]
    assert effect["mean_diff"] == pytest.approx(0.005 * 14.5 + 0.015)  # + 0.01 x mean seed
    assert effect["p_perm"] == pytest.approx(2 / 16) and effect["n"] == 4
    assert swarm["unseen_area_vs_base"]["mean_diff"] == pytest.approx(effect["mean_diff"])  # the same, 0.05 lower
    # half the veterans: 0.3 (0.45 in seed 3); reached alone at 20 (never: 30), beside them at 15 (25)
    assert foc["half_veterans_by_seed"] == {"0": 0.3, "1": 0.3, "2": 0.3, "3": 0.45}
    assert silo["rounds_to_half_by_seed"] == {"0": 20, "1": 20, "2": 20, "3": 30}
    assert swarm["rounds_to_half_by_seed"] == {"0": 15, "1": 15, "2": 15, "3": 25}
    assert swarm["rounds_to_half_vs_base"]["mean_diff"] == -5
    assert swarm["reward_vs_base"]["mean_diff"] == 0 and swarm["reward_vs_base"]["wins"] == 0  # 0.1 in both
    md = (out / "report.md").read_text()
    assert "## Focus peer: peer0" in md and md.index("## Focus peer") < md.index("## Held-out accuracy")
    assert "| 2/2 | s0: 15, s1: 15, s2: 15, s3: 25 | -5.0 | 0.125 |" in md
    assert "| 4/0 | s0: 20, s1: 20, s2: 20, s3: 30 | baseline | — |" in md
    assert "veterans (per configuration: 4/0: 0, 2/2: 4)" in md
    assert "| 2/2 | peer0 | 0.1000 ± 0.0000 | +0.0000 |" in md.split("## Focus peer")[1]  # its own reward only
    assert "Unseen set:" in md.split("## Focus peer")[1].split("## Held-out accuracy")[0]
    # the swarm means average 5 agents against 1: shown, never tested against each other
    whole = summary["per_config"]["2/2"]
    assert whole["agents_differ"] and "eval_final_vs_base" not in whole and "unseen_area_vs_base" not in whole
    assert summary["per_config"]["4/0"]["agents_differ"] is False
    assert (
        vs_cells(whole, "eval_final", False)[0] == "other agents"
        and vs_cells({}, "eval_final", True)[0] == "baseline"
        and vs_cells({}, "unseen_final", False)[0] == "n/a"
    )  # a set the baseline lacks: no comparison
    heldout = md.split("## Held-out accuracy")[1].split("## Unseen")[0]
    assert "| 2/2 | other agents | — | — | — |" in heldout and "other agents" in md.split("## Cumulative")[1]
    assert (out / "focus_peer.png").stat().st_size > 0
    assert "peer0 2/2 − 4/0, held-out area: +0.0875" in capsys.readouterr().out


def test_focus_on_a_peer_that_is_not_there(tmp_path, capsys):
    exp = tmp_path / "exp"
    write_newcomer_tree(exp)
    assert main([str(exp), "--out", str(tmp_path / "r"), "--focus-peer", "7"]) == 2
    assert "no agent named 'peer7'" in capsys.readouterr().err

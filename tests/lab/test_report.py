import json
import math

import numpy as np
import pytest

from node.lab.paired import bootstrap_improvement, paired_sign_test
from node.lab.report import main
from node.lab.runs import load_runs
from node.lab.stats import holm_across, moving_average, summarize

# reward(config, seed, peer, round t) = BASE[config] + 0.02 * t + 0.01 * seed  (same for both peers)
BASE = {"4/0": 0.10, "2/2": 0.25}
SEEDS = (0, 1, 2)
PEERS = (0, 1)
ROUNDS = 10


def reward(cfg, s, t):
    return BASE[cfg] + 0.02 * t + 0.01 * s


# held-out accuracy(config, seed, round t) = EVAL_BASE[config] + 0.01 * t + 0.01 * seed, at rounds 0, 5, 9
EVAL_BASE = {"4/0": 0.20, "2/2": 0.30}
# unseen accuracy(config, seed, round t) = UNSEEN_BASE[config] + 0.005 * t + 0.01 * seed, at the same rounds
UNSEEN_BASE = {"4/0": 0.10, "2/2": 0.15}
# token entropy(config, round t) = ENTROPY[config] - 0.1 * t: falling, and different per config
ENTROPY = {"4/0": 2.0, "2/2": 1.5}


# completion tokens a peer samples per round, and the starting weights' held-out accuracy (round 0's line)
TOKENS = {"4/0": 400, "2/2": 200}
START = 0.15


def write_exp(root, *, corrupt=True, held_out=False, unseen=False, tokens=False, start=True):
    for cfg in BASE:
        i, j = map(int, cfg.split("/"))
        for s in SEEDS:
            rd = root / cfg.replace("/", "-") / f"seed{s}"
            rd.mkdir(parents=True)
            (rd / "run.json").write_text(
                json.dumps(
                    {
                        "config_name": cfg,
                        "num_local": i,
                        "num_external": j,
                        "ij_policy": "fixed",
                        "seed": s,
                        "peers": len(PEERS),
                        "rounds": ROUNDS,
                    }
                )
            )
            for p in PEERS:
                pd = rd / f"peer{p}"
                pd.mkdir()
                lines = []
                for t in range(ROUNDS):
                    rec = {
                        "round": t,
                        "reward_mean": reward(cfg, s, t),
                        "num_local": i,
                        "num_external": j,
                        "target_external": j,
                        "round_s": 1.5,
                    }
                    if j:
                        rec.update(external_accepted=3, external_rejected=1)
                    if tokens:
                        rec.update(tokens_generated=TOKENS[cfg] + 10 * p)  # peers differ: their mean counts
                        if t == 0 and start:  # the collapse guard's start evaluation
                            rec.update(start_accuracy=START + 0.01 * p)
                    if held_out:
                        rec.update(signal_frac=1.0 - 0.1 * t, entropy_mean=ENTROPY[cfg] - 0.1 * t)
                        if t % 5 == 0 or t == ROUNDS - 1:
                            rec.update(
                                {
                                    "eval_accuracy": EVAL_BASE[cfg] + 0.01 * t + 0.01 * s,
                                    "eval_accuracy/count_bits": 0.5,
                                    "eval_s": 2.0,
                                    "eval_baseline": 0.245,
                                    "eval_distinct_gold": 0.5,
                                    "eval_distinct_answers": 0.2 if (cfg, s, p) == ("2/2", 2, 1) else 0.4,
                                }
                            )
                            if unseen:
                                rec.update(
                                    eval_unseen_accuracy=UNSEEN_BASE[cfg] + 0.005 * t + 0.01 * s,
                                    eval_unseen_baseline=0.17,
                                    eval_unseen_size=64,
                                )
                    lines.append(json.dumps(rec))
                if corrupt and cfg == "2/2" and s == 1 and p == 0:
                    lines.insert(3, "this is not json")
                    lines.insert(5, "")  # blank: ignored, not counted
                    lines.append('{"round": 10, "reward_me')  # truncated last line
                (pd / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root


def held_out_report(tmp_path, holm=(), **logged):
    """(summary.json, report.md) of sapo-report over an experiment whose lines carry held-out accuracy and
    what `logged` adds (write_exp's flags); `holm`: its --holm family."""
    exp = write_exp(tmp_path / "exp", corrupt=False, held_out=True, **logged)
    out = tmp_path / "out"
    assert main([str(exp), "--out", str(out), *(["--holm", *holm] if holm else [])]) == 0
    return json.loads((out / "summary.json").read_text()), (out / "report.md").read_text()


def test_report_end_to_end(tmp_path, capsys):
    exp = write_exp(tmp_path / "exp")
    out = tmp_path / "out"
    assert main([str(exp), "--out", str(out)]) == 0
    md = (out / "report.md").read_text()

    # cumulative per seed = 2 peers * sum_t (base + 0.02 t + 0.01 s) = 20*base + 1.8 + 0.2*s
    #   4/0: 3.8, 4.0, 4.2 -> mean 4.00, std 0.20 ;  2/2: 6.8, 7.0, 7.2 -> mean 7.00, std 0.20
    assert "| 4/0 | 4.00 ± 0.20 | s0: 3.80, s1: 4.00, s2: 4.20 |" in md
    assert "| 2/2 | 7.00 ± 0.20 | s0: 6.80, s1: 7.00, s2: 7.20 |" in md
    # improvement = 100 * (7.0 / 4.0 - 1) = +75.00 %
    assert "+75.00%" in md
    assert "| 3/3 (p = 0.125) |" in md  # 2/2 beats 4/0 in every paired seed; 0.5^3
    assert "Baseline: **4/0**" in md
    # acceptance 3 / (3 + 1)
    assert "75.0%" in md
    # corrupt lines: 2 (garbage + truncated); blank line not counted
    assert "Corrupt metrics lines skipped: **2**" in md
    assert "No adaptive runs" in md
    for name in ("per_agent_rewards.png", "moving_average_band.png", "cumulative_reward.png", "j_trajectory.png"):
        f = out / name
        assert f.exists() and f.stat().st_size > 1000, name
        assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"({name})" in md
    s = json.loads((out / "summary.json").read_text())
    assert s["skipped_lines"] == 2
    assert s["per_config"]["2/2"]["improvement_pct"] == pytest.approx(75.0)
    lo, hi = s["per_config"]["2/2"]["improvement_ci"]
    assert lo <= 75.0 <= hi
    printed = capsys.readouterr().out
    assert "+75.00%" in printed and "skipped 2 corrupt" in printed


def test_report_leads_with_held_out_accuracy(tmp_path, capsys):
    exp = write_exp(tmp_path / "exp", corrupt=False, held_out=True)
    out = tmp_path / "out"
    assert main([str(exp), "--out", str(out)]) == 0
    s = json.loads((out / "summary.json").read_text())
    d, b = s["per_config"]["2/2"], s["per_config"]["4/0"]
    # final = value at round 9: 4/0 0.29 + 0.01 s -> mean 0.30; 2/2 -> 0.40: +33.33 %
    assert b["eval_final_mean"] == pytest.approx(0.30) and d["eval_final_mean"] == pytest.approx(0.40)
    assert d["eval_final_vs_base"]["pct"] == pytest.approx(100 / 3)
    assert d["eval_final_vs_base"]["wins"] == 3 and d["eval_final_vs_base"]["p"] == pytest.approx(0.125)
    # a linear curve: trapezoids are exact, area / span = value at round 4.5 -> 0.255 vs 0.355
    assert b["eval_area_mean"] == pytest.approx(0.255) and d["eval_area_mean"] == pytest.approx(0.355)
    assert d["eval_area_vs_base"]["pct"] == pytest.approx(100 * (0.355 / 0.255 - 1))
    # signal_frac 1.0 - 0.1 t: all rounds mean 0.55; last quarter (rounds 7..9, 2 of 10 -> rounds 8, 9) 0.15
    assert d["signal_frac_mean"] == pytest.approx(0.55) and d["signal_frac_last_quarter"] == pytest.approx(0.15)
    # entropy: all rounds mean ENTROPY - 0.45, last quarter (rounds 8, 9) ENTROPY - 0.85, each config its own
    assert d["entropy_mean"] == pytest.approx(1.05) and d["entropy_last_quarter"] == pytest.approx(0.65)
    assert b["entropy_mean"] == pytest.approx(1.55) and b["entropy_last_quarter"] == pytest.approx(1.15)
    md = (out / "report.md").read_text()
    assert md.index("## Held-out accuracy") < md.index("## Cumulative reward (training reward, the second view)")
    assert "| 2/2 | 0.4000 ± 0.0100 | +33.33% |" in md
    # collapsed at the last evaluation: 4/0 seed 0 ends at 0.29 <= 0.245 + 0.05 (both agents); one 2/2 agent
    # gives 0.2 distinct answers per task where the gold answers have 0.5
    assert (d["collapsed_final"], d["evaluated_peers"], b["collapsed_final"], b["evaluated_peers"]) == (1, 6, 2, 6)
    assert "| 2/2 | 1 of 6 | 0.550 | 0.150 | 1.050 | 0.650 |" in md
    assert "| 4/0 | 2 of 6 | 0.550 | 0.150 | 1.550 | 1.150 |" in md
    assert (out / "heldout_and_collapse.png").stat().st_size > 1000
    assert (out / "heldout_by_seed.png").stat().st_size > 1000 and "(heldout_by_seed.png)" in md
    # every 2/2 seed is 0.10 ahead of its 4/0 twin: the paired CI is that difference, p the smallest for 3 seeds
    assert d["eval_final_vs_base"]["ci_low"] == pytest.approx(0.10) == d["eval_final_vs_base"]["ci_high"]
    assert d["eval_final_vs_base"]["p_perm"] == pytest.approx(2 / 8)
    printed = capsys.readouterr().out
    assert "held-out final" in printed and "+33.33%" in printed and "2 of 6" in printed
    assert "unseen" not in printed and "Unseen" not in md and not b["unseen_final_by_seed"]  # not logged


def test_report_sets_the_held_out_gain_beside_the_tokens_generated(tmp_path, capsys):
    s, md = held_out_report(tmp_path, tokens=True)
    d, b = s["per_config"]["2/2"], s["per_config"]["4/0"]
    # a peer's tokens: 10 rounds x (TOKENS + 10 p), mean over peers 0 and 1 -> 10 x (TOKENS + 5)
    assert b["tokens_mean"] == pytest.approx(4050) and d["tokens_mean"] == pytest.approx(2050)
    # gain = a peer's final (EVAL_BASE + 0.09 + 0.01 s) - its start (0.15 + 0.01 p), mean over peers:
    # 2/2 seed 1 -> 0.40 - 0.155 = 0.245
    assert d["gain_by_seed"]["1"] == pytest.approx(0.245) and b["gain_mean"] == pytest.approx(0.145)
    assert d["gain_per_100k_by_seed"]["1"] == pytest.approx(0.245 / 0.0205)
    assert md.index("## Held-out accuracy") < md.index("## Generated tokens") < md.index("## Cumulative reward")
    assert "| 2/2 | 2.0 ± 0.0 | 0.51× | +0.245 ± 0.010 | " in md and "| 4/0 | 4.0 ± 0.0 | — |" in md


def test_report_without_token_counts_has_no_token_section(tmp_path, capsys):
    s, md = held_out_report(tmp_path)
    assert "## Generated tokens" not in md and not s["per_config"]["2/2"]["tokens_by_seed"]


def test_report_says_when_no_start_was_logged_to_measure_a_gain_from(tmp_path):
    s, md = held_out_report(tmp_path, tokens=True, start=False)
    assert s["per_config"]["2/2"]["tokens_mean"] == pytest.approx(2050) and not s["per_config"]["2/2"]["gain_by_seed"]
    assert "No run logged its starting weights' accuracy" in md


def test_holm_corrects_the_named_arms_comparisons_with_the_silo_only(tmp_path):
    per = {
        "4/0": {},
        "2/2 a": {"eval_final_vs_base": {"p_perm": 0.01}, "eval_area_vs_base": {"p_perm": 0.03}},
        "2/2 b": {"eval_final_vs_base": {"p_perm": 0.04}, "eval_area_vs_base": {"p_perm": 0.02}},
        "2/2 c": {"eval_final_vs_base": {"p_perm": 0.001}, "eval_area_vs_base": {"p_perm": 0.001}},
    }
    holm_across(per, "4/0", ["2/2 a", "2/2 b"])  # c is reported, not in the family
    assert [per[c]["eval_area_vs_base"]["p_holm"] for c in ("2/2 a", "2/2 b")] == pytest.approx([0.04, 0.04])
    assert [per[c]["eval_final_vs_base"]["p_holm"] for c in ("2/2 a", "2/2 b")] == pytest.approx([0.02, 0.04])
    assert "p_holm" not in per["2/2 c"]["eval_area_vs_base"]
    del per["2/2 b"]["eval_area_vs_base"]  # a member without a test still counts: m stays 2
    per["2/2 b"]["eval_final_vs_base"]["p_perm"] = math.nan
    holm_across(per, "4/0", ["2/2 a", "2/2 b"])
    assert per["2/2 a"]["eval_area_vs_base"]["p_holm"] == pytest.approx(0.06)
    assert per["2/2 a"]["eval_final_vs_base"]["p_holm"] == pytest.approx(0.02)
    assert math.isnan(per["2/2 b"]["eval_final_vs_base"]["p_holm"])  # no p of its own: none adjusted
    for bad in (["4/0"], ["2/2 z"]):  # the baseline itself, an unknown arm
        with pytest.raises(ValueError, match="--holm"):
            holm_across(per, "4/0", bad)


def test_report_names_the_holm_family_in_its_paired_table(tmp_path, capsys):
    s, md = held_out_report(tmp_path, holm=["2/2", "2/2"])  # named twice: one member
    area = s["per_config"]["2/2"]["eval_area_vs_base"]
    assert area["p_holm"] == pytest.approx(area["p_perm"])  # a family of one
    assert "| config | final: mean diff | 95% CI | d_z | p | Holm p | area: mean diff |" in md
    assert "corrected across 2/2 (the family named with --holm)" in md
    assert main([str(tmp_path / "exp"), "--out", str(tmp_path / "o2"), "--holm", "1/3"]) == 2
    assert "--holm needs configurations" in capsys.readouterr().err


def test_report_compares_the_unseen_set_too(tmp_path, capsys):
    s, md = held_out_report(tmp_path, unseen=True)
    d, b = s["per_config"]["2/2"], s["per_config"]["4/0"]
    assert s["has_unseen"] and s["unseen_baseline"] == pytest.approx(0.17)
    # final = value at round 9: 4/0 0.145 + 0.01 s -> mean 0.155; 2/2 -> 0.205
    assert b["unseen_final_mean"] == pytest.approx(0.155) and d["unseen_final_mean"] == pytest.approx(0.205)
    assert d["unseen_final_vs_base"]["pct"] == pytest.approx(100 * (0.205 / 0.155 - 1))
    assert d["unseen_final_vs_base"]["ci_low"] == pytest.approx(0.05) == d["unseen_final_vs_base"]["ci_high"]
    assert d["unseen_area_mean"] == pytest.approx(0.15 + 0.0225 + 0.01)  # the value at round 4.5
    assert d["eval_final_mean"] == pytest.approx(0.40)  # the in-distribution figures are unchanged
    assert md.index("## Held-out accuracy") < md.index("## Unseen held-out accuracy") < md.index("## Collapse")
    assert "Constant-answer baseline of the unseen set: **0.1700**" in md
    assert f"| 2/2 | 0.2050 ± 0.0100 | {100 * (0.205 / 0.155 - 1):+.2f}% |" in md
    assert "unseen final" in capsys.readouterr().out


def test_summarize_numbers(tmp_path):
    runs = load_runs([write_exp(tmp_path / "exp")])
    assert len(runs) == 6 and all(len(r.peers) == 2 for r in runs)
    s = summarize(runs, threshold=0.345, window=5)
    assert s["configs"] == ["4/0", "2/2"] and s["baseline"] == "4/0"
    b, c = s["per_config"]["4/0"], s["per_config"]["2/2"]
    assert b["cumulative_by_seed"] == pytest.approx({"0": 3.8, "1": 4.0, "2": 4.2})
    assert c["cumulative_mean"] == pytest.approx(7.0)
    assert c["cumulative_std"] == pytest.approx(0.2)
    assert c["improvement_pct"] == pytest.approx(75.0)
    assert c["reward_per_agent_round"] == pytest.approx(0.35)
    # MA(window 5) at round t = base + 0.02 (t - 2) + 0.01 s ; 2/2 reaches 0.345 at t = 7, 7, 6
    assert c["rounds_to_threshold_by_seed"] == {"0": 7, "1": 7, "2": 6}
    assert c["rounds_to_threshold_mean"] == pytest.approx(20 / 3)
    assert b["rounds_to_threshold_by_seed"] == {"0": None, "1": None, "2": None}
    # per-round swarm mean is linear: std over rounds = 0.02 * std(0..9) ; no drops on a rising curve
    assert c["reward_std_mean"] == pytest.approx(0.02 * np.std(np.arange(10)))
    assert c["steep_drops_mean"] == 0 and c["max_drawdown_mean"] == pytest.approx(0.0)
    assert c["acceptance_rate"] == pytest.approx(0.75)
    assert math.isnan(b["acceptance_rate"])
    assert s["skipped_lines"] == 2
    # default threshold: 0.5 x max MA(window 10) = 0.5 * (0.25 + 0.09 + 0.02)
    assert summarize(runs)["threshold"] == pytest.approx(0.18)
    # bootstrap is deterministic
    assert summarize(runs)["per_config"]["2/2"]["improvement_ci"] == s["per_config"]["2/2"]["improvement_ci"]


def test_fallback_names_adaptive_drops_and_single_seed(tmp_path, capsys):
    exp = tmp_path / "exp2"
    # no run.json: config / seed from directory names
    for cfg, js, rewards in [
        ("silo", [0] * 20, [0.5] * 20),
        # reward drops from 0.6 to 0.2 between the first and second block of 10 rounds
        ("adaptive", [4, 5, 6, 5, 4, 3, 4, 4, 5, 5] * 2, [0.6] * 10 + [0.2] * 10),
    ]:
        d = exp / cfg / "seed7" / "peerA"
        d.mkdir(parents=True)
        d.joinpath("metrics.jsonl").write_text(
            "\n".join(
                json.dumps(
                    {
                        "round": t + 1,
                        "reward_mean": r,
                        "num_local": 8 - j,
                        "num_external": j if cfg != "silo" else 0,
                        "target_external": j,
                    }
                )
                for t, (j, r) in enumerate(zip(js, rewards))
            )
        )
    out = tmp_path / "o"
    assert main([str(exp), "--out", str(out), "--baseline", "silo", "--drop", "0.3"]) == 0
    md = (out / "report.md").read_text()
    assert "degenerate CI: 1 seed each" in md
    # cumulative: silo 20*0.5 = 10 ; adaptive 10*0.6 + 10*0.2 = 8 -> -20 %
    assert "-20.00%" in md
    assert "![J trajectory](j_trajectory.png)" in md
    runs = load_runs([exp])
    assert {(r.config, r.seed) for r in runs} == {("silo", "7"), ("adaptive", "7")}
    s = summarize(runs, baseline="silo", drop=0.3)
    a = s["per_config"]["adaptive"]
    assert a["adaptive"] and not s["per_config"]["silo"]["adaptive"]
    assert a["steep_drops_mean"] == 1
    assert a["max_drawdown_mean"] == pytest.approx(0.4)
    assert a["mean_target_j"] == pytest.approx(4.5)
    assert a["final_target_j_mean"] == 5
    with pytest.raises(ValueError, match="baseline"):
        summarize(runs, baseline="nope")
    assert main([str(exp), "--out", str(out), "--baseline", "nope"]) == 2


def test_no_metrics_and_all_corrupt(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert main([str(tmp_path / "empty"), "--out", str(tmp_path / "o")]) == 2
    d = tmp_path / "bad" / "c" / "seed0" / "peer0"
    d.mkdir(parents=True)
    d.joinpath("metrics.jsonl").write_text(
        '[1, 2]\n{"round": "x", "reward_mean": 1}\n{"round": true, "reward_mean": 1}\n'
    )
    assert main([str(tmp_path / "bad")]) == 2
    assert "3 corrupt" in capsys.readouterr().err


def test_paired_sign_test():
    assert paired_sign_test({"0": 2.0, "1": 3.0, "2": 1.0}, {"0": 1.0, "1": 1.0, "2": 1.5}) == (2, 3, 0.5)
    assert paired_sign_test({"0": 2.0, "1": 3.0}, {"0": 1.0, "1": 1.0, "7": 9.0}) == (2, 2, 0.25)
    wins, n, p = paired_sign_test({str(k): 1.0 for k in range(5)}, {str(k): 0.0 for k in range(5)})
    assert (wins, n, p) == (5, 5, 1 / 32)
    # a tie carries no sign: 1 win out of 1 informative pair
    assert paired_sign_test({"0": 1.0, "1": 2.0}, {"0": 1.0, "1": 1.0}) == (1, 2, 0.5)
    wins, n, p = paired_sign_test({}, {"0": 1.0})
    assert (wins, n) == (0, 0) and math.isnan(p)


def test_moving_average_and_bootstrap_helpers():
    ma = moving_average(np.array([1.0, 2.0, np.nan, 4.0, 5.0]), 2)
    assert np.isnan(ma[0])
    assert ma[1:].tolist() == [1.5, 2.0, 4.0, 4.5]
    assert moving_average(np.array([1.0, 3.0]), 10).tolist()[-1] == 2.0
    pt, lo, hi, note = bootstrap_improvement([2.0], [1.0])
    assert pt == lo == hi == 100.0 and "degenerate" in note
    pt, lo, hi, note = bootstrap_improvement([2.0, 2.0, 2.0], [1.0, 1.0])
    assert pt == lo == hi == pytest.approx(100.0)
    pt, lo, hi, note = bootstrap_improvement([1.0, 3.0], [1.0, 1.0], n_boot=500)
    assert pt == pytest.approx(100.0) and lo == pytest.approx(0.0) and hi == pytest.approx(200.0)


def test_paired_effect_exact_permutation_and_d_z():
    from node.lab.paired import paired_effect

    base = {str(k): 0.5 for k in range(5)}
    up = {str(k): 0.5 + d for k, d in enumerate([0.1, 0.2, 0.15, 0.05, 0.1])}
    eff = paired_effect(up, base)
    diffs = np.array([0.1, 0.2, 0.15, 0.05, 0.1])
    assert eff["n"] == 5 and eff["mean_diff"] == pytest.approx(diffs.mean())
    assert eff["d_z"] == pytest.approx(diffs.mean() / diffs.std(ddof=1))
    assert eff["p_perm"] == pytest.approx(2 / 32)  # all five ahead: only the all-plus and all-minus flips tie
    assert 0.05 <= eff["ci_low"] < eff["mean_diff"] < eff["ci_high"] <= 0.2  # resampled means stay in range
    mixed = paired_effect({k: base[k] + d for k, d in zip(base, [0.1, -0.1, 0.05, -0.05, 0.0])}, base)
    assert mixed["mean_diff"] == pytest.approx(0.0) and mixed["p_perm"] == 1.0
    assert math.isnan(paired_effect({"9": 1.0}, base)["p_perm"])  # no common seed: no test


def write_local_swarm(root, peers=5, rounds=12, unseen=False):
    """scripts/local_swarm.sh's layout: ROOT/bootstrap/, ROOT/peer<i>/ (metrics, logs, tb/), ROOT/local_swarm.log;
    no run.json. Peer i's reward at round t: 0.1 + 0.01 i + 0.02 t; held-out every 5 rounds and at the end."""
    (root / "bootstrap").mkdir(parents=True)
    (root / "bootstrap" / "maddrs.txt").write_text("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWabc\n")
    (root / "bootstrap" / "bootstrap.log").write_text("bootstrap up\n")
    (root / "local_swarm.log").write_text("finished\n")
    for i in range(peers):
        d = root / f"peer{i}"
        (d / "tb").mkdir(parents=True)
        (d / "node.log").write_text("round 0 | ...\n")
        (d / "console.log").write_text("")
        lines = []
        for t in range(rounds):
            rec = {
                "round": t,
                "reward_mean": 0.1 + 0.01 * i + 0.02 * t,
                "num_local": 2,
                "num_external": 2,
                "target_external": 2,
                "external_accepted": 4,
                "external_rejected": 0,
                "ij_policy": "fixed",
                "signal_frac": 0.5,
                "entropy_mean": 1.0,
            }
            if t % 5 == 0 or t == rounds - 1:
                rec.update(eval_accuracy=0.5 + 0.01 * t, eval_baseline=0.5625, eval_size=64)
                if unseen:
                    rec.update(eval_unseen_accuracy=0.1 + 0.01 * i, eval_unseen_baseline=0.17)
            lines.append(json.dumps(rec))
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return root


def test_local_swarm_dir_is_one_configuration_with_five_agents(tmp_path, capsys):
    root = write_local_swarm(tmp_path / "runs" / "local-swarm")
    runs = load_runs([root])
    assert [(r.config, r.seed, len(r.peers)) for r in runs] == [("local-swarm", "0", 5)]
    assert [p.peer for p in runs[0].peers] == [f"peer{i}" for i in range(5)]

    # the command local_swarm.sh suggests when it finishes: sapo-report ROOT (report into ROOT/report)
    assert main([str(root)]) == 0
    printed = capsys.readouterr().out
    md = (root / "report" / "report.md").read_text()
    s = json.loads((root / "report" / "summary.json").read_text())
    assert s["configs"] == ["local-swarm"] and s["baseline"] is None
    assert s["per_config"]["local-swarm"]["peers"] == [5]
    assert "One configuration, **local-swarm**: 1 run(s) with 5 agents" in md
    for i in range(5):  # one row per agent; mean reward = 0.1 + 0.01 i + 0.02 * 5.5
        assert f"| seed 0 | peer{i} | 12 | {0.21 + 0.01 * i:.4f} |" in md
    assert "vs baseline" not in md and "seeds ahead" not in md and "baseline" not in printed
    # cumulative = sum over 5 peers and 12 rounds: 60 * 0.1 + 12 * 0.01 * (0 + 1 + 2 + 3 + 4) + 5 * 0.02 * 66 = 13.8
    assert "| local-swarm | 13.80 ± 0.00 | s0: 13.80 | 0.2300 |" in md
    assert "Constant-answer baseline: **0.5625**" in md and "unseen" not in md
    for name in ("per_agent_rewards.png", "moving_average_band.png", "heldout_and_collapse.png"):
        assert (root / "report" / name).stat().st_size > 1000
    # with an unseen set, each agent's row ends with its final unseen accuracy
    other = write_local_swarm(tmp_path / "runs" / "unseen", unseen=True)
    assert main([str(other)]) == 0
    md = (other / "report" / "report.md").read_text()
    assert "final held-out accuracy | final unseen accuracy |" in md and "| 0.6100 | 0.1300 |" in md


def test_held_out_plot_draws_the_constant_answer_baseline(tmp_path, monkeypatch):
    """The baseline is a line in the held-out panel (what accuracy must beat), labelled with its value."""
    from matplotlib.axes import Axes

    from node.lab import figures

    drawn = []
    real = Axes.axhline
    monkeypatch.setattr(
        Axes, "axhline", lambda ax, y=0, *a, **k: drawn.append((y, k.get("label"))) or real(ax, y, *a, **k)
    )
    runs = load_runs([write_local_swarm(tmp_path / "ls")])
    figures.fig_learning_health(runs, summarize(runs), tmp_path / "h.png")
    assert (0.5625, "constant-answer baseline 0.562") in drawn
    assert not [label for _, label in drawn if "unseen" in label]
    drawn.clear()
    runs = load_runs([write_exp(tmp_path / "exp", corrupt=False, held_out=True, unseen=True)])
    figures.fig_learning_health(runs, summarize(runs), tmp_path / "u.png")
    assert (0.17, "constant answer, unseen set 0.170") in drawn


def test_the_report_and_run_json_name_the_evaluator(tmp_path, capsys):
    """Which evaluator decoded the held-out answers (eval_engine; torch in records from before the key): the
    report names it, and warns when the runs it compares were decoded by different ones."""
    from node.lab.runs import run_engines

    exp = write_exp(tmp_path / "exp", corrupt=False, held_out=True)
    for path in (exp / "2-2").glob("seed*/peer*/metrics.jsonl"):
        recs = [json.loads(x) for x in path.read_text().splitlines()]
        path.write_text(
            "".join(json.dumps({**r, "eval_engine": "llama"} if "eval_accuracy" in r else r) + "\n" for r in recs)
        )
    assert run_engines(exp / "2-2" / "seed0")["evaluators"] == ["llama"]
    assert run_engines(exp / "4-0" / "seed0")["evaluators"] == ["torch"]
    # what sampled: the records' rollout_engine; a stretch logged before the key is named too
    path = exp / "2-2" / "seed1" / "peer0" / "metrics.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    wheel = "llama: ik-llama-cpp-python 0.1.5 (wheel)"
    path.write_text("".join(json.dumps({**r, "rollout_engine": wheel} if r["round"] > 3 else r) + "\n" for r in recs))
    assert run_engines(exp / "2-2" / "seed1")["rollout_engines"] == [wheel, "unrecorded"]
    assert run_engines(exp / "4-0" / "seed1") == {
        "evaluators": ["torch"],
        "rollout_engines": ["unrecorded"],
        "external_screens": ["unrecorded"],
    }
    summary = summarize(load_runs([exp]))
    assert summary["evaluators"] == ["llama", "torch"]
    assert summary["per_config"]["2/2"]["evaluators"] == ["llama"]
    assert any("decoded by llama and torch" in w for w in summary["warnings"])
    assert main([str(exp), "--out", str(tmp_path / "out")]) == 0
    assert "Decoded by: llama, torch" in (tmp_path / "out" / "report.md").read_text()

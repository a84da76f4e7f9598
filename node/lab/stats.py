"""The numbers behind `sapo-report`: moving averages, cumulative reward, held-out accuracy (final and area
under the curve), `summarize`; the comparisons over seeds are in `node.lab.paired`.

Definitions are in `node.lab.report`'s docstring, which is also what the report prints.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from node.lab.paired import bootstrap_improvement, holm, paired_effect, paired_sign_test
from node.lab.runs import IJ_RE, PeerSeries, Run, config_sort_key, seed_sort_key
from node.learn.guard import collapsed


def moving_average(x: np.ndarray, window: int) -> np.ndarray:
    """Trailing NaN-aware mean over `window` positions; NaN for the first window-1 positions.

    If len(x) < window the window shrinks to len(x).  A position whose window holds only NaN is NaN.
    """
    x = np.asarray(x, dtype=float)
    n = x.size
    out = np.full(n, np.nan)
    if n == 0:
        return out
    w = max(1, min(int(window), n))
    ok = np.isfinite(x)
    cs = np.concatenate([[0.0], np.cumsum(np.where(ok, x, 0.0))])
    cc = np.concatenate([[0], np.cumsum(ok)])
    s = cs[w:] - cs[:-w]
    c = cc[w:] - cc[:-w]
    with np.errstate(invalid="ignore", divide="ignore"):
        out[w - 1 :] = np.where(c > 0, s / np.maximum(c, 1), np.nan)
    return out


def align_series(series: Sequence[PeerSeries], attr: str = "reward") -> tuple[np.ndarray, np.ndarray]:
    """(union of rounds, matrix agents × rounds with NaN where an agent did not log the round)."""
    if not series:
        return np.array([], dtype=np.int64), np.zeros((0, 0))
    rounds = np.unique(np.concatenate([s.rounds for s in series]))
    mat = np.full((len(series), rounds.size), np.nan)
    for i, s in enumerate(series):
        mat[i, np.searchsorted(rounds, s.rounds)] = getattr(s, attr)
    return rounds, mat


def nanmean_rows(mat: np.ndarray) -> np.ndarray:
    ok = np.isfinite(mat)
    cnt = ok.sum(axis=0)
    tot = np.where(ok, mat, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, tot / np.maximum(cnt, 1), np.nan)


def swarm_curve(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, swarm-mean reward per round) of one run."""
    rounds, mat = align_series(run.peers)
    return rounds, (nanmean_rows(mat) if mat.size else np.array([]))


def _fmean(xs: Sequence[float]) -> float:
    v = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(v)) if v else math.nan


def _fstd(xs: Sequence[float]) -> float:
    v = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.std(v, ddof=1)) if len(v) >= 2 else (0.0 if len(v) == 1 else math.nan)


def _steep_drops(curve: np.ndarray, window: int, drop: float) -> int:
    n = curve.size // max(window, 1)
    if n < 2 or not math.isfinite(drop):
        return 0
    blocks = curve[: n * window].reshape(n, window)
    m = nanmean_rows(blocks.T)
    d = m[:-1] - m[1:]
    return int(np.sum(np.isfinite(d) & (d > drop)))


def _max_drawdown(ma: np.ndarray) -> float:
    v = ma[np.isfinite(ma)]
    if v.size == 0:
        return math.nan
    return float(np.max(np.maximum.accumulate(v) - v))


def eval_curve(run: Run, attr: str = "eval_acc") -> tuple[np.ndarray, np.ndarray]:
    """(evaluated rounds, swarm-mean held-out accuracy there) of one run; empty when it never evaluated.
    `attr` "unseen_acc": the unseen set's accuracy."""
    rounds, mat = align_series([p for p in run.peers if getattr(p, attr).size], attr)
    if not mat.size:
        return rounds, np.array([])
    curve = nanmean_rows(mat)
    keep = np.isfinite(curve)
    return rounds[keep], curve[keep]


def eval_area(rounds: np.ndarray, acc: np.ndarray) -> float:
    """Area under the held-out curve divided by its round span: the run's mean accuracy over time, in the
    units of accuracy (trapezoids between evaluated rounds; one evaluation is its own value)."""
    if acc.size == 0:
        return math.nan
    if acc.size == 1 or rounds[-1] == rounds[0]:
        return float(acc.mean())
    return float(np.sum((acc[1:] + acc[:-1]) / 2 * np.diff(rounds)) / (rounds[-1] - rounds[0]))


def _tail_mean(series: Sequence[np.ndarray], frac: float = 0.25) -> float:
    """Mean over the last `frac` of each agent's rounds (at least one), pooled."""
    vals = [x[-max(1, int(round(frac * x.size))) :] for x in series if x.size]
    v = np.concatenate(vals) if vals else np.array([])
    v = v[np.isfinite(v)]
    return float(v.mean()) if v.size else math.nan


HELD_OUT_SETS = {"eval": "eval_acc", "unseen": "unseen_acc"}  # summary key prefix -> PeerSeries attribute
HOLM_KEYS = ("eval_final", "eval_area")  # the held-out measures Holm-corrected across a family of tests


def reward_per_agent_round(run: Run) -> float:
    """The run's training reward per agent-round: the sum of its peers' `reward_mean` (the mean reward of
    their own sampled completions) over the rounds that logged one, divided by the count of those rounds."""
    rewards = np.concatenate([p.reward for p in run.peers]) if run.peers else np.array([])
    finite = rewards[np.isfinite(rewards)]
    return float(finite.mean()) if finite.size else math.nan


def learning_health(rs: Sequence[Run]) -> dict:
    """Held-out accuracy per seed (final and area under the curve), of the in-distribution set (eval_*) and
    the unseen one (unseen_*; empty without), the training reward per agent-round per seed, and the collapse
    signs of one config."""
    out: dict = {}
    for prefix, attr in HELD_OUT_SETS.items():
        final, area = {}, {}
        for r in rs:
            rounds, acc = eval_curve(r, attr)
            if acc.size:
                final[r.seed], area[r.seed] = float(acc[-1]), eval_area(rounds, acc)
        for key, by_seed in (("final", final), ("area", area)):
            out.update(
                {
                    f"{prefix}_{key}_by_seed": by_seed,
                    f"{prefix}_{key}_mean": _fmean(list(by_seed.values())),
                    f"{prefix}_{key}_std": _fstd(list(by_seed.values())),
                }
            )
    out.update(token_cost(rs))
    peers = [p for r in rs for p in r.peers]
    finals = [p.final_eval for p in peers if p.final_eval is not None]
    reward = {r.seed: reward_per_agent_round(r) for r in rs}
    return {
        **out,
        "reward_by_seed": reward,
        "reward_mean": _fmean(list(reward.values())),
        "reward_std": _fstd(list(reward.values())),
        "collapsed_final": sum(collapsed(e) for e in finals),  # peers collapsed at their last evaluation
        "evaluated_peers": len(finals),
        "signal_frac_mean": _tail_mean([p.signal_frac for p in peers], 1.0),
        "signal_frac_last_quarter": _tail_mean([p.signal_frac for p in peers]),
        "entropy_mean": _tail_mean([p.entropy for p in peers], 1.0),
        "entropy_last_quarter": _tail_mean([p.entropy for p in peers]),
    }


def token_cost(rs: Sequence[Run]) -> dict:
    """What a configuration's held-out gain cost in sampling, per seed: the completion tokens a peer generated
    over the run (the mean over its peers; a 2/2 peer samples half the local groups of a 4/0 peer), the mean
    gain of a peer's last held-out accuracy over its starting weights' (over the peers that logged both), and
    that gain per 100 000 tokens a peer generated. A seed without token counts, or without a peer that logged
    its start, is left out of that measure."""
    tokens, gain, per_100k = {}, {}, {}
    for r in rs:
        totals = [float(np.nansum(p.tokens_generated)) for p in r.peers if np.isfinite(p.tokens_generated).any()]
        gains = [
            float(p.eval_acc[np.isfinite(p.eval_acc)][-1]) - p.start_acc
            for p in r.peers
            if math.isfinite(p.start_acc) and np.isfinite(p.eval_acc).any()
        ]
        if totals:
            tokens[r.seed] = float(np.mean(totals))
        if gains:
            gain[r.seed] = float(np.mean(gains))
        if totals and gains and tokens[r.seed] > 0:
            per_100k[r.seed] = gain[r.seed] / (tokens[r.seed] / 1e5)
    out: dict = {}
    for key, by_seed in (("tokens", tokens), ("gain", gain), ("gain_per_100k", per_100k)):
        out[f"{key}_by_seed"] = by_seed
        out[f"{key}_mean"] = _fmean(list(by_seed.values()))
        out[f"{key}_std"] = _fstd(list(by_seed.values()))
    return out


def compare_heldout(d: dict, base: dict, n_boot: int, boot_seed: int) -> None:
    """Adds, for final and area held-out accuracy (and the unseen set's, where both sides have one): % vs the
    baseline, its bootstrap CI and the sign test."""
    for key in (f"{prefix}_{kind}" for prefix in HELD_OUT_SETS for kind in ("final", "area")):
        cfg_v, base_v = d[f"{key}_by_seed"], base[f"{key}_by_seed"]
        if not key.startswith("eval_") and not (cfg_v and base_v):
            continue
        pt, lo, hi, note = bootstrap_improvement(list(cfg_v.values()), list(base_v.values()), n_boot, boot_seed)
        wins, n, p = paired_sign_test(cfg_v, base_v)
        d[f"{key}_vs_base"] = {
            "pct": pt,
            "ci": [lo, hi],
            "note": note,
            "wins": wins,
            "seeds": n,
            "p": p,
            **paired_effect(cfg_v, base_v),
        }


def holm_across(per: dict[str, dict], base: str | None, family: Sequence[str]) -> None:
    """Holm-corrects the held-out comparisons (HOLM_KEYS) of the `family` configurations with the baseline: a
    design that tests several arms against one silo controls its error rate over them."""
    if not family:
        return
    unknown = [c for c in family if c not in per]
    if unknown or base is None or base in family:
        raise ValueError(
            f"--holm needs configurations compared with a baseline: {', '.join(unknown or family)} "
            f"(configurations: {', '.join(per)}; baseline: {base})"
        )
    for key in HOLM_KEYS:  # a member without a test (no paired seed, other agents) still counts toward m
        tests = {c: per[c].get(f"{key}_vs_base", {}) for c in dict.fromkeys(family)}
        for c, p in holm({c: t.get("p_perm", math.nan) for c, t in tests.items()}).items():
            if tests[c]:
                tests[c]["p_holm"] = p


def _pick_baseline(by_cfg: dict[str, list[Run]], requested: str | None) -> tuple[str | None, str]:
    if requested is not None:
        if requested not in by_cfg:
            raise ValueError(f"baseline {requested!r} not found; configurations: {', '.join(by_cfg)}")
        return requested, "given with --baseline"
    silo = [c for c, rs in by_cfg.items() if all(r.silo for r in rs)]
    named = [c for c in by_cfg if IJ_RE.match(c.strip()) and IJ_RE.match(c.strip()).group(2) == "0"]  # type: ignore[union-attr]
    both = [c for c in named if c in silo] or named or silo
    if not both:
        return None, "no silo configuration found (use --baseline)"
    if len(both) > 1:
        return both[0], f"several silo configurations ({', '.join(both)}); using the first (use --baseline)"
    return both[0], "silo configuration (num_external == 0)"


def summarize(
    runs: Sequence[Run],
    *,
    baseline: str | None = None,
    threshold: float | None = None,
    window: int = 10,
    drop: float | None = None,
    n_boot: int = 2000,
    boot_seed: int = 0,
    holm_family: Sequence[str] = (),
) -> dict:
    """Core numbers per configuration (see the module docstring for definitions).

    `holm_family`: configurations whose held-out comparisons with the baseline form one family of tests (a
    design's arms): their permutation p-values get a Holm-corrected `p_holm`.

    Returns a JSON-safe-ish dict (NaN where undefined) with keys: configs, baseline,
    baseline_reason, threshold, threshold_source, drop, drop_source, window, n_boot, boot_seed,
    skipped_lines, skipped_by_file, duplicate_rounds, unreadable_files, warnings, per_config{name: {...}}.
    """
    if window < 1:
        raise ValueError("window must be >= 1")
    by_cfg: dict[str, list[Run]] = {}
    for r in sorted(runs, key=lambda r: (config_sort_key(r.config), seed_sort_key(r.seed))):
        if r.peers:
            by_cfg.setdefault(r.config, []).append(r)
    warnings: list[str] = []
    empty = [f"{r.config} seed {r.seed}" for r in runs if not r.peers and not r.left_out]
    if empty:
        warnings.append(f"runs with no valid metrics: {', '.join(empty)}")

    for rs in by_cfg.values():
        for r in rs:
            most = max(p.rounds.size for p in r.peers)
            if short := [f"{p.peer} ({p.rounds.size})" for p in r.peers if p.rounds.size < most]:
                warnings.append(
                    f"{r.config} seed {r.seed}: {', '.join(short)} logged fewer rounds than the run's most "
                    f"({most}): stopped early, or a metrics.jsonl cut short; the others alone make its missing rounds' "
                    "swarm means"
                )
    curves = {id(r): swarm_curve(r) for rs in by_cfg.values() for r in rs}
    mas = {k: moving_average(v[1], window) for k, v in curves.items()}
    all_ma = np.concatenate([m for m in mas.values()]) if mas else np.array([])
    max_ma = float(np.nanmax(all_ma)) if np.any(np.isfinite(all_ma)) else math.nan
    if threshold is None:
        thr, thr_src = 0.5 * max_ma, f"0.5 × max observed moving average ({max_ma:.4g})"
    else:
        thr, thr_src = float(threshold), "given with --threshold"
    if drop is None:
        drp, drp_src = 0.1 * max_ma, f"0.1 × max observed moving average ({max_ma:.4g})"
    else:
        drp, drp_src = float(drop), "given with --drop"

    base_name, base_reason = _pick_baseline(by_cfg, baseline) if by_cfg else (None, "no runs")
    if len(by_cfg) == 1:  # e.g. one local swarm: its peers are agents of one configuration, not rivals
        base_name, base_reason = None, "one configuration: nothing to compare it with"

    per: dict[str, dict] = {}
    for cfg, rs in by_cfg.items():
        seeds = [r.seed for r in rs]
        cum = {r.seed: float(np.nansum(np.concatenate([p.reward for p in r.peers]))) for r in rs}
        rtt: dict[str, int | None] = {}
        rstd, drops, dd = {}, {}, {}
        for r in rs:
            rounds, cur = curves[id(r)]
            ma = mas[id(r)]
            hit = np.nonzero(np.isfinite(ma) & (ma >= thr))[0] if math.isfinite(thr) else np.array([])
            rtt[r.seed] = int(rounds[hit[0]]) if hit.size else None
            fin = cur[np.isfinite(cur)]
            rstd[r.seed] = float(np.std(fin)) if fin.size else math.nan
            drops[r.seed] = _steep_drops(cur, window, drp)
            dd[r.seed] = _max_drawdown(ma)
        acc = float(sum(np.nansum(p.accepted) for r in rs for p in r.peers))
        rej = float(sum(np.nansum(p.rejected) for r in rs for p in r.peers))
        has_acc = any(np.isfinite(p.accepted).any() or np.isfinite(p.rejected).any() for r in rs for p in r.peers)
        tj = np.concatenate([p.target_external for r in rs for p in r.peers])
        tj_fin = tj[np.isfinite(tj)]
        final_j = [
            p.target_external[np.isfinite(p.target_external)][-1]
            for r in rs
            for p in r.peers
            if np.isfinite(p.target_external).any()
        ]
        ne = np.concatenate([p.num_external for r in rs for p in r.peers])
        nl = np.concatenate([p.num_local for r in rs for p in r.peers])
        rs_s = np.concatenate([p.round_s for r in rs for p in r.peers])
        reached = [v for v in rtt.values() if v is not None]
        # per run: (fewest, most) rounds an agent logged: they differ where one stopped early or was cut short
        ranges = sorted({(min(p.rounds.size for p in r.peers), max(p.rounds.size for p in r.peers)) for r in rs})
        per[cfg] = {
            "ij_policy": ",".join(sorted({r.ij_policy for r in rs})),
            "adaptive": any(r.adaptive for r in rs),
            "silo": all(r.silo for r in rs),
            "seeds": seeds,
            "n_seeds": len(rs),
            "peers": sorted({len(r.peers) for r in rs}),
            "rounds": sorted({int(most) for _, most in ranges}),
            "rounds_range": ranges,
            "cumulative_by_seed": cum,
            "cumulative_mean": _fmean(list(cum.values())),
            "cumulative_std": _fstd(list(cum.values())),
            "reward_per_agent_round": _fmean([reward_per_agent_round(r) for r in rs]),
            "improvement_pct": math.nan,
            "improvement_ci": [math.nan, math.nan],
            "improvement_note": "",
            "paired_wins": None,
            "paired_seeds": None,
            "sign_test_p": math.nan,
            "rounds_to_threshold_by_seed": rtt,
            "rounds_to_threshold_mean": float(np.mean(reached)) if reached else math.nan,
            "seeds_reaching_threshold": len(reached),
            "reward_std_by_seed": rstd,
            "reward_std_mean": _fmean(list(rstd.values())),
            "steep_drops_by_seed": drops,
            "steep_drops_mean": _fmean([float(v) for v in drops.values()]),
            "max_drawdown_mean": _fmean(list(dd.values())),
            "external_accepted": int(acc) if has_acc else None,
            "external_rejected": int(rej) if has_acc else None,
            "acceptance_rate": (acc / (acc + rej)) if has_acc and (acc + rej) > 0 else math.nan,
            "mean_num_local": float(np.nanmean(nl)) if np.isfinite(nl).any() else math.nan,
            "mean_num_external": float(np.nanmean(ne)) if np.isfinite(ne).any() else math.nan,
            "mean_target_j": float(tj_fin.mean()) if tj_fin.size else math.nan,
            "final_target_j_mean": float(np.mean(final_j)) if final_j else math.nan,
            "mean_round_s": float(np.nanmean(rs_s)) if np.isfinite(rs_s).any() else math.nan,
            "skipped_lines": sum(r.skipped_lines for r in rs),
            "evaluators": sorted({p.evaluator for r in rs for p in r.peers if p.evaluator}),
            **learning_health(rs),
        }

    if base_name is not None:
        b = per[base_name]
        bvals = list(b["cumulative_by_seed"].values())
        for cfg, d in per.items():
            other_agents = d["agents_differ"] = d["peers"] != b["peers"]  # means over other agents: not paired
            if cfg == base_name:
                d["improvement_pct"], d["improvement_ci"], d["improvement_note"] = 0.0, [0.0, 0.0], "baseline"
            elif other_agents:
                d["improvement_note"] = "other agents: not paired"
            else:
                cum = d["cumulative_by_seed"]
                pt, lo, hi, note = bootstrap_improvement(list(cum.values()), bvals, n_boot, boot_seed)
                d["improvement_pct"], d["improvement_ci"], d["improvement_note"] = pt, [lo, hi], note
                d["paired_wins"], d["paired_seeds"], d["sign_test_p"] = paired_sign_test(cum, b["cumulative_by_seed"])
                compare_heldout(d, b, n_boot, boot_seed)
            if other_agents or d["rounds"] != b["rounds"]:
                warnings.append(
                    f"{cfg}: agents {d['peers']} / rounds {d['rounds']} differ from baseline {base_name} "
                    f"({b['peers']} / {b['rounds']}): cumulative sums are not directly comparable; see "
                    "reward per agent-round"
                    + (
                        "; the swarm means (held-out too) average other agents: "
                        "shown, not tested; compare one agent with --focus-peer"
                        if other_agents
                        else ""
                    )
                )

    holm_across(per, base_name, holm_family)
    evaluators = sorted({e for d in per.values() for e in d["evaluators"]})
    if len(evaluators) > 1:
        warnings.append(
            f"held-out answers were decoded by {' and '.join(evaluators)} (eval_engine; per configuration "
            "in summary.json): near-ties can go either way between them (docs/EVALUATION.md)"
        )
    skipped_by_file: dict[str, int] = {}
    unreadable: dict[str, str] = {}
    for r in runs:
        skipped_by_file.update(r.skipped_by_file)
        unreadable.update(r.unreadable)
    return {
        "configs": list(per),
        "baseline": base_name,
        "baseline_reason": base_reason,
        "threshold": thr,
        "threshold_source": thr_src,
        "drop": drp,
        "drop_source": drp_src,
        "window": window,
        "n_boot": n_boot,
        "boot_seed": boot_seed,
        "skipped_lines": sum(skipped_by_file.values()),
        "skipped_by_file": skipped_by_file,
        "duplicate_rounds": sum(r.duplicate_rounds for r in runs),
        "unreadable_files": unreadable,
        "warnings": warnings,
        "per_config": per,
        "has_eval": any(d["eval_final_by_seed"] for d in per.values()),
        "evaluators": evaluators,
        "eval_baseline": next(
            (p.eval_baseline for r in runs for p in r.peers if math.isfinite(p.eval_baseline)), math.nan
        ),
        "has_unseen": any(d["unseen_final_by_seed"] for d in per.values()),
        "has_tokens": any(d["tokens_by_seed"] for d in per.values()),
        "holm_family": list(dict.fromkeys(holm_family)),
        "unseen_baseline": next(
            (p.unseen_baseline for r in runs for p in r.peers if math.isfinite(p.unseen_baseline)), math.nan
        ),
    }

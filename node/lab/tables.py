"""The report's text: number formats, the held-out and collapse sections, the per-agent table, the console
table. Kept apart from `report` (which writes the files) so that each stays short."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from node.lab.runs import Run
from node.lab.stats import moving_average
from node.learn.packaged import model_label

FIGURES = {
    "per_agent": "per_agent_rewards.png",
    "ma_band": "moving_average_band.png",
    "cumulative": "cumulative_reward.png",
    "j_trajectory": "j_trajectory.png",
    "health": "heldout_and_collapse.png",
    "paired": "heldout_by_seed.png",
    "families": "heldout_per_family.png",
    "focus": "focus_peer.png",
}


def num(x: Any, fmt: str = ".2f", na: str = "n/a") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return na
    return format(x, fmt)


def pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:+.2f}%"


def md_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A markdown table and the blank line after it."""
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(row) + " |" for row in rows),
        "",
    ]


def unpaired(d: dict, is_base: bool) -> str | None:
    """Why a configuration is not compared with the baseline: it is the baseline, or its runs have other agents
    (no paired test of means over different agents); None where it is compared."""
    return "baseline" if is_base else "other agents" if d.get("agents_differ") else None


def vs_cells(d: dict, key: str, is_base: bool) -> tuple[str, str, str]:
    """(% vs baseline, CI, seeds ahead with p) of one held-out measure, or dashes where it is `unpaired`; "n/a"
    where the baseline has no such measure."""
    v = d.get(f"{key}_vs_base")
    if not v:
        return unpaired(d, is_base) or "n/a", "—", "—"
    lo, hi = v["ci"]
    ci = "n/a" if not (math.isfinite(lo) and math.isfinite(hi)) else f"[{lo:+.2f}%, {hi:+.2f}%]"
    ahead = "n/a" if not v["seeds"] else f"{v['wins']}/{v['seeds']} (p = {num(v['p'], '.3f')})"
    return pct(v["pct"]), ci, ahead


def heldout_section(summary: dict) -> list[str]:
    """The primary comparison when the runs logged held-out accuracy; collapse signs either way."""
    per, L = summary["per_config"], []
    if summary.get("has_eval"):
        L.append("## Held-out accuracy\n")
        L.append(
            "Greedy answers to the task mix's fixed evaluation set (never trained on), scored like training. "
            "Per seed: the swarm mean over agents at the last evaluation (final), and the area under the "
            "swarm-mean curve divided by its round span (the mean accuracy over the run)."
            + (
                " % vs baseline, 95% bootstrap CI over seeds and the paired sign test as for the cumulative "
                "reward below."
                if summary["baseline"] is not None
                else ""
            )
            + "\n"
        )
        if summary.get("evaluators"):
            L.append(
                f"Decoded by: {', '.join(summary['evaluators'])} (the records' `eval_engine`; docs/EVALUATION.md).\n"
            )
        if math.isfinite(summary.get("eval_baseline", math.nan)):
            L.append(
                f"Constant-answer baseline: **{summary['eval_baseline']:.4f}**, what one fixed answer per "
                'dataset scores on this set (e.g. always "True"). A policy that collapsed onto such answers '
                "scores about this; only accuracy above it shows the model answering the question.\n"
            )
        L += heldout_table(summary, "eval")
    if summary.get("has_unseen"):
        L.append("## Unseen held-out accuracy\n")
        L.append(
            "The same, on the unseen set: questions whose content (the arithmetic fact, in either dataset's "
            "phrasing) the task mix reserves, so no training task and no accepted group ever asks one. "
            "Accuracy here is learned beyond the facts trained on.\n"
        )
        if math.isfinite(summary.get("unseen_baseline", math.nan)):
            L.append(f"Constant-answer baseline of the unseen set: **{summary['unseen_baseline']:.4f}**.\n")
        L += heldout_table(summary, "unseen")
    L.append("## Collapse signs\n")
    L.append(
        "Agents collapsed at their last held-out evaluation (docs/experiments/cpu-recipe.md: accuracy within 0.05 "
        "of the constant-answer baseline, or distinct greedy answers under half of the gold answers' "
        "share); the share of groups (local and external) whose rewards differ, and the mean token entropy "
        "(nats) of the sampled completions: over all rounds and over each agent's last quarter of rounds.\n"
    )
    L += md_table(
        ["config", "collapsed agents", "groups with signal", "… last quarter", "token entropy", "… last quarter"],
        [
            [c, collapsed_cell(per[c])]
            + [
                num(per[c][k], ".3f")
                for k in ("signal_frac_mean", "signal_frac_last_quarter", "entropy_mean", "entropy_last_quarter")
            ]
            for c in summary["configs"]
        ],
    )
    L.append(f"![held-out accuracy and collapse signs]({FIGURES['health']})\n")
    return L


def tokens_section(summary: dict) -> list[str]:
    """The held-out gain beside what it cost in sampling: a 2/2 peer samples half the local groups of a 4/0
    peer, so an arm can trail in accuracy and lead per generated token."""
    if not summary.get("has_tokens"):
        return []
    per, base = summary["per_config"], summary["baseline"]
    base_tokens = per[base]["tokens_mean"] if base is not None else math.nan
    L = ["## Generated tokens\n"]
    L.append(
        "Completion tokens a peer sampled over its run (`tokens_generated`, summed over rounds; the mean over "
        "peers, then over seeds ± std), and the gain of a peer's last held-out accuracy over its starting "
        "weights' (`start_accuracy`; the mean over the peers that logged both), per 100 000 tokens a peer "
        "generated (per seed, then the mean). "
        "Descriptive, not tested."
        + (
            ""
            if any(per[c]["gain_by_seed"] for c in summary["configs"])
            else " No run logged its starting weights' accuracy (the collapse guard's start evaluation does): "
            "no gain is shown."
        )
        + "\n"
    )
    rows = []
    for c in summary["configs"]:
        d = per[c]
        ratio = d["tokens_mean"] / base_tokens if math.isfinite(base_tokens) and base_tokens > 0 else math.nan
        rows.append(
            [
                c,
                f"{num(d['tokens_mean'] / 1e3, '.1f')} ± {num(d['tokens_std'] / 1e3, '.1f')}",
                "—" if c == base or not math.isfinite(ratio) else f"{ratio:.2f}×",
                f"{num(d['gain_mean'], '+.3f')} ± {num(d['gain_std'], '.3f')}",
                num(d["gain_per_100k_mean"], "+.3f"),
            ]
        )
    L += md_table(
        [
            "config",
            "thousand tokens a peer generated",
            "vs baseline",
            "final held-out − start",
            "… per 100k tokens",
        ],
        rows,
    )
    return L


def collapsed_cell(d: dict) -> str:
    """ "k of n" agents collapsed at their last evaluation; a dash where none evaluated."""
    return f"{d['collapsed_final']} of {d['evaluated_peers']}" if d.get("evaluated_peers") else "—"


def heldout_table(summary: dict, prefix: str, figure: bool = True) -> list[str]:
    """Final and area accuracy per configuration of one evaluation set ("eval" or "unseen"), against the
    baseline configuration where there is one."""
    per = summary["per_config"]
    if summary["baseline"] is not None:
        return heldout_comparison(summary, prefix, figure)
    return md_table(
        ["config", "final (mean ± std)", "area (mean ± std)"],
        [
            [
                c,
                f"{num(per[c][f'{prefix}_final_mean'], '.4f')} ± {num(per[c][f'{prefix}_final_std'], '.4f')}",
                f"{num(per[c][f'{prefix}_area_mean'], '.4f')} ± {num(per[c][f'{prefix}_area_std'], '.4f')}",
            ]
            for c in summary["configs"]
        ],
    )


def heldout_comparison(summary: dict, prefix: str = "eval", figure: bool = True) -> list[str]:
    """Held-out accuracy of each configuration against the baseline: %, CI, sign test, paired effect."""
    per, base, L = summary["per_config"], summary["baseline"], []
    L.append(
        "| config | final (mean ± std) | vs baseline | 95% CI | seeds ahead (p) | area (mean ± std) "
        "| vs baseline | 95% CI | seeds ahead (p) |"
    )
    L.append("|---|---|---|---|---|---|---|---|---|")
    for c in summary["configs"]:
        d = per[c]
        L.append(
            f"| {c} | {num(d[f'{prefix}_final_mean'], '.4f')} ± {num(d[f'{prefix}_final_std'], '.4f')} | "
            + " | ".join(vs_cells(d, f"{prefix}_final", c == base))
            + f" | {num(d[f'{prefix}_area_mean'], '.4f')}"
            f" ± {num(d[f'{prefix}_area_std'], '.4f')} | " + " | ".join(vs_cells(d, f"{prefix}_area", c == base)) + " |"
        )
    L.append("")
    family = summary.get("holm_family") if prefix == "eval" else None
    holm_note = f"; Holm p: corrected across {', '.join(family)} (the family named with --holm)" if family else ""
    L.append(
        "Paired effect over seeds (config − baseline, same seeds): mean difference in accuracy points "
        "with its 95% bootstrap CI over seeds, Cohen's d_z (mean / sd of the differences) and the "
        f"two-sided exact permutation p{holm_note}.\n"
    )
    per_key = ["mean diff", "95% CI", "d_z", "p"] + (["Holm p"] if family else [])
    header = ["config"] + [
        f"{key}: {col}" if i == 0 else col for key in ("final", "area") for i, col in enumerate(per_key)
    ]
    rows = []
    for c in summary["configs"]:
        cells = []
        for key in (f"{prefix}_final", f"{prefix}_area"):
            v = per[c].get(f"{key}_vs_base") or {}
            ci = f"[{num(v.get('ci_low', math.nan), '+.4f')}, {num(v.get('ci_high', math.nan), '+.4f')}]" if v else ""
            cells += (
                [
                    num(v.get("mean_diff", math.nan), "+.4f"),
                    ci,
                    num(v.get("d_z", math.nan), "+.2f"),
                    num(v.get("p_perm", math.nan), ".3f"),
                ]
                + ([num(v["p_holm"], ".3f") if "p_holm" in v else "—"] if family else [])
                if v
                else [vs_cells(per[c], key, c == base)[0]] + ["—"] * (len(per_key) - 1)
            )
        rows.append([c, *cells])
    L += md_table(header, rows)
    if prefix == "eval" and figure:
        L.append(f"![held-out accuracy per seed, one line per seed]({FIGURES['paired']})\n")
    return L


def rounds_cell(d: dict) -> str:
    """The rounds an agent of a configuration logged: one count per run, "fewest–most" for a run whose agents
    differ (a metrics.jsonl cut short)."""
    return ", ".join(f"{lo}–{hi}" if lo != hi else str(hi) for lo, hi in d["rounds_range"])


def console_table(summary: dict) -> str:
    """Held-out (when logged) and cumulative reward per configuration; % vs baseline only when there is one."""
    base, rows = summary["baseline"], []
    head = f"{'config':<16}{'seeds':>6}{'agents':>8}"
    vs_head = f"{'vs base':>13}  95% CI" if base is not None else ""
    agents = {c: ",".join(map(str, d["peers"])) for c, d in summary["per_config"].items()}
    for prefix, title in (("eval", "held-out final"), ("unseen", "unseen final")):
        if not summary.get(f"has_{prefix}"):
            continue
        rows.append(f"{head}{title:>18}{'collapsed' if prefix == 'eval' else '':>11}{vs_head}")
        for c, d in summary["per_config"].items():
            vs, ci, _ = vs_cells(d, f"{prefix}_final", c == base)
            tail = "" if base is None else f"{vs:>13}  {'' if ci == '—' else ci}"
            fallen = collapsed_cell(d) if prefix == "eval" else ""
            rows.append(
                f"{c:<16}{d['n_seeds']:>6}{agents[c]:>8}{num(d[f'{prefix}_final_mean'], '.3f'):>18}{fallen:>11}{tail}"
            )
        rows.append("")
    rows.append(f"{head}{'cumulative':>22}{vs_head}")
    for c, d in summary["per_config"].items():
        cum = f"{num(d['cumulative_mean'])} ± {num(d['cumulative_std'])}"
        lo, hi = d["improvement_ci"]
        why = unpaired(d, c == base)
        ci = "" if why else ("n/a" if not math.isfinite(lo) else f"[{lo:+.1f}%, {hi:+.1f}%]")
        vs = why or pct(d["improvement_pct"])
        rows.append(f"{c:<16}{d['n_seeds']:>6}{agents[c]:>8}{cum:>22}" + ("" if base is None else f"{vs:>13}  {ci}"))
    return "\n".join(rows + view_lines(summary))


def view_lines(summary: dict) -> list[str]:
    """The focus peer's and each family's paired held-out differences with the baseline, for the console."""
    views = [(f"{summary['focus']['peer']}", summary["focus"]["per_config"])] if summary.get("focus") else []
    if summary.get("families"):
        views += list(summary["families"]["per_family"].items())
    rows = []
    for name, per in views:
        for c, d in per.items():
            for key, label in (("eval_final", "final"), ("eval_area", "area")):
                v = d.get(f"{key}_vs_base")
                if v:
                    holm = f", Holm p = {v['p_holm']:.3f}" if "p_holm" in v else ""
                    rows.append(
                        f"{name} {c} − {summary['baseline']}, held-out {label}: {v['mean_diff']:+.4f} "
                        f"[{v['ci_low']:+.4f}, {v['ci_high']:+.4f}], p = {v['p_perm']:.3f}{holm} "
                        f"({v['n']} seeds)"
                    )
    return [""] + rows if rows else []


def agents_table(runs: Sequence[Run], window: int = 10) -> list[str]:
    """One row per agent: how each peer of a single configuration did (the curves are in the figures)."""

    def last(values: np.ndarray) -> str:
        values = values[np.isfinite(values)] if values.size else values
        return num(float(values[-1]) if values.size else math.nan, ".4f")

    def mean(values: np.ndarray) -> str:  # n/a, not a numpy warning, when no round logged a reward
        values = values[np.isfinite(values)]
        return num(float(values.mean()) if values.size else math.nan, ".4f")

    unseen = any(np.isfinite(p.unseen_acc).any() for r in runs for p in r.peers if p.unseen_acc.size)
    rows = []
    for r in runs:
        for p in r.peers:
            ma = moving_average(p.reward, window)
            rows.append(
                [
                    f"seed {r.seed}",
                    p.peer,
                    str(p.rounds.size),
                    mean(p.reward),
                    num(float(ma[-1]) if ma.size else math.nan, ".4f"),
                    last(p.eval_acc),
                ]
                + [last(p.unseen_acc)] * unseen
            )
    return md_table(
        ["run", "agent", "rounds", "mean reward", "last moving average", "final held-out accuracy"]
        + ["final unseen accuracy"] * unseen,
        rows,
    )


def view_summary(summary: dict, per: dict) -> dict:
    """A summary of a subset view (`node.lab.views`) in the shape the held-out tables read."""
    configs = [c for c in summary["configs"] if c in per]
    return {
        "per_config": per,
        "configs": configs,
        "baseline": summary["baseline"] if summary["baseline"] in per else None,
    }


def view_tables(summary: dict, per: dict) -> list[str]:
    """The held-out tables of a subset view; the unseen set's too where its runs evaluated one."""
    view = view_summary(summary, per)
    unseen = any(d.get("unseen_final_by_seed") for d in per.values())
    return heldout_table(view, "eval", figure=False) + (
        ["Unseen set:\n", *heldout_table(view, "unseen", figure=False)] if unseen else []
    )


def families_section(summary: dict) -> list[str]:
    """Held-out accuracy per model family of a mixed swarm, each against its own silo, Holm-corrected."""
    fam = summary.get("families")
    if not fam:
        return []
    L = [
        "## Per model family\n",
        "The swarms mix models, so each family is judged on its own peers: the held-out measures above, "
        "computed over the family's peers only (mean over them per seed), paired by seed against the "
        "baseline's peers of the same family. The p-values of the families' tests are Holm-corrected "
        f"across the {len(fam['families'])} families (the table after the families).\n",
    ]
    holm_rows = []
    for f in fam["families"]:
        per = fam["per_family"][f]
        L.append(f"### {model_label(f)}: {', '.join(map(str, fam['peers'][f]))} peer(s) per run\n")
        L += view_tables(summary, per)
        for c in per:
            tests = [per[c].get(f"{key}_vs_base") for key in ("eval_final", "eval_area")]
            if all(tests):
                holm_rows.append([c, f] + [num(t[k], ".3f") for t in tests for k in ("p_perm", "p_holm")])
    if holm_rows:
        L.append("Permutation p of each family's paired difference, and Holm-corrected across the families:\n")
        L += md_table(["config", "family", "final: p", "final: Holm p", "area: p", "area: Holm p"], holm_rows)
    L += reward_table(summary, fam["per_family"], "each family")
    sources = fam.get("sources") or {}
    if sources:
        columns = fam["families"] + (
            ["unknown"] if any("unknown" in d for c in sources.values() for d in c.values()) else []
        )
        L.append("External groups each family trained on, by the family whose peer sampled them (all seeds):\n")
        L += md_table(
            ["config", "family", *(f"from {c}" for c in columns)],
            [[c, f, *(str(d.get(src, 0)) for src in columns)] for c, per in sources.items() for f, d in per.items()],
        )
    L.append(f"![held-out accuracy per family]({FIGURES['families']})\n")
    return L


def reward_table(summary: dict, views: dict[str, dict], what: str) -> list[str]:
    """The training reward (the paper's measure) and the token entropy of the samples of each view (a family,
    or the focus peer), per configuration, with the paired difference against the baseline's same view.
    Shown, not corrected for multiplicity: the held-out measures are the ones tested."""
    rows = []
    for name, per in views.items():
        for c, d in per.items():
            v = d.get("reward_vs_base")
            vs = (
                [
                    num(v["mean_diff"], "+.4f"),
                    f"[{num(v['ci_low'], '+.4f')}, {num(v['ci_high'], '+.4f')}]",
                    num(v["d_z"], "+.2f"),
                    num(v["p_perm"], ".3f"),
                    f"{v['wins']}/{v['seeds']}",
                ]
                if v
                else ["baseline" if c == summary["baseline"] else "—"] + ["—"] * 4
            )
            rows.append(
                [
                    c,
                    name,
                    f"{num(d['reward_mean'], '.4f')} ± {num(d['reward_std'], '.4f')}",
                    *vs,
                    num(d["entropy_mean"], ".3f"),
                    num(d["entropy_last_quarter"], ".3f"),
                ]
            )
    if not rows:
        return []
    return [
        f"Training reward of {what}: the mean reward of the peer's own sampled completions per round (the "
        "paper's measure; a mean over the peers per seed), paired by seed with the baseline (mean "
        "difference, 95% bootstrap CI, d_z, exact permutation p, seeds ahead), and the mean token entropy "
        "of those samples, all rounds and the last quarter:\n",
        *md_table(
            [
                "config",
                "peers",
                "reward per peer-round (mean ± std)",
                "mean diff",
                "95% CI",
                "d_z",
                "p",
                "seeds ahead",
                "token entropy",
                "… last quarter",
            ],
            rows,
        ),
    ]


def focus_section(summary: dict) -> list[str]:
    """One peer (a newcomer) across configurations, against the baseline, with the other peers as veterans."""
    foc = summary.get("focus")
    if not foc:
        return []
    per, peer = foc["per_config"], foc["peer"]
    L = [
        f"## Focus peer: {peer}\n",
        f"The held-out measures of {peer} alone (its area: trapezoids over its own evaluations divided by their "
        f"round span), paired by seed against {peer} of the baseline. The other peers of each run are the "
        "veterans (per configuration: "
        + ", ".join(f"{c}: {', '.join(map(str, v))}" for c, v in foc["veterans"].items())
        + ").\n",
    ]
    L += view_tables(summary, per)
    rows = []
    for c, d in per.items():
        vs = d.get("rounds_to_half_vs_base")
        if d.get("rounds_to_half_by_seed"):
            rows.append(
                [c, ", ".join(f"s{s}: {v}" for s, v in d["rounds_to_half_by_seed"].items())]
                + ([num(vs["mean_diff"], "+.1f"), num(vs["p_perm"], ".3f")] if vs else ["baseline", "—"])
            )
    if rows:
        L.append(
            f"Rounds until {peer} first reached half of the veterans' mean accuracy at their first evaluation "
            "(same seed; the run's round count when it never did), and the paired difference with the "
            "baseline (negative: sooner) with its exact permutation p:\n"
        )
        L += md_table(["config", "per seed", "vs baseline (rounds)", "p"], rows)
    L += reward_table(summary, {peer: per}, peer)
    L.append(f"![{peer} against the veterans]({FIGURES['focus']})\n")
    return L

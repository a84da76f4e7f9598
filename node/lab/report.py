"""sapo-report: compare SAPO local/external (I/J) configurations from experiment metrics.

Usage::

    sapo-report EXPERIMENT_DIR [EXPERIMENT_DIR ...] [--out DIR] [--threshold R] [--baseline NAME]
                [--window 10] [--drop X] [--bootstrap 2000] [--boot-seed 0] [--focus-peer P]

Input layout (discovered leniently): every ``metrics.jsonl`` below an experiment dir is one agent
(peer) of one run.  A run is identified by the nearest ``run.json`` above the file (fields
``config_name``, ``seed``, ``num_local``, ``num_external``, ``ij_policy``, ``peers``, ``rounds``),
e.g. ``EXP/<config>/seed<k>/run.json`` + ``EXP/<config>/seed<k>/peer<p>/metrics.jsonl``.  Without a
``run.json`` the config and seed come from the directory names (``.../<config>/seed<k>/<peer>/``);
``DIR/peer<i>/metrics.jsonl`` (``scripts/local_swarm.sh``'s layout) is one run of one configuration,
named after DIR, with each peer an agent.  Comparisons with a baseline need two configurations or more.
Runs with the same config name are pooled across all experiment dirs given.  A ``run.json`` that is not a
regular file, not a JSON object, or has one of those fields of the wrong type (null counts as absent) is
malformed: its run is left out, not filed by the directory names, with a warning naming the file (stderr and
the report's Data quality section).  Only regular files are read: a ``metrics.jsonl`` that is not one (a
FIFO) or cannot be read is left out the same way.

Each metrics line is a JSON object with ``round`` (int, 0 to 10^9) and ``reward_mean`` (float, or null when
the round had no local groups), plus optionally ``num_local``, ``num_external``,
``target_external``, ``external_accepted``, ``external_rejected``, ``round_s``.  Lines that are not
JSON objects, lack a valid ``round``/``reward_mean`` or carry a field the report reads with the wrong type
(``eval_accuracy: "abc"``; null is "not logged") are skipped and counted; if a round is
logged twice (a resumed run) the last line wins.  An agent with fewer rounds than the others of its run (a
metrics.jsonl cut short) gets a warning, and "rounds per agent" shows fewest–most.

Definitions (also written into the report):

* swarm-mean reward of a run at round t: mean over the run's agents that logged round t.
* moving average (MA): trailing mean over the last ``window`` logged rounds (positions, not round
  numbers), over the rounds in it that have a reward (a round without one is left out, not counted as 0);
  undefined for the first ``window - 1`` rounds (or ``window`` = number of rounds when a run is shorter
  than the window).
* cumulative reward of a run: sum over agents and rounds of ``reward_mean`` (NaN rounds count 0).
  Per config: mean ± sample std (ddof = 1) over seeds. Reward per agent-round: the cumulative reward / the
  agent-rounds with a reward of a run, meaned over seeds (comparable across runs of different sizes).
* improvement over the baseline: 100 * (mean_cum(config) / mean_cum(baseline) - 1).  95% CI: seeds
  of the config and of the baseline are resampled independently with replacement (``--bootstrap``
  resamples, ``numpy.random.default_rng(--boot-seed)``), 2.5/97.5 percentiles.  With one seed on
  both sides the CI is degenerate (a point) and the report says so.
* seeds ahead: number of seeds k in which the config's cumulative reward beats the baseline's with
  the same seed k (same node seeds), with the one-sided exact sign-test p = P(X >= wins), X ~
  Binomial(n, 1/2) over the n seeds without a tie; never below 0.5^n.
* rounds to threshold: first logged round at which the swarm-mean MA is >= threshold; default
  threshold = 0.5 × the largest swarm-mean MA observed in any run.
* stability: std (ddof = 0) over rounds of the swarm-mean reward (includes the learning trend);
  steep drops: the swarm-mean reward is averaged over consecutive non-overlapping windows of
  ``window`` rounds (the MA sampled at window ends) and a drop is counted whenever one window's
  mean is lower than the previous window's by more than X (``--drop``; default 0.1 × the largest
  swarm-mean MA observed); max drawdown: largest fall of the MA below its running maximum.
* acceptance rate: sum(external_accepted) / (sum(external_accepted) + sum(external_rejected)).
* held-out accuracy (when the lines carry ``eval_accuracy``): the swarm mean over agents at each
  evaluated round; per seed the final value and the area under that curve divided by its round span
  (trapezoids); compared with the baseline like the cumulative reward (bootstrap CI, sign test). A node
  evaluates round t's weights after round t's update: round 0 is the starting weights only where round 0
  made no optimizer step (no group with signal); runs since the guard's start evaluation also carry the
  starting weights' figures in round 0's line (start_accuracy, ...).
  When present it is the report's first comparison; training reward stays as the second view.
  Its paired difference (also of the focus peer and of each family): the mean of the per-seed differences
  with the baseline, its 95% bootstrap CI (10 000 resamples of the differences, default_rng(0), whatever
  ``--bootstrap`` says), Cohen's d_z and the two-sided permutation p over every sign flip of the
  differences (exact up to 16 seeds, 65 536 random flips above).
  A configuration whose runs have another number of agents than the baseline's (a newcomer's swarm of 5
  against its silo of 1) gets its means shown, marked "other agents", and not tested against the
  baseline's: a mean over other agents is no paired measure (``--focus-peer`` pairs one agent).
  ``--holm CONFIG ...`` names a design's family of tests (its arms against the silo): their held-out final
  and area permutation p-values get a Holm-corrected column.
  Lines that carry ``eval_unseen_accuracy`` (a task mix split by content) get the same for the
  unseen set, questions whose content training never draws.
* per model family (when a run's peers ran different models: the ``model`` of their metrics lines, else
  run.json's ``models``): the held-out measures over each family's peers only, each configuration paired
  by seed with the baseline's same family; the permutation p-values of the held-out final and area (not
  the unseen set's) are Holm-corrected across families;
  and the external groups each family trained on, by the family whose peer sampled them (``publisher``).
* focus peer (``--focus-peer P``: agent ``peer<P>``, e.g. a newcomer among veterans): the held-out measures
  of that agent alone (area: trapezoids over its own evaluations / their span), paired by seed with the
  same agent of the baseline; the other agents of its runs are the veterans, drawn as their mean curve.
  Also the first evaluated round at which it reaches half of the veterans' mean accuracy at their first
  evaluation (same seed; the run's round count when never).
  Each family and the focus peer also get their training reward per agent-round (seed by seed, paired with
  the baseline's same peers: mean difference, CI, d_z, permutation p, seeds ahead; shown, not corrected for
  multiplicity) beside the token entropy of their samples.
* collapse signs: the agents collapsed at their last held-out evaluation (accuracy within 0.05 of the
  constant-answer baseline, or distinct greedy answers under half of the gold answers' share: RESULTS 7),
  ``signal_frac`` (share of groups with differing rewards; older runs:
  ``local_signal_frac``) and ``entropy_mean`` (token entropy of the samples), all rounds and the
  last quarter of each agent's rounds.
* generated tokens (lines that carry ``tokens_generated``): the completion tokens a peer sampled over its run
  (the mean over the run's peers), the gain of a peer's last held-out accuracy over its starting weights'
  (round 0's ``start_accuracy``; the mean over the peers that logged both), and that gain per 100 000 tokens
  a peer generated; per seed, then the mean ± std over seeds; shown, not tested (a 2/2 peer samples half the
  local groups of a 4/0 peer).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from node import __version__
from node.lab.figures import (
    fig_cumulative,
    fig_families,
    fig_focus,
    fig_j_trajectory,
    fig_learning_health,
    fig_ma_band,
    fig_paired_seeds,
    fig_per_agent,
)
from node.lab.runs import PeerSeries, Run, load_runs
from node.lab.stats import summarize
from node.lab.tables import (
    FIGURES,
    agents_table,
    console_table,
    families_section,
    focus_section,
    heldout_section,
    num,
    pct,
    rounds_cell,
    tokens_section,
    unpaired,
)
from node.lab.views import family_summary, focus_name, focus_summary

__all__ = [
    "PeerSeries",
    "Run",
    "load_runs",
    "summarize",
    "write_report",
    "main",
]


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (float, np.floating)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, np.integer):
        return int(x)
    return x


def write_report(runs: Sequence[Run], summary: dict, out: Path, inputs: Sequence[str] = ()) -> Path:
    """Write figures, summary.json and report.md into `out`; returns the report path."""
    out.mkdir(parents=True, exist_ok=True)
    fig_per_agent(runs, summary, out / FIGURES["per_agent"])
    fig_ma_band(runs, summary, out / FIGURES["ma_band"])
    fig_cumulative(summary, out / FIGURES["cumulative"])
    has_adaptive = fig_j_trajectory(runs, summary, out / FIGURES["j_trajectory"])
    fig_learning_health(runs, summary, out / FIGURES["health"])
    fig_paired_seeds(summary, out / FIGURES["paired"])
    if summary.get("families"):
        fig_families(runs, summary, out / FIGURES["families"])
    if summary.get("focus"):
        fig_focus(runs, summary, out / FIGURES["focus"])
    (out / "summary.json").write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=False))

    per = summary["per_config"]
    cfgs = summary["configs"]
    base = summary["baseline"]
    L: list[str] = []
    L.append("# SAPO I/J experiment report\n")
    if inputs:
        L.append("Inputs: " + ", ".join(f"`{p}`" for p in inputs) + "\n")
    if len(cfgs) == 1:
        d = per[cfgs[0]]
        L.append(
            f"One configuration, **{cfgs[0]}**: {d['n_seeds']} run(s) with "
            f"{', '.join(map(str, d['peers']))} agents; per-agent curves and the mean over agents with its "
            "min/max band below. Comparisons with a baseline need two configurations or more.\n"
        )
        L += agents_table(runs, summary["window"])
    L.append(
        f"Baseline: **{base if base else 'none'}** ({summary['baseline_reason']}). "
        f"Moving-average window: {summary['window']} rounds. Bootstrap: {summary['n_boot']} resamples of seeds, "
        f"numpy default_rng({summary['boot_seed']}).\n"
    )
    if summary["warnings"]:
        L.append("**Warnings**\n")
        L += [f"- {w}" for w in summary["warnings"]]
        L.append("")

    L.append("## Configurations\n")
    L.append("| config | I/J policy | seeds | agents per run | rounds per agent | mean I used | mean J used |")
    L.append("|---|---|---|---|---|---|---|")
    for c in cfgs:
        d = per[c]
        L.append(
            f"| {c} | {d['ij_policy']}{' (adaptive)' if d['adaptive'] else ''} | {d['n_seeds']} | "
            f"{', '.join(map(str, d['peers']))} | {rounds_cell(d)} | "
            f"{num(d['mean_num_local'])} | {num(d['mean_num_external'])} |"
        )
    L.append("")

    L += focus_section(summary)
    L += families_section(summary)
    L += heldout_section(summary)
    L += tokens_section(summary)

    L.append("## Cumulative reward" + (" (training reward, the second view)" if summary.get("has_eval") else "") + "\n")
    L.append("Sum over agents and rounds of `reward_mean`, per seed; mean ± sample std over seeds.\n")
    if base is None:
        L.append("| config | cumulative reward (mean ± std) | per seed | reward per agent-round |")
        L.append("|---|---|---|---|")
    else:
        L.append(
            "Seeds ahead: in how many seeds the configuration beat the baseline with the same seed (peer p "
            "of seed k has the same node seed in every configuration), with the one-sided exact sign-test p; "
            "with n seeds p cannot go below 0.5^n.\n"
        )
        L.append(
            "| config | cumulative reward (mean ± std) | per seed | reward per agent-round | vs baseline "
            "| 95% CI (bootstrap over seeds) | seeds ahead (sign-test p) | note |"
        )
        L.append("|---|---|---|---|---|---|---|---|")
    for c in cfgs:
        d = per[c]
        seeds = ", ".join(f"s{s}: {num(v)}" for s, v in d["cumulative_by_seed"].items())
        if base is None:
            L.append(
                f"| {c} | {num(d['cumulative_mean'])} ± {num(d['cumulative_std'])} | {seeds} | "
                f"{num(d['reward_per_agent_round'], '.4f')} |"
            )
            continue
        if why := unpaired(d, c == base):
            vs, ci, ahead = why, "—", "—"
        else:
            ahead = (
                "n/a"
                if not d["paired_seeds"]
                else f"{d['paired_wins']}/{d['paired_seeds']} (p = {num(d['sign_test_p'], '.3f')})"
            )
            vs = pct(d["improvement_pct"])
            lo, hi = d["improvement_ci"]
            ci = "n/a" if not (math.isfinite(lo) and math.isfinite(hi)) else f"[{lo:+.2f}%, {hi:+.2f}%]"
        L.append(
            f"| {c} | {num(d['cumulative_mean'])} ± {num(d['cumulative_std'])} | {seeds} | "
            f"{num(d['reward_per_agent_round'], '.4f')} | {vs} | {ci} | {ahead} | "
            f"{d['improvement_note'] if c != base else ''} |"
        )
    L.append("")
    L.append(f"![cumulative reward]({FIGURES['cumulative']})\n")

    L.append("## Learning speed\n")
    L.append(
        f"Threshold: {num(summary['threshold'], '.4f')} ({summary['threshold_source']}). "
        "Rounds to threshold = first logged round at which the swarm-mean reward's moving average "
        "reaches the threshold.\n"
    )
    L.append("| config | round reached (mean over seeds that reached it) | seeds reaching | per seed |")
    L.append("|---|---|---|---|")
    for c in cfgs:
        d = per[c]
        ps = ", ".join(f"s{s}: {v if v is not None else 'never'}" for s, v in d["rounds_to_threshold_by_seed"].items())
        L.append(
            f"| {c} | {num(d['rounds_to_threshold_mean'], '.1f', 'never')} "
            f"| {d['seeds_reaching_threshold']}/{d['n_seeds']} | {ps} |"
        )
    L.append("")
    L.append(f"![moving average with min/max band]({FIGURES['ma_band']})\n")
    L.append(f"![per-agent reward curves]({FIGURES['per_agent']})\n")

    L.append("## Stability\n")
    L.append(
        f"Std over rounds of the swarm-mean reward (mean over seeds; includes the learning trend). "
        f"Steep drop: the mean over a block of {summary['window']} consecutive rounds is lower than the previous "
        f"block's by more than X = {num(summary['drop'], '.4f')} ({summary['drop_source']}). "
        "Max drawdown: largest fall of the moving average below its running maximum (mean over seeds).\n"
    )
    L.append("| config | reward std | steep drops per seed (mean) | max drawdown |")
    L.append("|---|---|---|---|")
    for c in cfgs:
        d = per[c]
        L.append(
            f"| {c} | {num(d['reward_std_mean'], '.4f')} | {num(d['steep_drops_mean'])} "
            f"| {num(d['max_drawdown_mean'], '.4f')} |"
        )
    L.append("")

    L.append("## External groups and J\n")
    L.append(
        "| config | accepted | rejected | acceptance rate | mean target J | final target J (mean over agents) "
        "| mean round time (s) |"
    )
    L.append("|---|---|---|---|---|---|---|")
    for c in cfgs:
        d = per[c]
        rate = d["acceptance_rate"]
        L.append(
            f"| {c} | {num(d['external_accepted'], 'd')} | {num(d['external_rejected'], 'd')} | "
            f"{'n/a' if not math.isfinite(rate) else f'{100 * rate:.1f}%'} | {num(d['mean_target_j'])} | "
            f"{num(d['final_target_j_mean'])} | {num(d['mean_round_s'])} |"
        )
    L.append("")
    if has_adaptive:
        L.append(f"![J trajectory]({FIGURES['j_trajectory']})\n")
    else:
        L.append(
            f"No adaptive runs (every configuration used a fixed J); "
            f"[{FIGURES['j_trajectory']}]({FIGURES['j_trajectory']}) says so.\n"
        )

    L.append("## Data quality\n")
    L.append(
        f"Corrupt metrics lines skipped: **{summary['skipped_lines']}**. "
        f"Rounds logged more than once (last kept): {summary['duplicate_rounds']}.\n"
    )
    for fpath, n in summary["skipped_by_file"].items():
        L.append(f"- `{fpath}`: {n} line(s) skipped")
    L.append("")
    if summary["unreadable_files"]:
        L.append(f"Files left out: **{len(summary['unreadable_files'])}**.\n")
        L += [f"- `{fpath}`: {why}" for fpath, why in summary["unreadable_files"].items()]
        L.append("")
    path = out / "report.md"
    path.write_text("\n".join(L))
    return path


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sapo-report", description="Compare SAPO I/J configurations from metrics.jsonl files."
    )
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument("experiments", nargs="+", metavar="EXPERIMENT_DIR")
    ap.add_argument(
        "--out", type=Path, default=None, help="output dir (default: FIRST_EXPERIMENT_DIR/report; beside a file)"
    )
    ap.add_argument("--threshold", type=float, default=None, help="reward threshold (default 0.5 × max observed MA)")
    ap.add_argument("--baseline", default=None, help="baseline config name (default: the silo config, J = 0)")
    ap.add_argument("--window", type=int, default=10, help="moving-average window in rounds (default 10)")
    ap.add_argument("--drop", type=float, default=None, help="steep-drop size X (default 0.1 × max observed MA)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
    ap.add_argument("--boot-seed", type=int, default=0, help="bootstrap RNG seed (default 0)")
    ap.add_argument(
        "--holm",
        nargs="+",
        default=[],
        metavar="CONFIG",
        help="configurations whose held-out comparisons with the baseline form one family of tests (a design's "
        "arms): their permutation p-values are Holm-corrected",
    )
    ap.add_argument(
        "--focus-peer",
        default=None,
        metavar="P",
        help="also compare agent peer<P> alone across configurations (a newcomer among veterans)",
    )
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    a = build_parser().parse_args(argv)

    missing = [p for p in a.experiments if not Path(p).exists()]
    if missing:
        print(f"sapo-report: no such path: {', '.join(missing)}", file=sys.stderr)
        return 2
    if a.window < 1 or a.bootstrap < 1:
        print("sapo-report: --window and --bootstrap must be >= 1", file=sys.stderr)
        return 2
    runs = load_runs(a.experiments)
    unreadable = {fpath: why for r in runs for fpath, why in r.unreadable.items()}
    for fpath, why in unreadable.items():
        print(f"sapo-report: warning: {fpath}: {why}", file=sys.stderr)
    if not any(r.peers for r in runs):
        skipped = sum(r.skipped_lines for r in runs)
        print(
            f"sapo-report: no usable metrics.jsonl found ({skipped} corrupt line(s) skipped, "
            f"{len(unreadable)} file(s) left out)",
            file=sys.stderr,
        )
        return 2
    try:
        summary = summarize(
            runs,
            baseline=a.baseline,
            threshold=a.threshold,
            window=a.window,
            drop=a.drop,
            n_boot=a.bootstrap,
            boot_seed=a.boot_seed,
            holm_family=a.holm,
        )
        summary["families"] = family_summary(runs, summary)
        if a.focus_peer is not None:
            summary["focus"] = focus_summary(runs, summary, focus_name(a.focus_peer))
    except ValueError as e:
        print(f"sapo-report: {e}", file=sys.stderr)
        return 2
    first = Path(a.experiments[0])
    out = a.out if a.out is not None else (first if first.is_dir() else first.parent) / "report"
    try:
        path = write_report(runs, summary, out, a.experiments)
    except OSError as e:
        where = f" ({e.filename})" if e.filename and Path(e.filename) != out else ""
        print(f"sapo-report: cannot write the report to {out}: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    print(console_table(summary))
    if summary["skipped_lines"]:
        print(f"skipped {summary['skipped_lines']} corrupt metrics line(s)")
    for w in summary["warnings"]:
        print(f"warning: {w}")
    print(f"report: {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""The report's figures (matplotlib, Agg): per-agent curves, moving-average band, cumulative bars, J over time."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from node.lab.runs import Run
from node.lab.stats import align_series, eval_curve, moving_average, nanmean_rows
from node.lab.tables import unpaired
from node.lab.views import family_runs, restrict
from node.learn.packaged import model_label


def _figure(w: float, h: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(w, h), dpi=110)
    FigureCanvasAgg(fig)
    return fig


def _colors(n: int) -> list:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if n <= 10 else "tab20"]
    return [cmap(i % cmap.N) for i in range(max(n, 1))]


def _grid(n: int) -> tuple[int, int]:
    cols = min(3, max(n, 1))
    return int(math.ceil(max(n, 1) / cols)), cols


def _by_cfg(runs: Sequence[Run], configs: Sequence[str]) -> dict[str, list[Run]]:
    out: dict[str, list[Run]] = {c: [] for c in configs}
    for r in runs:
        if r.config in out and r.peers:
            out[r.config].append(r)
    return out


def fig_per_agent(runs: Sequence[Run], summary: dict, path: Path) -> None:
    configs = summary["configs"]
    w = summary["window"]
    by = _by_cfg(runs, configs)
    nr, nc = _grid(len(configs))
    fig = _figure(5.2 * nc, 3.6 * nr)
    axes = fig.subplots(nr, nc, squeeze=False, sharey=True)
    for k, cfg in enumerate(configs):
        ax = axes[k // nc][k % nc]
        agents = [(r, p) for r in by[cfg] for p in r.peers]
        cols = _colors(len(agents))
        for i, (r, p) in enumerate(agents):
            lab = f"seed {r.seed} · {p.peer}" if len(by[cfg]) > 1 else p.peer
            ax.plot(p.rounds, moving_average(p.reward, w), lw=1.0, alpha=0.75, color=cols[i], label=lab)
        rounds, mat = align_series([p for _, p in agents])
        if mat.size:
            ax.plot(rounds, moving_average(nanmean_rows(mat), w), color="black", lw=2.0, label="mean of agents")
        ax.set_title(f"{cfg}  ({len(by[cfg])} seed(s), {len(agents)} agent curves)")
        ax.set_xlabel("round")
        ax.set_ylabel(f"reward (MA, window {w})")
        ax.grid(alpha=0.3)
        if len(agents) <= 12:
            ax.legend(fontsize=7, loc="best")
    for k in range(len(configs), nr * nc):
        axes[k // nc][k % nc].set_visible(False)
    fig.suptitle("Per-agent reward curves, one panel per configuration")
    fig.tight_layout()
    fig.savefig(path)


def fig_ma_band(runs: Sequence[Run], summary: dict, path: Path) -> None:
    configs = summary["configs"]
    w = summary["window"]
    by = _by_cfg(runs, configs)
    fig = _figure(9, 5)
    ax = fig.add_subplot(111)
    cols = _colors(len(configs))
    for i, cfg in enumerate(configs):
        series = [p for r in by[cfg] for p in r.peers]
        rounds, mat = align_series(series)
        if not mat.size:
            continue
        # per-agent MA computed on each agent's own logged rounds, then aligned
        ma = np.full_like(mat, np.nan)
        for j, p in enumerate(series):
            ma[j, np.searchsorted(rounds, p.rounds)] = moving_average(p.reward, w)
        ok = np.isfinite(ma).any(axis=0)
        lo = np.where(ok, np.min(np.where(np.isfinite(ma), ma, np.inf), axis=0), np.nan)
        hi = np.where(ok, np.max(np.where(np.isfinite(ma), ma, -np.inf), axis=0), np.nan)
        mean = nanmean_rows(ma)
        imp = summary["per_config"][cfg]["improvement_pct"]
        lab = cfg + ("" if not math.isfinite(imp) or cfg == summary["baseline"] else f" ({imp:+.1f}%)")
        ax.plot(rounds, mean, color=cols[i], lw=2, label=lab)
        ax.fill_between(rounds, lo, hi, color=cols[i], alpha=0.15, lw=0)
    thr = summary["threshold"]
    if math.isfinite(thr):
        ax.axhline(thr, color="grey", ls="--", lw=1, label=f"threshold {thr:.3g}")
    ax.set_title(f"Reward moving average (window {w}): mean over agents, band = min/max across agents")
    ax.set_xlabel("round")
    ax.set_ylabel("reward (moving average)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path)


def fig_cumulative(summary: dict, path: Path) -> None:
    configs = summary["configs"]
    per = summary["per_config"]
    fig = _figure(max(5.0, 1.4 * len(configs) + 2), 4.8)
    ax = fig.add_subplot(111)
    means = [per[c]["cumulative_mean"] for c in configs]
    stds = [per[c]["cumulative_std"] if math.isfinite(per[c]["cumulative_std"]) else 0.0 for c in configs]
    cols = ["#888888" if c == summary["baseline"] else "#1f77b4" for c in configs]
    x = np.arange(len(configs))
    ax.bar(x, means, yerr=stds, color=cols, capsize=4)
    top = max([m + s for m, s in zip(means, stds) if math.isfinite(m)] or [1.0])
    for xi, c, m, s in zip(x, configs, means, stds):
        imp = per[c]["improvement_pct"]
        if summary["baseline"] is None:
            tag = ""  # nothing to compare with
        elif why := unpaired(per[c], c == summary["baseline"]):
            tag = f"\n{why}"
        else:
            tag = f"\n{imp:+.1f}%" if math.isfinite(imp) else "\nn/a"
        ax.text(
            xi, (m if math.isfinite(m) else 0) + s + 0.02 * top, f"{m:.1f}{tag}", ha="center", va="bottom", fontsize=9
        )
    ax.set_xticks(x)
    ax.set_xticklabels(configs)
    ax.set_ylim(0, top * 1.2 if top > 0 else 1)
    ax.set_xlabel("configuration (I/J)")
    ax.set_ylabel("cumulative reward (sum over agents and rounds)")
    ax.set_title(
        "Cumulative reward, mean ± std over seeds"
        + (f"; % vs baseline {summary['baseline']}" if summary["baseline"] is not None else "")
    )
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)


def fig_j_trajectory(runs: Sequence[Run], summary: dict, path: Path) -> bool:
    """J over rounds for adaptive configurations; returns False when there were none."""
    adaptive = [c for c in summary["configs"] if summary["per_config"][c]["adaptive"]]
    by = _by_cfg(runs, adaptive)
    if not adaptive:
        fig = _figure(6, 2.5)
        ax = fig.add_subplot(111)
        ax.text(0.5, 0.5, "no adaptive runs", ha="center", va="center", fontsize=14)
        ax.set_axis_off()
        ax.set_title("J trajectory (target_external over rounds)")
        fig.savefig(path)
        return False
    nr, nc = _grid(len(adaptive))
    fig = _figure(5.2 * nc, 3.6 * nr)
    axes = fig.subplots(nr, nc, squeeze=False)
    for k, cfg in enumerate(adaptive):
        ax = axes[k // nc][k % nc]
        agents = [(r, p) for r in by[cfg] for p in r.peers]
        cols = _colors(len(agents))
        top = 0.0
        for i, (r, p) in enumerate(agents):
            y = p.target_external if np.isfinite(p.target_external).any() else p.num_external
            tot = p.num_local + p.num_external
            if np.isfinite(tot).any():
                top = max(top, float(np.nanmax(tot)))
            lab = f"seed {r.seed} · {p.peer}" if len(by[cfg]) > 1 else p.peer
            ax.step(
                p.rounds,
                y,
                where="post",
                lw=1.0,
                alpha=0.8 if len(agents) <= 12 else 0.3,
                color=cols[i],
                label=lab if len(agents) <= 12 else None,
            )
        if len(agents) > 1:
            jr, jm = align_series([p for _, p in agents], "target_external")
            if np.isfinite(jm).any():
                ax.plot(
                    jr,
                    moving_average(nanmean_rows(jm), summary["window"]),
                    color="black",
                    lw=2.0,
                    label=f"mean over agents (MA {summary['window']})",
                )
        if top > 0:
            ax.set_ylim(-0.3, top + 0.3)
        ax.set_title(f"{cfg} ({summary['per_config'][cfg]['ij_policy']})")
        ax.set_xlabel("round")
        ax.set_ylabel("J (target external groups)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="best")
    for k in range(len(adaptive), nr * nc):
        axes[k // nc][k % nc].set_visible(False)
    fig.suptitle("J chosen by the adaptive I/J policy, per agent")
    fig.tight_layout()
    fig.savefig(path)
    return True


def plot_seed_band(
    ax, runs: Sequence[Run], color, label: str, attr: str = "eval_acc", style: str = "-", band: bool = True
) -> bool:
    """The mean over runs (seeds) of each run's held-out curve (the mean over its agents), with the min/max
    band over seeds; False when none evaluated."""
    curves = [c for c in (eval_curve(r, attr) for r in runs) if c[1].size]
    if not curves:
        return False
    rounds = np.unique(np.concatenate([x for x, _ in curves]))
    mat = np.full((len(curves), rounds.size), np.nan)
    for j, (x, y) in enumerate(curves):
        mat[j, np.searchsorted(rounds, x)] = y
    ax.plot(rounds, nanmean_rows(mat), color=color, lw=2, ls=style, marker="o", ms=3, label=label)
    if band:
        ax.fill_between(rounds, np.nanmin(mat, axis=0), np.nanmax(mat, axis=0), color=color, alpha=0.15, lw=0)
    return True


def fig_learning_health(runs: Sequence[Run], summary: dict, path: Path) -> None:
    """Held-out accuracy per config (mean over seeds of the swarm mean, band = min/max over seeds; the unseen
    set's dashed where the mix has one), and the collapse signs: share of groups with signal and token
    entropy (moving averages, mean over agents)."""
    configs = summary["configs"]
    w = summary["window"]
    by = _by_cfg(runs, configs)
    fig = _figure(15, 4.4)
    axes = fig.subplots(1, 3)
    cols = _colors(len(configs))
    for i, cfg in enumerate(configs):
        for attr, style, label in (("eval_acc", "-", cfg), ("unseen_acc", "--", f"{cfg}, unseen")):
            plot_seed_band(axes[0], by[cfg], cols[i], label, attr, style)
        for ax, attr in ((axes[1], "signal_frac"), (axes[2], "entropy")):
            series = [p for r in by[cfg] for p in r.peers if getattr(p, attr).size]
            rounds, mat = align_series(series, attr)
            if mat.size and np.isfinite(mat).any():
                short = max(1, min(w, rounds.size // 4))  # a short run keeps a curve, not one point
                ax.plot(rounds, moving_average(nanmean_rows(mat), short), color=cols[i], lw=1.5, label=cfg)
    base = summary.get("eval_baseline", math.nan)
    if axes[0].lines and math.isfinite(base):  # what accuracy must beat: one fixed answer per dataset
        axes[0].axhline(base, color="grey", ls="--", lw=1.2, label=f"constant-answer baseline {base:.3f}")
    base = summary.get("unseen_baseline", math.nan)
    if summary.get("has_unseen") and math.isfinite(base):
        axes[0].axhline(base, color="grey", ls=":", lw=1.2, label=f"constant answer, unseen set {base:.3f}")
    titles = (
        "Held-out accuracy (greedy); band = min/max over seeds",
        "Groups with signal (moving average)",
        "Token entropy of the samples, nats (moving average)",
    )
    for ax, title in zip(axes, titles):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=8, loc="best")
        else:
            ax.text(0.5, 0.5, "not logged by these runs", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path)


def fig_paired_seeds(summary: dict, path: Path) -> bool:
    """The seeds' spread: each seed's held-out accuracy (final, and area over the run) per configuration,
    one line per seed, so a paired effect is read off the slopes rather than off two means. Returns False
    (and draws nothing) when no configuration logged held-out accuracy."""
    configs = summary["configs"]
    per = summary["per_config"]
    panels = [
        (k, t)
        for k, t in (
            ("eval_final_by_seed", "final held-out accuracy"),
            ("eval_area_by_seed", "held-out accuracy, area / rounds"),
        )
        if any(per[c].get(k) for c in configs)
    ]
    if not panels:
        return False
    fig = _figure(4.2 * len(panels) + 1.3, 4.2)
    for i, (key, title) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        seeds = sorted({s for c in configs for s in (per[c].get(key) or {})}, key=lambda s: (len(s), s))
        other_agents = any(per[c].get("agents_differ") for c in configs)  # means over other agents: no slopes
        for seed, color in zip(seeds, _colors(len(seeds))):
            ys = [(per[c].get(key) or {}).get(seed, math.nan) for c in configs]
            ax.plot(
                range(len(configs)), ys, "o" if other_agents else "o-", color=color, alpha=0.8, label=f"seed {seed}"
            )
        means = [np.nanmean(list((per[c].get(key) or {}).values()) or [math.nan]) for c in configs]
        ax.plot(range(len(configs)), means, "s-", color="black", lw=2.5, label="mean")
        if summary.get("eval_baseline") is not None and math.isfinite(summary["eval_baseline"]):
            ax.axhline(summary["eval_baseline"], color="gray", ls="--", lw=1, label="constant answer")
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(configs)
        ax.set_xlim(-0.3, len(configs) - 0.7)
        ax.set_xlabel("configuration (I/J)")
        ax.set_title(title + ("\n(configurations of other agents: not paired)" if other_agents else ""))
        ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path)
    return True


def _heldout_axes(ax, title: str, summary: dict) -> None:
    base = summary.get("eval_baseline", math.nan)
    if ax.lines and math.isfinite(base):
        ax.axhline(base, color="grey", ls="--", lw=1.2, label=f"constant answer {base:.3f}")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("round")
    ax.set_ylabel("held-out accuracy (greedy)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(fontsize=8, loc="best")


def fig_families(runs: Sequence[Run], summary: dict, path: Path) -> None:
    """One panel per model family of a mixed swarm: the family's held-out curve per configuration (mean over
    seeds of the mean over the family's peers; band = min/max over seeds)."""
    families = summary["families"]["families"]
    nr, nc = _grid(len(families))
    fig = _figure(5.2 * nc, 3.8 * nr)
    axes = fig.subplots(nr, nc, squeeze=False, sharey=True)
    cols = _colors(len(summary["configs"]))
    for k, fam in enumerate(families):
        ax = axes[k // nc][k % nc]
        mine = family_runs(runs, fam)
        for cfg, color in zip(summary["configs"], cols):
            plot_seed_band(ax, [r for r in mine if r.config == cfg], color, cfg)
        _heldout_axes(ax, f"{model_label(fam)}: band = min/max over seeds", summary)
    for k in range(len(families), nr * nc):
        axes[k // nc][k % nc].set_visible(False)
    fig.tight_layout()
    fig.savefig(path)


def fig_focus(runs: Sequence[Run], summary: dict, path: Path) -> None:
    """The focus peer's held-out curve per configuration (solid; band = min/max over seeds) against the mean
    curve of the other peers of its runs, the veterans (dashed, same colour, no band)."""
    peer = summary["focus"]["peer"]
    fig = _figure(8, 4.8)
    ax = fig.add_subplot(111)
    for cfg, color in zip(summary["configs"], _colors(len(summary["configs"]))):
        mine = [r for r in runs if r.config == cfg]
        plot_seed_band(ax, restrict(mine, lambda r, p: p.peer == peer), color, f"{cfg}: {peer}")
        plot_seed_band(
            ax, restrict(mine, lambda r, p: p.peer != peer), color, f"{cfg}: veterans (mean)", style="--", band=False
        )
    _heldout_axes(ax, f"{peer} (band = min/max over seeds) against the veterans' mean", summary)
    fig.tight_layout()
    fig.savefig(path)

"""How sure a comparison over seeds is, for `sapo-report`: the bootstrap CI of a configuration's % against the
baseline, and, with seeds paired (peer p of seed k has the same node seed in every configuration), the sign
test and the paired effect (mean difference, its CI, d_z, the exact permutation p)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np


def bootstrap_improvement(
    cfg: Sequence[float], base: Sequence[float], n_boot: int = 2000, seed: int = 0
) -> tuple[float, float, float, str]:
    """(point %, CI low %, CI high %, note) for 100 * (mean(cfg)/mean(base) - 1)."""
    c = np.asarray([x for x in cfg if math.isfinite(x)], dtype=float)
    b = np.asarray([x for x in base if math.isfinite(x)], dtype=float)
    if c.size == 0 or b.size == 0:
        return math.nan, math.nan, math.nan, "no data"
    bm = float(b.mean())
    if bm == 0:
        return math.nan, math.nan, math.nan, "baseline mean is 0"
    point = 100.0 * (float(c.mean()) / bm - 1.0)
    if c.size == 1 and b.size == 1:
        return point, point, point, "degenerate CI: 1 seed each"
    rng = np.random.default_rng(seed)
    cm = c[rng.integers(0, c.size, size=(n_boot, c.size))].mean(axis=1)
    bms = b[rng.integers(0, b.size, size=(n_boot, b.size))].mean(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        ratio = np.where(bms != 0, 100.0 * (cm / bms - 1.0), np.nan)
    ratio = ratio[np.isfinite(ratio)]
    if ratio.size == 0:
        return point, math.nan, math.nan, "bootstrap failed"
    lo, hi = np.percentile(ratio, [2.5, 97.5])
    note = ""
    if c.size == 1:
        note = "config has 1 seed: CI reflects baseline seeds only"
    elif b.size == 1:
        note = "baseline has 1 seed: CI reflects config seeds only"
    return point, float(lo), float(hi), note


def paired_sign_test(cfg: dict[str, float], base: dict[str, float]) -> tuple[int, int, float]:
    """(seeds where the config beat the baseline, common seeds, one-sided exact sign-test p).

    Seeds are paired: peer p of seed k has the same node seed in every configuration. With n seeds
    the smallest possible p is 0.5**n, so 3 seeds can never reach p < 0.05 however large the effect."""
    common = [k for k in cfg if k in base and math.isfinite(cfg[k]) and math.isfinite(base[k])]
    diffs = [cfg[k] - base[k] for k in common if cfg[k] != base[k]]  # ties carry no sign
    n, wins = len(diffs), sum(d > 0 for d in diffs)
    p = sum(math.comb(n, i) for i in range(wins, n + 1)) / 2**n if n else math.nan
    return wins, len(common), p


def paired_effect(cfg: dict[str, float], base: dict[str, float]) -> dict[str, float]:
    """Paired effect over common seeds: mean difference with its 95% bootstrap CI (10 000 resamples of the
    differences, default_rng(0)), Cohen's d_z (mean / sd of the differences) and the two-sided exact
    permutation p (every sign flip of the differences; no normality assumed, unlike a t-test on 5 seeds).
    With n seeds the smallest p is 2 / 2**n: 5 seeds can reach 0.0625, 6 reach 0.03."""
    common = [k for k in cfg if k in base and math.isfinite(cfg[k]) and math.isfinite(base[k])]
    diffs = np.array([cfg[k] - base[k] for k in common], dtype=float)
    n = len(diffs)
    if n == 0:
        return {
            "mean_diff": math.nan,
            "ci_low": math.nan,
            "ci_high": math.nan,
            "d_z": math.nan,
            "p_perm": math.nan,
            "n": 0,
        }
    sd = float(diffs.std(ddof=1)) if n > 1 else math.nan
    observed = abs(diffs.mean())
    signs = (
        np.array(list(itertools.product((1.0, -1.0), repeat=n)))
        if n <= 16
        else np.random.default_rng(0).choice((1.0, -1.0), size=(65536, n))
    )
    p = float(np.mean(np.abs((signs * diffs).mean(axis=1)) >= observed - 1e-12))
    means = diffs[np.random.default_rng(0).integers(0, n, size=(10_000, n))].mean(axis=1)
    low, high = (float(q) for q in np.percentile(means, [2.5, 97.5]))
    return {
        "mean_diff": float(diffs.mean()),
        "ci_low": low,
        "ci_high": high,
        "d_z": float(diffs.mean() / sd) if sd and sd > 0 else math.nan,
        "p_perm": p,
        "n": n,
    }


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment: the k-th smallest of m p-values times (m - k + 1), never below the one
    before it, at most 1. A member without a p-value (NaN: no test) still counts toward m, as if its p were
    1, so a family never shrinks to make the others look stronger; its own adjusted p stays NaN."""
    ranked = sorted((p, k) for k, p in pvalues.items() if math.isfinite(p))
    m = len(pvalues)
    out = {k: math.nan for k in pvalues}
    running = 0.0
    for i, (p, k) in enumerate(ranked):
        running = max(running, min(1.0, p * (m - i)))
        out[k] = running
    return out

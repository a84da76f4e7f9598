"""sapo-report: compare SAPO local/external (I/J) configurations from experiment metrics.

Usage::

    sapo-report EXPERIMENT_DIR [EXPERIMENT_DIR ...] [--out DIR] [--threshold R] [--baseline NAME]
                [--window 10] [--drop X] [--bootstrap 2000] [--boot-seed 0]

Input layout (discovered leniently): every ``metrics.jsonl`` below an experiment dir is one agent
(peer) of one run.  A run is identified by the nearest ``run.json`` above the file (fields
``config_name``, ``seed``, ``num_local``, ``num_external``, ``ij_policy``, ``peers``, ``rounds``),
e.g. ``EXP/<config>/seed<k>/run.json`` + ``EXP/<config>/seed<k>/peer<p>/metrics.jsonl``.  Without a
``run.json`` the config and seed come from the directory names (``.../<config>/seed<k>/<peer>/``).
Runs with the same config name are pooled across all experiment dirs given.

Each metrics line is a JSON object with ``round`` (int) and ``reward_mean`` (float, or null when
the round had no local groups), plus optionally ``num_local``, ``num_external``,
``target_external``, ``external_accepted``, ``external_rejected``, ``round_s``.  Lines that are not
JSON objects or lack a valid ``round``/``reward_mean`` are skipped and counted; if a round is
logged twice (a resumed run) the last line wins.

Definitions (also written into the report):

* swarm-mean reward of a run at round t: mean over the run's agents that logged round t.
* moving average (MA): trailing mean over the last ``window`` logged rounds (positions, not round
  numbers); undefined for the first ``window - 1`` rounds (or ``window`` = number of rounds when a
  run is shorter than the window).
* cumulative reward of a run: sum over agents and rounds of ``reward_mean`` (NaN rounds count 0).
  Per config: mean ± sample std (ddof = 1) over seeds.
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
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np

try:  # orjson is a project dependency, but keep the tool usable without it
    import orjson

    def _loads(b: bytes) -> Any:
        return orjson.loads(b)

except ImportError:  # pragma: no cover

    def _loads(b: bytes) -> Any:
        return json.loads(b)


__all__ = [
    "PeerSeries",
    "Run",
    "load_runs",
    "summarize",
    "write_report",
    "main",
]

_SEED_RE = re.compile(r"^seed[_-]?(\w+)$", re.IGNORECASE)
_IJ_RE = re.compile(r"^(\d+)\s*[/_-]\s*(\d+)$")


# ============================================================================ data


@dataclass
class PeerSeries:
    """One agent's metrics, sorted by round (one entry per round)."""

    peer: str
    path: str
    rounds: np.ndarray  # int
    reward: np.ndarray  # float, NaN where no local reward
    num_local: np.ndarray  # float (NaN = missing)
    num_external: np.ndarray
    target_external: np.ndarray
    accepted: np.ndarray
    rejected: np.ndarray
    round_s: np.ndarray
    ij_policy: str | None = None  # last "ij_policy" string logged in the file, if any


@dataclass
class Run:
    """One configuration × seed: its agents and metadata."""

    config: str
    seed: str
    run_dir: str
    meta: dict = field(default_factory=dict)
    peers: list[PeerSeries] = field(default_factory=list)
    skipped_lines: int = 0
    skipped_by_file: dict[str, int] = field(default_factory=dict)
    duplicate_rounds: int = 0

    @property
    def ij_policy(self) -> str:
        p = self.meta.get("ij_policy")
        if p in (None, ""):
            p = next((s.ij_policy for s in self.peers if s.ij_policy), None)
        return str(p) if p not in (None, "") else "fixed"

    @property
    def adaptive(self) -> bool:
        if self.ij_policy.lower() != "fixed":
            return True
        for p in self.peers:
            t = p.target_external[np.isfinite(p.target_external)]
            if t.size and np.unique(t).size > 1:
                return True
        return False

    @property
    def silo(self) -> bool:
        """True when this run never used an external group (and is not adaptive)."""
        if self.adaptive:
            return False
        ne = self.meta.get("num_external")
        if isinstance(ne, (int, float)) and not isinstance(ne, bool) and ne != 0:
            return False
        seen = False
        for p in self.peers:
            v = p.num_external[np.isfinite(p.num_external)]
            if v.size:
                seen = True
                if np.any(v != 0):
                    return False
        return seen or ne == 0


# ============================================================================ loading


def _num(x: Any) -> float:
    if isinstance(x, bool) or x is None:
        return math.nan
    if isinstance(x, (int, float)):
        return float(x)
    return math.nan


def _parse_line(raw: bytes) -> dict | None:
    """Parsed record, or None when the line is corrupt."""
    try:
        obj = _loads(raw)
    except Exception:
        return None
    if not isinstance(obj, dict):
        return None
    r = obj.get("round")
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r != int(r):
        return None
    if "reward_mean" not in obj:
        return None
    rm = obj["reward_mean"]
    if rm is not None and (isinstance(rm, bool) or not isinstance(rm, (int, float))):
        return None
    return obj


def _read_metrics(path: Path, peer: str) -> tuple[PeerSeries | None, int, int]:
    """(series or None if no valid line, corrupt line count, duplicate round count)."""
    by_round: dict[int, dict] = {}
    bad = dup = 0
    try:
        data = path.read_bytes()
    except OSError:
        return None, 1, 0
    for raw in data.splitlines():
        if not raw.strip():
            continue
        obj = _parse_line(raw)
        if obj is None:
            bad += 1
            continue
        r = int(obj["round"])
        if r in by_round:
            dup += 1
        by_round[r] = obj
    if not by_round:
        return None, bad, dup
    rounds = np.array(sorted(by_round), dtype=np.int64)
    recs = [by_round[int(r)] for r in rounds]

    pol = next((o["ij_policy"] for o in reversed(recs) if isinstance(o.get("ij_policy"), str)), None)

    def col(key: str) -> np.ndarray:
        return np.array([_num(o.get(key)) for o in recs], dtype=float)

    return (
        PeerSeries(
            peer=peer,
            path=str(path),
            rounds=rounds,
            reward=col("reward_mean"),
            num_local=col("num_local"),
            num_external=col("num_external"),
            target_external=col("target_external"),
            accepted=col("external_accepted"),
            rejected=col("external_rejected"),
            round_s=col("round_s"),
            ij_policy=pol,
        ),
        bad,
        dup,
    )


def _read_run_json(path: Path) -> dict:
    try:
        d = json.loads(path.read_text())
        return d if isinstance(d, dict) else {}
    except (OSError, ValueError):
        return {}


def _identify(metrics: Path, root: Path) -> tuple[str, str, str, str, dict]:
    """(config, seed, run_dir, peer, meta) for one metrics file below experiment root."""
    parent = metrics.parent
    run_json_dir: Path | None = None
    d = parent
    while True:
        if (d / "run.json").is_file():
            run_json_dir = d
            break
        if d == root or root not in d.parents:
            break
        d = d.parent
    rel = parent.relative_to(root).parts if parent != root else ()

    # directory-name fallbacks
    seed_idx = next((i for i, p in enumerate(rel) if _SEED_RE.match(p)), None)
    if seed_idx is not None:
        fb_config = "/".join(rel[:seed_idx]) or root.name
        fb_seed = _SEED_RE.match(rel[seed_idx]).group(1)  # type: ignore[union-attr]
        fb_run_dir = root.joinpath(*rel[: seed_idx + 1])
    elif rel:
        fb_config, fb_seed, fb_run_dir = rel[0], "0", root / rel[0]
    else:
        fb_config, fb_seed, fb_run_dir = root.name, "0", root

    meta: dict = {}
    if run_json_dir is not None:
        meta = _read_run_json(run_json_dir / "run.json")
        run_dir = run_json_dir
    else:
        run_dir = fb_run_dir

    config = meta.get("config_name")
    if not isinstance(config, str) or not config:
        nl, ne = meta.get("num_local"), meta.get("num_external")
        if isinstance(nl, int) and isinstance(ne, int):
            config = f"{nl}/{ne}"
            pol = meta.get("ij_policy")
            if pol and str(pol).lower() != "fixed":
                config += f" {pol}"
        elif run_json_dir is not None and run_json_dir != root and seed_idx is None:
            config = run_json_dir.name
        else:
            config = fb_config
    seed = meta.get("seed")
    seed = str(seed) if seed is not None and not isinstance(seed, (dict, list)) else fb_seed
    prel = parent.relative_to(run_dir).parts if parent != run_dir and run_dir in parent.parents else ()
    peer = "/".join(prel) if prel else "peer0"
    return config, seed, str(run_dir), peer, meta


def load_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Discover every metrics.jsonl below the given experiment dirs and group them into runs."""
    runs: dict[tuple[str, str], Run] = {}
    seen_files: set[Path] = set()
    for p in paths:
        root = Path(p).resolve()
        if root.is_file():
            files = [root]
            root = root.parent
        else:
            files = sorted(root.rglob("metrics.jsonl"))
        for f in files:
            f = f.resolve()
            if f in seen_files:
                continue
            seen_files.add(f)
            config, seed, run_dir, peer, meta = _identify(f, root)
            key = (run_dir, config)
            run = runs.get(key)
            if run is None:
                run = runs[key] = Run(config=config, seed=seed, run_dir=run_dir, meta=meta)
            series, bad, dup = _read_metrics(f, peer)
            if bad:
                run.skipped_lines += bad
                run.skipped_by_file[str(f)] = bad
            run.duplicate_rounds += dup
            if series is not None:
                run.peers.append(series)
    out = [r for r in runs.values()]
    # seeds must be unique within a config: disambiguate same seed from different run dirs
    used: dict[tuple[str, str], int] = {}
    for r in sorted(out, key=lambda r: (r.config, r.seed, r.run_dir)):
        k = (r.config, r.seed)
        n = used.get(k, 0)
        used[k] = n + 1
        if n:
            r.seed = f"{r.seed}#{n + 1}"
    for r in out:
        r.peers.sort(key=lambda s: s.peer)
    return sorted(out, key=lambda r: (_config_sort_key(r.config), _seed_key(r.seed)))


# ============================================================================ numerics


def _config_sort_key(name: str) -> tuple:
    m = _IJ_RE.match(name.strip())
    if m:
        return (0, int(m.group(2)), -int(m.group(1)), name)
    return (1, 0, 0, name)


def _seed_key(seed: str) -> tuple:
    m = re.match(r"^(\d+)", seed)
    return (0, int(m.group(1)), seed) if m else (1, 0, seed)


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


def _align(series: Sequence[PeerSeries], attr: str = "reward") -> tuple[np.ndarray, np.ndarray]:
    """(union of rounds, matrix agents × rounds with NaN where an agent did not log the round)."""
    if not series:
        return np.array([], dtype=np.int64), np.zeros((0, 0))
    rounds = np.unique(np.concatenate([s.rounds for s in series]))
    mat = np.full((len(series), rounds.size), np.nan)
    for i, s in enumerate(series):
        mat[i, np.searchsorted(rounds, s.rounds)] = getattr(s, attr)
    return rounds, mat


def _nanmean_rows(mat: np.ndarray) -> np.ndarray:
    ok = np.isfinite(mat)
    cnt = ok.sum(axis=0)
    tot = np.where(ok, mat, 0.0).sum(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cnt > 0, tot / np.maximum(cnt, 1), np.nan)


def swarm_curve(run: Run) -> tuple[np.ndarray, np.ndarray]:
    """(rounds, swarm-mean reward per round) of one run."""
    rounds, mat = _align(run.peers)
    return rounds, (_nanmean_rows(mat) if mat.size else np.array([]))


def _fmean(xs: Sequence[float]) -> float:
    v = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.mean(v)) if v else math.nan


def _fstd(xs: Sequence[float]) -> float:
    v = [x for x in xs if x is not None and math.isfinite(x)]
    return float(np.std(v, ddof=1)) if len(v) >= 2 else (0.0 if len(v) == 1 else math.nan)


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
        return math.nan, math.nan, math.nan, "baseline cumulative reward is 0"
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


def _steep_drops(curve: np.ndarray, window: int, drop: float) -> int:
    n = curve.size // max(window, 1)
    if n < 2 or not math.isfinite(drop):
        return 0
    blocks = curve[: n * window].reshape(n, window)
    m = _nanmean_rows(blocks.T)
    d = m[:-1] - m[1:]
    return int(np.sum(np.isfinite(d) & (d > drop)))


def _max_drawdown(ma: np.ndarray) -> float:
    v = ma[np.isfinite(ma)]
    if v.size == 0:
        return math.nan
    return float(np.max(np.maximum.accumulate(v) - v))


def _pick_baseline(by_cfg: dict[str, list[Run]], requested: str | None) -> tuple[str | None, str]:
    if requested is not None:
        if requested not in by_cfg:
            raise ValueError(f"baseline {requested!r} not found; configurations: {', '.join(by_cfg)}")
        return requested, "given with --baseline"
    silo = [c for c, rs in by_cfg.items() if all(r.silo for r in rs)]
    named = [c for c in by_cfg if _IJ_RE.match(c.strip()) and _IJ_RE.match(c.strip()).group(2) == "0"]  # type: ignore[union-attr]
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
) -> dict:
    """Core numbers per configuration (see the module docstring for definitions).

    Returns a JSON-safe-ish dict (NaN where undefined) with keys: configs, baseline,
    baseline_reason, threshold, threshold_source, drop, drop_source, window, n_boot, boot_seed,
    skipped_lines, skipped_by_file, duplicate_rounds, warnings, per_config{name: {...}}.
    """
    if window < 1:
        raise ValueError("window must be >= 1")
    by_cfg: dict[str, list[Run]] = {}
    for r in sorted(runs, key=lambda r: (_config_sort_key(r.config), _seed_key(r.seed))):
        if r.peers:
            by_cfg.setdefault(r.config, []).append(r)
    warnings: list[str] = []
    empty = [f"{r.config} seed {r.seed}" for r in runs if not r.peers]
    if empty:
        warnings.append(f"runs with no valid metrics: {', '.join(empty)}")

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

    per: dict[str, dict] = {}
    for cfg, rs in by_cfg.items():
        seeds = [r.seed for r in rs]
        cum = {r.seed: float(np.nansum(np.concatenate([p.reward for p in r.peers]))) for r in rs}
        agent_rounds = {r.seed: int(sum(np.isfinite(p.reward).sum() for p in r.peers)) for r in rs}
        per_ar = [cum[s] / agent_rounds[s] if agent_rounds[s] else math.nan for s in seeds]
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
        final_j = [p.target_external[np.isfinite(p.target_external)][-1] for r in rs for p in r.peers if np.isfinite(p.target_external).any()]
        ne = np.concatenate([p.num_external for r in rs for p in r.peers])
        nl = np.concatenate([p.num_local for r in rs for p in r.peers])
        rs_s = np.concatenate([p.round_s for r in rs for p in r.peers])
        reached = [v for v in rtt.values() if v is not None]
        per[cfg] = {
            "ij_policy": ",".join(sorted({r.ij_policy for r in rs})),
            "adaptive": any(r.adaptive for r in rs),
            "silo": all(r.silo for r in rs),
            "seeds": seeds,
            "n_seeds": len(rs),
            "peers": sorted({len(r.peers) for r in rs}),
            "rounds": sorted({int(max(p.rounds.size for p in r.peers)) for r in rs}),
            "cumulative_by_seed": cum,
            "cumulative_mean": _fmean(list(cum.values())),
            "cumulative_std": _fstd(list(cum.values())),
            "reward_per_agent_round": _fmean(per_ar),
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
        }

    if base_name is not None:
        b = per[base_name]
        bvals = list(b["cumulative_by_seed"].values())
        for cfg, d in per.items():
            if cfg == base_name:
                d["improvement_pct"], d["improvement_ci"], d["improvement_note"] = 0.0, [0.0, 0.0], "baseline"
                continue
            pt, lo, hi, note = bootstrap_improvement(list(d["cumulative_by_seed"].values()), bvals, n_boot, boot_seed)
            d["improvement_pct"], d["improvement_ci"], d["improvement_note"] = pt, [lo, hi], note
            d["paired_wins"], d["paired_seeds"], d["sign_test_p"] = paired_sign_test(
                d["cumulative_by_seed"], b["cumulative_by_seed"])
            if d["peers"] != b["peers"] or d["rounds"] != b["rounds"]:
                warnings.append(
                    f"{cfg}: agents {d['peers']} / rounds {d['rounds']} differ from baseline {base_name} "
                    f"({b['peers']} / {b['rounds']}): cumulative sums are not directly comparable; "
                    "see reward per agent-round"
                )

    skipped_by_file: dict[str, int] = {}
    for r in runs:
        skipped_by_file.update(r.skipped_by_file)
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
        "warnings": warnings,
        "per_config": per,
    }


# ============================================================================ figures


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
        rounds, mat = _align([p for _, p in agents])
        if mat.size:
            ax.plot(rounds, moving_average(_nanmean_rows(mat), w), color="black", lw=2.0, label="mean of agents")
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
        rounds, mat = _align(series)
        if not mat.size:
            continue
        # per-agent MA computed on each agent's own logged rounds, then aligned
        ma = np.full_like(mat, np.nan)
        for j, p in enumerate(series):
            ma[j, np.searchsorted(rounds, p.rounds)] = moving_average(p.reward, w)
        ok = np.isfinite(ma).any(axis=0)
        lo = np.where(ok, np.min(np.where(np.isfinite(ma), ma, np.inf), axis=0), np.nan)
        hi = np.where(ok, np.max(np.where(np.isfinite(ma), ma, -np.inf), axis=0), np.nan)
        mean = _nanmean_rows(ma)
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
        if c == summary["baseline"]:
            tag = "baseline"
        elif math.isfinite(imp):
            tag = f"{imp:+.1f}%"
        else:
            tag = "n/a"
        ax.text(xi, (m if math.isfinite(m) else 0) + s + 0.02 * top, f"{m:.1f}\n{tag}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(x)
    ax.set_xticklabels(configs)
    ax.set_ylim(0, top * 1.2 if top > 0 else 1)
    ax.set_xlabel("configuration (I/J)")
    ax.set_ylabel("cumulative reward (sum over agents and rounds)")
    ax.set_title(f"Cumulative reward, mean ± std over seeds; % vs baseline {summary['baseline']}")
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
            ax.step(p.rounds, y, where="post", lw=1.0, alpha=0.8 if len(agents) <= 12 else 0.3,
                    color=cols[i], label=lab if len(agents) <= 12 else None)
        if len(agents) > 1:
            jr, jm = _align([p for _, p in agents], "target_external")
            if np.isfinite(jm).any():
                ax.plot(jr, moving_average(_nanmean_rows(jm), summary["window"]), color="black", lw=2.0,
                        label=f"mean over agents (MA {summary['window']})")
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


# ============================================================================ report


def _f(x: Any, fmt: str = ".2f", na: str = "n/a") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return na
    return format(x, fmt)


def _pct(x: float) -> str:
    return "n/a" if not math.isfinite(x) else f"{x:+.2f}%"


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


FIGURES = {
    "per_agent": "per_agent_rewards.png",
    "ma_band": "moving_average_band.png",
    "cumulative": "cumulative_reward.png",
    "j_trajectory": "j_trajectory.png",
}


def write_report(runs: Sequence[Run], summary: dict, out: Path, inputs: Sequence[str] = ()) -> Path:
    """Write figures, summary.json and report.md into `out`; returns the report path."""
    out.mkdir(parents=True, exist_ok=True)
    fig_per_agent(runs, summary, out / FIGURES["per_agent"])
    fig_ma_band(runs, summary, out / FIGURES["ma_band"])
    fig_cumulative(summary, out / FIGURES["cumulative"])
    has_adaptive = fig_j_trajectory(runs, summary, out / FIGURES["j_trajectory"])
    (out / "summary.json").write_text(json.dumps(_jsonable(summary), indent=2, sort_keys=False))

    per = summary["per_config"]
    cfgs = summary["configs"]
    base = summary["baseline"]
    L: list[str] = []
    L.append("# SAPO I/J experiment report\n")
    if inputs:
        L.append("Inputs: " + ", ".join(f"`{p}`" for p in inputs) + "\n")
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
            f"{', '.join(map(str, d['peers']))} | {', '.join(map(str, d['rounds']))} | "
            f"{_f(d['mean_num_local'])} | {_f(d['mean_num_external'])} |"
        )
    L.append("")

    L.append("## Cumulative reward\n")
    L.append("Sum over agents and rounds of `reward_mean`, per seed; mean ± sample std over seeds.\n")
    L.append("Seeds ahead: in how many seeds the configuration beat the baseline with the same seed (peer p of "
             "seed k has the same node seed in every configuration), with the one-sided exact sign-test p; "
             "with n seeds p cannot go below 0.5^n.\n")
    L.append("| config | cumulative reward (mean ± std) | per seed | reward per agent-round | vs baseline | 95% CI (bootstrap over seeds) | seeds ahead (sign-test p) | note |")
    L.append("|---|---|---|---|---|---|---|---|")
    for c in cfgs:
        d = per[c]
        seeds = ", ".join(f"s{s}: {_f(v)}" for s, v in d["cumulative_by_seed"].items())
        if c == base:
            vs, ci, ahead = "baseline", "—", "—"
        else:
            ahead = ("n/a" if not d["paired_seeds"] else
                     f"{d['paired_wins']}/{d['paired_seeds']} (p = {_f(d['sign_test_p'], '.3f')})")
            vs = _pct(d["improvement_pct"])
            lo, hi = d["improvement_ci"]
            ci = "n/a" if not (math.isfinite(lo) and math.isfinite(hi)) else f"[{lo:+.2f}%, {hi:+.2f}%]"
        L.append(
            f"| {c} | {_f(d['cumulative_mean'])} ± {_f(d['cumulative_std'])} | {seeds} | "
            f"{_f(d['reward_per_agent_round'], '.4f')} | {vs} | {ci} | {ahead} | "
            f"{d['improvement_note'] if c != base else ''} |"
        )
    L.append("")
    L.append(f"![cumulative reward]({FIGURES['cumulative']})\n")

    L.append("## Learning speed\n")
    L.append(
        f"Threshold: {_f(summary['threshold'], '.4f')} ({summary['threshold_source']}). "
        "Rounds to threshold = first logged round at which the swarm-mean reward's moving average "
        "reaches the threshold.\n"
    )
    L.append("| config | round reached (mean over seeds that reached it) | seeds reaching | per seed |")
    L.append("|---|---|---|---|")
    for c in cfgs:
        d = per[c]
        ps = ", ".join(f"s{s}: {v if v is not None else 'never'}" for s, v in d["rounds_to_threshold_by_seed"].items())
        L.append(f"| {c} | {_f(d['rounds_to_threshold_mean'], '.1f', 'never')} | {d['seeds_reaching_threshold']}/{d['n_seeds']} | {ps} |")
    L.append("")
    L.append(f"![moving average with min/max band]({FIGURES['ma_band']})\n")
    L.append(f"![per-agent reward curves]({FIGURES['per_agent']})\n")

    L.append("## Stability\n")
    L.append(
        f"Std over rounds of the swarm-mean reward (mean over seeds; includes the learning trend). "
        f"Steep drop: the mean over a block of {summary['window']} consecutive rounds is lower than the previous "
        f"block's by more than X = {_f(summary['drop'], '.4f')} ({summary['drop_source']}). "
        "Max drawdown: largest fall of the moving average below its running maximum (mean over seeds).\n"
    )
    L.append("| config | reward std | steep drops per seed (mean) | max drawdown |")
    L.append("|---|---|---|---|")
    for c in cfgs:
        d = per[c]
        L.append(f"| {c} | {_f(d['reward_std_mean'], '.4f')} | {_f(d['steep_drops_mean'])} | {_f(d['max_drawdown_mean'], '.4f')} |")
    L.append("")

    L.append("## External groups and J\n")
    L.append("| config | accepted | rejected | acceptance rate | mean target J | final target J (mean over agents) | mean round time (s) |")
    L.append("|---|---|---|---|---|---|---|")
    for c in cfgs:
        d = per[c]
        rate = d["acceptance_rate"]
        L.append(
            f"| {c} | {_f(d['external_accepted'], 'd')} | {_f(d['external_rejected'], 'd')} | "
            f"{'n/a' if not math.isfinite(rate) else f'{100 * rate:.1f}%'} | {_f(d['mean_target_j'])} | "
            f"{_f(d['final_target_j_mean'])} | {_f(d['mean_round_s'])} |"
        )
    L.append("")
    if has_adaptive:
        L.append(f"![J trajectory]({FIGURES['j_trajectory']})\n")
    else:
        L.append(f"No adaptive runs (every configuration used a fixed J); [{FIGURES['j_trajectory']}]({FIGURES['j_trajectory']}) says so.\n")

    L.append("## Data quality\n")
    L.append(f"Corrupt metrics lines skipped: **{summary['skipped_lines']}**. Rounds logged more than once (last kept): {summary['duplicate_rounds']}.\n")
    for fpath, n in summary["skipped_by_file"].items():
        L.append(f"- `{fpath}`: {n} line(s) skipped")
    L.append("")
    path = out / "report.md"
    path.write_text("\n".join(L))
    return path


def _console_table(summary: dict) -> str:
    rows = [f"{'config':<16}{'seeds':>6}{'cumulative':>22}{'vs base':>11}  95% CI"]
    for c in summary["configs"]:
        d = summary["per_config"][c]
        cum = f"{_f(d['cumulative_mean'])} ± {_f(d['cumulative_std'])}"
        lo, hi = d["improvement_ci"]
        ci = "" if c == summary["baseline"] else ("n/a" if not math.isfinite(lo) else f"[{lo:+.1f}%, {hi:+.1f}%]")
        vs = "baseline" if c == summary["baseline"] else _pct(d["improvement_pct"])
        rows.append(f"{c:<16}{d['n_seeds']:>6}{cum:>22}{vs:>11}  {ci}")
    return "\n".join(rows)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="sapo-report", description="Compare SAPO I/J configurations from metrics.jsonl files.")
    ap.add_argument("experiments", nargs="+", metavar="EXPERIMENT_DIR")
    ap.add_argument("--out", type=Path, default=None, help="output dir (default: FIRST_EXPERIMENT_DIR/report)")
    ap.add_argument("--threshold", type=float, default=None, help="reward threshold (default 0.5 × max observed MA)")
    ap.add_argument("--baseline", default=None, help="baseline config name (default: the silo config, J = 0)")
    ap.add_argument("--window", type=int, default=10, help="moving-average window in rounds (default 10)")
    ap.add_argument("--drop", type=float, default=None, help="steep-drop size X (default 0.1 × max observed MA)")
    ap.add_argument("--bootstrap", type=int, default=2000, help="bootstrap resamples (default 2000)")
    ap.add_argument("--boot-seed", type=int, default=0, help="bootstrap RNG seed (default 0)")
    a = ap.parse_args(argv)

    missing = [p for p in a.experiments if not Path(p).exists()]
    if missing:
        print(f"sapo-report: no such path: {', '.join(missing)}", file=sys.stderr)
        return 2
    if a.window < 1 or a.bootstrap < 1:
        print("sapo-report: --window and --bootstrap must be >= 1", file=sys.stderr)
        return 2
    runs = load_runs(a.experiments)
    if not any(r.peers for r in runs):
        skipped = sum(r.skipped_lines for r in runs)
        print(f"sapo-report: no usable metrics.jsonl found ({skipped} corrupt line(s) skipped)", file=sys.stderr)
        return 2
    try:
        summary = summarize(
            runs, baseline=a.baseline, threshold=a.threshold, window=a.window, drop=a.drop,
            n_boot=a.bootstrap, boot_seed=a.boot_seed,
        )
    except ValueError as e:
        print(f"sapo-report: {e}", file=sys.stderr)
        return 2
    out = a.out if a.out is not None else Path(a.experiments[0]) / "report"
    path = write_report(runs, summary, out, a.experiments)
    print(_console_table(summary))
    if summary["skipped_lines"]:
        print(f"skipped {summary['skipped_lines']} corrupt metrics line(s)")
    for w in summary["warnings"]:
        print(f"warning: {w}")
    print(f"report: {path}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""Reading experiment output: every metrics.jsonl below a dir becomes one agent of one `Run`
(layout in `node.lab.report`)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from node.lab.run_files import parse_metrics_line, run_meta
from node.learn.guard import EvalSummary

_SEED_RE = re.compile(r"^seed[_-]?(\w+)$", re.IGNORECASE)
IJ_RE = re.compile(r"^(\d+)\s*[/_-]\s*(\d+)$")
PEER_RE = re.compile(r"^peer[-_]?\w*$", re.IGNORECASE)  # a peer's run dir: scripts/local_swarm.sh's ROOT/peer<i>


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
    eval_acc: np.ndarray = field(default_factory=lambda: np.array([]))  # held-out accuracy, NaN if not evaluated
    entropy: np.ndarray = field(default_factory=lambda: np.array([]))  # mean token entropy of the samples
    signal_frac: np.ndarray = field(default_factory=lambda: np.array([]))  # share of groups with signal
    eval_baseline: float = float("nan")  # constant-answer accuracy on the evaluation set (logged since v0.3)
    unseen_acc: np.ndarray = field(default_factory=lambda: np.array([]))  # the unseen set's (mixes split by content)
    unseen_baseline: float = float("nan")
    model: str | None = None  # last "model" logged (peers of a mixed swarm run different ones)
    publisher: str | None = None  # its own key prefix, as the other peers' external_sources name it
    external_sources: dict[str, int] = field(default_factory=dict)  # publisher -> groups trained on, all rounds
    final_eval: EvalSummary | None = None  # its last held-out evaluation, as the collapse guard reads it
    evaluator: str | None = None  # what decoded its held-out answers (eval_engine; torch before it was logged)
    tokens_generated: np.ndarray = field(default_factory=lambda: np.array([]))  # completion tokens it sampled
    start_acc: float = float("nan")  # held-out accuracy of its starting weights (round 0's start_accuracy)


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
    unreadable: dict[str, str] = field(default_factory=dict)  # files left out: path -> why
    left_out: bool = False  # its run.json is malformed: none of its metrics read (config and seed unknown)

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


def _num(x: Any) -> float:
    if isinstance(x, bool) or x is None:
        return math.nan
    if isinstance(x, (int, float)):
        return float(x)
    return math.nan


def last_evaluation(recs: Sequence[dict]) -> tuple[EvalSummary, dict] | None:
    """A peer's last held-out evaluation as the collapse guard reads it, with its record; None if it ran none."""
    for rec in reversed(recs):
        summary = EvalSummary.from_record(int(rec["round"]), rec)
        if summary is not None:
            return summary, rec
    return None


def _read_metrics(path: Path, peer: str) -> tuple[PeerSeries | None, int, int]:
    """(series or None if no valid line, corrupt line count, duplicate round count); OSError when the file
    cannot be read (the caller reads only regular files: a FIFO would block)."""
    by_round: dict[int, dict] = {}
    bad = dup = 0
    for raw in path.read_bytes().splitlines():
        if not raw.strip():
            continue
        obj = parse_metrics_line(raw)
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

    def last_text(key: str) -> str | None:
        return next((o[key] for o in reversed(recs) if isinstance(o.get(key), str) and o[key]), None)

    def col(key: str) -> np.ndarray:
        return np.array([_num(o.get(key)) for o in recs], dtype=float)

    def first(key: str) -> float:
        values = col(key)
        return float(values[np.isfinite(values)][0]) if np.isfinite(values).any() else float("nan")

    def largest(key: str) -> float:
        values = col(key)
        return float(np.nanmax(values)) if np.isfinite(values).any() else float("nan")

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
            ij_policy=last_text("ij_policy"),
            model=last_text("model"),
            publisher=last_text("publisher"),
            external_sources=_sum_sources(recs),
            eval_acc=col("eval_accuracy"),
            eval_baseline=largest("eval_baseline"),
            unseen_acc=col("eval_unseen_accuracy"),
            unseen_baseline=largest("eval_unseen_baseline"),
            entropy=col("entropy_mean"),
            # older runs logged only the local share
            signal_frac=np.where(np.isnan(sf := col("signal_frac")), col("local_signal_frac"), sf),
            final_eval=(last_evaluation(recs) or (None, None))[0],
            evaluator=evaluator_of(recs),
            tokens_generated=col("tokens_generated"),
            start_acc=first("start_accuracy"),
        ),
        bad,
        dup,
    )


def evaluator_of(recs: Sequence[dict]) -> str | None:
    """What decoded a peer's held-out answers: its records' newest `eval_engine`, "torch" for evaluations logged
    before the key existed (torch was the only evaluator then), None without an evaluation."""
    for rec in reversed(recs):
        if "eval_accuracy" in rec:
            engine = rec.get("eval_engine")
            return engine if isinstance(engine, str) and engine else "torch"
    return None


def _peer_records(run_dir: Path) -> list[list[dict]]:
    """Each peer's valid records of a run (run_dir/peer*/metrics.jsonl); unreadable files are left out."""
    out = []
    for path in sorted(run_dir.glob("peer*/metrics.jsonl")):
        if not path.is_file():  # a FIFO would block
            continue
        try:
            lines = path.read_bytes().splitlines()
        except OSError:
            continue
        out.append([obj for obj in map(parse_metrics_line, lines) if obj is not None])
    return out


def run_engines(run_dir: Path) -> dict[str, list[str]]:
    """What a run's peers used, sorted, from their records in one pass: `evaluators` decoded their held-out
    answers, `rollout_engines` sampled their completions ("unrecorded" for records older than the key, so a run
    resumed across it shows the stretch nobody named), `external_screens` shaped other peers' right answers
    (--external-screen; "unrecorded" likewise)."""
    evaluators: set[str | None] = set()
    engines: set[str] = set()
    screens: set[str] = set()
    for recs in _peer_records(run_dir):
        evaluators.add(evaluator_of(recs))
        engines.update(e if isinstance(e := rec.get("rollout_engine"), str) else "unrecorded" for rec in recs)
        screens.update(e if isinstance(e := rec.get("external_screen"), str) else "unrecorded" for rec in recs)
    return {
        "evaluators": sorted(e for e in evaluators if e),
        "rollout_engines": sorted(engines),
        "external_screens": sorted(screens),
    }


def _sum_sources(recs: list[dict]) -> dict[str, int]:
    total: dict[str, int] = {}
    for rec in recs:
        sources = rec.get("external_sources")
        for key, n in sources.items() if isinstance(sources, dict) else ():
            if isinstance(key, str) and isinstance(n, int):
                total[key] = total.get(key, 0) + n
    return total


def _identify(metrics: Path, root: Path) -> tuple[str, str, str, str, dict, str]:
    """(config, seed, run_dir, peer, meta, problem) for one metrics file below experiment root; `problem`: why
    its run.json is malformed ("" when it is fine or there is none: then the directory names say)."""
    parent = metrics.parent
    run_json_dir: Path | None = None
    d = parent
    while True:
        if (d / "run.json").exists():
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
    elif rel and PEER_RE.match(rel[0]):  # ROOT/peer<i>/: one swarm run, its peers are agents, not configurations
        fb_config, fb_seed, fb_run_dir = root.name, "0", root
    elif rel:
        fb_config, fb_seed, fb_run_dir = rel[0], "0", root / rel[0]
    else:
        fb_config, fb_seed, fb_run_dir = root.name, "0", root

    meta: dict = {}
    if run_json_dir is not None:
        meta, problem = run_meta(run_json_dir / "run.json")
        if problem:
            return "", "", str(run_json_dir), "", {}, problem
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
    seed = str(seed) if seed is not None else fb_seed  # an int or a string: run_meta checked its type
    prel = parent.relative_to(run_dir).parts if parent != run_dir and run_dir in parent.parents else ()
    peer = "/".join(prel) if prel else "peer0"
    return config, seed, str(run_dir), peer, meta, ""


def load_runs(paths: Iterable[str | Path]) -> list[Run]:
    """Discover every metrics.jsonl below the given experiment dirs and group them into runs.

    Files left out are named in their run's `unreadable`: a metrics.jsonl that is not a regular file (a FIFO
    would block) or cannot be read, and a malformed run.json (`run_meta`), whose whole run is then a `left_out`
    one with no agents rather than one filed under the directory names' configuration."""
    runs: dict[tuple[str, str], Run] = {}
    seen_files: set[Path] = set()
    left_out_files: dict[str, int] = {}
    for p in paths:
        root = Path(p).resolve()
        if not root.is_dir():
            files = [root]
            root = root.parent
        else:
            files = sorted(root.rglob("metrics.jsonl"))
        for f in files:
            f = f.resolve()
            if f in seen_files:
                continue
            seen_files.add(f)
            config, seed, run_dir, peer, meta, problem = _identify(f, root)
            if problem:
                key = (run_dir, "\0left out")
                if key not in runs:
                    runs[key] = Run(config="", seed="", run_dir=run_dir, left_out=True)
                    runs[key].unreadable[str(Path(run_dir) / "run.json")] = problem
                left_out_files[run_dir] = left_out_files.get(run_dir, 0) + 1
                continue
            key = (run_dir, config)
            run = runs.get(key)
            if run is None:
                run = runs[key] = Run(config=config, seed=seed, run_dir=run_dir, meta=meta)
            if not f.is_file():
                run.unreadable[str(f)] = "not a regular file"
                continue
            try:
                series, bad, dup = _read_metrics(f, peer)
            except OSError as e:
                run.unreadable[str(f)] = f"unreadable: {e.strerror or e}"
                continue
            if bad:
                run.skipped_lines += bad
                run.skipped_by_file[str(f)] = bad
            run.duplicate_rounds += dup
            if series is not None:
                run.peers.append(series)
    out = [r for r in runs.values()]
    for r in out:
        if r.left_out:
            n = left_out_files[r.run_dir]
            for path, why in r.unreadable.items():
                r.unreadable[path] = f"{why}; its run is left out ({n} metrics file{'s' * (n != 1)})"
    # seeds must be unique within a config: disambiguate same seed from different run dirs
    used: dict[tuple[str, str], int] = {}
    for r in sorted((r for r in out if not r.left_out), key=lambda r: (r.config, r.seed, r.run_dir)):
        k = (r.config, r.seed)
        n = used.get(k, 0)
        used[k] = n + 1
        if n:
            r.seed = f"{r.seed}#{n + 1}"
    for r in out:
        r.peers.sort(key=lambda s: s.peer)
    return sorted(out, key=lambda r: (config_sort_key(r.config), seed_sort_key(r.seed)))


def config_sort_key(name: str) -> tuple:
    m = IJ_RE.match(name.strip())
    if m:
        return (0, int(m.group(2)), -int(m.group(1)), name)
    return (1, 0, 0, name)


def seed_sort_key(seed: str) -> tuple:
    m = re.match(r"^(\d+)", seed)
    return (0, int(m.group(1)), seed) if m else (1, 0, seed)

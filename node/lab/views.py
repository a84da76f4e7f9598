"""Views of the runs restricted to some of their peers, for `sapo-report`: per model family (a swarm of two
models: does sharing pay for each family?) and one focus peer (a newcomer among veterans: does it learn
faster beside them than in its silo?).

Both cut every run down to those peers and reuse the held-out statistics of `stats` unchanged (final and
area under the curve per seed, % vs the baseline with its bootstrap CI, the sign test, the paired effect with
its exact permutation p). Across families the p-values are Holm-corrected: with two families there are two
tests, and either one alone would be read at the wrong level.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import replace

import numpy as np

from node.lab.paired import holm, paired_effect, paired_sign_test
from node.lab.runs import PeerSeries, Run
from node.lab.stats import HOLM_KEYS, compare_heldout, eval_curve, learning_health

_PEER_INDEX = re.compile(r"^peer[-_]?(\d+)$", re.IGNORECASE)


def peer_model(run: Run, peer: PeerSeries) -> str:
    """The model a peer ran: what its metrics lines say, else run.json's per-peer list, else its `model`."""
    if peer.model:
        return peer.model
    models, m = run.meta.get("models"), _PEER_INDEX.match(peer.peer)
    if isinstance(models, list) and m and int(m.group(1)) < len(models):
        return str(models[int(m.group(1))])
    return str(run.meta.get("model") or "unknown")


def model_families(runs: Sequence[Run]) -> list[str]:
    """The models of mixed swarms in order of first appearance; [] when no run mixes models."""
    per_run = [[peer_model(r, p) for p in r.peers] for r in runs]
    if not any(len(set(models)) > 1 for models in per_run):
        return []
    return list(dict.fromkeys(m for models in per_run for m in models))


def restrict(runs: Sequence[Run], keep: Callable[[Run, PeerSeries], bool]) -> list[Run]:
    """The runs cut down to the peers `keep` selects; a run left with none is dropped."""
    cut = [replace(r, peers=[p for p in r.peers if keep(r, p)]) for r in runs]
    return [r for r in cut if r.peers]


def family_runs(runs: Sequence[Run], family: str) -> list[Run]:
    """The runs cut down to the peers of one model family."""
    return restrict(runs, lambda r, p: peer_model(r, p) == family)


def heldout_view(runs: Sequence[Run], summary: dict) -> dict[str, dict]:
    """Per configuration that evaluated: held-out accuracy per seed of these runs, and each configuration
    against the report's baseline, seeds paired, exactly as `summarize` compares whole swarms; the training
    reward per agent-round too (paired effect and seeds ahead)."""
    per = {c: learning_health([r for r in runs if r.config == c]) for c in summary["configs"]}
    per = {c: d for c, d in per.items() if d["eval_final_by_seed"]}
    base = summary["baseline"]
    if base in per:
        for c, d in per.items():
            if c != base:
                compare_heldout(d, per[base], summary["n_boot"], summary["boot_seed"])
                wins, seeds, _ = paired_sign_test(d["reward_by_seed"], per[base]["reward_by_seed"])
                d["reward_vs_base"] = {
                    "wins": wins,
                    "seeds": seeds,
                    **paired_effect(d["reward_by_seed"], per[base]["reward_by_seed"]),
                }
    return per


def family_summary(runs: Sequence[Run], summary: dict) -> dict:
    """Held-out accuracy per model family and configuration, each family's paired comparison with the
    baseline, Holm-corrected across families; {} when no run mixes models."""
    families = model_families(runs)
    if not families:
        return {}
    per = {f: heldout_view(family_runs(runs, f), summary) for f in families}
    for cfg in summary["configs"]:
        for key in HOLM_KEYS:
            tests = {f: per[f][cfg][f"{key}_vs_base"] for f in families if f"{key}_vs_base" in per[f].get(cfg, {})}
            for f, p in holm({f: t["p_perm"] for f, t in tests.items()}).items():
                tests[f]["p_holm"] = p
    peers = {f: sorted({sum(peer_model(r, p) == f for p in r.peers) for r in runs}) for f in families}
    return {"families": families, "peers": peers, "per_family": per, "sources": family_sources(runs)}


def family_sources(runs: Sequence[Run]) -> dict[str, dict[str, dict[str, int]]]:
    """Per configuration and family: the external groups its peers trained on, by the family of the peer that
    sampled them (a run's peers name themselves in their records, `publisher`; a source that is none of them
    counts as "unknown"). Whether a family learns from the other one's groups or only from its own."""
    out: dict[str, dict[str, dict[str, int]]] = {}
    for r in runs:
        family_of = {p.publisher: peer_model(r, p) for p in r.peers if p.publisher}
        for p in r.peers:
            counts = out.setdefault(r.config, {}).setdefault(peer_model(r, p), {})
            for source, n in p.external_sources.items():
                family = family_of.get(source, "unknown")
                counts[family] = counts.get(family, 0) + n
    return {c: d for c, d in out.items() if any(d.values())}


def focus_name(value: str) -> str:
    """`--focus-peer 0` and `--focus-peer peer0` name the same agent."""
    return f"peer{value}" if value.isdigit() else value


def focus_summary(runs: Sequence[Run], summary: dict, peer: str) -> dict:
    """One peer against itself across configurations (a newcomer: swarm vs silo), with the other peers of
    its runs as the veterans. Besides the held-out comparison: per seed, the first evaluated round at which
    the peer reaches half of the veterans' mean accuracy at their first evaluation (the run's round count
    when it never does), compared the same way."""
    focus = restrict(runs, lambda r, p: p.peer == peer)
    if not focus:
        names = sorted({p.peer for r in runs for p in r.peers})
        raise ValueError(f"no agent named {peer!r} in these runs (agents: {', '.join(names)})")
    per = heldout_view(focus, summary)
    firsts: dict[str, list[float]] = {}
    for r in restrict(runs, lambda r, p: p.peer != peer):
        acc = eval_curve(r)[1]
        if acc.size:
            firsts.setdefault(r.seed, []).append(float(acc[0]))
    half = {seed: 0.5 * float(np.mean(v)) for seed, v in firsts.items()}
    for r in focus:
        rounds, acc = eval_curve(r)
        if r.config in per and r.seed in half and acc.size:
            hit = np.nonzero(acc >= half[r.seed])[0]
            never = int(r.meta.get("rounds") or max(int(p.rounds.max()) for p in r.peers) + 1)
            per[r.config].setdefault("rounds_to_half_by_seed", {})[r.seed] = int(rounds[hit[0]]) if hit.size else never
    base = per.get(summary["baseline"], {}).get("rounds_to_half_by_seed")
    for cfg, d in per.items():
        if base and cfg != summary["baseline"] and d.get("rounds_to_half_by_seed"):
            d["rounds_to_half_vs_base"] = paired_effect(d["rounds_to_half_by_seed"], base)
    veterans = {c: sorted({len(r.peers) - 1 for r in runs if r.config == c}) for c in per}
    return {"peer": peer, "per_config": per, "veterans": veterans, "half_veterans_by_seed": half}

"""The runs one `sapo-experiment` command asks for, each checked as its peers would check their flags, before
any of them starts: where each lives, the flags every peer gets in either mode, and what would refuse them.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from node.lab.run_record import RunJsonError, existing_run_json
from node.lab.runspec import (
    PRESETS,
    RunSpec,
    check_peer_configs,
    node_learning_settings,
    peer_plan,
    recipe_env,
    slug,
    unused_settings,
)

MAX_SEED = 2**63 // 1000 - 1  # peer p of seed k is node seed 1000k + p, which sapo-node wants below 2^63


def run_dir_of(exp: Path, spec: RunSpec) -> Path:
    return exp / slug(spec.config_name) / f"seed{spec.seed}"


def shared_start_eval(root: Path) -> list[str]:
    """Peers of a run that start from the same weights evaluate them once (node/learn/eval_share.py): the
    same greedy answers, so the records are as if each had; peers that start apart (a veteran's adapter)
    evaluate their own."""
    return ["--eval-share", str(root / "shared-eval")]


def run_flags(spec: RunSpec, root: Path) -> list[str]:
    """Every peer's flags besides RunSpec.node_args, in either mode: the run's swarm and its shared evaluation."""
    return ["--swarm", f"exp-{slug(spec.config_name)}", *shared_start_eval(root)]


def dht_flags(maddrs: list[str]) -> list[str]:
    """A dht-mode peer's addresses: its own on the loopback, the bootstrap peer's to join."""
    return ["--host-maddrs", "/ip4/127.0.0.1/tcp/0", "--peers", *maddrs]


def peer_env(spec: RunSpec) -> dict[str, str]:
    """A dht-mode peer's environment: this process's but the sapo-node settings its flags give (a memory-mode
    peer reads its flags with `recipe_env()`: the same settings either way)."""
    unused = unused_settings(os.environ)
    env = {k: v for k, v in os.environ.items() if k not in unused}
    return dict(env, SAPO_THREADS=str(spec.threads), PYTHONUNBUFFERED="1")


def check_run(spec: RunSpec, root: Path) -> None:
    """ValueError with the message to print when a peer of this run would refuse its flags: sapo-node's own
    checks on each peer's flags as the mode gives them (dht: the bootstrap's address stands in for the one it
    will have), before any run starts."""
    if spec.mode == "memory":
        check_peer_configs(spec, root, run_flags(spec, root), recipe_env())
    else:
        check_peer_configs(spec, root, run_flags(spec, root) + dht_flags(["/ip4/127.0.0.1/tcp/0"]), peer_env(spec))


def plan_runs(args: argparse.Namespace) -> list[tuple[str, RunSpec]]:
    """(configuration, run) for every run of the command, each checked as its peers would check their flags;
    ValueError with the message to print. Nothing is written."""
    peer_counts, models, peer_args = peer_plan(args)
    tasks, lora_rank, lr = node_learning_settings(args, models or [args.model])
    from node.learn.tasks import TaskError, resolve_mix

    try:
        resolve_mix(tasks)
    except TaskError as exc:
        raise ValueError(f"--tasks: {exc}") from None
    runs = []
    for name in args.configs:
        preset = PRESETS[name]
        peers = peer_counts[name]
        threads = args.threads or max(1, (os.cpu_count() or 1) // (1 if args.mode == "memory" else peers))
        for seed in args.seeds:
            spec = RunSpec(
                config_name=args.label or name,
                seed=seed,
                peers=peers,
                num_local=preset.num_local,
                num_external=preset.num_external,
                generations=preset.generations if args.generations is None else args.generations,
                ij_policy=preset.ij_policy,
                rounds=args.rounds,
                model=args.model if not models else models[0] if len(set(models)) == 1 else "mixed",
                tasks=tasks,
                max_new_tokens=args.max_new_tokens,
                lr=lr,
                mode=args.mode,
                threads=threads,
                extra_args=list(args.node_arg),
                eval_every=args.eval_every,
                eval_size=args.eval_size,
                eval_engine=args.eval_engine,
                lora_rank=lora_rank,
                lora_alpha=args.lora_alpha,
                models=models,
                peer_args=peer_args[name],
            )
            check_run(spec, run_dir_of(Path(args.out), spec))
            runs.append((name, spec))
    return runs


def place_problem(exp: Path, roots: list[Path]) -> str | None:
    """Why the experiment cannot keep its runs where they belong (--out or a run dir that is a file, a run.json
    that is not one), or None; checked before anything is written."""
    if exp.exists() and not exp.is_dir():
        return f"--out {exp}: not a directory"
    for root in roots:
        if root.exists() and not root.is_dir():
            return f"{root}: a file where a run dir belongs (--out {exp})"
        try:
            existing_run_json(root / "run.json")
        except RunJsonError as exc:
            return str(exc)
    return None

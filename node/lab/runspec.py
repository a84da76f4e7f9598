"""What one `sapo-experiment` run is: the I/J presets, a run's exact settings (`RunSpec`, written to run.json)
and the sapo-node flags of each of its peers, per-peer models and flags included, planned from the command line
(`peer_plan`, `node_learning_settings`) before any run starts."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from node.ops.config import ConfigError, load_config
from node.ops.config import build_parser as node_parser


@dataclass
class Preset:
    peers: int
    num_local: int
    num_external: int
    generations: int = 8
    ij_policy: str = "fixed"


PRESETS: dict[str, Preset] = {
    # the paper's table: 8 peers, I + J = 8, G = 8
    "8/0": Preset(8, 8, 0),
    "6/2": Preset(8, 6, 2),
    "4/4": Preset(8, 4, 4),
    "2/6": Preset(8, 2, 6),
    # single-GPU (or CPU) variants: 5 peers, I + J = 4
    "4/0": Preset(5, 4, 0),
    "3/1": Preset(5, 3, 1),
    "2/2": Preset(5, 2, 2),
    "1/3": Preset(5, 1, 3),
    # adaptive split, I + J = 4, starting at 2/2
    "ema": Preset(5, 2, 2, ij_policy="ema"),
    "usefulness": Preset(5, 2, 2, ij_policy="usefulness"),
}


@dataclass
class RunSpec:
    config_name: str
    seed: int
    peers: int
    num_local: int
    num_external: int
    generations: int
    ij_policy: str
    rounds: int
    model: str
    tasks: str
    max_new_tokens: int
    lr: float
    mode: str
    threads: int
    extra_args: list[str] = field(default_factory=list)
    eval_every: int = 10  # held-out evaluation cadence and size, passed to every peer
    eval_size: int = 64
    eval_engine: str = "auto"  # what decodes the held-out answers (sapo-node --eval-engine); run.json's
    # `evaluators` says what did
    lora_rank: int = 0  # > 0: every peer trains a LoRA adapter (memory mode: all on one shared base)
    lora_alpha: float = 32.0
    models: list[str] = field(default_factory=list)  # one per peer; empty: every peer runs `model`
    peer_args: dict[int, list[str]] = field(default_factory=dict)  # peer -> its own flags, after the common ones

    def peer_seed(self, p: int) -> int:
        return 1000 * self.seed + p

    def model_of(self, p: int) -> str:
        return self.models[p] if self.models else self.model

    def node_args(self, p: int, run_dir: Path) -> list[str]:
        """Peer p's sapo-node flags: the common ones, then its own (argparse keeps the last of a repeated flag,
        so a peer's own value wins)."""
        args = [
            "--model",
            self.model_of(p),
            "--tasks",
            self.tasks,
            "--num-local",
            str(self.num_local),
            "--num-external",
            str(self.num_external),
            "--generations",
            str(self.generations),
            "--ij-policy",
            self.ij_policy,
            "--rounds",
            str(self.rounds),
            "--seed",
            str(self.peer_seed(p)),
            "--lr",
            str(self.lr),
            "--run-dir",
            str(run_dir),
            "--name",
            f"peer{p}",
            "--threads",
            str(self.threads),
            "--eval-every",
            str(self.eval_every),
            "--eval-size",
            str(self.eval_size),
            "--eval-engine",
            self.eval_engine,
            "--lora-rank",
            str(self.lora_rank),
        ]
        if self.max_new_tokens:
            args += ["--max-new-tokens", str(self.max_new_tokens)]
        if self.lora_rank:
            args += ["--lora-alpha", str(self.lora_alpha)]
        return args + list(self.extra_args) + list(self.peer_args.get(p, []))


def parse_peer_args(values: list[str], peers: int) -> dict[int, list[str]]:
    """`P:FLAG` items (`1:--lora-init=DIR`) -> {P: [FLAG, ...]} in the order given; ValueError naming the bad one."""
    out: dict[int, list[str]] = {}
    for item in values:
        head, sep, flag = item.partition(":")
        if not sep or not head.strip().isdigit() or not flag.startswith("-"):
            raise ValueError(f"--peer-arg {item!r}: expected PEER:FLAG, e.g. 1:--lora-init=RUN_DIR")
        p = int(head)
        if p >= peers:
            raise ValueError(f"--peer-arg {item!r}: peer {p} does not exist (peers 0..{peers - 1})")
        out.setdefault(p, []).append(flag)
    return out


def slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name.replace("/", "-"))


def label_problem(label: str) -> str | None:
    """Why --label cannot name a configuration's runs, or None. Its run dirs are OUT/slug(label)/seedK, and slug
    turns a '/' into '-' ("2/2 ftis" -> 2-2_ftis: the documented form), so no label reaches outside --out but '.'
    and '..' (and labels that are a '..' path); those, and labels with control characters (a report's table
    row), are refused."""
    if slug(label) in (".", "..") or ".." in re.split(r"[/\\]", label):
        return f"--label {label!r}: names no directory inside --out (give a name, e.g. '2/2 ftis')"
    if any(not c.isprintable() for c in label):
        return f"--label {label!r}: control characters"
    return None


def recipe_env() -> dict[str, str]:
    """The environment an experiment's peers resolve their recipe with, in either mode: SAPO_RECIPE alone (every
    other setting reaches them as a flag)."""
    return {k: v for k, v in os.environ.items() if k == "SAPO_RECIPE"}


# sapo-node settings a dht-mode peer may take from the environment besides the recipe: how the private swarm's
# keys are minted, which nothing a peer learns depends on (the suite mints at a low difficulty)
SWARM_PLUMBING = ("SAPO_POW_DIFFICULTY", "SAPO_IDENTITY_TIER")


def unused_settings(env: Mapping[str, str]) -> list[str]:
    """The SAPO_<OPTION> variables of `env` that an experiment's peers never see, in either mode: each setting
    reaches them as a flag, which run.json records (--node-arg), so a shell's leftover SAPO_EVAL_EVERY cannot
    change a dht-mode run and not a memory-mode one. SAPO_THREADS is the experiment's own (--threads)."""
    from dataclasses import fields

    from node.ops.config import NodeConfig

    settings = {f"SAPO_{f.name.upper()}" for f in fields(NodeConfig)} - {"SAPO_RECIPE", "SAPO_THREADS", *SWARM_PLUMBING}
    return sorted(k for k in env if k in settings)


# The sapo-node options every peer gets from sapo-experiment itself (RunSpec.node_args, and the run's own: its swarm,
# shared evaluation, addresses, resume), each with the experiment's flag or the source that sets it. --node-arg may
# set none of them: the peers would run with a value that run.json does not record (or outside the run's dirs).
SET_BY_EXPERIMENT = {
    "model": "give --model or --models",
    "tasks": "give --tasks",
    "num_local": "the preset sets it",
    "num_external": "the preset sets it",
    "generations": "give --generations",
    "ij_policy": "the preset sets it",
    "rounds": "give --rounds",
    "seed": "give --seeds: peer p of seed k has node seed 1000k + p",
    "lr": "give --lr",
    "run_dir": "give --out: peer p of a run lives in OUT/CONFIG/seedK/peerP",
    "name": "peer p is named peerP",
    "threads": "give --threads",
    "eval_every": "give --eval-every",
    "eval_size": "give --eval-size",
    "eval_engine": "give --eval-engine",
    "lora_rank": "give --lora-rank",
    "lora_alpha": "give --lora-alpha",
    "max_new_tokens": "give --max-new-tokens",
    "swarm": "each configuration has a swarm of its own",
    "peers": "each peer joins its run's bootstrap peer",
    "host_maddrs": "each peer listens on the loopback",
    "eval_share": "a run's peers share OUT/CONFIG/seedK/shared-eval",
    "resume": "a run that has begun is resumed",
}
# What --peer-arg may still give one peer of its own (its own --eval-every, --lr, --lora-init...): all but these,
# which the run itself depends on: its layout and seeds, its swarm, one task mix and the shared LoRA base in memory mode
# (`run_memory` loads each peer's model, builds its mix and its adapter from the run's settings), one CPU split.
PEER_RESERVED = (
    *("model", "tasks", "rounds", "seed", "run_dir", "name", "threads", "lora_rank", "lora_alpha"),
    *("swarm", "peers", "host_maddrs", "eval_share", "resume"),
)


def check_not_set_by_experiment(flags: list[str], where: str, reserved: tuple[str, ...] | list[str]) -> None:
    """ValueError when `flags` (already known to parse) set an option of `reserved` that sapo-experiment sets itself;
    parsed as sapo-node parses them, so `--rounds=3`, `--rounds 3`, `--no-resume` and abbreviations all count."""
    given, _ = node_parser().parse_known_args(flags)
    for name in vars(given):
        if name in reserved:
            raise ValueError(
                f"{where}: {'--' + name.replace('_', '-')} is set by sapo-experiment itself, not by a peer's "
                f"flags ({SET_BY_EXPERIMENT[name]})"
            )


def check_node_flags(flags: list[str], where: str) -> None:
    """ValueError naming what sapo-node would refuse in `flags` (an unknown flag, or a value argparse refuses),
    so that a typo stops the command before any run starts rather than when a peer starts."""
    try:
        _, unknown = node_parser().parse_known_args(flags)
    except SystemExit:  # argparse has printed which value it refused
        raise ValueError(f"{where}: a value sapo-node refuses (above)") from None
    if unknown:
        raise ValueError(f"{where}: {' '.join(unknown)} is no sapo-node flag (see sapo-node --help)")


def peer_plan(args: argparse.Namespace) -> tuple[dict[str, int], list[str], dict[str, dict[int, list[str]]]]:
    """(peers per configuration, per-peer models, per-peer flags per configuration) from the CLI; ValueError
    with the message to print. Checked for every configuration before any run starts."""
    if args.peers is not None and args.peers < 1:
        raise ValueError(f"--peers must be >= 1 (got {args.peers})")
    models = [m.strip() for m in args.models.split(",")] if args.models else []
    if any(not m for m in models):
        raise ValueError(f"--models {args.models!r}: an empty model name")
    if models and args.peers and args.peers != len(models):
        raise ValueError(f"--models names {len(models)} models but --peers is {args.peers}; give one model per peer")
    peers = {name: len(models) or args.peers or PRESETS[name].peers for name in args.configs}
    plan = {name: parse_peer_args(args.peer_arg, n) for name, n in peers.items()}
    for flags in plan.values():
        for p, own in flags.items():
            check_node_flags(own, f"--peer-arg {p}")
            check_not_set_by_experiment(own, f"--peer-arg {p}", PEER_RESERVED)
    return peers, models, plan


def node_learning_settings(args: argparse.Namespace, models: list[str]) -> tuple[str, int, float]:
    """(tasks, LoRA rank, learning rate) as `sapo-node` resolves them from what this command gives (its flags,
    then --node-arg, as a peer reads them; the recipe from `--node-arg=--recipe=...` or SAPO_RECIPE, else auto,
    which depends on the model on a GPU), so that an experiment's peers train as a node alone would: on a CPU,
    the CPU recipe. Models whose recipes differ (a packaged and another model on a GPU) need one named: every
    peer of a run has one recipe. ValueError with the message to print."""
    given = ["--lora-alpha", str(args.lora_alpha)]  # checked here even when no peer gets it (no LoRA)
    for flag, value in (("--tasks", args.tasks), ("--lora-rank", args.lora_rank), ("--lr", args.lr)):
        given += [flag, str(value)] if value is not None else []
    check_node_flags(given + list(args.node_arg), "--node-arg")
    check_not_set_by_experiment(list(args.node_arg), "--node-arg", tuple(SET_BY_EXPERIMENT))
    from node.build import check_fits_the_wire  # the torch-heavy part: not for --help

    resolved = {}
    for model in dict.fromkeys(models):
        try:
            cfg = load_config(["--model", model, *given, *args.node_arg], env=recipe_env())
            check_fits_the_wire(cfg)  # every mode's peers publish: a swarm of silent peers would be no swarm
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        resolved[model] = (cfg.recipe, cfg.tasks, cfg.lora_rank, cfg.lr)
    if len({r[0] for r in resolved.values()}) > 1:
        raise ValueError(
            "--models: their recipes differ here ("
            + ", ".join(f"{m}: {r[0]}" for m, r in resolved.items())
            + "); name one for every peer, e.g. --node-arg=--recipe=cpu"
        )
    return next(iter(resolved.values()))[1:]


def check_peer_configs(spec: RunSpec, root: Path, run_flags: list[str], env: Mapping[str, str]) -> None:
    """ValueError with the message to print when sapo-node would refuse a peer of this run: the node's own checks
    (load_config, the wire's limits) on exactly the flags each peer gets, in the environment it gets, so a bad
    value (`--generations -3`, `--eval-size 0`) stops the command before any run starts, not each peer at its
    start. A peer's own flags (--peer-arg) are checked after the common ones, so the message says whose they are;
    a peer's --practise against the run's task mix too (five specialists: `--peer-arg P:--practise=DATASET`)."""
    from node.build import check_fits_the_wire, practised_part
    from node.learn.tasks import resolve_mix

    mix = resolve_mix(spec.tasks)  # every peer's (plan_runs has checked it)
    for p in range(spec.peers):
        common = spec.node_args(p, root / f"peer{p}")
        own = list(spec.peer_args.get(p, []))
        for flags, where in ((common[: len(common) - len(own)], ""), (common, f"--peer-arg {p}: ")):
            try:
                cfg = load_config(flags + run_flags, env=env)
                check_fits_the_wire(cfg)
                practised_part(cfg, mix)
            except ConfigError as exc:
                raise ValueError(f"{where}{exc}") from None
            if not own:
                break

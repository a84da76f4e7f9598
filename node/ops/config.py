"""Node configuration: one dataclass; values come from flags > SAPO_* env vars > TOML file > defaults."""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from node import __version__
from node.learn import practise
from node.learn.choices import (
    ENGINE_WEIGHTS,
    ENGINES,
    EVAL_ENGINES,
    EXTERNAL_LOSSES,
    EXTERNAL_SCREENS,
    IJ_POLICIES,
    LOSS_TYPES,
    MIXED_PRECISION,
    NET_PIPELINE,
    PREFIX_SHARING,
)
from node.learn.packaged import PACKAGED

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


def opt(default: Any, help: str, **extra: Any) -> Any:
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class NodeConfig:
    # model and tasks
    model: str = opt(
        "default",
        "HF model id, local dir, .gguf file, 'default' (embedded SmolLM2-135M-Instruct) "
        "or 'tiny-random' / 'tiny-random-smol'",
    )
    tasks: str = opt(
        "paper",
        "task mix: a preset (paper, cpu-learn, cpu-sparse, cpu-parts, cpu-easy, smoke, "
        "test-learn) "
        "or comma-separated reasoning-gym datasets",
    )
    practise: str = opt(
        "",
        "sample this node's own tasks from part of the task mix only: dataset names of the mix, "
        "comma-separated, optionally with weights (basic_arithmetic:1,chain_sum:3); peers' groups from the "
        "whole mix are still trained on, and the evaluations cover the whole mix (empty: the whole mix)",
    )
    device: str = opt("auto", "auto, cpu, cuda, cuda:N")
    recipe: str = opt(
        "auto",
        "defaults for what no flag, variable or file sets: cpu (the CPU recipe: cpu-learn, "
        "LoRA rank 8, its learning rate, beta 0.04, 2/2), none (the paper's setup), auto "
        "(cpu on a CPU and for the packaged models, none on a GPU for other models); see "
        "docs/CONFIGURATION.md 'Defaults'",
    )
    threads: int = opt(0, "torch CPU threads for this process (0 = all cores)")
    # SAPO round
    num_local: int = opt(
        4,
        "I: local groups (tasks sampled and trained on) per round; at most 64 in a swarm (peers refuse larger batches)",
    )
    num_external: int = opt(4, "J: external groups from other peers per round (upper bound for adaptive policies)")
    ij_policy: str = opt("fixed", f"how J changes each round: {', '.join(IJ_POLICIES)}")
    generations: int = opt(8, "G: completions per task; at most 32 in a swarm (peers refuse larger groups)")
    rounds: int = opt(100, "stop after this many rounds in total (resume counts earlier ones)")
    seed: int = opt(0, "seed for tasks, sampling and selection (peers should differ)")
    # sampling
    max_new_tokens: int = opt(0, "max new tokens per completion (0 = the task mix's default)")
    temperature: float = opt(1.0, "sampling temperature")
    top_p: float = opt(1.0, "nucleus sampling p")
    rollout_engine: str = opt(
        "auto",
        "what samples the completions: auto (llama on a CPU where it imports, else "
        "torch), torch (the training model), llama (llama.cpp, CPU: the wheel setup "
        "installs or a source build) or vllm (GPU, untested); one that cannot load "
        "falls back to torch with a warning",
    )
    engine_weights: str = opt(
        "auto",
        "weights the llama engine samples with: auto (bf16 with the ik-llama wheel; "
        "a source build: bf16 on a CPU with native bf16, else f16), bf16, f16, "
        "q8_0, f32; rewritten after each update, a LoRA adapter merged in (a source "
        "build with f16/q8_0 and LoRA: the base written once, then only the adapter)",
    )
    # GRPO
    lr: float = opt(
        1e-6,
        "Adam learning rate (chosen by 200-round solo runs: "
        "docs/experiments/learning-rate-cpu-easy.md); with "
        "--lora-rank and no explicit --lr, 10x that (LoRA Without Regret)",
    )
    loss_type: str = opt("grpo", f"loss aggregation: {', '.join(LOSS_TYPES)}")
    eps_low: float = opt(0.2, "lower clip range")
    eps_high: float = opt(0.28, "upper clip range")
    beta: float = opt(
        0.0,
        "KL weight against the reference: the initial model, with LoRA the base without the "
        "adapter (0 = no reference model)",
    )
    scale_std: bool = opt(True, "divide advantages by the group's reward std (off = Dr. GRPO)")
    external_loss: str = opt(
        "sapo",
        "how other peers' completions are trained on: sapo (as our own, the paper's "
        "rule), positive (only those with positive advantage), is (weighted by "
        "min(1, pi_old/mu), mu the publisher's log-probs), ftis (both); "
        "docs/experiments/off-policy-sharing.md",
    )
    external_screen: str = opt(
        "on",
        "what of another peer's right answer is learned: on (span and reference), span (short-answer "
        "mixes: only the answer the reward reads, a completion with more text outside it dropped), "
        "reference (windows the frozen reference finds far less likely than our own text masked), off "
        "(all of it, the paper's rule); docs/ALGORITHM.md",
    )
    epochs: int = opt(1, "passes over the round's sequences")
    minibatches: int = opt(1, "optimizer steps per epoch")
    micro_batch_size: int = opt(
        4,
        "sequences per forward/backward (memory bound); with prefix sharing, as many "
        "tokens as that many of the longest sequences",
    )
    max_grad_norm: float = opt(1.0, "gradient clipping norm")
    mixed_precision: str = opt(
        "auto",
        "matmuls in bf16 under torch.autocast, weights, optimizer and loss in fp32: "
        "auto (on a CPU with native bf16: AVX512-BF16/AMX, and on a GPU with bf16), "
        "bf16, off",
    )
    prefix_sharing: str = opt(
        "auto",
        "train each group's prompt once under its G completions: auto (when the model's KV cache allows it), on, off",
    )
    lora_rank: int = opt(
        0,
        "LoRA rank on every linear layer of the decoder (0 = off: full fine-tuning); "
        "only the adapter is trained and checkpointed",
    )
    lora_alpha: float = opt(32.0, "LoRA alpha (the adapter's update is scaled by alpha / rank)")
    lora_init: str = opt(
        "",
        "start the adapter from this checkpoint (a round-* dir or a run dir: its newest good "
        "checkpoint; adapter weights only, same base and rank); --resume takes precedence",
    )
    # held-out evaluation
    eval_every: int = opt(10, "greedy held-out evaluation every N rounds (0 = off; 10 keeps its cost near 6 percent)")
    eval_size: int = opt(64, "tasks in the held-out evaluation set (fixed per task mix, never trained on)")
    collapse_guard: bool = opt(
        True,
        "at each held-out evaluation, restore the best evaluation's weights and "
        "lower the learning rate when the policy has collapsed; a fresh node first "
        "evaluates its starting weights (docs/OPERATING.md)",
    )
    guard_lr_factor: float = opt(0.5, "the collapse guard multiplies the learning rate by this on each restore")
    eval_unseen_size: int = opt(0, "tasks in the unseen evaluation set of a mix split by content (0 = --eval-size)")
    eval_at: str = opt(
        "",
        "also evaluate after these rounds, comma-separated (e.g. 3,6: the first rise shows "
        "early; scripts/local_swarm.sh's default)",
    )
    eval_round0: bool = opt(
        True,
        "evaluate after round 0's update as well (--no-eval-round0: a fresh node's first point is its "
        "starting weights' evaluation; the quick start saves that minute)",
    )
    eval_share: str = opt(
        "",
        "a directory shared by peers on this machine: peers that start from the same weights evaluate them "
        "once, the others read the result (scripts/local_swarm.sh's; empty: each evaluates its own)",
    )
    eval_engine: str = opt(
        "auto",
        "what decodes the held-out answers: auto (the rollout engine where it is not "
        "torch: llama.cpp, synced first, unless torch computes in bf16), torch (the training model), "
        "engine; each record names it (eval_engine; docs/EVALUATION.md)",
    )
    # run dir, checkpoints, logs
    run_dir: str = opt("runs/node", "where metrics, logs, identity and checkpoints live")
    resume: bool = opt(False, "continue from the newest good checkpoint in --run-dir")
    checkpoint_every: int = opt(
        5,
        "checkpoint every N rounds (and always on exit or a stop); a kill -9 loses "
        "at most the N - 1 rounds since the last one (docs/benchmarks/stop.md: cost)",
    )
    keep_checkpoints: int = opt(2, "how many checkpoints to keep")
    log_level: str = opt("INFO", ", ".join(LOG_LEVELS))
    name: str = opt("", "display name in logs (default: from the public key)")
    # swarm
    peers: list = opt([], "multiaddrs of peers to join (none = silo, or first peer with --swarm-start)")
    require_peers: bool = opt(
        False,
        "exit when no --peers answers at start (default: train in silo meanwhile "
        "and join when one answers; docs/OPERATING.md)",
    )
    swarm: str = opt("sapo-default", "swarm name; DHT keys are namespaced by it")
    host_maddrs: list = opt(["/ip4/0.0.0.0/tcp/0"], "libp2p listen multiaddrs")
    announce_maddrs: list = opt([], "multiaddrs to announce (public IP)")
    client_mode: bool = opt(False, "DHT client mode (behind NAT: not dialable)")
    swarm_start: bool = opt(False, "start a new swarm with no --peers (first peer) instead of running in silo")
    window: int = opt(2, "W: a publisher's W newest rounds are accepted (round > its newest - W)")
    fetch_max: int = opt(
        16, "K: batches fetched per round at most; most go to publishers proven useful, >= K/4 explore"
    )
    pow_difficulty: int = opt(20, "swarm-wide proof-of-work bits on every peer key (all peers must agree)")
    identity_tier: int = opt(
        1,
        "work tier of this node's own key: 4 bits above --pow-difficulty per tier (16x the "
        "mint each, once: ~16 s at tier 1 and 20 bits); peers try never-tried keys of "
        "higher tiers first, so Sybils minted cheaper cannot delay this node's first "
        "fetch (docs/PROTOCOL.md, node policy)",
    )
    net_timeout: float = opt(10.0, "upper bound in seconds on swarm I/O per round")
    net_pipeline: str = opt(
        "auto",
        "the network behind the round: on (publish in the background; others' batches fetched and "
        "verified while the round generates, taken at select without waiting), off (awaited in the "
        "round, in line), auto (on over the DHT, off in a silo and in-process experiments)",
    )
    net_max_age: int = opt(
        0,
        "rounds a node may run ahead of its network: a prefetch begun at round r is taken at round "
        "r + N at the latest, which waits for it (bounded by --net-timeout); 0: in its own round, the "
        "round waiting only for what the fetch takes beyond generation (a reader reads each publisher's "
        "newest round only, so a prefetch spanning several rounds brings one batch where they would bring several)",
    )
    verify_budget_s: float = opt(
        0.0, "seconds of verification per round; the rest waits a round (0 = --net-timeout / 3)"
    )
    verify_budget_mb: float = opt(32.0, "MiB of received batches verified per round; the rest waits a round")
    ban_s: float = opt(3600.0, "first ban of a misbehaving publisher in seconds; each repeat doubles it")
    reset_reputation: bool = opt(False, "forget every publisher score and ban at start (unban everyone)")
    # status
    status_port: int = opt(0, "serve /status, /metrics, / on this port (0 = off)")
    status_host: str = opt("127.0.0.1", "status server bind address")
    tensorboard: bool = opt(True, "write per-round scalars as TensorBoard event files under RUN_DIR/tb/")
    config: str = opt("", "TOML config file (flags > SAPO_* env > file > defaults)")

    @property
    def run_path(self) -> Path:
        return Path(self.run_dir)

    @property
    def eval_rounds(self) -> tuple[int, ...]:
        """--eval-at as round numbers (validate() has checked them)."""
        return tuple(sorted({int(r) for r in self.eval_at.replace(",", " ").split()}))

    @property
    def swarm_enabled(self) -> bool:
        return bool(self.peers) or self.swarm_start

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class ConfigError(ValueError):
    """One clear line naming the offending option."""


POSITIVE = {
    "num_local",
    "generations",
    "rounds",
    "epochs",
    "minibatches",
    "micro_batch_size",
    "checkpoint_every",
    "keep_checkpoints",
    "window",
    "fetch_max",
}
NON_NEGATIVE = {
    "num_external",
    "max_new_tokens",
    "threads",
    "beta",
    "status_port",
    "seed",
    "eval_every",
    "lora_rank",
    "eval_unseen_size",
    "net_max_age",
}
MAX_EVAL_SIZE = 10_000  # held-out tasks per set: found before round 0, not after an hour of searching
LORA_LR_SCALE = 10.0  # LoRA Without Regret (Thinking Machines, 2025): LoRA's best RL learning rate is ~10x


def default_lr(lora_rank: int) -> float:
    """The learning rate when none is given: the full fine-tuning default, x LORA_LR_SCALE with LoRA."""
    lr = float(NodeConfig.__dataclass_fields__["lr"].default)  # type: ignore[arg-type]  # a float default
    return float(f"{lr * LORA_LR_SCALE:.6g}") if lora_rank > 0 else lr


# The CPU recipe: what a node on a CPU learns with when nothing else is set, and a GPU node on a small
# packaged model (CONFIGURATION.md "Defaults"). Its learning rate and KL weight were chosen by a sweep fixed first:
# docs/RESULTS.md (the CPU recipe's experiment) has its design and figures. Both are
# LoRA values (the KL reference is the base with the adapter off, no second model): a run with --lora-rank 0
# gets the full fine-tuning rate and no KL term. A GPU node on any other model keeps the paper's setup.
RECIPES: dict[str, dict[str, Any]] = {
    "cpu": {"tasks": "cpu-learn", "lora_rank": 8, "lr": 2e-4, "beta": 0.04, "num_local": 2, "num_external": 2},
    "none": {},
}
LORA_ONLY = ("lr", "beta")  # recipe values that hold for a LoRA run only
RECIPE_CHOICES = ("auto", *RECIPES)
SMALL_MODELS = (*PACKAGED, "tiny-random", "tiny-random-smol")  # models `auto` gives the CPU recipe on a GPU too


# the allowed values of a flag: the implementation's own list (node/learn/choices.py), one source for both
CHOICES = {
    "loss_type": LOSS_TYPES,
    "external_loss": EXTERNAL_LOSSES,
    "external_screen": EXTERNAL_SCREENS,
    "ij_policy": IJ_POLICIES,
    "log_level": LOG_LEVELS,
    "prefix_sharing": PREFIX_SHARING,
    "rollout_engine": ENGINES,
    "engine_weights": ENGINE_WEIGHTS,
    "eval_engine": EVAL_ENGINES,
    "mixed_precision": MIXED_PRECISION,
    "recipe": RECIPE_CHOICES,
    "net_pipeline": NET_PIPELINE,
}


def resolve_recipe(name: str, device: str, model: str = "default") -> str:
    """auto: the CPU recipe, except on a GPU (an NVIDIA driver, asked without importing torch: --help stays
    light) with a model that is not one of the small packaged ones, which keeps the paper's setup. The paper
    mix gives the packaged models nothing to learn from (SmolLM2-135M on an H100: held-out 0.004 against a
    constant-answer baseline of 0.156), where the CPU recipe learns there too (docs/benchmarks/gpu-h100.md)."""
    if name != "auto":
        return name
    gpu = device.startswith("cuda") if device != "auto" else Path("/proc/driver/nvidia/version").exists()
    return "none" if gpu and model not in SMALL_MODELS else "cpu"


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate(cfg: NodeConfig) -> None:
    def bad(name: str, why: str) -> ConfigError:
        return ConfigError(f"{flag(name)} {why} (got {getattr(cfg, name)!r})")

    for f in fields(cfg):
        if f.type in ("float", float) and not math.isfinite(getattr(cfg, f.name)):
            raise bad(f.name, "must be a finite number")
    for name in POSITIVE:
        if getattr(cfg, name) < 1:
            raise bad(name, "must be >= 1")
    for name in NON_NEGATIVE:
        if getattr(cfg, name) < 0:
            raise bad(name, "must be >= 0")
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise bad(name, f"must be one of {', '.join(allowed)}")
    if cfg.generations < 2:
        raise bad("generations", "must be >= 2 (advantages are relative within a group)")
    if cfg.seed >= 2**63:
        raise bad("seed", "must be below 2^63 (a signed 64-bit int: peers regenerate our tasks from it)")
    if not cfg.swarm:
        raise bad("swarm", "must not be empty")
    if cfg.eval_every and cfg.eval_size < 1:
        raise bad("eval_size", "must be >= 1 when --eval-every is on")
    try:
        practise.parse(cfg.practise)
    except ValueError as exc:
        raise ConfigError(f"--practise {exc}") from None
    if not re.fullmatch(r"[\d,\s]*", cfg.eval_at):
        raise bad("eval_at", "must be round numbers, comma-separated (e.g. 3,6)")
    for name in ("eval_size", "eval_unseen_size"):  # the reserved range holds 100 000 tasks a mix shares out
        if getattr(cfg, name) > MAX_EVAL_SIZE:
            raise bad(name, f"must be at most {MAX_EVAL_SIZE} (the held-out sets come from a fixed reserved range)")
    if cfg.lr <= 0:
        raise bad("lr", "must be > 0")
    if cfg.max_grad_norm <= 0:
        raise bad("max_grad_norm", "must be > 0")
    if not 0 < cfg.guard_lr_factor <= 1:
        raise bad("guard_lr_factor", "must be in (0, 1]")
    if cfg.lora_alpha <= 0:
        raise bad("lora_alpha", "must be > 0")
    if cfg.lora_init and cfg.lora_rank < 1:
        raise bad("lora_init", "needs --lora-rank >= 1")
    if cfg.temperature <= 0:
        raise bad("temperature", "must be > 0")
    if not 0 < cfg.top_p <= 1:
        raise bad("top_p", "must be in (0, 1]")
    if not 0 <= cfg.eps_low < 1 or cfg.eps_high < 0:
        raise ConfigError(f"--eps-low must be in [0, 1) and --eps-high >= 0 (got {cfg.eps_low}, {cfg.eps_high})")
    if cfg.net_timeout <= 0:
        raise bad("net_timeout", "must be > 0")
    if not 0 <= cfg.verify_budget_s < cfg.net_timeout:
        raise bad("verify_budget_s", "must be >= 0 and below --net-timeout (0 = automatic)")
    if not 0 < cfg.verify_budget_mb <= 1 << 20:
        raise bad("verify_budget_mb", "must be > 0 and at most 1 TiB")
    if not 0 < cfg.ban_s < float("inf"):
        raise bad("ban_s", "must be > 0 and finite")
    if not 0 <= cfg.pow_difficulty <= 40:
        raise bad("pow_difficulty", "must be in [0, 40] (each bit doubles the time to mint a key)")
    if not 0 <= cfg.identity_tier <= 3 or cfg.pow_difficulty + 4 * cfg.identity_tier > 40:  # p2p.pow's limits
        raise bad("identity_tier", "must be in [0, 3], with --pow-difficulty + 4 x tier at most 40")
    if cfg.status_port > 65535:
        raise bad("status_port", "must be a TCP port")
    if cfg.threads > 4096:  # torch takes a C int; no machine this runs on has more cores
        raise bad("threads", "must be at most 4096 (0 = all cores)")
    if not re.fullmatch(r"auto|cpu|cuda(:[0-9]{1,4})?", cfg.device):
        raise bad("device", "must be auto, cpu or cuda[:N]")
    if not cfg.run_dir.strip():
        raise bad("run_dir", "must name a directory (empty would write the run into the current one)")
    if cfg.require_peers and not cfg.peers and not cfg.swarm_start:  # a swarm's first peer has none to wait for
        raise bad("require_peers", "needs --peers: the peers that must answer at start")
    for peer in cfg.peers:
        if not str(peer).startswith("/"):
            hint = (
                "; a number in SAPO_PEERS is scripts/local_swarm.sh's peer count, not for sapo-node"
                if str(peer).isdigit()
                else ""
            )
            raise ConfigError(
                f"--peers takes multiaddrs like /ip4/1.2.3.4/tcp/31337/p2p/12D3Koo... (got {peer!r})" + hint
            )


def _convert(name: str, kind: Any, raw: Any) -> Any:
    """Env vars and TOML values to the field's type, with an error that names the option."""
    try:
        if isinstance(raw, dict) or isinstance(raw, list) and kind not in ("list", list):  # TOML tables, arrays
            raise ValueError(raw)
        if kind in ("bool", bool):
            if isinstance(raw, bool):
                return raw
            value = str(raw).strip().lower()
            if value in ("1", "true", "yes", "on"):
                return True
            if value in ("0", "false", "no", "off", ""):
                return False
            raise ValueError(raw)
        if kind in ("list", list):
            if isinstance(raw, list):
                if not all(isinstance(v, (str, int, float)) for v in raw):
                    raise ValueError(raw)
                return [str(v) for v in raw]
            return [v for v in str(raw).replace(",", " ").split() if v]
        if kind in ("int", int):
            if isinstance(raw, bool) or (isinstance(raw, float) and not raw.is_integer()):
                raise ValueError(raw)
            return int(raw)
        if kind in ("float", float):
            if isinstance(raw, bool):  # TOML `lr = true` would be 1.0
                raise ValueError(raw)
            return float(raw)
        return str(raw)
    except (TypeError, ValueError):
        raise ConfigError(f"{flag(name)}: invalid value {raw!r}") from None


def build_parser(prog: str = "sapo-node") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        usage="%(prog)s [options]  (--help lists them)",  # a mistyped flag: one short line, not 80 lines of usage
        description="Run a SAPO swarm node: sample tasks, generate, share rollouts, train with GRPO.",
        argument_default=argparse.SUPPRESS,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    defaults = NodeConfig()
    for f in fields(NodeConfig):
        env = f"env SAPO_{f.name.upper()}"
        default = getattr(defaults, f.name)
        if f.type in ("list", list):
            text = f"{f.metadata.get('help', '')} [{env}]"
        else:
            shown = default if f.type in ("bool", bool) else repr(default)
            text = f"{f.metadata.get('help', '')} [{env}; default {shown}]"
        text = text.replace("%", "%%")  # argparse %-formats help: a bare "6%" made --help crash
        if f.type in ("bool", bool):
            parser.add_argument(flag(f.name), action=argparse.BooleanOptionalAction, help=text)
        elif f.type in ("list", list):
            parser.add_argument(flag(f.name), nargs="+", metavar="MADDR", help=text)
        else:
            kind = {"int": int, "float": float}.get(f.type, str)
            parser.add_argument(flag(f.name), type=kind, help=text)
    return parser


def load_config(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> NodeConfig:
    """Merge the four sources; raises ConfigError (or SystemExit from argparse) with one clear line."""
    env = os.environ if env is None else env
    args = vars(build_parser().parse_args(argv))
    types = {f.name: f.type for f in fields(NodeConfig)}
    values: dict[str, Any] = {}
    config_path = args.get("config") or env.get("SAPO_CONFIG", "")
    if config_path:
        try:
            data = tomllib.loads(Path(config_path).read_text())
        except OSError as exc:
            raise ConfigError(f"--config: cannot read {config_path}: {exc.strerror}") from None
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"--config: {config_path} is not valid TOML: {exc}") from None
        outside = (
            sorted(k for k, v in data.items() if k != "node" and not isinstance(v, dict)) if "node" in data else []
        )
        if outside:  # options above a [node] table would be ignored silently; other tables ([bootstrap]) may be there
            raise ConfigError(f"--config: {', '.join(outside)} in {config_path} lie outside its [node] table")
        data = data.get("node", data)
        if not isinstance(data, dict):
            raise ConfigError(f"--config: [node] in {config_path} must be a table of options")
        for key, raw in data.items():
            name = key.replace("-", "_")
            if name not in types:
                raise ConfigError(f"--config: unknown option {key!r} in {config_path}")
            values[name] = _convert(name, types[name], raw)
    for name, kind in types.items():
        raw = env.get(f"SAPO_{name.upper()}")
        if raw is not None and raw != "":
            values[name] = _convert(name, kind, raw)
    values.update(args)
    values["config"] = config_path
    recipe = resolve_recipe(
        str(values.get("recipe", "auto")), str(values.get("device", "auto")), str(values.get("model", "default"))
    )
    if recipe not in RECIPES:
        raise ConfigError(f"--recipe must be one of {', '.join(RECIPE_CHOICES)} (got {recipe!r})")
    values["recipe"] = recipe
    for name, value in RECIPES[recipe].items():  # only what no source set
        if name not in LORA_ONLY:
            values.setdefault(name, value)
    rank = int(values.get("lora_rank", 0))
    if "lr" not in values:  # the documented rule, applied only when no source set a learning rate
        values["lr"] = RECIPES[recipe]["lr"] if rank > 0 and "lr" in RECIPES[recipe] else default_lr(rank)
    if rank > 0 and "beta" in RECIPES[recipe]:  # with full fine-tuning a KL term needs a second model: not set
        values.setdefault("beta", RECIPES[recipe]["beta"])
    cfg = NodeConfig(**values)
    validate(cfg)
    return cfg

"""The experiments that run the chosen CPU recipe, cell by cell, resumable, each finished cell committed to
docs/data/<experiment>/: the CPU recipe's validation (docs/experiments/cpu-recipe.md: 8 seeds at 4/0 and at
2/2; its 100-round solo runs are 8a's veterans) and the experiments where sharing should pay (section 8): a
newcomer among veterans (8a) and two model families in one swarm (8b); and the off-policy sharing pilot
(docs/experiments/off-policy-sharing.md: 15 cells, 5 arms x seeds 100-102, on the cpu-sparse preset) and its
confirmatory run (24 cells: the silo, the loss the pilot picks and sapo x seeds 0-7, 60 rounds).

    python -m scripts.research.sharing_pays run --experiment validation [--part 0/2]   # section 7: 16 cells, seeds 0-7

    python -m scripts.research.sharing_pays run --experiment veterans            # 8a's 4 veterans: 100 solo rounds each
    python -m scripts.research.sharing_pays run --experiment newcomer [--part 0/2] [--arms shares silo] [--seeds 0 1]
                                               # --part i/n: every n-th seed, all its arms
    python -m scripts.research.sharing_pays run --experiment families [--part 1/2]
    python -m scripts.research.sharing_pays run --experiment offpolicy-pilot [--part 0/2]
    python -m scripts.research.sharing_pays run --experiment offpolicy-confirm [--part 0/2]   # after the pilot
    python -m scripts.research.sharing_pays run --experiment specialists-pilot [--part 0/2]   # the transfer pilot
    python -m scripts.research.sharing_pays commands --experiment newcomer    # print the cells' commands
    python -m scripts.research.sharing_pays status --experiment validation    # cells committed, cells left
    ... run ... --finish-by 22:15 [--cell-minutes 40]   # start no cell that would not finish by then
    sapo-report docs/data/newcomer --focus-peer 0 --out docs/data/newcomer/report
    sapo-report docs/data/families --out docs/data/families/report

Every cell is one `sapo-experiment` command: one arm (configuration), one seed k, in memory mode on one
thread. Peer p of seed k runs node seed 1000k + p, so the newcomer (peer 0) has the same seed in the silo arm
(`--peers 1`) as in the swarm arms, where peers 1-4 are the veterans started with `--lora-init` from the 4
veterans' adapters (`--veterans`, default: the round-99 weights the veterans experiment keeps beside their
metrics, docs/data/newcomer-veterans/4-0/seed<j>/adapter; a veteran counts as done only once they are there).

The recipe is read, not written here: learning rate, LoRA rank and tasks from node/ops/config.py
RECIPES["cpu"], the KL weight from it too (the node's default where the recipe names none), and every peer
runs `--recipe cpu`, so the cells follow the recipe the sweep of section 7 chooses. Each run.json records the
command's settings and the git commit it ran.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from node.lab.cells import ADAPTER, Cell, add_deadline_args, cell_status, deadline_of, part_of, run_cells
from node.lab.runspec import slug
from node.learn.choices import EXTERNAL_LOSSES
from node.learn.engines import llama_api
from node.learn.packaged import PACKAGED, is_installed
from node.learn.tasks import PART_CONFIGS
from node.ops.checkpoint import PREFIX
from node.ops.config import RECIPES, NodeConfig
from scripts.research.offpolicy_pick import PILOT_SEEDS, confirmatory_arms
from scripts.research.specialists import PILOT_SEEDS as SPECIALIST_SEEDS

REPO = Path(__file__).resolve().parents[2]

SEEDS = list(range(8))
ROUNDS = 30
VETERAN_ROUNDS = 100
VETERAN_SEEDS = [0, 1, 2, 3]  # solo runs; veteran p (peer p of a swarm cell) starts from VETERAN_SEEDS[p - 1]
FAMILY_MODELS = "default,default,default,gemma3-270m,gemma3-270m"
SPARSE = ["--tasks", "cpu-sparse", "--peers", "5"]
CONFIRM_ROUNDS = 60
SPECIALIST_PILOT_ROUNDS = 20
# the held-out set (128 tasks) after rounds 0, 10, ..., 50, 59 and of the starting weights, as many points as the
# pilot's; the unseen set only at 0, 20, 40, 59 and the start (--eval-at's points read the held-out set alone)
CONFIRM_EVAL = ["--eval-every", "20", "--node-arg=--eval-at=10,30,50", "--eval-engine", "torch"]


def offpolicy_arms(rounds: int, evaluation: list[str]) -> dict[str, tuple[str, list[str]]]:
    """The silo and a 2/2 arm per external loss on the sparse preset, each 2/2 arm under its own name."""
    common = [*SPARSE, "--rounds", str(rounds), *evaluation]
    arms = {"silo": ("4/0", common)}
    for rule in EXTERNAL_LOSSES:
        arms[rule] = ("2/2", [*common, "--label", f"2/2 {rule}", f"--node-arg=--external-loss={rule}"])
    return arms


def specialists_pilot() -> dict[str, tuple[str, list[str]]]:
    """The transfer pilot (docs/experiments/specialists.md, part 1): six silo peers on cpu-parts, peer p
    practising part p; and six generalist silos beside them (the whole mix), the same sampling cost."""
    common = ["--tasks", "cpu-parts", "--peers", str(len(PART_CONFIGS)), "--rounds", str(SPECIALIST_PILOT_ROUNDS)]
    # held-out of the starting weights and after the last round only: the transfer reads those two (an
    # evaluation of 192 + 64 tasks costs a peer about as much as 8 rounds on this CPU)
    common += ["--eval-every", "100", "--eval-size", str(32 * len(PART_CONFIGS)), "--eval-engine", "torch"]
    common += ["--node-arg=--eval-unseen-size=64", "--node-arg=--no-eval-round0"]
    practise = [f"{p}:--practise={part}" for p, part in enumerate(PART_CONFIGS)]
    return {
        "specialists": (
            "4/0",
            [*common, "--label", "4/0 specialists", *[a for x in practise for a in ("--peer-arg", x)]],
        ),
        "generalists": ("4/0", [*common, "--label", "4/0 generalists"]),
    }


ARMS = {  # experiment -> arm -> (sapo-experiment configuration, its own flags)
    "validation": {
        "shares": ("2/2", ["--rounds", str(ROUNDS), "--eval-every", "10"]),
        "silo": ("4/0", ["--rounds", str(ROUNDS), "--eval-every", "10"]),
    },
    "veterans": {
        "solo": (
            "4/0",
            ["--peers", "1", "--rounds", str(VETERAN_ROUNDS), "--eval-every", "10", "--keep-run-checkpoints"],
        )
    },
    "newcomer": {
        "shares": ("2/2", ["--peers", "5"]),
        "silo": ("4/0", ["--peers", "1"]),
        "adaptive": ("usefulness", ["--peers", "5"]),
    },
    "families": {"shares": ("2/2", ["--models", FAMILY_MODELS]), "silo": ("4/0", ["--models", FAMILY_MODELS])},
    # off-policy sharing where a peer's own successes are scarce (docs/experiments/off-policy-sharing.md)
    "offpolicy-pilot": offpolicy_arms(ROUNDS, ["--eval-every", "5"]),
    "offpolicy-confirm": offpolicy_arms(CONFIRM_ROUNDS, CONFIRM_EVAL),
    # peers that practise different things (docs/experiments/specialists.md)
    "specialists-pilot": specialists_pilot(),
}
DATA_DIRS = {"veterans": "newcomer-veterans", "validation": "recipe-validation"}  # else the experiment's name
DEFAULT_ARMS = {
    "validation": ["shares", "silo"],
    "veterans": ["solo"],
    "newcomer": ["shares", "silo"],
    "families": ["shares", "silo"],
    "offpolicy-pilot": ["silo", "positive", "sapo", "ftis", "is"],
    "specialists-pilot": ["specialists", "generalists"],
}  # offpolicy-confirm: the silo, the loss the pilot picks and sapo (`arms_of`)
PICK_FREE_ARMS = ["silo", "sapo"]  # the confirmatory arms that do not depend on the pilot's pick


def arms_of(experiment: str, requested: list[str] | None, data: Path) -> list[str]:
    """The arms to run: those named (--arms), else the experiment's. The off-policy confirmatory run's follow
    from the pilot's committed cells by its written rule: only the silo and sapo, which do not depend on it,
    run before the pilot has finished (ValueError), and no other loss than the pick ever runs."""
    if experiment != "offpolicy-confirm":
        return requested or DEFAULT_ARMS[experiment]
    if requested and set(requested) <= set(PICK_FREE_ARMS):
        return requested
    arms = confirmatory_arms(data / "offpolicy-pilot")
    if requested and (other := [a for a in requested if a not in arms]):
        raise ValueError(
            f"the confirmatory run's arms are {', '.join(arms)} (the pilot's pick), not {', '.join(other)}"
        )
    return requested or arms


def wheel_and_torch(meta: dict) -> list[str]:
    """The off-policy confirmatory design's engines, from a cell's run.json: sampled by the llama.cpp wheel
    (not a source build, not torch after a failed load), answers decoded by torch; else it is run again."""
    problems = []
    engines = meta.get("rollout_engines") or ["an unrecorded engine"]
    if not all(e.startswith("llama: ") and e.endswith("(wheel)") for e in engines):
        problems.append(f"sampled by {', '.join(engines)}, not the llama.cpp wheel the design names")
    if meta.get("evaluators") != ["torch"]:
        problems.append(f"held-out answers decoded by {meta.get('evaluators')}, not torch as the design names")
    return problems


def wheel_binding() -> str:
    """Which llama.cpp binding a node's `--rollout-engine auto` takes in this python (a source build before
    the wheel), as its records will name it."""
    try:
        return llama_api.binding("auto").label
    except ImportError:
        return "no llama.cpp binding"


def recipe_flags(engine: str, tasks: str | None = None) -> list[str]:
    """The CPU recipe as sapo-experiment flags (read at run time: the recipe may change before a cell runs);
    `tasks`: another task mix than the recipe's."""
    recipe = RECIPES["cpu"]
    beta = recipe.get("beta", NodeConfig.__dataclass_fields__["beta"].default)
    return [
        "--mode",
        "memory",
        "--threads",
        "1",
        "--tasks",
        tasks or str(recipe["tasks"]),
        "--lora-rank",
        str(recipe["lora_rank"]),
        "--lr",
        str(recipe["lr"]),
        "--eval-size",
        "128",
        "--node-arg=--recipe=cpu",
        f"--node-arg=--beta={beta}",
        f"--node-arg=--rollout-engine={engine}",
    ]


def veteran_checkpoint(run_dir: Path) -> Path:
    """A veteran's run's round-99 checkpoint by its exact name, so that no newcomer can start from a veteran
    that had not finished its 100 rounds."""
    return run_dir / "peer0" / "checkpoints" / f"{PREFIX}{VETERAN_ROUNDS - 1:06d}"


def veteran_dirs(data: Path) -> list[Path]:
    """The 4 trained adapters that `run --experiment veterans` keeps beside their committed metrics (their round-99
    weights, without the optimizer: ~10 MB each; git ignores them, so a fresh machine reruns the veterans)."""
    return [data / DATA_DIRS["veterans"] / "4-0" / f"seed{j}" / ADAPTER for j in VETERAN_SEEDS]


def has_adapter(path: Path) -> bool:
    """A round dir, or a run dir with one (what --lora-init reads)."""
    return (path / "MANIFEST.json").is_file() or any((path / "checkpoints").glob("round-*/MANIFEST.json"))


def arm_flags(experiment: str, arm: str, veterans: list[Path]) -> list[str]:
    """Flags of one arm besides the common ones: the newcomer evaluates every 5 rounds, the veterans every
    10; 8b's peers every 10."""
    config, flags = ARMS[experiment][arm]
    if experiment == "newcomer":
        flags = flags + ["--rounds", str(ROUNDS), "--eval-every", "5"]
        if arm != "silo":
            for p, adapter in enumerate(veterans, start=1):
                flags += ["--peer-arg", f"{p}:--lora-init={adapter}", "--peer-arg", f"{p}:--eval-every=10"]
    elif experiment == "families":
        flags = flags + ["--rounds", str(ROUNDS), "--eval-every", "10"]
    return [config, *flags]


def cell_command(experiment: str, arm: str, seed: int, args: argparse.Namespace) -> list[str]:
    config, *flags = arm_flags(experiment, arm, [Path(v) for v in args.veterans])
    tasks = None
    if "--tasks" in flags:
        at = flags.index("--tasks")
        tasks, flags = flags[at + 1], flags[:at] + flags[at + 2 :]
    return [
        sys.executable,
        "-m",
        "node.lab.experiment",
        config,
        "--out",
        str(Path(args.runs) / experiment),
        *recipe_flags(args.engine, tasks),
        *flags,
        "--seeds",
        str(seed),
    ]


def cells(args: argparse.Namespace) -> list[Cell]:
    default_seeds = {"veterans": VETERAN_SEEDS, "offpolicy-pilot": PILOT_SEEDS, "specialists-pilot": SPECIALIST_SEEDS}
    default_seeds = default_seeds.get(args.experiment, SEEDS)
    seeds = args.seeds if args.seeds is not None else default_seeds
    data = Path(args.data) / DATA_DIRS.get(args.experiment, args.experiment)
    arms = arms_of(args.experiment, args.arms, Path(args.data))
    check = wheel_and_torch if args.experiment == "offpolicy-confirm" else None
    out = []
    for seed in part_of(seeds, args.part):  # a process takes whole seeds, all arms: each pair completes in one
        for arm in arms:
            config, flags = ARMS[args.experiment][arm]
            config = flags[flags.index("--label") + 1] if "--label" in flags else config  # its run dir's name
            run_dir = Path(args.runs) / args.experiment / slug(config) / f"seed{seed}"
            adapter = veteran_checkpoint(run_dir) if args.experiment == "veterans" else None
            out.append(
                Cell(
                    f"{args.experiment} {arm} seed {seed}",
                    cell_command(args.experiment, arm, seed, args),
                    run_dir,
                    data / slug(config) / f"seed{seed}",
                    adapter,
                    check,
                )
            )
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    for name in ("run", "commands", "status"):
        p = sub.add_parser(name)
        p.add_argument("--experiment", required=True, choices=list(ARMS))
        p.add_argument("--arms", nargs="*", default=None, help="arms to run (default: all but adaptive)")
        p.add_argument("--seeds", nargs="*", type=int, default=None)
        p.add_argument("--part", default="0/1", help="i/n: every n-th seed starting at the i-th (all its arms)")
        p.add_argument(
            "--runs",
            default="runs/sharing-pays",
            help="where the run dirs live (not committed; relative paths: to the repository root)",
        )
        p.add_argument("--data", default="docs/data", help="cells are committed to DATA/<experiment>/")
        p.add_argument(
            "--veterans",
            nargs=4,
            default=None,
            metavar="DIR",
            help="the 4 veterans' adapters (run or round dirs; default: the ones the veterans "
            "experiment commits, DATA/newcomer-veterans/4-0/seed<j>/adapter)",
        )
        p.add_argument("--engine", default="auto", help="--rollout-engine of every peer")
        if name == "run":
            add_deadline_args(p)
    args = parser.parse_args()
    os.chdir(REPO)  # relative paths (--runs, --data, --veterans) are the repository's, as in the commands
    args.veterans = args.veterans or [str(v) for v in veteran_dirs(Path(args.data))]
    unknown = [a for a in args.arms or [] if a not in ARMS[args.experiment]]
    if unknown:
        parser.error(f"arms of {args.experiment}: {', '.join(ARMS[args.experiment])} (got {', '.join(unknown)})")
    try:
        todo = cells(args)
    except ValueError as e:  # the confirmatory run's arms before its pilot has finished
        if args.cmd != "status" or args.arms:
            print(f"sharing_pays: {e}", file=sys.stderr)
            return 2
        print(f"({e}; the arms that do not depend on the pick:)")
        args.arms = PICK_FREE_ARMS
        todo = cells(args)
    if args.cmd == "status":
        print(cell_status(todo))
        return 0
    if args.cmd == "commands":
        for cell in todo:
            print(shlex.join(["sapo-experiment", *cell.command[3:]]))
        return 0
    if args.experiment == "offpolicy-confirm" and not (binding := wheel_binding()).endswith("(wheel)"):
        print(f"sharing_pays: the design samples with the llama.cpp wheel; this python has {binding}", file=sys.stderr)
        return 2
    absent = sorted({m for m in FAMILY_MODELS.split(",") if m in PACKAGED and not is_installed(m)})
    if args.experiment == "families" and absent:
        print(
            f"sharing_pays: the families' models are not installed here: {', '.join(absent)}; run "
            f"SAPO_MODELS={','.join(absent)} bash scripts/setup.sh first",
            file=sys.stderr,
        )
        return 2
    missing = [v for v in args.veterans if not has_adapter(Path(v))]
    if args.experiment == "newcomer" and set(args.arms or DEFAULT_ARMS["newcomer"]) - {"silo"} and missing:
        print(
            f"sharing_pays: no trained adapter in {', '.join(missing)}: run --experiment veterans first, or name "
            "them with --veterans",
            file=sys.stderr,
        )
        return 2
    return run_cells(todo, REPO, args.experiment, deadline_of(args))


if __name__ == "__main__":
    sys.exit(main())

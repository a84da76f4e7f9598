"""Task survey (which datasets can the default model learn from?): greedy pass@1, sampled pass@8, the
constant-answer baseline and more for every
reasoning-gym dataset, per config level and prompt format, on held-out tasks. Resumable: every finished
cell is one line of docs/data/survey/cells.jsonl; cells already there are skipped. Stages, cheapest and
most useful first:

  screen   every dataset, easiest config, "direct" format, 16 tasks (does pass@8 > 0 at all?)
  full     datasets that passed the screen: easiest config, both formats, 64 tasks
  harder   the same datasets at their default config, both formats, 64 tasks
  rescreen datasets that failed the screen, "reason" format, 16 tasks
  harder-screen  datasets that passed neither screen (or failed to build): default config, "direct",
           16 tasks, where the default differs from the easiest (is the harder setting any better?)

    nice -n 10 python -m scripts.research.survey_tasks --model default \
        --stages screen full harder rescreen harder-screen
    python -m scripts.research.survey_tasks --summarize   # docs/data/survey/survey.json + survey.md
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from node.lab.survey import (
    EASIEST_OVERRIDES,
    FORMATS,
    SCREEN_TASKS,
    STAGES,
    PresetRule,
    choose_preset,
    load_records,
    run_cells,
    stage_cells,
    summarize,
)
from node.learn import gym

OUT = Path(__file__).resolve().parents[2] / "docs" / "data" / "survey"
# composite needs a list of datasets; arc_agi / rearc / codeio read big data files: tried, not special-cased
SKIP: dict[str, str] = {"composite": "a mix of other datasets, not a dataset"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    ap.add_argument("--datasets", default="", help="comma list (default: every reasoning-gym dataset)")
    ap.add_argument(
        "--screen-formats",
        nargs="+",
        default=["direct"],
        choices=list(FORMATS),
        help="prompt formats of the screen stage (the plan screens direct only)",
    )
    ap.add_argument("--tasks", type=int, default=64, help="held-out tasks per full cell")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--engine",
        default="torch",
        choices=["torch", "llama"],
        help="what samples the pass@8 completions (greedy answers always come from torch); llama: "
        "llama.cpp on the same weights, 3-4x faster on a CPU (setup installs it by default)",
    )
    ap.add_argument("--log", type=Path, default=OUT / "cells.jsonl")
    ap.add_argument("--summarize", action="store_true", help="only write survey.json and survey.md")
    ap.add_argument(
        "--max-memory-gb",
        type=float,
        default=8.0,
        help="address-space cap of this process: a dataset whose generator allocates past it (arc_agi "
        "took 24 GB and the OOM killer) is recorded with a MemoryError instead (0 = no cap)",
    )
    args = ap.parse_args()
    if args.max_memory_gb > 0:
        cap = int(args.max_memory_gb * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, resource.getrlimit(resource.RLIMIT_AS)[1]))
    if args.summarize:
        print(summarize(args.log, OUT))
        records = list(load_records(args.log).values())
        for min_tasks in (64, SCREEN_TASKS):
            fmt, cells = choose_preset(records, min_tasks=min_tasks)
            print(
                f"preset rule {PresetRule()} on cells of >= {min_tasks} tasks: format {fmt}, "
                f"{[(c['dataset'], c['level']) for c in cells]}"
            )
        return
    torch.set_num_threads(args.threads)
    from node.learn.model_io import load_model, pick_device

    # hand-tuned datasets (short answers, arithmetic and counting) first: the likely useful ones
    everything = list(EASIEST_OVERRIDES) + sorted(set(gym.datasets()) - set(EASIEST_OVERRIDES))
    names = [n for n in (args.datasets.split(",") if args.datasets else everything) if n and n not in SKIP]
    model, tok = load_model(args.model, pick_device("auto"))
    engine = None
    if args.engine != "torch":
        from node.learn.engines import make_engine

        engine = make_engine(args.engine, model, tok, model_name=args.model)  # falls back to torch, with a line
        print(f"# samples from the {engine.name} engine", flush=True)
    for stage in args.stages:
        cells = stage_cells(
            stage, names, load_records(args.log), args.tasks, args.temperature, tuple(args.screen_formats)
        )
        t0 = time.time()
        print(f"# stage {stage}: {len(cells)} cells", flush=True)

        def show(rec):
            brief = rec.get("error") or " ".join(
                f"{k}={rec[k]}" for k in ("pass1", "pass8", "baseline", "distinct_correct", "s_per_task")
            )
            print(f"{time.time() - t0:7.0f}s {rec['key']}: {brief}", flush=True)  # noqa: B023 (this stage's)

        run_cells(model, tok, cells, args.log, on_record=show, engine=engine)


if __name__ == "__main__":
    main()

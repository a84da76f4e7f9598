r"""Rollout engine checks that need the default model (docs/benchmarks/rollout-engine.md), side by side in one run:

  parity  answer accuracy of each --variants sampler (llama.cpp with given weights, the torch sampler under
          bf16 autocast) vs the torch sampler's (fp32) on a fixed set of tasks (same tasks, same number of
          samples each, temperature 1): accuracies, the difference and its 95% confidence interval, a
          paired bootstrap over tasks (a task's samples are not independent draws: an easy task is solved
          by most of them, so treating n samples as n independent ones understates the noise; that
          narrower interval is printed beside it). A variant passes when 0 lies inside the interval.
  sync    seconds to move the current weights into the engine: full weights in each --engine-weights
          format (write the GGUF + load it) and a LoRA adapter (write + swap in), median of --repeats.

  bindings the llama engine's bindings side by side in one process (the wheel, the source build), with the
          torch sampler as the reference: greedy answers on --tasks-n held-out tasks (same as torch's?),
          sampling speed (--prompts x --generations at T = 1, --repeats interleaved: tokens/s, groups/s,
          wall and CPU) and sync cost (full weights and a merged LoRA adapter), medians and ratios.

    python -m scripts.bench.engine parity --tasks-n 256 --samples 2 --variants torch-bf16,llama-bf16,llama-f16 \
        --json parity.json
    python -m scripts.bench.engine sync --json sync.json
    nice python -m scripts.bench.engine bindings --tasks cpu-learn --tasks-n 64 --repeats 5 --json bindings.json
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from node.lab.evidence import paired_task_gain
from node.learn.engines import make_engine
from node.learn.groups import Prompter, local_group, score_responses
from node.learn.model_io import load_model
from node.learn.sampling import SamplingConfig
from node.learn.tasks import TaskSampler, resolve_mix


def parity(args, model, tok, mix) -> dict:
    """Every variant of --variants against `torch` (today's sampler, fp32): torch-bf16 is the torch sampler
    under bf16 autocast, llama-<weights> the llama.cpp engine with those weights."""
    from node.learn import precision

    names = ["torch"] + [v for v in args.variants.split(",") if v and v != "torch"]
    engines, contexts = {}, {}
    for name in names:
        if name.startswith("llama-"):
            engines[name] = make_engine("llama", model, tok, args.model, weight_type=name.split("-", 1)[1])
            if engines[name].name != "llama":
                raise SystemExit("the llama engine is not available here")
        elif name in ("torch", "torch-bf16"):
            engines[name] = make_engine("torch", model, tok)
        else:
            raise SystemExit(f"unknown variant {name!r}: torch, torch-bf16, llama-<weights>")
        contexts[name] = "bf16" if name == "torch-bf16" else "off"
    prompter = Prompter(tok, mix)
    tasks = TaskSampler(mix, seed=args.seed).sample(args.tasks_n)
    scfg = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=mix.max_new_tokens)
    correct = {k: 0 for k in engines}
    reward = {k: 0.0 for k in engines}
    cpu = {k: 0.0 for k in engines}
    tokens = {k: 0 for k in engines}
    per_dataset: dict[str, dict[str, list[float]]] = {}
    per_task: dict[str, list[float]] = {k: [] for k in engines}  # share of a task's samples that are correct
    for start in range(0, len(tasks), args.batch):
        chunk = tasks[start : start + args.batch]
        prompts = [prompter(t) for t in chunk]
        for name, eng in engines.items():  # interleaved
            torch.manual_seed(10_000 + start)
            c0 = time.process_time()
            with precision.autocast(contexts[name], torch.device("cpu")):
                sampled = eng.sample(prompts, args.samples, scfg)
            cpu[name] += time.process_time() - c0
            for t, g in zip(chunk, sampled):
                group = local_group(t, g, mix.answer_prefix)
                tokens[name] += sum(len(c) for c in g.completion_ids)
                right = sum(r >= 1.0 for r in group.rewards)
                correct[name] += right
                per_task[name].append(right / len(group.rewards))
                reward[name] += sum(group.rewards)
                per_dataset.setdefault(t.spec.dataset, {}).setdefault(name, []).extend(group.rewards)
        done = start + len(chunk)
        print(
            f"  {done}/{len(tasks)} tasks: "
            + "  ".join(f"{k} {correct[k] / (done * args.samples):.3f}" for k in engines),
            flush=True,
        )
    n = len(tasks) * args.samples
    acc = {k: correct[k] / n for k in engines}
    out = {
        "tasks": len(tasks),
        "samples_per_task": args.samples,
        "n": n,
        "accuracy": acc,
        "mean_reward": {k: reward[k] / n for k in engines},
        "gen_cpu_s": cpu,
        "tokens": tokens,
        "per_dataset_mean_reward": {d: {k: statistics.mean(v) for k, v in e.items()} for d, e in per_dataset.items()},
        "versus_torch": {},
    }
    out["per_task_accuracy"] = per_task
    for name in names[1:]:
        diff = acc[name] - acc["torch"]
        se = math.sqrt(sum(a * (1 - a) / n for a in (acc[name], acc["torch"])))
        paired = paired_task_gain(per_task["torch"], per_task[name], seed=args.seed)
        within = paired["ci_low"] <= 0.0 <= paired["ci_high"]
        out["versus_torch"][name] = {
            "difference": diff,
            "ci95": [paired["ci_low"], paired["ci_high"]],
            "ci95_independent_samples": [diff - 1.96 * se, diff + 1.96 * se],
            "within_noise": within,
        }
        print(
            f"accuracy (reward 1) torch {acc['torch']:.3f}  {name} {acc[name]:.3f}  difference {diff:+.3f}  "
            f"95% CI [{paired['ci_low']:+.3f}, {paired['ci_high']:+.3f}] (tasks resampled, {len(tasks)} tasks "
            f"x {args.samples} samples; as independent samples [{diff - 1.96 * se:+.3f}, {diff + 1.96 * se:+.3f}])"
            f"  -> {'within' if within else 'OUTSIDE'} the noise;  sampling CPU s "
            f"{cpu['torch']:.1f} vs {cpu[name]:.1f} ({cpu['torch'] / max(cpu[name], 1e-9):.2f}x)"
        )
    return out


def sync(args, model, tok) -> dict:
    from node.learn.lora import attach

    out: dict = {}
    for wt in args.engine_weights.split(","):
        eng = make_engine("llama", model, tok, args.model, weight_type=wt)
        wall, cpu = [], []
        for _ in range(args.repeats):
            t0, c0 = time.perf_counter(), time.process_time()
            eng.sync(model)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        out[f"full_{wt}"] = {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}
        eng.close()
    adapter = attach(model, args.lora_rank, 32.0)
    eng = make_engine("llama", adapter.model, tok, args.model)
    wall, cpu = [], []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        eng.sync(adapter.model)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    out[f"lora_r{args.lora_rank}"] = {"wall_s": statistics.median(wall), "cpu_s": statistics.median(cpu)}
    eng.close()
    for k, v in out.items():
        print(f"  sync {k:10s} {v['wall_s']:6.2f}s wall  {v['cpu_s']:6.2f}s cpu")
    return out


def _timed(fn) -> tuple[float, float]:
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t0, time.process_time() - c0


def _greedy_parity(args, model, tok, mix, engines: dict, prompter) -> dict:
    """Greedy answers (`LlamaEngine.greedy`) against torch's greedy decode (the held-out eval's)."""
    from node.learn.evaluate import eval_tasks, greedy_texts

    tasks = eval_tasks(mix, args.tasks_n)
    prompts = [prompter(t) for t in tasks]
    answers = {"torch": greedy_texts(model, tok, prompts, mix.max_new_tokens, batch_size=16)}
    for b, eng in engines.items():  # the engine's own greedy decoding, as --eval-engine evaluates with it
        answers[b] = eng.greedy(prompts, mix.max_new_tokens)
    scored = {
        k: [score_responses(t, [mix.answer_prefix + text])[0] for t, text in zip(tasks, v)] for k, v in answers.items()
    }
    out: dict = {
        k: {
            "accuracy": sum(v) / len(v),
            "same_text_as_torch": sum(a == b for a, b in zip(answers[k], answers["torch"])) / len(tasks),
            "same_reward_as_torch": sum(a == b for a, b in zip(v, scored["torch"])) / len(tasks),
        }
        for k, v in scored.items()
    }
    names = list(engines)
    if len(names) > 1:
        out[f"same_text_{names[0]}_vs_{names[1]}"] = sum(
            a == b for a, b in zip(answers[names[0]], answers[names[1]])
        ) / len(tasks)
    for k, v in out.items():
        print(f"  greedy {k:8s} {v}")
    return out


def bindings(args, model, tok, mix) -> dict:
    from node.learn.lora import attach

    names = [b for b in args.bindings.split(",") if b]
    engines = {}
    for b in names:
        engines[b] = make_engine("llama", model, tok, args.model, weight_type=args.weights, llama_binding=b)
        if engines[b].name != "llama":
            raise SystemExit(f"the {b} binding is not available here")
    prompter = Prompter(tok, mix)
    out: dict = {
        "bindings": {b: e.api.label for b, e in engines.items()},
        "weights": {b: e.weight_type for b, e in engines.items()},
    }
    if args.tasks_n:  # 1. greedy answers
        out["greedy"] = _greedy_parity(args, model, tok, mix, engines, prompter)
    # 2. sampling speed, interleaved
    sampler = TaskSampler(mix, seed=args.seed)
    scfg = SamplingConfig(temperature=1.0, top_p=1.0, max_new_tokens=mix.max_new_tokens)
    runs = {b: {"wall": [], "cpu": [], "tokens": []} for b in names}
    for i in range(-1, args.repeats):  # -1: warm-up
        batch = [prompter(t) for t in sampler.sample(args.prompts)]
        for b, eng in engines.items():
            torch.manual_seed(100 + i)
            got = []
            wall, cpu = _timed(lambda: got.extend(eng.sample(batch, args.generations, scfg)))  # noqa: B023 (run at once)
            if i >= 0:
                runs[b]["wall"].append(wall)
                runs[b]["cpu"].append(cpu)
                runs[b]["tokens"].append(sum(len(c) for g in got for c in g.completion_ids))
    speed = {}
    for b, r in runs.items():
        speed[b] = {
            "tokens_per_s": statistics.median(t / w for t, w in zip(r["tokens"], r["wall"])),
            "tokens_per_cpu_s": statistics.median(t / c for t, c in zip(r["tokens"], r["cpu"])),
            "groups_per_s": statistics.median(args.prompts / w for w in r["wall"]),
            "groups_per_cpu_s": statistics.median(args.prompts / c for c in r["cpu"]),
            "runs": r,
        }
        print(f"  sample {b:8s} " + "  ".join(f"{k} {v:.2f}" for k, v in speed[b].items() if k != "runs"))
    out["sampling"] = speed
    # 3. sync: full weights, then a LoRA adapter merged in
    adapter = attach(copy.deepcopy(model), args.lora_rank, 32.0)
    lora_engines = {
        b: make_engine("llama", adapter.model, tok, args.model, weight_type=args.weights, llama_binding=b)
        for b in names
    }
    sync_s: dict = {b: {"full_wall": [], "full_cpu": [], "lora_wall": [], "lora_cpu": []} for b in names}
    for _ in range(args.repeats):
        for b in names:
            w, c = _timed(lambda: engines[b].sync(model))  # noqa: B023 (run at once)
            sync_s[b]["full_wall"].append(w)
            sync_s[b]["full_cpu"].append(c)
            w, c = _timed(lambda: lora_engines[b].sync(adapter.model))  # noqa: B023 (run at once)
            sync_s[b]["lora_wall"].append(w)
            sync_s[b]["lora_cpu"].append(c)
    out["sync"] = {b: {k: statistics.median(v) for k, v in d.items()} for b, d in sync_s.items()}
    for b, d in out["sync"].items():
        print(f"  sync   {b:8s} " + "  ".join(f"{k} {v:.2f}s" for k, v in d.items()))
    if len(names) > 1:
        a, z = names
        out["ratios"] = {
            f"{a}/{z}": {
                "tokens_per_s": speed[a]["tokens_per_s"] / speed[z]["tokens_per_s"],
                "tokens_per_cpu_s": speed[a]["tokens_per_cpu_s"] / speed[z]["tokens_per_cpu_s"],
                "sync_full_cpu": out["sync"][a]["full_cpu"] / out["sync"][z]["full_cpu"],
                "sync_lora_cpu": out["sync"][a]["lora_cpu"] / out["sync"][z]["lora_cpu"],
            }
        }
        print(f"  ratios {out['ratios']}")
    for e in [*engines.values(), *lora_engines.values()]:
        e.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=("parity", "sync", "bindings"))
    ap.add_argument("--model", default="default")
    ap.add_argument("--tasks", default="cpu-easy")
    ap.add_argument("--tasks-n", type=int, default=256)
    ap.add_argument("--samples", type=int, default=2, help="completions per task and engine")
    ap.add_argument("--batch", type=int, default=8, help="prompts per sampling call")
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--engine-weights", default="f16,q8_0", help="sync: the weight types to time")
    ap.add_argument(
        "--variants",
        default="llama-auto",
        help="parity: compared with torch (fp32): torch-bf16, llama-auto, llama-bf16, llama-f16, ...",
    )
    ap.add_argument("--lora-rank", type=int, default=8)
    ap.add_argument("--bindings", default="wheel,source", help="bindings: the llama bindings compared")
    ap.add_argument("--weights", default="auto", help="bindings: --engine-weights of both")
    ap.add_argument("--prompts", type=int, default=4, help="bindings: prompts per sampling call (I)")
    ap.add_argument("--generations", type=int, default=8, help="bindings: completions per prompt (G)")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    mix = resolve_mix(args.tasks)
    model, tok = load_model(args.model, torch.device("cpu"))
    result = {"model": args.model, "tasks": mix.name, "threads": args.threads}
    what = {
        "parity": lambda: parity(args, model, tok, mix),
        "sync": lambda: sync(args, model, tok),
        "bindings": lambda: bindings(args, model, tok, mix),
    }
    result.update(what[args.what]())
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

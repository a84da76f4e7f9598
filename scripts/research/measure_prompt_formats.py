"""Which prompt format fits a model: greedy accuracy and sampled pass@k on a mix's held-out tasks, per format
of node/learn/formats.py (the model's own template is replaced by each in turn). Chose Gemma 3 270M's format
(docs/RESULTS.md, "Gemma 3 270M"). One JSON line per format on stdout.

    nice python -m scripts.research.measure_prompt_formats --model gemma3-270m --formats chatml gemma-chat completion
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

from node.learn import precision
from node.learn.evaluate import greedy_texts
from node.learn.formats import FORMATS, apply_format, stop_token_ids
from node.learn.groups import Prompter, score_responses
from node.learn.model_io import load_model
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.tasks import PRESETS, eval_tasks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    ap.add_argument("--tasks", default="cpu-learn", choices=list(PRESETS))
    ap.add_argument("--size", type=int, default=64, help="held-out tasks")
    ap.add_argument("--samples", type=int, default=8, help="k of pass@k (temperature 1)")
    ap.add_argument("--greedy-only", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--mixed-precision", default="auto", choices=precision.MIXED_PRECISION, help="as the node's flag")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.time()
    model, tok = load_model(args.model, torch.device("cpu"))
    print(f"# loaded {args.model} in {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    mix = PRESETS[args.tasks]
    tasks = eval_tasks(mix, args.size)
    own_eos = model.generation_config.eos_token_id  # load_model gave the tokenizer its family's stop token
    own_eos = tok.convert_ids_to_tokens(own_eos[0] if isinstance(own_eos, list) else own_eos)
    mode = precision.resolve(args.mixed_precision, torch.device("cpu"))
    for name in args.formats:
        tok.eos_token = own_eos
        apply_format(tok, FORMATS[name])
        with precision.autocast(mode, torch.device("cpu")):
            record = measure(model, tok, Prompter(tok, mix), tasks, 0 if args.greedy_only else args.samples)
        stops = stop_token_ids(tok)
        print(
            json.dumps(
                {
                    "model": args.model,
                    "format": name,
                    "tasks": args.tasks,
                    "precision": mode,
                    "stops": tok.convert_ids_to_tokens(stops[:2]),
                    "n_stops": len(stops),
                    **record,
                }
            ),
            flush=True,
        )


def measure(model, tok, prompter: Prompter, tasks: list, samples: int) -> dict:
    """Greedy accuracy (overall and per half of the set: one dataset each on cpu-learn) and, with samples,
    pass@k and the sampled mean reward at temperature 1."""
    mix, half = prompter.mix, len(tasks) // 2
    prompts = [prompter(t) for t in tasks]
    t0 = time.time()
    greedy = greedy_texts(model, tok, prompts, mix.max_new_tokens, 16)
    scores = [score_responses(t, [mix.answer_prefix + g])[0] for t, g in zip(tasks, greedy)]
    rec = {
        "size": len(tasks),
        "greedy_acc": round(sum(scores) / len(tasks), 4),
        "greedy_acc_halves": [round(sum(scores[:half]) / half, 4), round(sum(scores[half:]) / half, 4)],
        "distinct_greedy": len({g.strip() for g in greedy}),
        "greedy_examples": greedy[:3],
        "greedy_s": round(time.time() - t0, 1),
    }
    if samples:
        cfg = SamplingConfig(temperature=1.0, max_new_tokens=mix.max_new_tokens)
        solved, sampled = 0, []
        for i in range(0, len(tasks), 8):
            for task, group in zip(tasks[i : i + 8], sample_groups(model, tok, prompts[i : i + 8], samples, cfg)):
                s = score_responses(task, [mix.answer_prefix + text for text in group.texts])
                solved += any(x >= 1.0 for x in s)
                sampled += s
        rec |= {
            f"pass{samples}": round(solved / len(tasks), 4),
            "sample_mean": round(sum(sampled) / len(sampled), 4),
            "total_s": round(time.time() - t0, 1),
        }
    return rec


if __name__ == "__main__":
    main()

"""A packaged model's one-time conversion from GGUF, with the file parsed once (node/learn/gguf_once.py) and
as transformers does it alone (three times), side by side.

    python -m scripts.bench.convert [--model default] [--repeats 2]

Each repeat converts the model both ways, in alternating order (so the page cache and the machine's load favour
neither), into fresh temporary caches, and checks that both give the same weights and the same tokenizer.
Prints the seconds and CPU-seconds of each conversion and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import tempfile
import time

import torch

from node.learn import model_io
from node.learn.packaged import PACKAGED


def convert(name: str, parse_once: bool) -> tuple[float, float, dict, list[int]]:
    """(wall s, CPU s, state dict, token ids of a chat prompt) of one conversion into an empty cache."""
    with tempfile.TemporaryDirectory() as cache:
        os.environ["SAPO_MODEL_CACHE"] = cache
        real = model_io.parsed_once
        if not parse_once:
            model_io.parsed_once = contextlib.nullcontext  # type: ignore[assignment]
        try:
            wall, cpu = time.perf_counter(), time.process_time()
            model, tok = model_io.load_model(name, torch.device("cpu"))
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        finally:
            model_io.parsed_once = real  # type: ignore[assignment]
        prompt = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 30?"}], tokenize=False)
        return wall, cpu, model.state_dict(), tok(prompt)["input_ids"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default", choices=sorted(PACKAGED))
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error("--repeats must be at least 1")
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for repeat in range(args.repeats):
        results = {}
        for parse_once in (True, False) if repeat % 2 == 0 else (False, True):
            wall, cpu, state, ids = convert(args.model, parse_once)
            times[parse_once].append((wall, cpu))
            results[parse_once] = (state, ids)
            print(
                f"repeat {repeat}: {'parsed once' if parse_once else 'transformers alone'}: "
                f"{wall:.1f} s, {cpu:.1f} CPU-s",
                flush=True,
            )
        (a_state, a_ids), (b_state, b_ids) = results[True], results[False]
        same = a_ids == b_ids and a_state.keys() == b_state.keys()
        if not (same and all(torch.equal(a_state[k], b_state[k]) for k in a_state)):
            raise SystemExit(f"repeat {repeat}: the two conversions differ")
    (once, once_cpu), (alone, alone_cpu) = (tuple(map(statistics.median, zip(*times[k]))) for k in (True, False))
    print(
        f"{args.model}: same weights and tokenizer both ways; medians {once:.1f} s ({once_cpu:.1f} CPU-s) parsed "
        f"once against {alone:.1f} s ({alone_cpu:.1f} CPU-s) by transformers alone: {alone / once:.2f}x "
        f"({alone_cpu / once_cpu:.2f}x CPU)"
    )


if __name__ == "__main__":
    main()

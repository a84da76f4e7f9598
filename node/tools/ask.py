"""`sapo-ask SOURCE "What is 4 + 5?"`: a model's answer in the node's prompt format, or (`--eval`) its score
on a task mix's held-out set, the figure the node reports.

SOURCE is a run dir or one of its checkpoints (the weights exactly as the node held them, in the node's
precision), an export of `sapo-export` (hf, peft or gguf: its mix and prompt come with it), a `.gguf` file,
or any model `--model` takes (a packaged name, a hub id, a transformers dir). Without a question it reads one
question a line from standard input. Greedy by default, as the node's evaluation decodes; `--sample` draws.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node import __version__
from node.learn import precision
from node.learn.evaluate import EvalResult, EvalSet, evaluate, greedy_texts
from node.learn.groups import Prompter, prompt_text
from node.learn.model_io import ModelLoadError, load_model
from node.learn.sampling import SamplingConfig
from node.learn.tasks import TaskError, TaskMix, eval_tasks, extract_answer, resolve_mix
from node.ops.checkpoint import CHECKPOINTS_DIR
from node.tools.export import EXPORT_JSON
from node.tools.trained import ToolError, load_trained, open_run

DEFAULT_MIX = "cpu-learn"  # the CPU recipe's mix: what a default node practises


@dataclass
class Asker:
    """A model ready to answer: torch (`model`) or llama.cpp (`engine`), the mix whose prompt it answers in."""

    tokenizer: Any
    mix: TaskMix
    max_new_tokens: int
    model: torch.nn.Module | None = None
    engine: Any = None  # a LlamaEngine on a GGUF file
    precision: str = "off"
    node_eval: dict[str, Any] | None = None  # the node's own last held-out figures for these weights
    what: str = ""

    @property
    def evaluator(self) -> str:
        return (
            "llama" if self.engine is not None else f"torch ({'bf16 autocast' if self.precision == 'bf16' else 'fp32'})"
        )

    def _autocast(self) -> contextlib.AbstractContextManager:
        return precision.autocast(self.precision, torch.device("cpu"))

    def answers(self, questions: list[str], sample: SamplingConfig | None = None) -> list[str]:
        """The completions (after the forced answer prefix) to free-form questions."""
        system = self.mix.system_prompt
        prompts = [
            prompt_text(
                self.tokenizer,
                [{"role": "system", "content": system}, {"role": "user", "content": q}],
                self.mix.answer_prefix,
            )
            for q in questions
        ]
        if self.engine is not None:
            if sample is None:
                return self.engine.greedy(prompts, self.max_new_tokens)
            return [g.texts[0] for g in self.engine.sample(prompts, 1, sample)]
        assert self.model is not None
        with self._autocast():
            if sample is None:
                return greedy_texts(self.model, self.tokenizer, prompts, self.max_new_tokens, batch_size=16)
            return [_sampled(self.model, self.tokenizer, p, sample) for p in prompts]

    def evaluate(self, mix: TaskMix, size: int, unseen_size: int) -> EvalResult:
        """The held-out (and unseen) set of `mix`, greedy, scored with the node's reward: EvalResult as the
        node records it, its constant-answer yardsticks included."""
        seen = EvalSet.of(eval_tasks(mix, size))
        unseen_tasks = eval_tasks(mix, unseen_size or size, unseen=True)
        prompter = Prompter(self.tokenizer, mix)
        with self._autocast():
            result = evaluate(
                self.model,
                self.tokenizer,
                prompter,
                seen.tasks,
                self.max_new_tokens,
                unseen=unseen_tasks or None,
                engine=self.engine,
            )
        if result.unseen is not None:
            EvalSet.of(unseen_tasks).label(result.unseen)
        return seen.label(result)


@torch.no_grad()
def _sampled(model: torch.nn.Module, tokenizer, prompt: str, cfg: SamplingConfig) -> str:
    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
    out = model.generate(
        **ids,
        do_sample=True,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_new_tokens=cfg.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
    )
    return tokenizer.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


def _mix(name: str | None, fallback: str) -> TaskMix:
    try:
        return resolve_mix(name or fallback)
    except TaskError as exc:
        raise ToolError(f"task mix {name or fallback!r}: {exc}") from None


def open_source(source: str, tasks: str | None, round_: int | None, evaluator: str) -> Asker:
    """The model SOURCE names, ready to answer; ToolError when it names nothing that loads."""
    path = Path(source).expanduser()
    if path.is_dir() and ((path / CHECKPOINTS_DIR).is_dir() or (path / "MANIFEST.json").is_file()):
        run = open_run(path, round_)
        policy = load_trained(run, torch.device("cpu"), node_precision=evaluator == "node")
        mix = _mix(tasks, run.cfg.tasks)
        return Asker(
            policy.tokenizer,
            mix,
            run.cfg.max_new_tokens or mix.max_new_tokens,
            model=policy.model,
            precision=policy.precision,
            node_eval=run.last_eval(),
            what=f"round {run.round} of {path}",
        )
    if round_ is not None:
        raise ToolError("--round chooses among a run dir's checkpoints; this source is not a run dir")
    facts = _export_facts(path)
    mix = _mix(tasks, str(facts.get("tasks") or DEFAULT_MIX))
    max_new = int(facts.get("max_new_tokens") or mix.max_new_tokens)
    node_eval = facts if "eval_accuracy" in facts else None
    gguf = path if path.suffix == ".gguf" else (path / facts["gguf"] if facts.get("gguf") else None)
    if gguf is not None:
        return Asker(
            _tokenizer(gguf.parent), mix, max_new, engine=_gguf_engine(gguf), node_eval=node_eval, what=str(gguf)
        )
    if (path / "adapter_config.json").is_file():
        model, tokenizer = _peft(path)
    else:
        try:
            model, tokenizer = load_model(str(path) if path.exists() else source, torch.device("cpu"))
        except ModelLoadError as exc:
            raise ToolError(str(exc)) from None
    model.eval()
    return Asker(tokenizer, mix, max_new, model=model, node_eval=node_eval, what=source)


def _export_facts(path: Path) -> dict[str, Any]:
    f = path / EXPORT_JSON if path.is_dir() else path.parent / EXPORT_JSON
    if not f.is_file():
        return {}
    try:
        data = json.loads(f.read_text())
    except (OSError, ValueError) as exc:
        raise ToolError(f"{f}: unreadable ({exc})") from None
    return data if isinstance(data, dict) else {}


def _tokenizer(directory: Path):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory))
    except Exception as exc:
        raise ToolError(f"{directory}: no tokenizer beside the model file ({exc}); sapo-export writes one") from None
    tokenizer.padding_side = "left"
    return tokenizer


def _gguf_engine(path: Path):
    if not path.is_file():
        raise ToolError(f"{path}: no such model file")
    try:
        from node.learn.engines.llama import LlamaEngine

        return LlamaEngine.from_file(path, _tokenizer(path.parent))
    except ImportError as exc:
        raise ToolError(f"a .gguf needs the llama.cpp engine (bash scripts/setup.sh installs it): {exc}") from None
    except RuntimeError as exc:
        raise ToolError(f"{path}: llama.cpp cannot load it ({exc})") from None


def _peft(path: Path):
    from peft import PeftConfig, PeftModel

    base = PeftConfig.from_pretrained(str(path)).base_model_name_or_path
    try:
        model, tokenizer = load_model(base, torch.device("cpu"))
    except ModelLoadError as exc:
        raise ToolError(f"the adapter's base {base!r} does not load: {exc}") from None
    return PeftModel.from_pretrained(model, str(path)), tokenizer


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sapo-ask",
        description="Ask a trained node's model (a run dir, an export, a .gguf, or any model) in the node's "
        "prompt format, or score it on a task mix's held-out set.",
    )
    ap.add_argument("source", help="run dir, checkpoint, sapo-export dir, .gguf file, packaged model or HF id/path")
    ap.add_argument("question", nargs="*", help="questions (none: one a line from standard input)")
    ap.add_argument(
        "--eval",
        nargs="?",
        const="",
        default=None,
        metavar="MIX",
        help="score the held-out set of MIX (no value: the source's own mix)",
    )
    ap.add_argument(
        "--tasks", default=None, help=f"the mix whose prompt to answer in (default: the source's, else {DEFAULT_MIX})"
    )
    ap.add_argument("--eval-size", type=int, default=64, help="held-out tasks (the node's --eval-size; default 64)")
    ap.add_argument(
        "--eval-unseen-size", type=int, default=0, help="unseen tasks where the mix has them (0: --eval-size)"
    )
    ap.add_argument("--round", type=int, default=None, help="a run dir's checkpoint of this round")
    ap.add_argument(
        "--evaluator",
        choices=("node", "fp32"),
        default="node",
        help="for a run dir: node (its mixed precision, as its evaluation ran) or fp32",
    )
    ap.add_argument("--sample", action="store_true", help="draw the answer instead of taking the greedy one")
    ap.add_argument("--temperature", type=float, default=1.0, help="with --sample (default 1.0)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="answer length cap (0: the mix's own)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return ap


def _eval_lines(result: EvalResult, mix: TaskMix, asker: Asker) -> list[str]:
    lines = [
        f"held-out accuracy {result.accuracy:.3f} on {result.size} tasks of {mix.name} (greedy by {asker.evaluator}; "
        f"one fixed answer per dataset scores {result.baseline or 0.0:.3f})"
    ]
    lines += [f"  {name}: {acc:.3f}" for name, acc in sorted(result.by_dataset.items())]
    if result.unseen is not None:
        u = result.unseen
        lines.append(f"unseen accuracy {u.accuracy:.3f} on {u.size} tasks (constant answer {u.baseline or 0.0:.3f})")
    node = asker.node_eval
    if node is not None and node.get("eval_accuracy") is not None:
        lines.append(
            f"the node reported {node['eval_accuracy']:.3f} on {node.get('eval_size')} tasks after round "
            f"{node.get('round', node.get('eval_round'))} (greedy by {node.get('eval_engine', '?')})"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        if args.eval_size < 1 or args.eval_unseen_size < 0:
            raise ToolError("--eval-size must be >= 1 and --eval-unseen-size >= 0")
        asker = open_source(args.source, args.tasks, args.round, args.evaluator)
        if args.max_new_tokens > 0:
            asker.max_new_tokens = args.max_new_tokens
        if args.eval is not None:
            mix = _mix(args.eval, asker.mix.name) if args.eval else asker.mix
            result = asker.evaluate(mix, args.eval_size, args.eval_unseen_size)
            if args.json:
                print(json.dumps({**result.to_record(), "evaluator": asker.evaluator, "node": asker.node_eval}))
            else:
                print("\n".join(_eval_lines(result, mix, asker)))
            if not args.question:
                return 0
        sample = SamplingConfig(args.temperature, 1.0, asker.max_new_tokens) if args.sample else None
        if args.question:
            _answer(asker, args.question, sample, args.json)
        else:
            for line in sys.stdin:
                if line.strip():
                    _answer(asker, [line.strip()], sample, args.json)
    except ToolError as exc:
        print(f"sapo-ask: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _answer(asker: Asker, questions: list[str], sample: SamplingConfig | None, as_json: bool) -> None:
    for q, text in zip(questions, asker.answers(questions, sample)):
        full = asker.mix.answer_prefix + text
        if as_json:
            print(json.dumps({"question": q, "completion": full, "answer": extract_answer(full)}))
        else:
            print(f"{q}\n  {full.strip()}\n  answer: {extract_answer(full)}")


if __name__ == "__main__":
    sys.exit(main())

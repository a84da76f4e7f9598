"""`sapo-export RUN_DIR --out DIR`: a trained node's model in a format other tools load.

- `hf`: a transformers directory (config, tokenizer with its chat template, safetensors), a LoRA adapter
  merged into its base: `AutoModelForCausalLM.from_pretrained(DIR)` loads it offline.
- `peft`: the LoRA adapter alone, as PEFT saves one; `adapter_config.json` names the base it belongs to, and
  `PeftModel.from_pretrained(base, DIR)` puts it on that base.
- `gguf`: one llama.cpp model file (f16 by default; bf16, q8_0, f32), the adapter merged in, with its tokenizer
  files and a one-line Ollama `Modelfile` beside it. Llama-architecture models only (llama.cpp's tensor names
  are written here, not by a converter).

Every format gets a model card (README.md: base, task mix, rounds, I/J, the last held-out figures with their
constant-answer yardstick, seed, commit) and `sapo-export.json`, the same facts for `sapo-ask`, which answers
in the node's prompt format. The directory appears whole or not at all (a temporary directory renamed into
place); a bad input writes nothing and exits 2 with one line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from node import __version__
from node.learn.choices import GGUF_WEIGHTS
from node.learn.packaged import PACKAGED, converted_dir
from node.tools.card import model_card
from node.tools.trained import Policy, ToolError, TrainedRun, load_trained, open_run

FORMATS = ("hf", "peft", "gguf")
EXPORT_JSON = "sapo-export.json"  # what sapo-ask reads back: the prompt's mix, the round, the node's figures
HF_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ExportRequest:
    run: Path
    out: Path
    format: str = "hf"
    round: int | None = None
    gguf_type: str = "f16"
    dtype: str = "float32"
    force: bool = False


def export(req: ExportRequest) -> Path:
    """Writes the export of `req.run` into `req.out` and returns it; ToolError (nothing written) if it cannot."""
    _check_out(req.out, req.force)
    run = open_run(req.run, req.round)
    if req.format == "peft" and not run.lora:
        raise ToolError(
            f"{run.checkpoint.path}: this run fine-tuned every weight (--lora-rank 0): there is no adapter to "
            "export alone; --format hf or gguf exports the whole model"
        )
    policy = load_trained(run, torch.device("cpu"))
    out = req.out.expanduser()
    tmp = out.with_name(f".tmp-{out.name}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        WRITERS[req.format](policy, run, tmp, req)
        facts = export_facts(run, req, sorted(p.name for p in tmp.iterdir()))
        (tmp / EXPORT_JSON).write_text(json.dumps(facts, indent=2) + "\n")
        (tmp / "README.md").write_text(model_card(facts))
        if out.exists():  # --force (checked above): the old export goes only once the new one is whole
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _check_out(out: Path, force: bool) -> None:
    out = out.expanduser()
    if out.exists() and not out.is_dir():
        raise ToolError(f"--out {out}: exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ToolError(f"--out {out}: not empty (--force replaces what is there)")


def _merged(policy: Policy) -> torch.nn.Module:
    """The whole model with the adapter folded into its weights (W + scale * B A, float32), or the model."""
    if policy.adapter is None:
        return policy.model
    return policy.model.merge_and_unload()


def write_hf(policy: Policy, run: TrainedRun, out: Path, req: ExportRequest) -> None:
    model = _merged(policy).to(HF_DTYPES[req.dtype])
    model.generation_config.pad_token_id = policy.tokenizer.pad_token_id
    model.save_pretrained(str(out), safe_serialization=True)
    policy.tokenizer.save_pretrained(str(out))


def base_location(model: str) -> str:
    """What `from_pretrained` should load for the run's base: a packaged model's converted transformers copy
    (its weights exactly as the node trained on them), else the --model the run named (a hub id or a path)."""
    if model in PACKAGED:
        converted = converted_dir(model)
        if converted is not None and (converted / "config.json").exists():
            return str(converted)
    return model


def write_peft(policy: Policy, run: TrainedRun, out: Path, req: ExportRequest) -> None:
    assert policy.adapter is not None  # export() refused a full fine-tune
    name = policy.adapter.name
    policy.model.peft_config[name].base_model_name_or_path = base_location(run.cfg.model)
    with warnings.catch_warnings():  # "could not find a config file in <base>": a packaged or tiny base
        warnings.simplefilter("ignore", UserWarning)
        policy.model.save_pretrained(str(out), selected_adapters=[name])


def gguf_name(req: ExportRequest) -> str:
    return f"model-{req.gguf_type}.gguf"


def write_gguf(policy: Policy, run: TrainedRun, out: Path, req: ExportRequest) -> None:
    from node.learn.engines import gguf_export
    from node.learn.engines.llama import template_for

    try:
        gguf_export.check_supported(policy.model)
        template = template_for(run.cfg.model, policy.tokenizer)
    except ValueError as exc:
        raise ToolError(f"--format gguf: {exc}; --format hf exports this model") from None
    model = _merged(policy)
    path = out / gguf_name(req)
    gguf_export.write_model(path, model, gguf_export.template_fields(template), req.gguf_type)
    policy.tokenizer.save_pretrained(str(out))  # sapo-ask prompts with it; llama.cpp reads the file's own
    (out / "Modelfile").write_text(f"FROM ./{path.name}\n")


WRITERS = {"hf": write_hf, "peft": write_peft, "gguf": write_gguf}


def export_facts(run: TrainedRun, req: ExportRequest, files: list[str]) -> dict[str, Any]:
    """What the export is, from the run's own records: the card's table and sapo-ask's settings."""
    cfg, mix = run.cfg, run.mix()
    last = run.last_eval() or {}
    prov = run.provenance()
    keys = ("eval_accuracy", "eval_baseline", "eval_size", "eval_engine")
    unseen = ("eval_unseen_accuracy", "eval_unseen_baseline", "eval_unseen_size")
    return {
        "format": req.format,
        "exported_by": f"sapo-export {__version__}",
        "round": run.round,
        "model": cfg.model,
        "base": base_location(cfg.model),
        "base_fingerprint": (run.checkpoint.meta or {}).get("base"),
        "lora": run.lora,
        "merged": req.format != "peft" and bool(run.lora),
        "tasks": cfg.tasks,
        "datasets": sorted(mix.datasets),
        "system_prompt": mix.system_prompt,
        "answer_prefix": mix.answer_prefix,
        "max_new_tokens": cfg.max_new_tokens or mix.max_new_tokens,
        "num_local": cfg.num_local,
        "num_external": cfg.num_external,
        "ij_policy": cfg.ij_policy,
        "swarm": cfg.swarm if cfg.swarm_enabled else None,
        "seed": cfg.seed,
        "lr": cfg.lr,
        "eval_round": last.get("round"),
        **{k: last.get(k) for k in keys + unseen if k in last},
        "commit": prov.get("commit") or (prov.get("provenance") or {}).get("commit"),
        "node_version": run.checkpoint.state.get("version"),
        "gguf": gguf_name(req) if req.format == "gguf" else None,
        "dtype": req.gguf_type if req.format == "gguf" else (req.dtype if req.format == "hf" else "float32"),
        "files": files,
    }


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="sapo-export",
        description="Export a trained node's model: a transformers dir (hf), its LoRA adapter alone (peft), "
        "or a llama.cpp file (gguf), with a model card.",
    )
    ap.add_argument("run", type=Path, help="the node's run dir (its newest checkpoint) or a checkpoints/round-* dir")
    ap.add_argument("--out", type=Path, required=True, help="the directory to write (must be empty or absent)")
    ap.add_argument("--format", choices=FORMATS, default="hf", help="hf (default), peft or gguf")
    ap.add_argument("--round", type=int, default=None, help="export this round's checkpoint, not the newest")
    ap.add_argument(
        "--gguf-type",
        choices=[t for t in GGUF_WEIGHTS],
        default="f16",
        help="gguf weights: f16 (default), bf16, q8_0 (half the size) or f32",
    )
    ap.add_argument("--dtype", choices=tuple(HF_DTYPES), default="float32", help="hf weights (default float32)")
    ap.add_argument("--force", action="store_true", help="replace what --out holds")
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    req = ExportRequest(args.run, args.out, args.format, args.round, args.gguf_type, args.dtype, args.force)
    try:
        out = export(req)
    except ToolError as exc:
        print(f"sapo-export: error: {exc}", file=sys.stderr)
        return 2
    facts = json.loads((out / EXPORT_JSON).read_text())
    print(f"exported round {facts['round']} of {req.run} as {req.format} to {out}")
    print(f'try it: sapo-ask {out} "What is 4 + 5?"')
    return 0


if __name__ == "__main__":
    sys.exit(main())

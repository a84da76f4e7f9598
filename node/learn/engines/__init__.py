"""Rollout engines: what samples a round's G completions per prompt. One small interface, one module per
engine in this folder (torch.py: the `transformers` sampler, llama.py: llama.cpp, vllm.py: vLLM), chosen
with `--rollout-engine`.

An engine samples from the *current* policy: after every update the loop calls `sync(model)` (the
weights, or only the LoRA adapter, move into the engine; its cost is the round's `sync` phase). Its
samples say whether their behaviour log-probs are the trained model's own (`SampledGroup.logp_exact`):
when an engine's numerics differ (quantised weights, other kernels) the trainer forms pi_old itself with
the training model (node/learn/trainer.py), so GRPO's ratio stays exact for the trained model.

An engine that is not installed or fails to load is reported in one log line and torch samples instead.
`auto` (the default) is llama.cpp on a CPU (the ik_llama.cpp wheel that setup installs, or a source build)
and torch on a GPU, said in one log line either way.

An engine that can also decode greedily (`greedy`: llama.cpp) may run the held-out evaluation
(`eval_engine`, `--eval-engine`; docs/EVALUATION.md): on the weights of its last sync, so the loop syncs
it first when they moved.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from node.learn.choices import ENGINES, EVAL_ENGINES
from node.learn.sampling import SampledGroup, SamplingConfig
from node.learn.stop import StopRequest

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)


class EngineUnavailable(RuntimeError):
    """The engine cannot serve this model here (package missing, unsupported architecture, load failed)."""


class RolloutEngine(Protocol):
    name: str

    def sync(self, model: torch.nn.Module) -> None:
        """Make the engine sample from `model`'s current weights (or adapter)."""

    def sample(
        self, prompts: list[str], group_size: int, cfg: SamplingConfig, stop: StopRequest | None = None
    ) -> list[SampledGroup]:
        """`group_size` completions per prompt, in prompt order; randomness drawn from torch's global RNG
        (so checkpoints, which hold its state, make resumed rounds sample the same), RoundAbandoned between
        two decode steps once `stop` is set."""

    def close(self) -> None:
        """Release what the engine holds outside Python's memory (native models, scratch files)."""


def make_engine(
    name: str,
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    model_name: str = "",
    weight_type: str = "auto",
    logp_exact: bool = True,
    llama_binding: str = "auto",
) -> RolloutEngine:
    """The engine `name` for this model, synced to its current weights, or the torch sampler (with one log
    line) when it is unavailable or fails to load. `logp_exact=False` tells the torch sampler that its
    recorded log-probs are not the update's numerics (mixed precision: node/learn/precision.py);
    `llama_binding` picks llama.cpp's binding (node/learn/engines/llama_api.py)."""
    from node.learn.engines.torch import TorchEngine

    if name == "torch":
        return TorchEngine(model, tokenizer, logp_exact)
    if name == "auto":
        device = next(model.parameters()).device.type
        if device != "cpu":
            log.info("rollout engine auto: torch (the model is on %s)", device)
            return TorchEngine(model, tokenizer, logp_exact)
    engine: RolloutEngine | None = None
    try:
        if name in ("llama", "auto"):
            from node.learn.engines.llama import LlamaEngine

            llama = engine = LlamaEngine(model, tokenizer, model_name, weight_type, llama_binding)
            llama.sync(model)  # a model llama.cpp cannot load shows here, while falling back is still free
            log.info("rollout engine %s: llama.cpp through %s", name, llama.api.label)
            return llama
        if name == "vllm":
            from node.learn.engines.vllm import VllmEngine

            engine = VllmEngine(model, tokenizer)
            engine.sync(model)
            return engine
        raise EngineUnavailable(f"unknown rollout engine {name!r} (one of {', '.join(ENGINES)})")
    except Exception as exc:  # a missing or broken engine must never stop the node: torch always works
        if engine is not None:  # built but could not load the model: free what it holds now
            engine.close()
        if name == "auto":  # expected where neither llama.cpp binding is installed: not a warning
            log.info("rollout engine auto: torch (llama.cpp unavailable: %s: %s)", type(exc).__name__, exc)
        else:
            log.warning("rollout engine %s unavailable (%s: %s); sampling with torch", name, type(exc).__name__, exc)
        return TorchEngine(model, tokenizer, logp_exact)


def engine_label(engine: RolloutEngine) -> str:
    """What samples a node's completions, for its records: the engine's name, and for llama.cpp the binding
    and its version ("llama: ik-llama-cpp-python 0.1.5 (wheel)"), since the two bindings differ in speed and
    kernels; an experiment states what sampled its cells by it."""
    binding: str = getattr(getattr(engine, "api", None), "label", "")
    return f"{engine.name}: {binding}" if binding else engine.name


def eval_engine(choice: str, engine: RolloutEngine, precision: str = "off") -> RolloutEngine | None:
    """What decodes the held-out evaluation's greedy answers, said in one log line: None (torch, the training
    model itself) or `engine`. `torch`: torch. `engine`: the rollout engine where it decodes greedily
    (llama.cpp), else torch with a warning. `auto`: the rollout engine where it decodes greedily and the
    node's torch runs without native bf16 (`precision` "off"); where torch computes in bf16 (a CPU with
    AVX512-BF16/AMX, a GPU) torch decodes at least as fast as the llama.cpp wheel's kernels (docs/EVALUATION.md)
    and keeps the evaluator of the committed experiments."""
    if choice not in EVAL_ENGINES:
        raise ValueError(f"unknown evaluation engine {choice!r} (one of {', '.join(EVAL_ENGINES)})")
    greedy = callable(getattr(engine, "greedy", None))
    if choice == "engine" and not greedy:
        log.warning(
            "--eval-engine engine: the %s rollout engine has no greedy decoding; evaluating with torch", engine.name
        )
    if choice == "torch" or not greedy or (choice == "auto" and precision == "bf16"):
        log.info("held-out evaluation: greedy decoding with torch")
        return None
    log.info("held-out evaluation: greedy decoding through the %s rollout engine", engine.name)
    return engine

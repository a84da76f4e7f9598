"""LoRA peers: a frozen base model, and per peer a low-rank adapter on every linear layer (PEFT).

"LoRA Without Regret" (Thinking Machines, 2025) finds that in RL even rank-1 LoRA matches full
fine-tuning at about 10x its learning rate: a policy-gradient update carries few bits per episode. What a
peer then trains, checkpoints and keeps optimizer state for is the adapter alone (the default model's
adapter at rank 8 is 0.3% of its weights), and several peers in one process share one base in memory:

    base = LoraBase(model, rank, alpha)          # wraps the model once (PEFT mutates its linear layers)
    a, b = base.adapter("peer0", seed=0), base.adapter("peer1", seed=1)
    a.activate(); ...sample / train a...         # peers run round-robin: switch before each one's model work

PEFT keeps every named adapter inside the same wrapped layers; only the active one takes part in the
forward pass and only its parameters require gradients, so a peer's optimizer (built over
`Adapter.parameters()`) never touches another peer's weights. The base model with all adapters disabled
(`Adapter.disabled()`) is the KL reference: no second copy of the model.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from node.learn import precision

TARGETS = "all-linear"  # PEFT: every nn.Linear of the decoder (q, k, v, o, gate, up, down), never the LM head
_PEFT_NAMES = re.compile(r"^base_model\.model\.|\.base_layer(?=\.|$)")


def base_name(name: str) -> str:
    """A parameter's name under a PEFT wrapper, back to the base model's (`base_model.model.x.q_proj.base_layer
    .weight` -> `x.q_proj.weight`)."""
    return _PEFT_NAMES.sub("", name)


def base_fingerprint(model: torch.nn.Module) -> str:
    """A short hash naming a model's weights: names, shapes and 64 values sampled along each tensor.

    Cheap (no pass over all 135M values) and enough to tell two bases apart: an adapter trained on one
    base means nothing on another, so checkpoints and `--lora-init` refuse a base whose hash differs.
    Computed on the base before any adapter exists (PEFT renames the wrapped weights). Values are rounded
    to bf16 first, so an adapter trained on a GPU (bf16 weights) resumes on a CPU (fp32) and back.
    """
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        flat = tensor.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 64)].to(device="cpu", dtype=torch.bfloat16).float()
        h.update(f"{name}:{tuple(tensor.shape)}:".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha}


class LoraBase:
    """One frozen base model, wrapped by PEFT on the first adapter; every further adapter shares it."""

    def __init__(self, model: torch.nn.Module, settings: LoraSettings):
        if settings.rank < 1:
            raise ValueError("LoRA rank must be >= 1")
        self.settings = settings
        self.fingerprint = base_fingerprint(model)
        self._base = model
        self.model: torch.nn.Module | None = None  # the PeftModel, once the first adapter exists

    def adapter(self, name: str, seed: int = 0) -> Adapter:
        """A new adapter (A random from `seed`, B zero: the peer starts exactly at the base model)."""
        from peft import LoraConfig, get_peft_model

        config = LoraConfig(
            r=self.settings.rank,
            lora_alpha=self.settings.alpha,
            target_modules=TARGETS,
            lora_dropout=0.0,
            bias="none",
            task_type="CAUSAL_LM",
        )
        # the caller's RNG stream stays as it was; PEFT's deprecation chatter stays out of node.log
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            torch.manual_seed(seed)
            if self.model is None:
                self.model = get_peft_model(self._base, config, adapter_name=name)
                self._base = None
            else:
                if name in self.model.peft_config:
                    raise ValueError(f"adapter {name!r} exists already")
                self.model.add_adapter(name, config)
        return Adapter(self, name)

    def store_frozen_weights_as(self, dtype: torch.dtype) -> int:
        """Keep the frozen base's matmul weights (linear layers, embeddings) in `dtype`; returns how many.

        Under mixed precision (node/learn/precision.py) autocast casts every weight to bf16 on each use,
        and caches that cast only for weights that require gradients, so a LoRA base's frozen weights were
        cast again in every forward: a quarter of a LoRA update's time on one CPU thread. Stored once in
        bf16 they are used as they are, and the base takes half the memory. The adapters, norms and the
        optimizer stay float32. Such a model runs only under autocast (its inputs stay fp32): from now on its
        every forward enters it by itself (`precision.runs_under_autocast`), wherever it is called from."""
        if self.model is None:
            raise ValueError("no adapter yet: the base is wrapped by the first adapter")
        n = 0
        with torch.no_grad():
            for name, module in self.model.named_modules():
                weight = getattr(module, "weight", None)
                if (
                    isinstance(module, (torch.nn.Linear, torch.nn.Embedding))
                    and ".lora_" not in name
                    and weight is not None
                    and weight.dtype != dtype
                ):
                    weight.data = weight.data.to(dtype)
                    n += 1
        if dtype != torch.float32:  # the wrapper's forward (PEFT's path) and the base's own (generate's)
            for model in (self.model, self.model.get_base_model()):
                precision.runs_under_autocast(model, dtype)
        return n


class Adapter:
    """One peer's adapter on a `LoraBase`: what it trains, saves and loads; `activate` before model work."""

    def __init__(self, base: LoraBase, name: str):
        if base.model is None:
            raise ValueError("an adapter is made by LoraBase.adapter, which wraps the base first")
        self.base = base
        self.name = name
        self.model: torch.nn.Module = base.model
        self._params = dict(self._named())
        self.activate()

    def _named(self) -> Iterator[tuple[str, torch.nn.Parameter]]:
        """(key without the adapter's name, parameter) for this adapter's LoRA weights, in model order."""
        tag = f".{self.name}."
        for n, p in self.model.named_parameters():
            if ".lora_" in n and tag in n:
                yield n.replace(tag, ".", 1), p

    @property
    def settings(self) -> LoraSettings:
        return self.base.settings

    def activate(self) -> None:
        """Route the shared model through this adapter (and make only its weights trainable)."""
        if self.model.active_adapter != self.name:
            self.model.set_adapter(self.name)

    def parameters(self) -> list[torch.nn.Parameter]:
        return list(self._params.values())

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self._params.values())

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The adapter's weights under names free of the adapter's own name (peer0's load as peer3's)."""
        return {key: p.detach() for key, p in self._params.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Strict: the same LoRA layers with the same shapes (rank), or a ValueError saying what differs."""
        missing, extra = set(self._params) - set(state), set(state) - set(self._params)
        if missing or extra:
            raise ValueError(
                f"adapter weights do not fit this model: {len(missing)} missing, {len(extra)} "
                f"unexpected (e.g. {sorted(missing or extra)[0]})"
            )
        with torch.no_grad():
            for key, p in self._params.items():
                if tuple(state[key].shape) != tuple(p.shape):
                    raise ValueError(
                        f"adapter weight {key} has shape {tuple(state[key].shape)}, this model's "
                        f"rank-{self.settings.rank} adapter needs {tuple(p.shape)}"
                    )
                p.copy_(state[key])

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """The frozen base model alone (every adapter off): the KL reference policy."""
        with self.model.disable_adapter():
            yield


def attach(model: torch.nn.Module, rank: int, alpha: float, seed: int = 0, name: str = "default") -> Adapter:
    """One peer's adapter on its own base (a single node): the usual way in."""
    return LoraBase(model, LoraSettings(rank, alpha)).adapter(name, seed)

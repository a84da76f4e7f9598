"""vLLM as the rollout engine on a GPU. UNTESTED: no GPU or vLLM in this project's CI; written against
vLLM's offline `LLM` API (0.8 and later) and kept to the same interface as the other engines.

The engine serves the model's own Hugging Face id or directory (`name_or_path`; a GGUF source is not
supported) in the same process; `sync` pushes the current weights into it (LoRA models: not written yet) with
`load_weights`. vLLM's log-probs come from its own kernels, so its samples are inexact and the trainer forms
pi_old itself. A stop request is honoured before and after each `generate` call, not inside it.
"""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedTokenizerBase

from node.learn.sampling import SampledGroup, SamplingConfig
from node.learn.stop import StopRequest


class VllmEngine:
    name = "vllm"

    def __init__(self, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, gpu_share: float = 0.3):
        import vllm  # ImportError: make_engine falls back to torch

        if not torch.cuda.is_available():
            raise RuntimeError("vLLM needs a GPU")
        source = getattr(getattr(model, "config", None), "name_or_path", "")
        if not source or source.endswith(".gguf") or not os.path.exists(source) and "/" not in source:
            raise RuntimeError("vLLM serves a Hugging Face id or directory; this model has none")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # weights are pushed in-process
        self.vllm = vllm
        self.tokenizer = tokenizer
        self.llm = vllm.LLM(model=source, gpu_memory_utilization=gpu_share, enforce_eager=True)

    def sync(self, model: torch.nn.Module) -> None:
        if hasattr(model, "peft_config"):
            raise NotImplementedError("vLLM with a LoRA model is not written yet (push merged weights)")
        weights = list(model.state_dict().items())
        self.llm.apply_model(lambda m: m.load_weights(weights))

    def sample(
        self, prompts: list[str], group_size: int, cfg: SamplingConfig, stop: StopRequest | None = None
    ) -> list[SampledGroup]:
        if stop is not None:
            stop.check()
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        params = self.vllm.SamplingParams(
            n=group_size,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            max_tokens=cfg.max_new_tokens,
            seed=seed,
            logprobs=0,
            stop_token_ids=[self.tokenizer.eos_token_id],
        )
        ids = [self.tokenizer(p, add_special_tokens=False)["input_ids"] for p in prompts]
        outputs = self.llm.generate([{"prompt_token_ids": x} for x in ids], params, use_tqdm=False)
        if stop is not None:
            stop.check()
        groups = []
        for prompt_ids, out in zip(ids, outputs):
            comps = [list(o.token_ids) for o in out.outputs]
            logps = [[float(next(iter(d.values())).logprob) for d in (o.logprobs or [])] for o in out.outputs]
            groups.append(
                SampledGroup(
                    prompt_ids=prompt_ids,
                    completion_ids=comps,
                    behaviour_logp=logps,
                    texts=[self.tokenizer.decode(c, skip_special_tokens=True) for c in comps],
                    entropy=[],
                    logp_exact=False,
                )
            )  # no full distribution: no entropy
        return groups

    def close(self) -> None:
        """vLLM frees its GPU memory when the `LLM` object goes."""
        self.llm = None

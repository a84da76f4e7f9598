"""Reading the policy's distribution: batched sampling of groups with their behaviour log-probs, and token
log-probs of training sequences (the model comes from node/learn/model_io.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedTokenizerBase,
    TemperatureLogitsWarper,
    TopPLogitsWarper,
)

from node.learn.formats import stop_token_ids
from node.learn.kvcache import cache_arg, shared_prompt_cache
from node.learn.stop import StopRequest


@dataclass
class SampledGroup:
    """G completions of one prompt as token ids, with the behaviour log-probs recorded while sampling."""

    prompt_ids: list[int]
    completion_ids: list[list[int]]  # each ends with EOS if the model stopped
    behaviour_logp: list[list[float]]  # aligned with completion_ids
    texts: list[str]  # decoded completions, without the forced prefix
    entropy: list[float] = field(default_factory=list)  # per completion: mean token entropy (nats) of the
    # temperature-scaled sampling distribution, the policy's own spread (collapse shows as it nears 0)
    logp_exact: bool = True  # behaviour_logp is the trained model's own; False for a rollout engine with
    # other numerics (quantised weights, other kernels): the trainer then forms pi_old itself (trainer.py)


class _BehaviourRecorder(LogitsProcessor):
    """Records log softmax(logits / T) of each sampled token, keeping one step of logits at a time.

    It runs before the temperature/top-p warpers, so the recorded distribution is the policy's own
    (temperature-scaled, untruncated), the same one the trainer recomputes: ratio = 1 at step 0.
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (scaled logits, logsumexp)
        self.steps: list[torch.Tensor] = []
        self.entropies: list[torch.Tensor] = []  # [B] per step: H(softmax(logits / T))

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        self._collect(input_ids[:, -1])
        # The warpers after us return new tensors, so keeping a reference (no copy) is safe. Only the
        # log-normaliser is computed per step; the full log-softmax is never materialised.
        scaled = scores if self.temperature == 1.0 else scores / self.temperature
        x = scaled.float()  # one float32 view per step (a copy under bf16), shared by all three uses
        lse = torch.logsumexp(x, dim=-1)
        self.pending = (scaled, lse)
        # H = lse - sum p * x: one more pass over the vocabulary per step, no [B, V] log-softmax kept
        probs = torch.exp(x - lse.unsqueeze(1))
        self.entropies.append(lse - (probs * torch.nan_to_num(x, neginf=0.0)).sum(dim=-1))
        return scores

    def _collect(self, last_tokens: torch.Tensor) -> None:
        if self.pending is not None:
            scaled, lse = self.pending
            self.steps.append(scaled.gather(1, last_tokens.unsqueeze(1)).squeeze(1).float() - lse)
            self.pending = None

    def finish(self, sequences: torch.Tensor) -> torch.Tensor:
        self._collect(sequences[:, -1])
        return torch.stack(self.steps, dim=1) if self.steps else torch.zeros(sequences.shape[0], 0)


class _StopCheck(LogitsProcessor):
    """Polls the stop request once per generated token: a stop abandons generation within one token."""

    def __init__(self, stop: StopRequest):
        self.stop = stop

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        self.stop.check()
        return scores


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256


def prompt_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], answer_prefix: str) -> str:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text + answer_prefix


@torch.no_grad()
def sample_groups(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    prompts: list[str],
    group_size: int,
    cfg: SamplingConfig,
    stop: StopRequest | None = None,
    share_prompt: bool = True,
) -> list[SampledGroup]:
    """Batched sampling of `group_size` completions for each prompt, KV cache on, each prompt prefilled
    once for its whole group (`shared_prompt_cache`; off only to compare). With `stop`, raises
    RoundAbandoned between two tokens once a stop is requested."""
    device = next(model.parameters()).device
    enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    stops = stop_token_ids(tokenizer)
    recorder = _BehaviourRecorder(cfg.temperature)
    processors = LogitsProcessorList([recorder, TemperatureLogitsWarper(cfg.temperature)])
    if stop is not None:
        stop.check()
        processors.insert(0, _StopCheck(stop))
    if cfg.top_p < 1.0:
        processors.append(TopPLogitsWarper(cfg.top_p))
    was_training = model.training
    model.eval()
    watch = stop.watch(model) if stop is not None else contextlib.nullcontext()
    try:
        with watch:
            inputs = {
                "input_ids": enc["input_ids"],
                "attention_mask": enc["attention_mask"],
                "num_return_sequences": group_size,
            }
            cache = None
            if share_prompt:
                cache = shared_prompt_cache(
                    model, enc["input_ids"], enc["attention_mask"], group_size, cfg.max_new_tokens
                )
            if cache is not None:  # rows already in group order: prompt p's completions at p*G ... p*G + G-1
                inputs = {
                    "input_ids": enc["input_ids"].repeat_interleave(group_size, dim=0),
                    "attention_mask": enc["attention_mask"].repeat_interleave(group_size, dim=0),
                    **cache_arg(cache),
                }
            out = model.generate(
                **inputs,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=cfg.max_new_tokens,
                logits_processor=processors,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=stops,
                use_cache=True,
            )
    finally:
        model.train(was_training)
    sequences = out if isinstance(out, torch.Tensor) else out.sequences
    logps = recorder.finish(sequences).cpu()
    entropies = torch.stack(recorder.entropies, dim=1).cpu() if recorder.entropies else torch.zeros_like(logps)
    prompt_len = enc["input_ids"].shape[1]
    generated = sequences[:, prompt_len:].cpu()
    groups = []
    for p in range(len(prompts)):
        ids = [int(t) for t, m in zip(enc["input_ids"][p].tolist(), enc["attention_mask"][p].tolist()) if m]
        comp, lps, texts, ents = [], [], [], []
        for g in range(group_size):
            row = generated[p * group_size + g].tolist()
            n = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
            comp.append(row[:n])
            lps.append(logps[p * group_size + g, :n].tolist())
            ents.append(float(entropies[p * group_size + g, :n].mean()) if n else 0.0)
            # the text ends before the stop token: a plain-text stop ("\n") is no part of the answer that peers
            # re-encode in their own format
            body = row[: n - 1] if n and row[n - 1] in stops else row[:n]
            texts.append(tokenizer.decode(body, skip_special_tokens=True))
        groups.append(SampledGroup(prompt_ids=ids, completion_ids=comp, behaviour_logp=lps, texts=texts, entropy=ents))
    return groups


def encode_completion(tokenizer: PreTrainedTokenizerBase, prompt: str, response: str) -> tuple[list[int], list[int]]:
    """Re-encode a received response (decoded text) with this node's tokenizer: (prompt ids, completion ids).

    `prompt` already ends with our forced answer prefix; the response is the full assistant text, so
    when it starts with that prefix we cut it off (it belongs to the prompt here). EOS is appended: the
    sender's model stopped there.
    """
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completion_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return prompt_ids, completion_ids


# --- token log-probs for training ----------------------------------------------------------------------


@dataclass
class Sequence:
    """One training sequence: prompt + completion ids, its advantage and pi_old log-probs."""

    prompt_ids: list[int]
    completion_ids: list[int]
    advantage: float
    old_logp: list[float] | None = None
    behaviour_mean_logp: float | None = None  # a peer's mean token log-prob (mu): weight min(1, pi_old/mu) (grpo.py)
    # the external screen (node/learn/screen.py): per completion token, its weight in the loss (None: all 1);
    # the publisher of another peer's completion (None: ours); whether the reference screen judges it
    token_weights: list[float] | None = None
    source: str | None = None
    screened: bool = False


def pad_batch(seqs: list[Sequence], pad_id: int, device: torch.device):
    """Layout [left pad | prompt | completion | right pad]: every completion starts at column P.

    So the logits needed are the last C + 1 positions for every row (`logits_to_keep`): the lm head and
    the log-softmax never run over prompt tokens, which dominate memory for long prompts and big
    vocabularies. Position ids count real tokens only, exactly as `generate` does with left padding.
    Returns (ids, attention, position ids, completion ids [B, C], completion mask [B, C]).
    """
    P = max(len(s.prompt_ids) for s in seqs)
    C = max(len(s.completion_ids) for s in seqs)
    B = len(seqs)
    ids = torch.full((B, P + C), pad_id, dtype=torch.long)
    attn = torch.zeros((B, P + C), dtype=torch.long)
    comp_ids = torch.full((B, C), pad_id, dtype=torch.long)
    comp_mask = torch.zeros((B, C))
    for i, s in enumerate(seqs):
        p, c = len(s.prompt_ids), len(s.completion_ids)
        ids[i, P - p : P] = torch.tensor(s.prompt_ids)
        ids[i, P : P + c] = torch.tensor(s.completion_ids)
        attn[i, P - p : P + c] = 1
        comp_ids[i, :c] = torch.tensor(s.completion_ids)
        comp_mask[i, :c] = 1.0
    positions = (attn.cumsum(dim=1) - 1).clamp(min=0)
    return ids.to(device), attn.to(device), positions.to(device), comp_ids.to(device), comp_mask.to(device)


def token_logprobs(model: torch.nn.Module, seqs: list[Sequence], pad_id: int, temperature: float):
    """log softmax(logits / T) at each completion token; returns ([B, C] logp, [B, C] mask)."""
    device = next(model.parameters()).device
    ids, attn, positions, comp_ids, comp_mask = pad_batch(seqs, pad_id, device)
    C = comp_ids.shape[1]
    logits = model(
        input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=False, logits_to_keep=C + 1
    ).logits[:, :-1]  # logits at t-1 predict token t
    return completion_logprobs(logits, comp_ids, comp_mask, temperature)


def completion_logprobs(logits: torch.Tensor, comp_ids: torch.Tensor, comp_mask: torch.Tensor, temperature: float):
    """[B, C, V] logits predicting the completion tokens -> ([B, C] masked logp, mask); half precision is
    lifted to float32 for the softmax, float64 stays float64 (the gradient tests run in it)."""
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:  # skipped at 1: a full pass over [B, C, vocab] for nothing
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1).gather(2, comp_ids.unsqueeze(-1)).squeeze(-1)
    comp_mask = comp_mask.to(logp.dtype)
    return logp * comp_mask, comp_mask

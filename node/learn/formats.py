"""Prompt formats per model family, for models whose files carry no chat template.

Every prompt is the tokenizer's chat template applied to the mix's system prompt and the question
(`policy.prompt_text`), so the format a model family needs is a template, plus the token that ends a
completion. A model that ships its own template keeps it; one that ships none gets its family's format
here, else ChatML. ChatML is what SmolLM2 was trained on; Gemma 3 270M (a base model, no template in its
GGUF) does not know it and answered "5" to every cpu-learn question under it (docs/RESULTS.md, "Gemma 3
270M", where the formats below were measured).

The stop becomes the tokenizer's EOS: a received completion re-encoded for training ends with it
(`policy.encode_completion`), as this model's own completions do. Sampling and greedy decoding stop at
every token that is the stop repeated (`stop_token_ids`): Gemma's vocabulary has one token for "\n", another
for "\n\n" and so on, and a base model that goes on after a blank line writes the next made-up question.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChatFormat:
    """A Jinja chat template over system/user/assistant messages, and what ends a completion."""

    name: str
    template: str
    stop: str | None = None  # text that ends a completion (one token, the tokenizer's EOS); None: the model's own


CHATML = ChatFormat(
    "chatml",
    (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    ),
)
# Gemma's turns: no system role (the system prompt opens the first user turn); BOS first, as Gemma expects.
GEMMA_CHAT = ChatFormat(
    "gemma-chat",
    (
        "{{ bos_token }}{% for m in messages if m['role'] != 'system' %}"
        "<start_of_turn>{{ 'model' if m['role'] == 'assistant' else 'user' }}\n"
        "{% if loop.first and messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
        "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
        "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
    ),
    stop="<end_of_turn>",
)
# A plain document for a base model: the instructions, then "Question: ... / Answer: ..."; a new line ends
# the answer (a base model goes on with the next made-up question otherwise).
COMPLETION = ChatFormat(
    "completion",
    (
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
        "{% elif m['role'] == 'user' %}Question: {{ m['content'] }}\n"
        "{% else %}Answer: {{ m['content'] }}\n\n{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}Answer: {% endif %}"
    ),
    stop="\n",
)

FORMATS: dict[str, ChatFormat] = {f.name: f for f in (CHATML, GEMMA_CHAT, COMPLETION)}
# model_type (transformers config) -> format, for families whose files ship no template
FAMILY_FORMATS: dict[str, ChatFormat] = {"gemma3_text": COMPLETION, "gemma3": COMPLETION}


def format_for(model_type: str) -> ChatFormat:
    return FAMILY_FORMATS.get(model_type, CHATML)


STOP_IDS_ATTR = "sapo_stop_token_ids"


def apply_format(tokenizer, fmt: ChatFormat) -> None:
    """Give the tokenizer this format's template and, if it has one, its stop as EOS and the ids that end a
    completion. The stop text is looked up through the tokenizer (a byte-level vocabulary spells a new line
    "Ċ"): it must be one token."""
    setattr(tokenizer, STOP_IDS_ATTR, None)
    if fmt.stop is not None:
        ids = tokenizer(fmt.stop, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            raise ValueError(f"prompt format {fmt.name}: stop {fmt.stop!r} is {len(ids)} tokens here, not one")
        unit = tokenizer.convert_ids_to_tokens(ids[0])
        tokenizer.eos_token = unit
        runs = [
            i
            for i, t in enumerate(tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))))
            if t and t != unit and t == unit * (len(t) // len(unit))
        ]
        setattr(tokenizer, STOP_IDS_ATTR, [ids[0], *runs])
    tokenizer.chat_template = fmt.template


def stop_token_ids(tokenizer) -> list[int]:
    """Every token that ends a completion: the EOS, and with a format's stop also that stop repeated."""
    return getattr(tokenizer, STOP_IDS_ATTR, None) or [tokenizer.eos_token_id]

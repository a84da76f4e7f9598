"""Commands beside the node, run from the repository's root.

scripts/*.sh are what a user or a contributor runs: set-up (setup.sh), a local swarm (local_swarm.sh), the
fast checks (check.sh), the suite (test.sh), the GPU check (gpu_check.sh), a flaky-test hunt (flake_check.sh);
check_equivalence.py compares what a fixed run learns before and after a change. The Python tools are
packages run as modules: `python -m scripts.bench.NAME` (benchmarks, docs/BENCHMARKS.md) and
`python -m scripts.research.NAME` (the one-off measurements and experiment runners behind docs/RESULTS.md).
"""

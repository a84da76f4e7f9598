"""Benchmarks: each measures something side by side in one run and prints it (`--json` writes it), e.g.
`python -m scripts.bench.round --model default --tasks cpu-easy --rounds 1`. The figures and how to read
them are in docs/BENCHMARKS.md; tests/test_tools_smoke.py smoke-runs every one on the tiny model.
`procs` holds the real-swarm process helpers the benchmarks and the suite share.
"""

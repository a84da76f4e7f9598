"""Research tools: the measurements, experiment runners and summaries behind docs/RESULTS.md, run as
`python -m scripts.research.NAME`. Each answered one question; they stay runnable (tests/test_tools_smoke.py
smoke-runs every one) so that a result can be re-measured.
"""

"""Loud skips: in CI (CI=true), a skipped rollout-engine, browser, protocol-versions or two-family test fails
the run.

These tests skip for reasons that are about the machine, not the code (llama-cpp-python did not build,
chromium is missing, the clone is shallow, the Gemma 3 packages did not install), and a skip reads as a
pass. CI installs what they need (.ci/run, scripts/test.sh), so there a skip means the set-up broke and the
code went untested: it is reported as a failure that names the skip's reason. A test that cannot run in CI
for a reason of its own goes in ALLOWED, with that reason, and docs/TESTING.md must say it too
(tests/test_ci_guard.py checks both ways).
Hooked into pytest by tests/conftest.py.
"""

from __future__ import annotations

import os

import pytest

# node id prefixes of the tests whose skips must not pass silently in CI, by what they need
GUARDED: dict[str, tuple[str, ...]] = {
    "engine": (
        "tests/learn/test_engine.py",
        "tests/learn/test_eval_engine.py",
        "tests/e2e/test_engines_cli.py",
        "tests/lab/test_survey.py",
    ),
    "browser": ("tests/ops/test_dashboard.py",),
    "versions": ("tests/p2p/test_p2p_versions.py", "tests/p2p/test_wire_minor.py"),
    "models": ("tests/e2e/test_two_families.py",),
}
# ... and the skip reasons that name what they need (a guarded test moved to another file is still caught)
GUARDED_REASONS: dict[str, tuple[str, ...]] = {
    "engine": ("llama_cpp", "llama-cpp-python"),
    "browser": ("chromium",),
    "versions": ("protocol v1", "before minor 1"),
    "models": ("gemma3-270m packages",),
}
# node id (or prefix) -> why it cannot run in CI; every entry is documented in docs/TESTING.md
ALLOWED: dict[str, str] = {}


def in_ci(env=os.environ) -> bool:
    return env.get("CI", "").lower() == "true"


def guarded_group(nodeid: str, reason: str = "") -> str | None:
    for group, prefixes in GUARDED.items():
        if any(nodeid == p or nodeid.startswith(p + "::") or nodeid.startswith(p + "[") for p in prefixes):
            return group
    for group, words in GUARDED_REASONS.items():
        if any(word in reason for word in words):
            return group
    return None


def allowed(nodeid: str) -> bool:
    return any(nodeid == a or nodeid.startswith(a) for a in ALLOWED)


def skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2])
    return str(longrepr)


def verdict(nodeid: str, reason: str, env=os.environ) -> str | None:
    """The failure message for a skip that CI must not accept, or None when the skip may stand."""
    group = guarded_group(nodeid, reason)
    if not in_ci(env) or group is None or allowed(nodeid):
        return None
    return (
        f"skipped in CI, where the {group} tests must run ({reason}). Fix the CI set-up (.ci/run), or add "
        f"the test to ALLOWED in tests/ci_guard.py and say in docs/TESTING.md why it cannot run in CI."
    )


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and not hasattr(report, "wasxfail"):
        message = verdict(report.nodeid, skip_reason(report))
        if message:
            report.outcome, report.longrepr = "failed", message


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    report = outcome.get_result()
    if report.skipped:  # a module skipped as a whole (a module-level importorskip)
        message = verdict(report.nodeid, skip_reason(report))
        if message:
            report.outcome, report.longrepr = "failed", message

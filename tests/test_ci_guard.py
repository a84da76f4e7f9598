"""Loud skips (tests/ci_guard.py): in CI a skipped engine, browser, versions or two-family test fails the run, every
exception is explained in docs/TESTING.md, and the test command lists every skip with its reason."""

import subprocess
import sys

from ci_guard import ALLOWED, GUARDED, verdict
from conftest import REPO, node_env

CI = {"CI": "true"}


def test_a_guarded_skip_fails_only_in_ci():
    engine = "tests/learn/test_engine.py::test_llama_engine_samples_valid_groups"
    message = verdict(engine, "could not import 'llama_cpp'", CI)
    assert message and "engine" in message and "could not import 'llama_cpp'" in message
    assert verdict("tests/ops/test_dashboard.py::test_dashboard_renders", "no chromium", CI)
    assert verdict("tests/p2p/test_p2p_versions.py::test_v1_peer_is_refused_and_nothing_crashes", "shallow", CI)
    assert verdict(engine, "could not import 'llama_cpp'", {}) is None  # a developer's machine: a listed skip
    assert verdict(engine, "whatever", {"CI": "false"}) is None
    assert verdict("tests/p2p/test_netns.py::test_join", "not root", CI) is None  # not a guarded group
    assert verdict("tests/learn/test_engine.pyx::t", "x", CI) is None  # a prefix of a file name is not the file
    # a guarded test in another file is known by what its skip says it lacks
    assert "engine" in verdict("tests/learn/engines/test_llama.py::t", "could not import 'llama_cpp'", CI)
    assert "browser" in verdict("tests/ops/test_ui.py::t", "/usr/bin/chromium not found", CI)
    families = "tests/e2e/test_two_families.py::test_smollm2_and_gemma3_train_on_each_others_groups"
    assert "models" in verdict(families, "gemma3-270m packages not installed", CI)


def test_guarded_files_exist_and_every_allowed_skip_is_explained_in_the_testing_doc():
    for prefixes in GUARDED.values():
        for prefix in prefixes:
            assert (REPO / prefix.split("::")[0]).is_file(), prefix
    testing = (REPO / "docs" / "TESTING.md").read_text()
    assert "tests/ci_guard.py" in testing and "CI=true" in testing
    for nodeid, why in ALLOWED.items():
        assert nodeid in testing, f"docs/TESTING.md does not say why {nodeid} may skip in CI ({why})"


def test_the_versions_test_skipped_in_ci_fails_the_run():
    """The real hook on a real guarded test: without the repository's history the versions test skips,
    and in CI pytest then exits 1, naming the skip and its reason."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/p2p/test_p2p_versions.py"]
    no_history = {"GIT_DIR": str(REPO / "no-such-git-dir")}
    ci = subprocess.run(
        cmd, cwd=REPO, env=node_env(CI="true", **no_history), capture_output=True, text=True, timeout=180
    )
    assert ci.returncode == 1, ci.stdout[-3000:]
    assert "skipped in CI, where the versions tests must run" in ci.stdout and "1 failed" in ci.stdout
    assert "protocol v1 is not in this checkout's git history" in ci.stdout
    assert "-rs" in (REPO / "scripts" / "test.sh").read_text()  # the suite lists every skip with its reason

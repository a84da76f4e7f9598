"""setup_logging: a node's name is text in every line, and only a lost console counts as one."""

from __future__ import annotations

import errno
import io
import logging
from pathlib import Path

import pytest

from node.ops.metrics import LOG_FILE, ConsoleHandler, NodeLogHandler, setup_logging


@pytest.fixture
def restore_root():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


@pytest.mark.parametrize("name", ["50%", "%(foo)s", "a%sb"])
def test_a_name_with_percent_signs_is_logged_as_written(tmp_path, restore_root, monkeypatch, name):
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    lost: list[bool] = []
    setup_logging(tmp_path, name=name, on_console_lost=lambda: lost.append(True))
    logging.getLogger("sapo.test").info("round %d", 3)
    for handler in logging.getLogger().handlers:
        handler.flush()
    line = (tmp_path / LOG_FILE).read_text(encoding="utf-8").strip()
    assert line.endswith(f" INFO {name} sapo.test: round 3")
    assert stderr.getvalue().strip().endswith(f" INFO {name} sapo.test: round 3")
    assert not lost  # a format problem is not a lost console: the node would stop


def test_a_closed_console_is_lost_once_and_silenced(restore_root, monkeypatch):
    stream = io.StringIO()
    lost: list[bool] = []
    handler = ConsoleHandler(stream, lambda: lost.append(True))
    monkeypatch.setattr("node.ops.metrics.silence_std_streams", lambda: None)  # keep pytest's own fds
    stream.close()
    record = logging.LogRecord("sapo.test", logging.INFO, __file__, 1, "hello", None, None)
    handler.emit(record)
    handler.emit(record)
    assert lost == [True] and handler.lost


def test_a_node_log_that_cannot_be_written_is_said_once_not_a_traceback_a_line(restore_root, monkeypatch):
    """A full disk under node.log (/dev/full: every write fails with ENOSPC): one line on stderr, then the
    console alone, never logging's `--- Logging error ---` traceback for each record."""
    stderr = io.StringIO()
    monkeypatch.setattr("sys.stderr", stderr)
    handler = NodeLogHandler(Path("/dev/full"))
    record = logging.LogRecord("sapo.test", logging.INFO, __file__, 1, "round %d", (3,), None)
    for _ in range(3):
        handler.emit(record)
    said = stderr.getvalue()
    assert said == "sapo-node: /dev/full cannot be written (No space left on device): the console goes on alone\n"
    assert handler.lost is not None and handler.lost.errno == errno.ENOSPC
    handler.close()  # nothing left to flush: no second error

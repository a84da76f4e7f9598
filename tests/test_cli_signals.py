"""The rule that turns signals into one stop request (node/cli.py `StopSignals`), without processes or clocks.

The end-to-end tests (tests/e2e/test_node_stop.py) send real signals; how close together they land there
depends on how fast the node stops, so the repeat rule itself is pinned down here.
"""

import pytest

import node.cli as cli
from node.learn.stop import StopRequest


class Aborted(Exception):
    pass


@pytest.fixture
def signals(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr(cli.time, "monotonic", lambda: now[0])
    monkeypatch.setattr(cli.os, "_exit", lambda code: (_ for _ in ()).throw(Aborted(code)))
    s = cli.StopSignals(StopRequest())
    s.now = now
    return s


def test_a_repeat_within_the_window_is_the_same_request(signals):
    signals("SIGINT")
    assert signals.stop.is_set() and signals.stop.reason == "SIGINT"
    signals.now[0] += 0.05
    signals("SIGTERM")  # the terminal's SIGINT and a script's cleanup signal: one request, not an abort
    assert signals.stop.reason == "SIGINT"


def test_a_third_request_aborts(signals):
    for _ in range(2):
        signals("SIGINT")
    with pytest.raises(Aborted) as exc:
        signals("SIGINT")
    assert exc.value.args == (cli.ABORT_EXIT_CODE,)


def test_a_request_after_the_window_aborts(signals):
    signals("SIGINT")
    signals.now[0] += cli.REPEAT_WINDOW_S + 0.1
    with pytest.raises(Aborted):
        signals("SIGINT")


def test_a_lost_console_is_a_graceful_stop_never_an_abort(signals):
    for _ in range(5):
        signals.console_lost()
    assert signals.stop.is_set() and signals.stop.reason == "console closed"


def test_a_repeat_landing_while_the_loop_handlers_are_removed_is_counted_not_fatal(signals, monkeypatch):
    """The race CI met: the node stopped within 50 ms, and the repeat Ctrl-C arrived while `uninstall` swapped
    the loop's handlers for plain ones, when SIGINT briefly meant KeyboardInterrupt (the node died, exit -2)."""
    import asyncio
    import os
    import signal

    before = {sig: signal.getsignal(sig) for sig in cli.STOP_SIGNALS}
    loop = asyncio.new_event_loop()
    remove = loop.remove_signal_handler

    def remove_then_repeat(sig):  # the repeat lands right after asyncio reset SIGINT to its default
        removed = remove(sig)
        if sig == signal.SIGINT and removed:
            os.kill(os.getpid(), signal.SIGINT)
        return removed

    monkeypatch.setattr(loop, "remove_signal_handler", remove_then_repeat)
    try:
        signals.install(loop)
        signals("SIGINT")  # the first request; the node then stops and uninstalls
        signals.uninstall(loop)  # must not raise KeyboardInterrupt
        assert signals.count == 2 and signals.stop.reason == "SIGINT"
        assert all(signal.getsignal(sig) == signals._plain_handler for sig in cli.STOP_SIGNALS)
    finally:
        loop.close()
        for sig, handler in before.items():
            signal.signal(sig, handler)

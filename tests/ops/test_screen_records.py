"""What the external screen did reaches a round's metrics line, node.log's round line and the run's totals
(which /status shows and checkpoints keep), per reason and publisher."""

from __future__ import annotations

from node.learn.screen import ScreenReport
from node.records import NodeTotals, _screen_part


def report() -> ScreenReport:
    r = ScreenReport(mode="on", reference="base", screened=4, tokens=40, masked_tokens=22, threshold=-3.21)
    r.count("aaaa" * 4, "outside_answer", 12)
    r.count("aaaa" * 4, "outside_answer", 8)
    r.count("bbbb" * 4, "masked_outside", 2)
    return r


def test_the_record_names_reasons_publishers_and_the_masked_share():
    rec = report().to_record()
    assert rec["external_screen"] == "on" and rec["screen_reference"] == "base"
    assert rec["screened_by_reason"] == {"outside_answer": 2, "masked_outside": 1}
    assert rec["screened_tokens_frac"] == 0.55 and rec["screened_completions"] == 4
    assert rec["screened_by_publisher"]["aaaa" * 4] == {"outside_answer": 2, "masked_tokens": 20}
    line = _screen_part(rec)
    assert "outside_answer 2" in line and "aaaaaaaa 2" in line and "bbbbbbbb 1" in line and "55%" in line
    assert _screen_part(ScreenReport().to_record()) == ""


def test_totals_add_up_across_rounds_and_survive_a_checkpoint():
    from node.learn.groups import Selection

    totals = NodeTotals()
    empty = Selection([], [], 0, 0, 0, 0)
    totals.add(empty, 0, report())
    totals.add(empty, 0, report())
    totals.add(empty, 0, None)
    assert totals.screened == {"outside_answer": 4, "masked_outside": 2}
    assert totals.screened_by_publisher == {"aaaa" * 4: 4, "bbbb" * 4: 2}
    again = NodeTotals()
    again.load_state_dict(totals.state_dict())
    assert again.screened == totals.screened and again.screened_by_publisher == totals.screened_by_publisher
    old = {k: v for k, v in totals.state_dict().items() if not k.startswith("screened")}
    again.load_state_dict(old)  # a checkpoint from before the screen
    assert again.screened == {} and again.rounds == 3

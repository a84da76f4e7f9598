"""The shared reader of the node's JSONL files (node/ops/metrics.py read_records): a live file's half-written
last line is left out only when asked; any other bad line is an error that names the file and line."""

import pytest

from node.ops.metrics import read_records


def test_records_in_order_blank_lines_skipped_and_a_cut_last_line_only_when_live(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 0}\n\n{"round": 1}\n{"round": 2, "rew')
    assert read_records(path, partial_ok=True) == [{"round": 0}, {"round": 1}]
    with pytest.raises(ValueError, match=r"metrics.jsonl: line 4 is not JSON"):
        read_records(path)
    path.write_text('{"round": 0}\n{"round": 1, "rew\n{"round": 2}\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):  # not the last line: corrupt, never skipped
        read_records(path, partial_ok=True)
    path.write_text('{"round": 0}\n[1, 2]\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON object"):
        read_records(path)


def test_resume_sets_aside_lines_that_are_no_record_and_keeps_them(tmp_path):
    """On resume a line that is JSON but no object (an edited file) goes to metrics.orphaned.jsonl like a cut one;
    nothing is lost and the node starts."""
    from node.ops.metrics import MetricsWriter

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"round": 0}\n[1, 2]\n7\n{"round": 1}\n{"round": 2}\n')
    writer = MetricsWriter(tmp_path)
    assert writer.truncate_after(1) == 3
    assert read_records(path) == [{"round": 0}, {"round": 1}]
    assert (tmp_path / "metrics.orphaned.jsonl").read_text().splitlines() == ["[1, 2]", "7", '{"round": 2}']
    path.write_text('{"round": 0}\n[3]\n')
    assert writer.last() is None  # not a record: no last round to go on from

"""Reads TensorBoard event files back, independently of the writer: TFRecord framing with its CRCs checked,
then the Event protobuf (tensorboardX ships the proto; it has no reader of its own)."""

from __future__ import annotations

import struct
from pathlib import Path

from tensorboardX.proto.event_pb2 import Event
from tensorboardX.record_writer import masked_crc32c


def read_events(path: Path) -> list[Event]:
    data, pos, events = path.read_bytes(), 0, []
    while pos < len(data):
        header = data[pos : pos + 8]
        (length,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[pos + 8 : pos + 12])[0] == masked_crc32c(header), f"{path}: header CRC"
        body = data[pos + 12 : pos + 12 + length]
        assert struct.unpack("<I", data[pos + 12 + length : pos + 16 + length])[0] == masked_crc32c(body), (
            f"{path}: record CRC"
        )
        events.append(Event.FromString(body))
        pos += 16 + length
    return events


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] over every event file in logdir, in file order (as TensorBoard loads them)."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(logdir).glob("events.out.tfevents.*")):
        for event in read_events(path):
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def read_scalars_with_tensorboard(logdir: Path) -> dict[str, list[tuple[int, float]]] | None:
    """The same, read by TensorBoard's own EventAccumulator when the `tensorboard` package is installed
    (the viewer; the node does not need it), else None."""
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return None
    acc = EventAccumulator(str(logdir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}

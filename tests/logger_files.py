"""Reading back what `peer.node.loggers` wrote, with the loggers' own formats (tests only).

- TensorBoard: event files, read by tensorboard's `EventAccumulator`.
- W&B offline: `<dir>/wandb/offline-run-*/run-*.wandb`, a LevelDB-style log (a 7-byte file header,
  then 32 KiB blocks of chunks, each with a 7-byte header: crc32, u16 length, u8 type — full, first,
  middle, last) of `wandb_internal_pb2.Record` protobufs; wandb has no public reader for it.
"""

from __future__ import annotations

import json
import struct
import time
from pathlib import Path
from typing import Any

BLOCK = 32 * 1024
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def tensorboard_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of every scalar under `log_dir`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def tensorboard_text(log_dir: Path, tag: str) -> str:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    events = acc.Tensors(f"{tag}/text_summary")
    return events[0].tensor_proto.string_val[0].decode() if events else ""


def _chunks(data: bytes) -> list[bytes]:
    """The records of a LevelDB-style log that starts after the W&B file header."""
    if data[:4] != b":W&B":
        raise ValueError("not a W&B transaction log")
    out, pending, pos = [], b"", 7
    while pos + 7 <= len(data):
        room = BLOCK - pos % BLOCK
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack_from("<IHB", data, pos)
        if kind == 0 and length == 0:
            pos += room
            continue
        body = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == FULL:
            out.append(body)
        elif kind == FIRST:
            pending = body
        elif kind == MIDDLE:
            pending += body
        elif kind == LAST:
            out.append(pending + body)
            pending = b""
    return out


def wandb_run(wandb_dir: Path) -> dict[str, Any]:
    """The one offline run under `wandb_dir`: {"name", "group", "config": {key: value}, "history": [row, ...]}."""
    from wandb.proto import wandb_internal_pb2 as pb

    files = sorted(wandb_dir.glob("offline-run-*/run-*.wandb"))
    if len(files) != 1:
        raise AssertionError(f"expected one offline W&B run under {wandb_dir}, found {files}")
    # W&B's writer process may still be flushing the log when `finish()` returned (seen on a loaded
    # machine: the file lacked its run record): read it once it ends with the run's exit record
    deadline = time.monotonic() + 30.0
    while True:
        records = []
        for body in _chunks(files[0].read_bytes()):
            rec = pb.Record()
            rec.ParseFromString(body)
            records.append(rec)
        if (records and records[-1].WhichOneof("record_type") == "exit") or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    run: dict[str, Any] = {"name": None, "group": None, "config": {}, "history": []}
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind == "run":
            run["name"], run["group"] = rec.run.display_name, rec.run.run_group
            for item in rec.run.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in rec.config.update:
                run["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in rec.history.item}
            run["history"].append(row)
    return run

"""`<data-dir>/metrics.jsonl`: the one writer every role uses and the readers every tool uses.

One JSON object per line, appended and line-buffered, so a crash loses at most the line being
written and readers skip a torn last line. Events and their fields are a contract other tools
read (the demo, `peer status`, tests, notebooks):
- `step`:  t, h, loss, tokens, step_s (the inner step's own seconds, without the batch read; not in a
           torchrun follower's file);
- `round`: t, stages → {param_hash, perp_hash, participants, clipped, max_norm_ratio},
           train_loss, val_loss, round_wall_s, bytes → {activations, activations_uncompressed_equiv,
           pseudo_gradients};
- `start`: stage, peer_id, address, config (the run's, `RunConfig.to_dict`), fingerprint;
- `mode` (a head, each outer step): t, mode ("compressed" or "uncompressed"), reason, util_uncompressed,
  compute_ms, bandwidth_mbps, bandwidth_source, rtt_ms (`peer.node.pipeline.mode`; None where not known);
- `sync`, `resume`, `resume_kept`, `catch_up`, `pause`, `checkpoint`, `checkpoint_failed`,
  `exit` (reason);
every event also carries `event`, `role` and `time` (unix seconds).
Sinks (`add_sink`, e.g. the Prometheus exporter of `peer join --metrics-port`) see every event
record of every writer in this process, after it is written; a failing sink is logged, never raised.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"

__all__ = ["METRICS_FILE", "MetricsTail", "MetricsWriter", "add_sink", "log_round", "read_events", "remove_sink"]

Sink = Callable[[dict[str, Any]], None]
_SINKS: list[Sink] = []


def add_sink(sink: Sink) -> None:
    """Call `sink(record)` for every event any MetricsWriter of this process logs from now on."""
    _SINKS.append(sink)


def remove_sink(sink: Sink) -> None:
    if sink in _SINKS:
        _SINKS.remove(sink)


class MetricsWriter:
    """Appends events to `<data_dir>/metrics.jsonl` from any thread."""

    def __init__(self, data_dir: Path, role: str, name: str = METRICS_FILE) -> None:
        """`name`: another file of the data dir (a torchrun rank > 0 writes `metrics-rank<r>.jsonl`)."""
        data_dir.mkdir(parents=True, exist_ok=True)
        self.path = data_dir / name
        self.role = role
        self._lock = threading.Lock()
        self._file = open(self.path, "a", buffering=1)  # noqa: SIM115 - kept open for the peer's lifetime

    def log(self, event: str, **fields: Any) -> None:
        record = {"event": event, "role": self.role, **fields, "time": time.time()}
        line = json.dumps(record) + "\n"
        with self._lock:
            if not self._file.closed:
                self._file.write(line)
        for sink in tuple(_SINKS):
            try:
                sink(record)
            except Exception:  # a monitoring sink must not stop the peer: say so and go on
                log.exception("metrics sink %r failed on a %r event", sink, event)

    def close(self) -> None:
        with self._lock:
            self._file.close()


def log_round(
    metrics: MetricsWriter,
    t: int,
    stages: Mapping[int, tuple[StageWorker, int]],
    train_loss: float | None,
    val_loss: float | None,
    wall_s: float,
    pg_bytes: int,
    activations: tuple[int, int] = (0, 0),
) -> None:
    """The `round` event of a committed round t: per stage (worker, participants) its hashes and clip
    stats; `pg_bytes` and `activations` = (sent, uncompressed equivalent) are cumulative bytes."""
    metrics.log(
        "round",
        t=t,
        stages={
            str(s): {
                "param_hash": w.param_hash(),
                "perp_hash": w.perp_hash(),
                "participants": n,
                "committed": [r[:16] for r in w.ledger.last_committed],
                "dropped": [r[:16] for r in w.ledger.last_dropped],
                "clipped": w.ledger.last_clip.n_clipped,
                "max_norm_ratio": w.ledger.last_clip.max_ratio,
            }
            for s, (w, n) in stages.items()
        },
        train_loss=train_loss,
        val_loss=val_loss,
        round_wall_s=wall_s,
        bytes={
            "activations": activations[0],
            "activations_uncompressed_equiv": activations[1],
            "pseudo_gradients": pg_bytes,
        },
    )


def _parse(line: bytes | str) -> dict[str, Any] | None:
    try:
        ev = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return ev if isinstance(ev, dict) else None


def read_events(path: Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The complete events of a metrics file (all, or those whose `event` is `kind`).

    A missing file has none; a torn or malformed line is skipped.
    """
    try:
        text = Path(path).read_text()
    except OSError:
        return []
    events = [ev for ev in map(_parse, text.splitlines()) if ev is not None]
    return events if kind is None else [ev for ev in events if ev.get("event") == kind]


class MetricsTail:
    """Reads the events appended to a metrics file since the last call (for live progress)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.offset = 0
        self.partial = b""

    def read_new(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return []
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()  # b"" when the chunk ended with a newline
        out = []
        for line in lines:
            ev = _parse(line)
            if ev is None:
                log.debug("skipping a malformed line in %s: %r", self.path, line[:80])
                continue
            out.append(ev)
        return out

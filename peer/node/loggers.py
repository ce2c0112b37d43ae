"""`peer join --wandb PROJECT` and `--tensorboard DIR`: the series of `metrics.jsonl`, in the loggers
people use.

Both are sinks of the peer's metrics events (`peer.node.metrics.add_sink`): whatever the peer writes
to `metrics.jsonl` they log, nothing else, so they cost no traffic and can never stop training (a
sink that fails is logged and skipped by the writer). One mapping (`scalars`) turns an event into
scalars on one of two x axes, the same for both loggers:

- `step` events, on the axis `inner_step` = t·H + h: `train/loss`, `train/tokens` (cumulative),
  `train/tokens_per_s`, `train/step_s`;
- `round` events, on the axis `outer_step` = t: `round/train_loss`, `round/val_loss`, `round/wall_s`,
  `bytes/<kind>` (activations, their uncompressed equivalent, pseudo-gradients; cumulative),
  `stage<s>/participants`, `stage<s>/clipped`, `stage<s>/dropped`;
- any other event (`sync`, `pause`, `checkpoint`, …), at the last outer step seen: `events/<name>`,
  how many so far. Values that are not finite numbers are left out.

The `start` event carries the run's config (`RunConfig.to_dict`) and fingerprint: W&B gets them as
the run's config (its group is the fingerprint, so every peer of a run is one group), TensorBoard as
a text summary. Both packages are optional extras (`pip install "peer[wandb]"`, `"peer[tensorboard]"`)
imported only when their flag is given. W&B honours its own settings: `WANDB_MODE=offline` logs to
`<data-dir>/wandb` with no network (`wandb sync` uploads it later), `WANDB_API_KEY` logs in.
"""

from __future__ import annotations

import atexit
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from peer.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["INNER", "OUTER", "Scalars", "TensorBoardSink", "WandbSink", "scalars"]

INNER, OUTER = "inner_step", "outer_step"
Scalars = tuple[str, int, dict[str, float]]  # (axis, x, {tag: value})
EARLY_ROWS = 64  # rows a W&B sink keeps before the `start` event; past them its run starts without the config


def _num(x: Any) -> float | None:
    """x as a float when it is a finite number (a JSON null, a string or NaN is left out)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    value = float(x)
    return value if value == value and abs(value) != float("inf") else None


def _kept(values: Mapping[str, Any]) -> dict[str, float]:
    return {tag: v for tag, x in values.items() if (v := _num(x)) is not None}


def _mapping(x: Any) -> Mapping[str, Any]:
    return x if isinstance(x, Mapping) else {}


class _Axes:
    """What the mapping remembers between events: H, the outer step last seen, counts, tokens."""

    def __init__(self) -> None:
        self.inner_steps = 1
        self.outer = 0
        self.tokens = 0.0
        self.counts: dict[str, int] = {}


def scalars(record: Mapping[str, Any], axes: _Axes) -> list[Scalars]:
    """The scalars of one metrics event (module docstring); [] for an event that has none."""
    event = str(record.get("event", ""))
    if event == "start":
        cfg = record.get("config")
        if isinstance(cfg, Mapping) and isinstance(cfg.get("train"), Mapping):
            h = cfg["train"].get("inner_steps")
            axes.inner_steps = h if isinstance(h, int) and h > 0 else axes.inner_steps
        return []
    t, h = record.get("t"), record.get("h")
    if event == "step" and isinstance(t, int) and isinstance(h, int):
        axes.outer = max(axes.outer, t)
        axes.tokens += _num(record.get("tokens")) or 0.0
        step_s, tokens = _num(record.get("step_s")), _num(record.get("tokens"))
        values = {"train/loss": record.get("loss"), "train/tokens": axes.tokens, "train/step_s": step_s}
        if step_s and tokens is not None:
            values["train/tokens_per_s"] = tokens / step_s
        return [(INNER, t * axes.inner_steps + h, _kept(values))]
    if event == "round" and isinstance(t, int):
        axes.outer = max(axes.outer, t)
        sent = _mapping(record.get("bytes"))
        values = {
            "round/train_loss": record.get("train_loss"),
            "round/val_loss": record.get("val_loss"),
            "round/wall_s": record.get("round_wall_s"),
            **{f"bytes/{k}": v for k, v in sent.items()},
        }
        stages = _mapping(record.get("stages"))
        for s, info in stages.items():
            if isinstance(info, Mapping):
                dropped = info.get("dropped")
                values[f"stage{s}/participants"] = info.get("participants")
                values[f"stage{s}/clipped"] = info.get("clipped")
                values[f"stage{s}/dropped"] = len(dropped) if isinstance(dropped, list) else None
        return [(OUTER, t, _kept(values))]
    if not event or event == "exit":
        return []
    axes.counts[event] = axes.counts.get(event, 0) + 1
    return [(OUTER, axes.outer, {f"events/{event}": float(axes.counts[event])})]


class _Sink:
    """A metrics sink: one lock (events come from every thread), the axes, a close at exit."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._axes = _Axes()
        self._closed = False
        atexit.register(self.close)

    def __call__(self, record: dict[str, Any]) -> None:
        with self._lock:
            if self._closed:
                return
            if record.get("event") == "start":
                self._started(record)
            for axis, x, values in scalars(record, self._axes):
                if values:
                    self._write(axis, x, values)
            if record.get("event") in ("round", "exit"):
                self._flush(final=record.get("event") == "exit")

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._flush(final=True)

    def _started(self, record: Mapping[str, Any]) -> None: ...
    def _write(self, axis: str, x: int, values: dict[str, float]) -> None: ...
    def _flush(self, final: bool) -> None: ...


def _run_name(record: Mapping[str, Any]) -> str:
    role, stage, peer = record.get("role", "peer"), record.get("stage"), str(record.get("peer_id", ""))[:8]
    return "-".join(str(p) for p in (role, "" if stage is None else f"s{stage}", peer) if p != "")


class TensorBoardSink(_Sink):
    """Scalars into TensorBoard event files under `log_dir` (torch's `SummaryWriter`)."""

    def __init__(self, log_dir: Path) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ConfigError('--tensorboard needs the tensorboard package: pip install "peer[tensorboard]"') from None
        log_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=str(log_dir))
        super().__init__()

    def _started(self, record: Mapping[str, Any]) -> None:
        import json

        run = {k: record.get(k) for k in ("role", "stage", "peer_id", "fingerprint")}
        text = json.dumps({"peer": run, "config": record.get("config")}, indent=2, sort_keys=True, default=str)
        self._writer.add_text("config", f"```\n{text}\n```", 0)

    def _write(self, axis: str, x: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, x)

    def _flush(self, final: bool) -> None:
        self._writer.flush()
        if final:
            self._writer.close()


class WandbSink(_Sink):
    """Scalars into a Weights & Biases run of `project`, its files under `data_dir`/wandb. The run starts
    at the `start` event, with the run's config (rows logged before it are kept for it, `EARLY_ROWS`);
    each series has its own x axis (`define_metric`), so a round that lands while the next outer step
    trains never goes backwards."""

    def __init__(self, project: str, data_dir: Path) -> None:
        try:
            import wandb
        except ImportError:
            raise ConfigError('--wandb needs the wandb package: pip install "peer[wandb]"') from None
        if not project.strip():
            raise ConfigError("--wandb takes a project name")
        self._wandb, self.project, self.data_dir = wandb, project, data_dir
        self._run: Any = None
        self._early: list[dict[str, float]] = []  # rows logged before the `start` event
        super().__init__()

    def _begin(self, record: Mapping[str, Any]) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fingerprint = record.get("fingerprint")
        self._run = self._wandb.init(
            project=self.project,
            dir=str(self.data_dir),
            config=dict(record.get("config") or {}),
            name=_run_name(record),
            group=str(fingerprint) if fingerprint else None,
            job_type=str(record.get("role", "peer")),
            reinit="create_new",
        )
        for axis in (INNER, OUTER):
            self._run.define_metric(axis)
        for prefix in ("train", "bytes", "round", "events"):
            self._run.define_metric(f"{prefix}/*", step_metric=INNER if prefix == "train" else OUTER)
        self._run.define_metric("stage*", step_metric=OUTER)
        for row in self._early:
            self._run.log(row)
        self._early.clear()

    def _started(self, record: Mapping[str, Any]) -> None:
        if self._run is None:
            self._begin(record)

    def _write(self, axis: str, x: int, values: dict[str, float]) -> None:
        if self._run is None:  # before the `start` event (the session's `connectivity`): kept for the run
            self._early.append({axis: x, **values})
            if len(self._early) < EARLY_ROWS:
                return
            self._begin({})
        self._run.log({axis: x, **values})

    def _flush(self, final: bool) -> None:
        if final and self._run is None and self._early:
            self._begin({})
        if final and self._run is not None:
            self._run.finish()
            self._run = None

"""What a `peer demo` run did, from its processes' metrics files: live state, per-round summary, loss curves.

`ProcessView` follows one join process's metrics.jsonl (start, step and round events); `DemoState`
is the snapshot the live view renders; `summarize_runs` aggregates the `round` events of every
process after the run: per round the mean train/validation loss of the heads and full replicas,
every stage's parameter hash (the same on every holder, DESIGN §3), and the bytes each kind of
link carried (subspace-compressed activations vs SparseLoCo pseudo-gradients).

Invariants: a round missed by one process is still reported (rounds are the union over
processes); `params_consistent` is False as soon as two holders of a stage disagree on a hash;
nothing here prints or writes: `demo_curves` gives the points `peer.cli.plots.plot_demo` draws.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.node.metrics import read_events

LOSS_ROLES = ("head", "full")  # roles that report a training loss
BYTE_KINDS = ("activations", "activations_uncompressed_equiv", "pseudo_gradients")


def _mean(xs: Sequence[float | None]) -> float | None:
    """Mean of the finite values in `xs`, None when there is none."""
    finite = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return sum(finite) / len(finite) if finite else None


def summarize_runs(metrics_paths: Sequence[Path]) -> dict[str, Any]:
    """Aggregate the `round` events of every process's metrics.jsonl (contract in DESIGN/issue 3).

    Returns {"rounds": [{"t", "train_loss", "val_loss", "param_hash": {stage: hash},
    "participants": {stage: n}, "reporters": n}], "params_consistent": bool, "bytes": {...}}.
    Rounds are the union over processes (a process that missed a round does not hide it);
    train/val loss = mean over the heads and full replicas that reported one; param_hash[s] = the
    most reported hash; params_consistent is False if two processes report different param_hash or
    perp_hash for the same (t, s); bytes = sum over processes of their last cumulative counters.
    """
    per_t: dict[int, list[dict[str, Any]]] = {}
    totals = dict.fromkeys(BYTE_KINDS, 0)
    for path in metrics_paths:
        rounds = [ev for ev in read_events(path) if ev.get("event") == "round" and isinstance(ev.get("t"), int)]
        for ev in rounds:
            per_t.setdefault(ev["t"], []).append(ev)
        if rounds:
            last = rounds[-1].get("bytes") or {}
            for k in BYTE_KINDS:
                totals[k] += int(last.get(k) or 0)
    consistent = True
    out_rounds: list[dict[str, Any]] = []
    for t in sorted(per_t):
        events = per_t[t]
        losses = [ev.get("train_loss") for ev in events if ev.get("role") in LOSS_ROLES]
        vals = [ev.get("val_loss") for ev in events if ev.get("role") in LOSS_ROLES]
        hashes: dict[str, list[str]] = {}
        perps: dict[str, set[str]] = {}
        participants: dict[str, int] = {}
        for ev in events:
            for s, rec in (ev.get("stages") or {}).items():
                s = str(s)
                if rec.get("param_hash") is not None:
                    hashes.setdefault(s, []).append(rec["param_hash"])
                if rec.get("perp_hash") is not None:
                    perps.setdefault(s, set()).add(rec["perp_hash"])
                if rec.get("participants") is not None:
                    participants[s] = max(participants.get(s, 0), int(rec["participants"]))
        if any(len(set(h)) > 1 for h in hashes.values()) or any(len(p) > 1 for p in perps.values()):
            consistent = False
        order = sorted(set(hashes) | set(participants), key=lambda s: (int(s) if s.isdigit() else 1 << 30, s))
        out_rounds.append(
            {
                "t": t,
                "train_loss": _mean(losses),
                "val_loss": _mean(vals),
                "param_hash": {s: max(hashes[s], key=hashes[s].count) for s in order if s in hashes},
                "participants": {s: participants[s] for s in order if s in participants},
                "reporters": len(events),
            }
        )
    return {"rounds": out_rounds, "params_consistent": consistent, "bytes": totals}


@dataclass
class ProcessView:
    """What the demo knows about one join process, from its metrics file and exit code."""

    name: str
    role: str  # "head" | "stage" | "full"
    stage: int | None
    rounds_done: int = 0
    outer_step: int | None = None
    inner_step: int | None = None
    loss: float | None = None
    tokens_per_s: float = 0.0
    exit_code: int | None = None
    started: bool = False
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BYTE_KINDS, 0))
    _steps: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=20), repr=False)

    def apply(self, ev: Mapping[str, Any]) -> None:
        """Fold one metrics event into the view."""
        kind = ev.get("event")
        if kind == "start":
            self.started = True
        elif kind == "step":
            self.outer_step, self.inner_step = ev.get("t"), ev.get("h")
            if ev.get("loss") is not None:
                self.loss = float(ev["loss"])
            if ev.get("time") is not None:
                self._steps.append((float(ev["time"]), int(ev.get("tokens") or 0)))
                if len(self._steps) >= 2 and self._steps[-1][0] > self._steps[0][0]:
                    tokens = sum(n for _, n in list(self._steps)[1:])
                    self.tokens_per_s = tokens / (self._steps[-1][0] - self._steps[0][0])
        elif kind == "round" and isinstance(ev.get("t"), int):
            self.rounds_done = max(self.rounds_done, ev["t"] + 1)
            self.bytes = {k: int((ev.get("bytes") or {}).get(k) or 0) for k in BYTE_KINDS}


@dataclass
class DemoState:
    """Snapshot handed to the progress callback."""

    phase: str  # "starting bootstrap" | "starting peers" | "training" | "stopping"
    elapsed_s: float
    outer_steps: int
    workdir: Path
    processes: list[ProcessView]

    @property
    def round(self) -> int:
        """Rounds committed by every join process (the swarm's clock)."""
        return min((p.rounds_done for p in self.processes), default=0)

    @property
    def train_loss(self) -> float | None:
        return _mean([p.loss for p in self.processes if p.role in LOSS_ROLES and p.loss is not None])

    @property
    def tokens_per_s(self) -> float:
        return sum(p.tokens_per_s for p in self.processes if p.role in LOSS_ROLES and p.exit_code is None)

    @property
    def bytes(self) -> dict[str, int]:
        return {k: sum(p.bytes[k] for p in self.processes) for k in BYTE_KINDS}


@dataclass
class DemoResult:
    """What `run_demo` returns: the summary, where everything was written, the last live state."""

    summary: dict[str, Any]  # summarize_runs(...) + wall_s
    workdir: Path
    metrics: dict[str, Path]  # join process name -> metrics.jsonl
    processes: list[ProcessView]


@dataclass(frozen=True)
class ProcessCurve:
    """One head's or full replica's train loss: (global inner step, loss) points; `index` is its place
    among all the run's processes by name (its colour in the plot)."""

    name: str
    index: int
    points: list[tuple[int, float]]


@dataclass(frozen=True)
class DemoCurves:
    """The loss curves of a demo run (`peer.cli.plots.plot_demo` draws them): per process, then the
    rounds' mean train loss (drawn mid-round) and validation loss (after the commit)."""

    processes: list[ProcessCurve]
    round_train: list[tuple[float, float]]
    round_val: list[tuple[int, float]]


def demo_curves(result: DemoResult, inner_steps: int) -> DemoCurves:
    """Per-process train loss against the global inner step (t·H + h), round means and validation loss."""
    roles = {v.name: v.role for v in result.processes}
    processes = []
    for i, (name, mpath) in enumerate(sorted(result.metrics.items())):
        if roles.get(name) not in LOSS_ROLES:
            continue
        pts = [
            (ev["t"] * inner_steps + ev["h"], ev["loss"])
            for ev in read_events(mpath)
            if ev.get("event") == "step"
            and ev.get("loss") is not None
            and isinstance(ev.get("t"), int)
            and isinstance(ev.get("h"), int)
        ]
        if pts:
            processes.append(ProcessCurve(name, i, pts))
    rounds = result.summary["rounds"]
    # a round's train loss is the mean over its inner steps: drawn mid-round; validation is after the commit
    train = [
        (r["t"] * inner_steps + (inner_steps - 1) / 2, r["train_loss"]) for r in rounds if r["train_loss"] is not None
    ]
    val = [((r["t"] + 1) * inner_steps, r["val_loss"]) for r in rounds if r["val_loss"] is not None]
    return DemoCurves(processes, train, val)

"""Figures of `peer bench utilisation`, read from replicas' metrics.jsonl (compute fraction, one state per round).

Compute fraction, round and outer-step times of a replica, and whether every (t, stage) has one state
among its holders.

From the `step` events (t, h, `time` at the step's end, `step_s` its own seconds) and the `round`
events (t, per stage `param_hash`/`perp_hash`, `round_wall_s`, `time` when recorded) of one replica:
- an outer step t starts when its first inner step starts (`time − step_s` of h = 0) and lasts until
  outer step t + 1 starts: its H inner steps plus whatever the schedule puts on the critical path
  (the round and validation synchronously; the encode, validation and a wait for round t − 1 to land
  overlapped);
- its compute is the sum of its inner steps' `step_s`; the compute fraction over the measured outer
  steps is Σ compute / Σ outer step;
- `landed_s`: from the end of outer step t's last inner step to round t's record (the round as the
  trainer waits for it synchronously; with overlap it ran meanwhile); `round_wall_s` is the node's
  own gather time of that round; `boundary_s`: from that end to the first inner step of t + 1 (what
  the schedule puts between two outer steps on the critical path);
An outer step that was started over (a pause) counts from its last start. Measured are outer steps
`first` .. T − 2 (the last one has no successor to end it). Invariant: pure functions on event dicts.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

Event = Mapping[str, Any]


def outer_steps(steps: Iterable[Event]) -> dict[int, list[Event]]:
    """{t: its inner steps' events, from the last time it started (h = 0)}."""
    out: dict[int, list[Event]] = {}
    for ev in steps:
        t = int(ev["t"])
        if int(ev["h"]) == 0:
            out[t] = []
        out.setdefault(t, []).append(ev)
    return out


def _start(step: Event) -> float:
    return float(step["time"]) - float(step["step_s"])


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def replica_figures(steps: Iterable[Event], rounds: Iterable[Event], inner_steps: int, first: int) -> dict[str, Any]:
    """One replica's figures over its measured outer steps (t ≥ `first` with a complete successor)."""
    by_t = outer_steps(steps)
    done = {int(r["t"]): r for r in rounds}
    measured = [t for t in sorted(by_t) if t >= first and t + 1 in by_t and len(by_t[t]) == inner_steps]
    compute, wall, boundary, landed, gather, step_s = [], [], [], [], [], []
    for t in measured:
        start, end = _start(by_t[t][0]), float(by_t[t][-1]["time"])
        wall.append(_start(by_t[t + 1][0]) - start)
        boundary.append(_start(by_t[t + 1][0]) - end)
        compute.append(sum(float(ev["step_s"]) for ev in by_t[t]))
        step_s += [float(ev["step_s"]) for ev in by_t[t]]
        if t in done:
            landed.append(float(done[t]["time"]) - end)
            gather.append(float(done[t]["round_wall_s"]))
    return {
        "measured": measured,
        "compute_fraction": sum(compute) / sum(wall) if wall else None,
        "outer_step_s": _median(wall),
        "compute_s": _median(compute),
        "boundary_s": _median(boundary),
        "landed_s": _median(landed),
        "round_wall_s": _median(gather),
        "step_s": _median(step_s),
        "rounds": sorted(done),
    }


def one_state(holders: Mapping[str, Iterable[Event]]) -> dict[str, Any]:
    """Every (t, stage) that a holder recorded: its states ((param_hash, perp_hash)) across holders.

    `checked`: (t, stage) pairs recorded; `agreed`: those with one state among every holder that
    recorded them; `all_holders`: those that every holder recorded; `splits`: [t, stage, states]."""
    states: dict[tuple[int, str], dict[str, tuple[str, str]]] = {}
    for name, rounds in holders.items():
        for r in rounds:
            for stage, s in r["stages"].items():
                states.setdefault((int(r["t"]), stage), {})[name] = (s["param_hash"], s["perp_hash"])
    splits = [
        [t, stage, sorted(set(by.values()))] for (t, stage), by in sorted(states.items()) if len(set(by.values())) > 1
    ]
    return {
        "checked": len(states),
        "agreed": len(states) - len(splits),
        "all_holders": sum(len(by) == len(holders) for by in states.values()),
        "splits": splits,
    }

"""`peer bench utilisation`'s figures from metrics events: the outer step's bounds, a restarted outer
step counted from its last start, and the one-state check that names a split."""

from __future__ import annotations

import pytest

from peer.research.bench.utilisation_report import one_state, replica_figures


def _steps(t: int, start: float, step_s: float, n: int, gap_s: float = 0.0) -> list[dict]:
    """n inner steps of outer step t from `start`, each `step_s` long, `gap_s` apart."""
    out, at = [], start
    for h in range(n):
        at += step_s
        out.append({"event": "step", "t": t, "h": h, "time": at, "step_s": step_s})
        at += gap_s
    return out


def _round(t: int, time: float, hashes: dict[str, str], wall_s: float = 1.0) -> dict:
    stages = {s: {"param_hash": h, "perp_hash": "p" + h} for s, h in hashes.items()}
    return {"event": "round", "t": t, "time": time, "round_wall_s": wall_s, "stages": stages}


def test_fraction_counts_inner_steps_against_the_outer_step_from_start_to_start():
    # outer step t: 4 steps of 1 s from 10 t, then 6 s at the boundary (the round), so 10 s each
    steps = [ev for t in range(4) for ev in _steps(t, 10.0 * t, 1.0, 4)]
    rounds = [_round(t, 10.0 * t + 9.0, {"0": "a"}, wall_s=3.0) for t in range(4)]
    got = replica_figures(steps, rounds, inner_steps=4, first=1)
    assert got["measured"] == [1, 2]  # 0 warms up; 3 has no successor
    assert got["compute_fraction"] == pytest.approx(0.4)
    assert got["outer_step_s"] == pytest.approx(10.0) and got["compute_s"] == pytest.approx(4.0)
    assert got["boundary_s"] == pytest.approx(6.0) and got["landed_s"] == pytest.approx(5.0)
    assert got["round_wall_s"] == 3.0 and got["rounds"] == [0, 1, 2, 3]


def test_an_outer_step_started_over_counts_from_its_last_start():
    first_try = _steps(1, 10.0, 1.0, 2)  # paused after two steps
    steps = _steps(0, 0.0, 1.0, 3) + first_try + _steps(1, 20.0, 1.0, 3) + _steps(2, 30.0, 1.0, 3)
    got = replica_figures(steps, [], inner_steps=3, first=1)
    assert got["measured"] == [1]
    assert got["outer_step_s"] == pytest.approx(10.0) and got["compute_s"] == pytest.approx(3.0)
    assert got["landed_s"] is None  # no round recorded


def test_one_state_names_a_split_and_a_round_only_one_holder_recorded():
    a = [_round(0, 1.0, {"0": "x", "1": "y"}), _round(1, 2.0, {"0": "x1", "1": "y1"})]
    b = [_round(0, 1.0, {"0": "x", "1": "y"}), _round(1, 2.0, {"0": "x1", "1": "OTHER"}), _round(2, 3.0, {"0": "z"})]
    got = one_state({"a": a, "b": b})
    assert got["checked"] == 5 and got["agreed"] == 4 and got["all_holders"] == 4
    assert got["splits"] == [[1, "1", [("OTHER", "pOTHER"), ("y1", "py1")]]]

"""The chaos report's counters (`peer.research.bench.chaos_report`) on metrics files written here."""

from __future__ import annotations

import json
from pathlib import Path

from peer.research.bench.chaos_report import (
    abandoned,
    disagreement_lines,
    disagreements,
    holder_events,
    lone_commits,
    longest_disagreement,
    outside_freezes,
    stalls,
    states,
)


def _round(t: int, stage: int, param: str, perp: str, committed: list[str], when: float) -> dict:
    st = {"param_hash": param, "perp_hash": perp, "participants": len(committed), "committed": committed}
    return {"event": "round", "t": t, "time": when, "stages": {str(stage): st}}


def _write(workdir: Path, holder: str, events: list[dict]) -> None:
    (workdir / holder).mkdir(parents=True, exist_ok=True)
    (workdir / holder / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_a_lone_set_is_counted_once_and_a_perp_mismatch_is_not_a_lone_commit(tmp_path):
    _write(tmp_path, "a", [_round(3, 1, "p", "x", ["head"], 1.0), _round(4, 1, "q", "x", ["head"], 2.0)])
    _write(tmp_path, "b", [_round(3, 1, "p", "y", ["head"], 1.1), _round(4, 1, "r", "x", ["head", "full"], 2.1)])
    events = holder_events(tmp_path)
    lone = lone_commits(events)
    # (3, 1): same set {head}, only T⊥ differs -> a disagreement, not a lone commit
    # (4, 1): a committed {head} alone while b committed {head, full} -> one lone commit, a's
    assert lone == [{"t": 4, "stage": 1, "holder": "a", "time": 2.0, "wall_s": 0.0}]
    committed, unresolved = disagreements(states(events))
    assert committed == 2 and unresolved == 1  # the last states of (5, 1) still differ
    # where they were, for a failed run's report: "!" marks the unresolved one
    assert disagreement_lines(states(events)) == ["4/1: a=round:p/x b=round:p/y", "!5/1: a=round:q/x b=round:r/x"]


def test_a_resync_resolves_a_committed_disagreement(tmp_path):
    _write(tmp_path, "a", [_round(3, 1, "p", "x", ["h"], 1.0)])
    _write(
        tmp_path,
        "b",
        [_round(3, 1, "q", "x", ["h", "f"], 1.1), {"event": "sync", "t": 4, "stage": 1, "param_hash": "p", "time": 2}],
    )
    committed, unresolved = disagreements(states(holder_events(tmp_path)))
    assert (committed, unresolved) == (1, 0)


def test_longest_disagreement_counts_consecutive_outer_steps_per_stage(tmp_path):
    a = [_round(t, 1, f"a{t}", "x", ["h"], t) for t in range(6)]
    b = [_round(t, 1, f"a{t}" if t in (0, 4) else f"b{t}", "x", ["h"], t) for t in range(6)]
    _write(tmp_path, "a", a)
    _write(tmp_path, "b", b)
    assert longest_disagreement(states(holder_events(tmp_path))) == 3  # t = 1, 2, 3 (+1 = outer steps 2..4)


def test_stalls_are_gaps_longer_than_the_threshold_including_the_end():
    assert stalls([0.0, 5.0, 30.0], stall_s=20.0) == [{"from": 5.0, "gap_s": 25.0}]
    assert stalls([0.0, 5.0], stall_s=20.0, end=40.0) == [{"from": 5.0, "gap_s": 35.0}]
    assert stalls([0.0, 5.0], stall_s=20.0, end=10.0) == []


def test_a_holder_that_resynced_past_a_step_no_longer_holds_what_it_committed_there(tmp_path):
    """b committed another state of (4, 1), then re-synced to outer step 6 (it replayed the swarm's
    rounds through 4): resolved. A sync to an earlier step, or one before the commit, resolves nothing."""
    _write(tmp_path, "a", [_round(3, 1, "p", "x", ["h"], 1.0), _round(4, 1, "p2", "x", ["h"], 2.0)])
    sync = {"event": "sync", "t": 6, "stage": 1, "param_hash": "s", "time": 3.0}
    _write(tmp_path, "b", [_round(3, 1, "q", "x", ["h", "f"], 1.1), sync])
    assert disagreements(states(holder_events(tmp_path))) == (1, 0)
    early = {"event": "sync", "t": 6, "stage": 1, "param_hash": "s", "time": 0.5}  # before its commit
    _write(tmp_path, "b", [early, _round(3, 1, "q", "x", ["h", "f"], 1.1)])
    assert disagreements(states(holder_events(tmp_path))) == (1, 1)
    other_stage = {"event": "sync", "t": 6, "stage": 0, "param_hash": "s", "time": 3.0}
    _write(tmp_path, "b", [_round(3, 1, "q", "x", ["h", "f"], 1.1), other_stage])
    assert disagreements(states(holder_events(tmp_path))) == (1, 1)


def test_a_lone_commit_is_explained_only_by_a_freeze_during_its_round():
    lone = [{"t": 4, "stage": 1, "holder": "a", "time": 10.0, "wall_s": 5.0}]  # its round: 5 s to 10 s
    assert outside_freezes(lone, [{"kind": "long_stop", "time": 2.0, "until": 6.0}]) == []
    assert outside_freezes(lone, [{"kind": "stop", "time": 9.0, "until": 9.5}]) == []
    assert outside_freezes(lone, [{"kind": "stop", "time": 1.0, "until": 4.9}]) == lone  # thawed before it began
    assert outside_freezes(lone, [{"kind": "stop", "time": 10.5, "until": 12.0}]) == lone  # frozen after it
    assert outside_freezes(lone, [{"kind": "kill_fresh", "time": 6.0, "until": 6.1}]) == lone  # a kill is no freeze


def test_a_holder_a_fresh_restart_replaced_keeps_no_state_at_the_end(tmp_path):
    # the head commits round 3 alone and is killed before it can reconcile; its fresh restart is a new
    # holder (head-1): the swarm keeps none of the old head's states, but its split still counts
    _write(tmp_path, "head", [_round(3, 0, "p", "", ["head"], 1.0)])
    _write(tmp_path, "full", [_round(3, 0, "q", "", ["head", "full"], 1.1)])
    _write(tmp_path, "head-1", [_round(5, 0, "r", "", ["head", "full"], 9.0)])
    gone = abandoned(["full", "head", "head-1", "s1b", "s1b-1", "s1b-2"])
    assert gone == {"head", "s1b", "s1b-1"}
    table = states(holder_events(tmp_path))
    assert disagreements(table) == (1, 1)
    assert disagreements(table, gone) == (1, 0)

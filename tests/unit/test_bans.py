"""Bans of repeated outliers (`peer.node.round.bans`, issue 12 item 5): the state machine and its agreement.

- a streak of `after` drops bans for exactly `rounds` rounds, then the ban ends by itself;
- a kept contribution breaks a streak, an absence does not, and a stale streak is forgotten;
- honest rounds (nothing dropped) never create any state;
- the state is a function of (state, round, set, drops): holders that commit the same rounds hold
  the same bans in any order of the ids; the record round-trips, junk is ignored, size is capped;
- agreement: the ban state is part of the state id (two states that differ only by their bans are
  two claims), banned replicas are dropped from a round, an observer skips only the replicas every
  holder of the stage at that round bans;
- `StageWorker.apply_round` advances the bans from its own screening: a holder that commits the
  same set from the same state holds the same bans (no bans are ever taken from a claim).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from peer.config import build_config
from peer.core.sparseloco.algorithm import compress, decompress
from peer.errors import ConfigError
from peer.net.records import Announcement, ReplicaRecord, StageRecord
from peer.node.round.agreement import round_bans, round_view
from peer.node.round.bans import MAX_ENTRIES, NONE, Bans, Entry
from peer.node.round.claims import state_id
from peer.node.stage.worker import StageWorker

A, B, C, X = ("A" * 20, "B" * 20, "C" * 20, "X" * 20)  # replica ids; bans key them by 16-char prefix
x = X[:16]


def _run(rounds: list[tuple[list[str], list[str]]], bans: Bans = NONE, start: int = 0, after=3, n=10) -> Bans:
    for t, (committed, dropped) in enumerate(rounds, start=start):
        bans = bans.advance(t, committed, dropped, after, n)
    return bans


def test_three_drops_in_a_row_ban_for_exactly_ban_rounds_rounds_then_the_ban_ends():
    bans = _run([([A, B, X], [X])] * 2)
    assert bans.entries == {x: Entry(2, 1, 0)} and not bans.banned(2)
    bans = bans.advance(2, [A, B, X], [X], 3, 10)
    assert bans.entries == {x: Entry(0, 2, 13)} and bans.started(2) == [x]
    assert [t for t in range(0, 20) if x in bans.banned(t)] == list(range(3, 13))  # rounds 3..12
    for t in range(3, 13):  # banned: not in any committed set
        bans = bans.advance(t, [A, B], [], 3, 10)
        assert bans.started(t) == []
    assert bans == NONE  # over: forgotten; it must be dropped 3 more times to be banned again
    assert _run([([A, B, X], [X])] * 2, bans, start=13).banned(15) == frozenset()


def test_a_kept_contribution_resets_the_streak_an_absence_does_not():
    kept = _run([([A, X], [X]), ([A, X], [X]), ([A, X], []), ([A, X], [X])])
    assert kept.entries == {x: Entry(1, 3, 0)} and not kept.banned(4)
    absent = _run([([A, X], [X]), ([A, X], [X]), ([A], []), ([A, X], [X])])
    assert absent.banned(4) == {x}


def test_a_stale_streak_is_forgotten():
    bans = _run([([A, X], [X]), ([A, X], [X])], n=4)
    assert bans.entries[x].streak == 2
    bans = _run([([A], [])] * 4, bans, start=2, n=4)  # 4 rounds without X: its streak is too old
    assert bans == NONE


def test_honest_rounds_never_create_state_and_zero_turns_banning_off():
    assert _run([([A, B, C], [])] * 50) == NONE
    assert _run([([A, X], [X])] * 5, after=0) == NONE
    assert _run([([A, X], [X])] * 5, n=0) == NONE
    with pytest.raises(ConfigError, match="swarm.ban_after"):
        build_config(overrides={"swarm.ban_after": -1})


def test_the_state_depends_only_on_the_rounds_not_on_id_order_or_prefix_length():
    rounds = [([A, B, X, C], [X, C]), ([C, X, A], [X]), ([X, B], [X])]
    one = _run(rounds)
    two = _run([(list(reversed(c)), [r[:16] for r in reversed(d)]) for c, d in rounds])
    assert one == two and one.to_record() == two.to_record()
    assert one.banned(3) == {x} and C[:16] not in one.entries  # kept in round 1: its streak ended


def test_the_record_round_trips_ignores_junk_and_stays_small():
    bans = _run([([A, X], [X])] * 3)
    assert Bans.from_record(bans.to_record()) == bans
    junk = {x: [0, 2, 13], "y": [1, 2], 3: [1, 1, 1], "z": ["1", 0, 0], "w": [True, 0, 0], "v": [-1, 0, 0]}
    assert Bans.from_record(junk) == Bans({x: Entry(0, 2, 13)})
    assert Bans.from_record(None) == Bans.from_record("bans") == NONE
    many = Bans.from_record({f"{i:016d}": [1, i, 0] for i in range(3 * MAX_ENTRIES)})
    assert len(many.entries) == MAX_ENTRIES and min(e.last for e in many.entries.values()) == 2 * MAX_ENTRIES


def test_the_ban_state_is_part_of_the_state_id():
    banned = _run([([A, X], [X])] * 3).to_record()
    assert state_id("h", "p", banned) != state_id("h", "p", {})  # other bans: another claim
    assert state_id("h", "p", banned) == state_id("h", "p", dict(reversed(list(banned.items()))))
    assert state_id("h", "p", {}) != state_id("h", "q", {}) != state_id("g", "p", {})


def _replica(t: int = 0) -> ReplicaRecord:
    return ReplicaRecord(kind="full", outer_step=t, joined_at=0, address="x:1")


def test_banned_replicas_are_out_of_the_round():
    anns = {rid: Announcement(replica=rid, sha256="0", address="x:1") for rid in (A, X)}
    replicas = {rid: _replica(3) for rid in (A, B, X)}
    view = round_view(3, 1, anns, {}, replicas, {}, B, "", banned=frozenset({x}))
    assert set(view.bound) == {A} and view.banned == {X} and X in view.dropped and X not in view.expected
    assert (X, X, "banned") in view.ignored


def test_an_observer_skips_only_what_every_holder_of_the_stage_at_that_round_bans():
    rec = _run([([A, X], [X])] * 3).to_record()
    holders = {
        A: StageRecord(outer_step=3, bans=rec),
        B: StageRecord(outer_step=3, bans=rec),
        C: StageRecord(outer_step=2, bans={}),  # another round: not read
    }
    assert round_bans(holders, 3) == {x}
    assert round_bans({**holders, "D": StageRecord(outer_step=3, bans={})}, 3) == frozenset()  # one disagrees
    lone = {A: StageRecord(outer_step=3, bans=rec), B: StageRecord(outer_step=3, bans={})}
    assert round_bans(lone, 3) == frozenset()  # a lone holder cannot make an observer skip a replica
    assert round_bans(holders, 3, me=A) == {x}
    assert round_bans(holders, 5) == frozenset()


def test_apply_round_advances_the_bans_from_screening_and_the_same_set_gives_the_same_bans():
    cfg = build_config()
    cfg = dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, ban_after=2, ban_rounds=4))
    worker = StageWorker(cfg, 1)
    shapes = {name: v.shape for name, v in sorted(worker.start.items()) if v.numel() <= 4096}  # small: fast

    def payload(seed: int, scale: float = 1e-3):
        g = torch.Generator().manual_seed(seed)
        return compress({n: torch.randn(s, generator=g) * scale for n, s in shapes.items()}, None, cfg.sparseloco)[0]

    for t in range(2):
        honest = [payload(10 * t + i) for i in range(3)]
        attacker = compress({n: -1e4 * v for n, v in decompress(honest[0]).items()}, None, cfg.sparseloco)[0]
        worker.apply_round([*honest, attacker], None, [A, B, C, X])
        assert worker.ledger.last_dropped == [X]
    assert worker.ledger.bans.banned(2) == {x} and worker.ledger.bans.entries[x].until == 2 + 4
    # a second holder that commits the same sets from the same state holds the same bans and state
    other = StageWorker(cfg, 1)
    for t in range(2):
        honest = [payload(10 * t + i) for i in range(3)]
        attacker = compress({n: -1e4 * v for n, v in decompress(honest[0]).items()}, None, cfg.sparseloco)[0]
        other.apply_round([*honest, attacker], None, [A, B, C, X])
    assert other.ledger.bans == worker.ledger.bans and other.state_id() == worker.state_id()

"""`peer bench swarm`: the simulator's links, its byte counts, and that its protocol calls are the swarm's.

Small swarms on the tiny preset (milliseconds to a few seconds); one 128-peer run on the real 1B shapes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import simpy

from peer.node.round import agreement
from peer.node.round.agreement import Close
from peer.node.round.ranges import ownership
from peer.research.bench.swarm import voted_bound
from peer.research.swarm.net import MBIT, Link, Network
from peer.research.swarm.run import simulate
from peer.research.swarm.sim import Protocol, SimConfig, summarize

FAST: dict[str, Any] = {"preset": "tiny", "stages": 2, "inner_steps": 2, "churn_per_h": 0.0}


def test_a_sender_upload_is_shared_fairly_and_a_transfer_ends_when_both_ends_carried_it():
    env = simpy.Environment()
    net = Network(env)
    net.add_peer("s", Link(up_Bps=10 * MBIT, down_Bps=100 * MBIT, rtt_s=0.0, dc=False))
    for r in ("a", "b"):
        net.add_peer(r, Link(up_Bps=10 * MBIT, down_Bps=100 * MBIT, rtt_s=0.0, dc=False))
    ends: dict[str, float] = {}
    for r, nbytes in (("a", 10 * MBIT), ("b", 5 * MBIT)):
        net.transfer("s", r, nbytes, tag=0).callbacks.append(lambda _e, r=r: ends.__setitem__(r, env.now))
    env.run()
    # both share 10 Mbit/s: b's 5 Mbit ends at 1 s, then a has it all: 10 Mbit by 1.5 s
    assert ends["b"] == pytest.approx(1.0) and ends["a"] == pytest.approx(1.5)
    assert net.sent[0]["s"] == 15 * MBIT and net.received[0] == {"a": 10 * MBIT, "b": 5 * MBIT}


def test_all_to_all_moves_m_minus_one_payloads_per_peer_each_way():
    M = 6
    sim = simulate(SimConfig(peers=M, rule="all", rounds=2, **FAST))
    rows = summarize(sim)
    assert [r["t"] for r in rows] == [0, 1]
    for row in rows:
        payload = row["payload_bytes"]
        assert set(sim.net.received[row["t"]].values()) == {(M - 1) * payload}
        assert set(sim.net.sent[row["t"]].values()) == {(M - 1) * payload}
        assert row["counted"] == M and row["rule"] == "all" and not row["lost"]


def test_the_default_protocol_is_the_swarms_own_functions():
    proto = Protocol()
    assert proto.owners is ownership.owners and proto.coordinator_order is ownership.coordinator_order
    assert proto.round_rule is ownership.round_rule
    assert proto.close_decision is agreement.close_decision and proto.round_view is agreement.round_view


def _recording(calls: dict[str, list[Any]], name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def wrapped(*args: Any) -> Any:
        out = fn(*args)
        calls.setdefault(name, []).append((args, out))
        return out

    return wrapped


def test_a_ranges_round_is_decided_by_the_swarms_owners_roster_order_and_close_rule():
    calls: dict[str, list[Any]] = {}
    real = Protocol()
    proto = Protocol(**{f: _recording(calls, f, getattr(real, f)) for f in real.__dataclass_fields__})
    M = 12
    sim = simulate(SimConfig(peers=M, rule="ranges", rounds=1, **FAST), proto)
    board = sim.boards[0]
    rg, sizes = board.ranges, board.sizes
    assert board.roster == tuple(sorted(sim.peers)) and board.R == 16  # n_ranges_for(12, tiles)
    # every range's owners are ownership.owners of the roster: primary + 1 backup
    for r in range(board.R):
        assert rg.owners[r] == ownership.owners(0, 0, r, rg.members, 2)
    assert len(calls["owners"]) == board.R
    # the roster's publisher was asked through coordinator_order, and published on a COMPLETE close
    assert calls["coordinator_order"] and calls["round_view"]
    assert Close.COMPLETE in [out for _, out in calls["close_decision"]]
    assert {out for _, out in calls["round_rule"]} == {"ranges"}
    # bytes only the real owners give: an owner fetched its ranges' parts from every other member, and
    # every peer fetched each other range's shard once
    for p in sim.peers:
        mine = rg.mine.get(p, [])
        parts = sum((M - 1) * (sizes.parts[r] + sizes.proof) for r in mine)
        shards = sum(sizes.shard(r, M) for r in range(board.R) if r not in mine)
        assert sim.net.received[0][p] == parts + shards


def test_the_same_seed_gives_the_same_rounds_and_another_seed_other_links():
    cfg = SimConfig(peers=10, rule="ranges", rounds=2, churn_per_h=20.0, preset="tiny", stages=2, inner_steps=2)
    a, b = summarize(simulate(cfg)), summarize(simulate(cfg))
    assert a == b
    other = summarize(simulate(SimConfig(**{**cfg.__dict__, "seed": 1})))
    assert [r["round_s"] for r in other] != [r["round_s"] for r in a]


def test_ranges_keep_a_peer_near_three_payloads_where_all_to_all_needs_m_minus_one():
    """128 peers on the 1B model's stage 0 (R = 128): a peer owns ~2 of 128 ranges (primary + backup:
    parts of 2/128 of every member's payload, ~2 payloads) and fetches the other ranges' shards (~1):
    3 payloads and the parts' proofs, the shards' bitmaps and per-entry headers (a few % over 3)."""
    M = 128
    cfg = SimConfig(peers=M, rule="ranges", rounds=1, churn_per_h=0.0, preset="1B", stages=4)
    row = summarize(simulate(cfg))[0]
    down = row["down_mean"] / row["payload_bytes"]
    assert row["R"] == M and not row["lost"] and row["counted"] == M
    assert 2.9 <= down <= 3.1, down


def test_a_voted_round_moves_each_phase_once_by_the_swarms_owners():
    """Exact bytes: an owner fetches its ranges' votes and values from every other member; every peer
    fetches every other range's support and mean once (tiny: R = 16 ranges for 12 peers)."""
    M = 12
    sim = simulate(SimConfig(peers=M, rule="voted", rounds=1, **FAST))
    board = sim.boards[0]
    vt, v = board.voted, board.voted.sizes
    assert board.roster == tuple(sorted(sim.peers)) and v.n == board.R == 16
    for r in range(board.R):
        assert vt.support.owners[r] == ownership.owners(0, 0, r, vt.support.members, 2)
    for p in sim.peers:
        mine = vt.support.mine.get(p, [])
        parts = (M - 1) * sum(v.votes[r] + v.values[r] + 2 * v.proof for r in mine)
        shards = sum(v.supports[r] + v.means[r] + 2 * v.head for r in range(board.R) if r not in mine)
        assert sim.net.received[0][p] == parts + shards
    row = summarize(sim)[0]
    assert row["rule"] == "voted" and row["counted"] == M and not row["lost"] and row["R"] == 16


def test_voted_download_per_holder_is_a_constant_of_the_stage_not_of_m():
    """1B stage 0 at M = 16 and M = 128: the mean download stays under `voted_bound` (every range's
    support and mean, two owner shares of a vote and values), the bound moves < 1 % between the two
    (proofs' log2 R), and at M = 128 it is far below all-to-all's M − 1 payloads."""
    downs, bounds = {}, {}
    for M in (16, 128):
        cfg = SimConfig(peers=M, rule="voted", rounds=1, churn_per_h=0.0, preset="1B", stages=4)
        row = summarize(simulate(cfg))[0]
        downs[M], bounds[M] = row["down_mean"], voted_bound(cfg, M)
        assert row["counted"] == M and not row["lost"] and row["timeouts"] == 0
        assert downs[M] <= bounds[M], (M, downs[M], bounds[M])
        payload = row["payload_bytes"]
    assert abs(bounds[128] - bounds[16]) <= 0.01 * bounds[16]
    assert 0.9 * bounds[128] <= downs[128] and downs[128] < 12 * payload < (128 - 1) * payload


def test_a_voted_round_under_churn_counts_every_live_contribution():
    """Peers leave (and join) mid-round, owners among them: a dead owner's ranges are served by their
    backup, and every holder that commits counts every member that lived through the round; none lost."""
    cfg = SimConfig(peers=24, rule="voted", rounds=3, compute_s=20.0, **{**FAST, "churn_per_h": 10.0})
    sim = simulate(cfg)
    rows = summarize(sim)
    assert len(rows) == 3 and not any(r["lost"] for r in rows)
    owners_lost = 0
    for t, board in sim.boards.items():
        done = [r for r in sim.log if r.t == t and r.outcome == "voted"]
        assert done and len({r.counted for r in done}) == 1  # one committed set
        end = max(r.start_s + r.round_s for r in done)
        lived = [p for p in board.roster if sim.peers[p].records_until - cfg.record_ttl_s > end]
        assert len(lived) <= done[0].counted <= len(board.roster)
        gone = {p: sim.peers[p].records_until - cfg.record_ttl_s for p in board.voted.support.mine}
        owners_lost += sum(board.roster_at < at < end for at in gone.values())
    assert owners_lost > 0  # the churn did take owners mid-round

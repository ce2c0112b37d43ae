"""Overlapped outer steps (`train.overlap` 1) in a heterogeneous swarm, in one test process: real
hivemind DHT, real gRPC on 127.0.0.1.

A bootstrap, a 2-stage compressed pipeline (head + stage-1 peer) and a full replica train the tiny
model with every round in the background of the next outer step's inner steps
(peer.node.round.in_flight). Every holder of a stage commits the same bits each round, and the
inner steps of outer step t + 1 ran while round t was in flight (their step events come before
round t's record).
"""

from __future__ import annotations

import dataclasses

import pytest

from peer.node.trainer import run_full_replica, run_head, run_stage_peer
from tests.integration.swarm_helpers import OUTER, InProcessSwarm, events, rounds, swarm_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


def test_overlapped_swarm_commits_one_state_per_round_while_training_ahead(tmp_path, reap_children):
    base = swarm_config()
    cfg = dataclasses.replace(base, train=dataclasses.replace(base.train, overlap=1))
    with InProcessSwarm(cfg, tmp_path) as sw:
        sw.spawn("stage1", run_stage_peer, sw.opts("stage1"), 1, sw.stop)
        sw.spawn("full", run_full_replica, sw.opts("full"), sw.stop)
        sw.spawn("head", run_head, sw.opts("head"), sw.stop)
        sw.join(timeout_s=360)
    sw.assert_clean()

    head, full, stage1 = (rounds(tmp_path / n / "metrics.jsonl") for n in ("head", "full", "stage1"))
    assert sorted(head) == sorted(full) == sorted(stage1) == list(range(OUTER))
    for t in range(OUTER):
        assert head[t]["stages"]["0"]["participants"] == full[t]["stages"]["1"]["participants"] == 2
        assert head[t]["stages"]["0"]["param_hash"] == full[t]["stages"]["0"]["param_hash"]
        assert stage1[t]["stages"]["1"]["param_hash"] == full[t]["stages"]["1"]["param_hash"]
        perps = {head[t]["stages"]["0"]["perp_hash"], stage1[t]["stages"]["1"]["perp_hash"]}
        assert perps == {full[t]["stages"]["0"]["perp_hash"], full[t]["stages"]["1"]["perp_hash"]}
    for name, record in (("head", head), ("full", full)):
        # the round of t is recorded after the first inner step of t + 1 ran: the round overlapped it
        lines = [e for e in events(tmp_path / name / "metrics.jsonl", "step") if e["h"] == 0]
        first_step = {e["t"]: e["time"] for e in lines}
        overlapped = [t for t in range(OUTER - 1) if first_step[t + 1] < record[t]["time"]]
        assert overlapped, f"{name}: no round ran during the next outer step's inner steps"
    assert head[OUTER - 1]["train_loss"] < head[0]["train_loss"]

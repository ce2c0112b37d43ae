"""`peer join --resume` in a running swarm: real hivemind DHT, real gRPC on 127.0.0.1, in-process peers.

A bootstrap, a 2-stage compressed pipeline (head + stage-1 peer) and a full replica train the tiny
model. The stage-1 peer leaves right after checkpointing round 0 (before it can serve a whole inner
step of outer step 1: its stop event fires as that checkpoint appears) and comes back with `resume=True`
on the same data dir: it restores its checkpoint (outer step 1, the swarm's step, so the swarm's
state download does not overwrite it), the pipeline picks it up again, and from then on its
stage-1 parameters and T⊥ are bit-identical to the full replica's after every round.
"""

from __future__ import annotations

import threading

import pytest

from peer.node.checkpoints.stage import list_stage_checkpoints
from peer.node.trainer import run_full_replica, run_head, run_stage_peer
from tests.integration.swarm_helpers import OUTER, InProcessSwarm, events, rounds, swarm_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]


class _LeaveOnFirstCheckpoint(threading.Event):
    """A stop event that sets itself once a checkpoint exists under `root`.

    The stage peer checks its stop event right after a round's checkpoint and before it serves the
    next inner step, so it leaves at that boundary whatever the machine's load. Setting it from the
    test after polling the metrics let a fast head finish outer step 1 with the old incarnation
    first, and the swarm then committed round 1 without it.
    """

    def __init__(self, root):
        super().__init__()
        self.root = root

    def is_set(self) -> bool:
        if not super().is_set() and list_stage_checkpoints(self.root):
            self.set()
        return super().is_set()


def test_stage_peer_leaves_after_a_round_and_resumes_from_its_checkpoint(tmp_path, reap_children):
    stage_dir = tmp_path / "stage1"
    stop_first = _LeaveOnFirstCheckpoint(stage_dir / "checkpoints")
    with InProcessSwarm(swarm_config(), tmp_path) as sw:
        first = sw.spawn("stage1", run_stage_peer, sw.opts("stage1"), 1, stop_first)
        sw.spawn("full", run_full_replica, sw.opts("full"), sw.stop)
        sw.spawn("head", run_head, sw.opts("head"), sw.stop)
        first.join(timeout=240)  # it leaves right after checkpointing round 0
        assert not first.is_alive() and not sw.errors, sw.errors
        assert [p.name for p in list_stage_checkpoints(stage_dir / "checkpoints")] == ["step-000001"]
        sw.spawn("stage1-resumed", run_stage_peer, sw.opts("stage1", resume=True), 1, sw.stop)
        sw.join(timeout_s=360)
    sw.assert_clean()

    metrics = stage_dir / "metrics.jsonl"
    exits = [e["reason"] for e in events(metrics, "exit")]
    assert exits == ["stopped", "finished"]  # the first incarnation left, the resumed one finished
    resumes = events(metrics, "resume")
    assert len(resumes) == 1 and resumes[0]["t"] == 1
    assert resumes[0]["path"].endswith("step-000001")
    kept = events(metrics, "resume_kept")
    assert kept and kept[0]["t"] == 1 and kept[0]["swarm_t"] == 1
    assert not events(metrics, "sync"), "the swarm's state must not overwrite a resume at its outer step"

    # rounds of the stage peer: 0 before leaving, 1..OUTER-1 after resuming — none repeated, none missed
    round_ts = [r["t"] for r in events(metrics, "round")]
    assert round_ts == list(range(OUTER))
    full = rounds(tmp_path / "full" / "metrics.jsonl")
    head = rounds(tmp_path / "head" / "metrics.jsonl")
    assert sorted(full) == sorted(head) == list(range(OUTER))
    stage = rounds(metrics)
    for t in range(OUTER):
        assert stage[t]["stages"]["1"]["param_hash"] == full[t]["stages"]["1"]["param_hash"]
        assert stage[t]["stages"]["1"]["perp_hash"] == full[t]["stages"]["1"]["perp_hash"]
        assert head[t]["stages"]["0"]["param_hash"] == full[t]["stages"]["0"]["param_hash"]
    # its payload of round 0, written by the first incarnation, was kept by the resumed one (served again:
    # tests/integration/test_payload_disk.py), as was the full replica's it fetched for that round
    [run_folder] = (stage_dir / "payloads").iterdir()  # the run's own folder
    kept_files = sorted(p.name.split(".")[:3] for p in run_folder.iterdir())
    assert ["0", "1", "own"] in kept_files and any(f[:2] == ["0", "1"] and f[2] != "own" for f in kept_files)
    # both replicas contributed to stage 1 in every round: the leaving peer handed off round 0's payload
    assert all(full[t]["stages"]["1"]["participants"] == 2 for t in range(OUTER))

    # every role keeps its newest two checkpoints, the last one at the end of the run
    for name in ("stage1", "head", "full"):
        names = [p.name for p in list_stage_checkpoints(tmp_path / name / "checkpoints")]
        assert names == [f"step-{OUTER:06d}", f"step-{OUTER - 1:06d}"], (name, names)
    saves = events(tmp_path / "head" / "metrics.jsonl", "checkpoint")
    assert [s["t"] for s in saves] == list(range(1, OUTER + 1)) and all(s["bytes"] > 0 for s in saves)

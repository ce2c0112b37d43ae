"""`peer join --resume` in a running swarm: real hivemind DHT, real gRPC on 127.0.0.1, in-process peers.

A bootstrap, a 2-stage compressed pipeline (head + stage-1 peer) and a full replica train the tiny
model. The stage-1 peer leaves right after committing round 0 and comes back with `resume=True`
on the same data dir: it restores its checkpoint (outer step 1, the swarm's step, so the swarm's
state download does not overwrite it), the pipeline picks it up again, and from then on its
stage-1 parameters and T⊥ are bit-identical to the full replica's after every round.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

import pytest

from bootstrap.node import BootstrapNode
from peer.config import build_config
from peer.stage_checkpoint import list_stage_checkpoints
from peer.swarm import SwarmOptions
from peer.trainer import run_full_replica, run_head, run_stage_peer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

OUTER = 4


def _events(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == kind] if path.exists() else []


def _rounds(path: Path) -> dict[int, dict]:
    return {r["t"]: r for r in _events(path, "round")}


def test_stage_peer_leaves_after_a_round_and_resumes_from_its_checkpoint(tmp_path, reap_children):
    from tests.conftest import _children, leftover_children

    before = _children(os.getpid())
    cfg = build_config(overrides={
        "train.inner_steps": 3, "train.outer_steps": OUTER, "train.batch_size": 4, "train.microbatches": 2,
        "train.seq_len": 32, "data.max_chars": 200_000, "swarm.min_replicas": 2, "swarm.round_timeout_s": 90,
        "swarm.claim_timeout_s": 90, "swarm.announce_interval_s": 0.5,
    }, environ={})
    stop, stop_first = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    threads: list[threading.Thread] = []

    def spawn(name, fn, *args):
        def target():
            try:
                assert fn(*args) == 0
            except BaseException as exc:  # reported by the test, never swallowed
                errors.append(exc)
        th = threading.Thread(target=target, name=name, daemon=True)
        th.start()
        threads.append(th)
        return th

    stage_dir = tmp_path / "stage1"
    with BootstrapNode(cfg) as node:
        peers = tuple(node.info.initial_peers)

        def opts(name: str, resume: bool = False) -> SwarmOptions:
            return SwarmOptions(initial_peers=peers, data_dir=tmp_path / name, manifest_timeout_s=30, resume=resume)

        first = spawn("stage1", run_stage_peer, opts("stage1"), 1, stop_first)
        spawn("full", run_full_replica, opts("full"), stop)
        spawn("head", run_head, opts("head"), stop)
        deadline = time.monotonic() + 240
        while 0 not in _rounds(stage_dir / "metrics.jsonl") and time.monotonic() < deadline and not errors:
            time.sleep(0.05)
        stop_first.set()  # the stage peer leaves right after committing round 0
        first.join(timeout=60)
        assert not first.is_alive() and not errors, errors
        assert [p.name for p in list_stage_checkpoints(stage_dir / "checkpoints")] == ["step-000001"]
        spawn("stage1-resumed", run_stage_peer, opts("stage1", resume=True), 1, stop)
        for th in threads:
            th.join(timeout=360)
        stop.set()
    assert not errors, errors
    assert not [th.name for th in threads if th.is_alive()]

    metrics = stage_dir / "metrics.jsonl"
    exits = [e["reason"] for e in _events(metrics, "exit")]
    assert exits == ["stopped", "finished"]  # the first incarnation left, the resumed one finished
    resumes = _events(metrics, "resume")
    assert len(resumes) == 1 and resumes[0]["t"] == 1
    assert resumes[0]["path"].endswith("step-000001")
    kept = _events(metrics, "resume_kept")
    assert kept and kept[0]["t"] == 1 and kept[0]["swarm_t"] == 1
    assert not _events(metrics, "sync"), "the swarm's state must not overwrite a resume at its outer step"

    # rounds of the stage peer: 0 before leaving, 1..OUTER-1 after resuming — none repeated, none missed
    round_ts = [r["t"] for r in _events(metrics, "round")]
    assert round_ts == list(range(OUTER))
    full = _rounds(tmp_path / "full" / "metrics.jsonl")
    head = _rounds(tmp_path / "head" / "metrics.jsonl")
    assert sorted(full) == sorted(head) == list(range(OUTER))
    stage = _rounds(metrics)
    for t in range(OUTER):
        assert stage[t]["stages"]["1"]["param_hash"] == full[t]["stages"]["1"]["param_hash"]
        assert stage[t]["stages"]["1"]["perp_hash"] == full[t]["stages"]["1"]["perp_hash"]
        assert head[t]["stages"]["0"]["param_hash"] == full[t]["stages"]["0"]["param_hash"]
    # the pipeline kept both replicas contributing to stage 1 after the resume
    assert all(full[t]["stages"]["1"]["participants"] == 2 for t in range(1, OUTER))

    # every role keeps its newest two checkpoints, the last one at the end of the run
    for name in ("stage1", "head", "full"):
        names = [p.name for p in list_stage_checkpoints(tmp_path / name / "checkpoints")]
        assert names == [f"step-{OUTER:06d}", f"step-{OUTER - 1:06d}"], (name, names)
    saves = _events(tmp_path / "head" / "metrics.jsonl", "checkpoint")
    assert [s["t"] for s in saves] == list(range(1, OUTER + 1)) and all(s["bytes"] > 0 for s in saves)

    deadline = time.monotonic() + 10
    while leftover_children(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftover_children(before) == set(), "DHT daemons left running after every peer closed"

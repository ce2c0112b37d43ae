"""A heterogeneous swarm in one test process: real hivemind DHT, real gRPC on 127.0.0.1.

A bootstrap, a 2-stage compressed pipeline (head + stage-1 peer) and a full replica train the
tiny model for 4 outer rounds; a second stage-1 peer joins late. Every role runs the same code as
`peer join` (peer.trainer), each in its own thread with its own DHT node and gRPC server.
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
from peer.swarm import SwarmOptions
from peer.trainer import run_full_replica, run_head, run_stage_peer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

OUTER = 4


def _rounds(path: Path) -> dict[int, dict]:
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec["event"] == "round":
            out[rec["t"]] = rec
    return out


def _events(path: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["event"] == kind] if path.exists() else []


@pytest.fixture
def swarm_run(tmp_path, reap_children):
    from tests.conftest import _children, leftover_children

    before = _children(os.getpid())
    cfg = build_config(overrides={
        "train.inner_steps": 3, "train.outer_steps": OUTER, "train.batch_size": 4, "train.microbatches": 2,
        "train.seq_len": 32, "data.max_chars": 200_000, "swarm.min_replicas": 2, "swarm.round_timeout_s": 90,
        "swarm.claim_timeout_s": 90, "swarm.announce_interval_s": 0.5,
    })
    stop = threading.Event()
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

    with BootstrapNode(cfg) as node:
        peers = tuple(node.info.initial_peers)

        def opts(name: str) -> SwarmOptions:
            return SwarmOptions(initial_peers=peers, data_dir=tmp_path / name, manifest_timeout_s=30)

        spawn("stage1", run_stage_peer, opts("stage1"), 1, stop)
        spawn("full", run_full_replica, opts("full"), stop)
        spawn("head", run_head, opts("head"), stop)
        # the late joiner arrives once round 0 has been committed
        deadline = time.monotonic() + 240
        while not _rounds(tmp_path / "head" / "metrics.jsonl") and time.monotonic() < deadline and not errors:
            time.sleep(0.2)
        spawn("late", run_stage_peer, opts("late"), 1, stop)
        for th in threads:
            th.join(timeout=360)
        stop.set()
    assert not errors, errors
    assert not [th.name for th in threads if th.is_alive()]
    deadline = time.monotonic() + 10
    while leftover_children(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert leftover_children(before) == set(), "DHT daemons left running after every peer closed"
    return tmp_path


def test_heterogeneous_swarm_trains_in_sync_and_a_late_joiner_catches_up(swarm_run):
    head = _rounds(swarm_run / "head" / "metrics.jsonl")
    full = _rounds(swarm_run / "full" / "metrics.jsonl")
    stage1 = _rounds(swarm_run / "stage1" / "metrics.jsonl")
    late = _rounds(swarm_run / "late" / "metrics.jsonl")
    assert sorted(head) == sorted(full) == sorted(stage1) == list(range(OUTER))

    # loss falls for both kinds of replica
    for rounds in (head, full):
        assert rounds[OUTER - 1]["train_loss"] < rounds[0]["train_loss"]
        assert rounds[OUTER - 1]["val_loss"] < rounds[0]["val_loss"]

    for t in range(OUTER):
        # both replicas contributed to both stages' rounds
        assert head[t]["stages"]["0"]["participants"] == 2
        assert full[t]["stages"]["0"]["participants"] == full[t]["stages"]["1"]["participants"] == 2
        # bit-identical parameters per stage across the pipeline and the full replica
        assert head[t]["stages"]["0"]["param_hash"] == full[t]["stages"]["0"]["param_hash"]
        assert stage1[t]["stages"]["1"]["param_hash"] == full[t]["stages"]["1"]["param_hash"]
        # the same T⊥ on every stage of every replica
        perps = {head[t]["stages"]["0"]["perp_hash"], stage1[t]["stages"]["1"]["perp_hash"],
                 full[t]["stages"]["0"]["perp_hash"], full[t]["stages"]["1"]["perp_hash"]}
        assert len(perps) == 1

    # the late joiner downloaded state tagged with an outer step > 0 and then stays bit-identical
    syncs = _events(swarm_run / "late" / "metrics.jsonl", "sync")
    assert syncs and syncs[0]["t"] >= 1
    assert late, "the late joiner committed no round"
    for t, rec in late.items():
        assert rec["stages"]["1"]["param_hash"] == full[t]["stages"]["1"]["param_hash"]
        assert rec["stages"]["1"]["perp_hash"] == full[t]["stages"]["1"]["perp_hash"]

    # subspace compression on the wire: fewer activation bytes than the uncompressed equivalent
    b = head[OUTER - 1]["bytes"]
    assert 0 < b["activations"] < b["activations_uncompressed_equiv"] / 5
    assert b["pseudo_gradients"] > 0

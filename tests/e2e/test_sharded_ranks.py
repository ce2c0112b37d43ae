"""Sharded full replicas (`torchrun … peer join --full-replica --sharded`, FSDP2 over two and four gloo
ranks) beside a compressed pipeline, as real processes.

Every round and stage the pipeline's holders and the 2-rank sharded replica commit one state; rank 1
adopts each committed state (rank 0 scatters it into the shards) and holds half of the replica's
parameters and AdamW state; the replica's record says 2 ranks and a global batch of 2 × b; rank 1 trains
on its own batches. SIGTERM to torchrun stops every process of the replica (DHT and p2pd included). A
4-rank sharded replica then joins the running pipeline and commits its states (its record: 4 ranks, 4 × b);
`kill -9` of one of its ranks stops every process of it, and the pipeline goes on committing.
"""

from __future__ import annotations

import signal
import time

import psutil
import pytest

from tests.e2e.test_replica_ranks import _alive, _kill_rank_and_check, _rank_events, _torchrun

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(480)]  # a 4-rank replica joins a running swarm on 2 cores


def test_two_and_four_rank_sharded_replicas_commit_the_pipelines_states(swarm_factory):
    sw = swarm_factory(outer_steps=1000)
    sw.join("s1", "--stage", "1")
    sw.wait_for(lambda: sw.events("s1", "start"))
    _torchrun(sw, "full", "--sharded")
    sw.join("head", "--stage", "0")
    sw.wait_for(lambda: len(sw.rounds("full")) >= 3 and len(sw.rounds("head")) >= 3, timeout_s=150)
    holders = ("head", "s1", "full")
    common = set.intersection(*(set(sw.rounds(h)) for h in holders))
    assert len(common) >= 2, {h: sorted(sw.rounds(h)) for h in holders}
    states: dict[tuple[int, str], set[str]] = {}
    for h in holders:
        for t, rec in sw.rounds(h).items():
            for s, st in rec["stages"].items():
                if t in common:
                    states.setdefault((t, s), set()).add(st["param_hash"])
    assert all(len(v) == 1 for v in states.values()), f"holders disagree: {states}"
    full = sw.rounds("full")
    assert all(r["stages"]["0"]["participants"] == 2 for t, r in full.items() if t in common), full
    # rank 1 adopted every committed state rank 0 scattered, and holds about half of the replica
    adopted = {e["outer_step"]: e for e in _rank_events(sw, "full", 1, "replica_state")}
    for t, rec in full.items():
        if t + 1 in adopted:
            assert {s: st["param_hash"] for s, st in rec["stages"].items()} == {
                s: st["param_hash"] for s, st in adopted[t + 1]["stages"].items()
            }
    assert len([t for t in full if t + 1 in adopted]) >= 2, (sorted(full), sorted(adopted))
    held = adopted[max(adopted)]["held"]
    params = held["params"] // 4  # float32
    assert held["optimizer"] == 2 * held["params"], held
    stages = [e["stages"] for e in sw.events("full", "replica_hash")]
    assert stages and params > 0
    # rank 1 trains on its own batches; the record says 2 ranks, a global batch of 2 x 8
    losses0 = [e["loss"] for e in sw.events("full", "step")][:4]
    losses1 = [e["loss"] for e in _rank_events(sw, "full", 1, "step")][:4]
    assert len(losses1) == len(losses0) == 4 and losses0 != losses1
    full = sw.status()["full_replicas"]
    assert [(r["ranks"], r["global_batch"]) for r in full] == [(2, 16)], full
    # SIGTERM to torchrun's agent: it passes it on; every process of the replica leaves
    agent = psutil.Process(sw.procs["full"].pid)
    tree = [agent, *agent.children(recursive=True)]
    agent.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + 60
    while any(_alive(p) for p in tree) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in tree if _alive(p)], sw.log("full")
    # a 4-rank sharded replica joins the running pipeline and commits the pipeline's states
    _torchrun(sw, "full4", "--sharded", ranks=4)
    sw.wait_for(lambda: len(sw.rounds("full4")) >= 2, timeout_s=180)
    four = sw.rounds("full4")
    sw.wait_for(lambda: max(four) in sw.rounds("head") and max(four) in sw.rounds("s1"), timeout_s=60)
    pipeline = {t: {"0": sw.rounds("head")[t]["stages"]["0"], "1": sw.rounds("s1")[t]["stages"]["1"]} for t in four}
    differ = {
        (t, s): (st["param_hash"], pipeline[t][s]["param_hash"])
        for t, rec in four.items()
        for s, st in rec["stages"].items()
        if st["param_hash"] != pipeline[t][s]["param_hash"]
    }
    assert not differ, f"the 4-rank replica and the pipeline's holders committed other states: {differ}"
    assert (4, 32) in [(r["ranks"], r["global_batch"]) for r in sw.status()["full_replicas"]]
    # kill -9 of a rank of a sharded replica: torchrun's agent and every process of the replica exit
    _kill_rank_and_check(sw, "full4", 3)

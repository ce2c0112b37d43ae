"""Churn with real processes: kill -9, SIGSTOP/SIGCONT and SIGTERM of peers mid-training.

A bootstrap, a head, two stage-1 peers (one claimed, one hot spare) and a full replica run with
short deadlines. Faults are injected with `Fault`: it waits for a named peer to reach an outer
step, then signals it. The swarm must keep training, reroute the pipeline to the spare, close
rounds on their deadlines, re-sync peers that come back, and every survivor must end bit-identical.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from tests.e2e.cli_swarm import DEADLINES

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(420)]


def test_stage_peer_kill_stall_and_return(swarm_factory):
    T = 30  # long enough for a restart and a stall to happen mid-run
    sw = swarm_factory(outer_steps=T)
    sw.join("s1a", "--stage", "1")
    sw.join("s1b", "--stage", "1")
    sw.wait_for(lambda: sw.events("s1a", "start") and sw.events("s1b", "start"))
    sw.join("full", "--full-replica")
    sw.join("head", "--stage", "0")

    # 1. kill -9 the claimed stage-1 peer in the middle of outer step 1
    sw.wait_for(lambda: any(e["t"] == 1 and e["h"] == 1 for e in sw.events("head", "step")))
    victim = sw.claimed_stage_peer(["s1a", "s1b"], 1)
    spare = "s1b" if victim == "s1a" else "s1a"
    killed_at = time.time()
    os.killpg(sw.procs[victim].pid, signal.SIGKILL)
    n_steps = len(sw.events("head", "step"))
    sw.wait_for(lambda: len(sw.events("head", "step")) > n_steps)
    recovered_s = sw.events("head", "step")[n_steps]["time"] - killed_at
    print(f"\nkill -9 {victim}: the head stepped again after {recovered_s:.1f}s (rerouted to {spare})")

    # 2. the killed peer comes back (same data dir): it re-syncs and becomes the spare
    sw.join(victim + "-back", "--stage", "1")
    sw.wait_for(lambda: sw.events(victim + "-back", "sync"))

    # 3. SIGSTOP the peer now in use; the head treats it as dead and reroutes; SIGCONT: it re-syncs
    t_now = max(sw.rounds("head"), default=0)
    sw.wait_for(lambda: any(e["t"] == t_now + 1 and e["h"] == 1 for e in sw.events("head", "step")))
    stalled = sw.claimed_stage_peer([spare, victim + "-back"], t_now + 1)
    os.kill(sw.procs[stalled].pid, signal.SIGSTOP)
    n_steps = len(sw.events("head", "step"))
    stopped_at = time.time()
    sw.wait_for(lambda: len(sw.events("head", "step")) > n_steps)
    resumed_after_s = sw.events("head", "step")[n_steps]["time"] - stopped_at
    print(f"SIGSTOP {stalled}: the head stepped again after {resumed_after_s:.1f}s")
    sw.wait_for(lambda: max(sw.rounds("full"), default=0) >= t_now + 3, timeout_s=240)
    os.kill(sw.procs[stalled].pid, signal.SIGCONT)

    for name in dict.fromkeys(("head", "full", spare, victim + "-back", stalled)):
        rc = sw.wait_exit(name)
        assert rc == 0, f"{name} exited {rc}\n{sw.log(name)}"

    # the stalled peer came back behind and either re-synced or applied every round it missed while its
    # payloads were still held (which of the two depends on how long the freeze lasted), each to the
    # swarm's state, instead of poisoning a round
    full, head, mine = sw.settled("full"), sw.settled("head"), sw.settled(stalled)
    synced = [e for e in sw.events(stalled, "sync") if e["t"] > t_now + 1]
    assert synced or set(range(t_now + 1, T)) <= set(mine), sw.log(stalled)
    for t in sorted(set(mine) & set(full)):
        if t > t_now:
            assert mine[t]["stages"]["1"]["param_hash"] == full[t]["stages"]["1"]["param_hash"], (t, sw.log(stalled))
    # every survivor that committed the last round holds the same parameters
    assert sorted(full) == list(range(T)) and T - 1 in head
    for t in head:
        assert head[t]["stages"]["0"]["param_hash"] == full[t]["stages"]["0"]["param_hash"], t
    for name in {spare, victim + "-back", stalled}:
        last = sw.settled(name)
        assert T - 1 in last, f"{name} did not reach the last round\n{sw.log(name)}"
        assert last[T - 1]["stages"]["1"]["param_hash"] == full[T - 1]["stages"]["1"]["param_hash"], name
    assert full[T - 1]["train_loss"] < full[0]["train_loss"]


def test_full_replica_and_head_kills_rejoin_and_graceful_leave(swarm_factory):
    T = 50  # long enough for a kill, a rejoin and a graceful leave mid-run (overlapped rounds run fast)
    # head2 joins by replay from the initial state (docs/protocol.md, "Joining by replay"), about 20
    # rounds in: the holders keep the whole run's history, so it replays from there, not from the attester
    # every round in the background of the next outer step (`train.overlap` 1; the first test: synchronous)
    overlapped = {**DEADLINES, "PEER_SWARM__HISTORY_ROUNDS": str(T), "PEER_TRAIN__OVERLAP": "1"}
    sw = swarm_factory(outer_steps=T, min_replicas=3, deadlines=overlapped)
    sw.join("s1", "--stage", "1")
    sw.wait_for(lambda: sw.events("s1", "start"))
    sw.join("full-a", "--full-replica")
    sw.join("full-b", "--full-replica")
    sw.join("head", "--stage", "0")

    # kill -9 one full replica: the rest close rounds without it (its record expires)
    sw.wait_for(lambda: 1 in sw.rounds("full-a"))
    os.killpg(sw.procs["full-a"].pid, signal.SIGKILL)
    killed_at = time.time()
    sw.wait_for(lambda: max(sw.rounds("head"), default=-1) >= 2)
    print(f"\nkill -9 full-a: round 2 committed {sw.rounds('head')[2]['time'] - killed_at:.1f}s later")

    # kill -9 the head: the full replica trains on, the stage peer frees its claim and stays in sync
    os.killpg(sw.procs["head"].pid, signal.SIGKILL)
    t_kill = max(sw.rounds("full-b"))
    sw.wait_for(lambda: max(sw.rounds("full-b")) >= t_kill + 2)
    sw.wait_for(lambda: max(sw.rounds("s1"), default=-1) >= t_kill + 2)  # as a hot spare

    # a new head joins: it replays stage 0 over the rounds the full replica kept and claims the spare
    sw.join("head2", "--stage", "0")
    sw.wait_for(lambda: sw.events("head2", "sync") and sw.events("head2", "round"))
    # and the full replica committed a round the new head committed too (its first round waits for
    # the new head's payload: a SIGTERM right after the head's commit could land before the full
    # replica's own commit of that round)
    sw.wait_for(lambda: set(sw.rounds("head2")) & set(sw.rounds("full-b")) & set(sw.rounds("s1")))

    # graceful leave: SIGTERM the full replica → exit 0 quickly, no kill needed
    sigterm_at = time.monotonic()
    sw.procs["full-b"].send_signal(signal.SIGTERM)
    assert sw.wait_exit("full-b", timeout_s=30) == 0, sw.log("full-b")
    print(f"SIGTERM full-b: exited 0 after {time.monotonic() - sigterm_at:.1f}s")
    assert sw.events("full-b", "exit")[-1]["reason"] == "stopped"

    # the new pipeline alone finishes the run, in sync
    assert sw.wait_exit("head2") == 0, sw.log("head2")
    assert sw.wait_exit("s1") == 0, sw.log("s1")
    head2, s1, full_b = sw.rounds("head2"), sw.rounds("s1"), sw.rounds("full-b")
    assert T - 1 in s1 and T - 1 in head2
    # the stage peer lost its head mid-round: it either applied the rounds as a spare or re-synced
    missed = set(range(T)) - set(s1)
    synced = [e["t"] for e in sw.events("s1", "sync")]
    unrepaired = [t for t in sorted(missed) if not any(ts > t for ts in synced)]
    assert unrepaired == [], f"s1 neither applied nor re-synced past rounds {unrepaired}: {sw.log('s1')}"
    assert head2[T - 1]["stages"]["0"]["participants"] == 1
    assert s1[T - 1]["stages"]["1"]["perp_hash"] == head2[T - 1]["stages"]["0"]["perp_hash"]
    # the new head applied the round it joined in as an observer, then contributed from the next one
    assert sw.events("head2", "catch_up"), sw.log("head2")  # it synced (waited for above), then caught up
    # while the full replica was there, its last round agrees with the pipeline's (faults in
    # between are repaired by the hash-majority re-sync, not required to be absent)
    t_last = max(set(head2) & set(full_b) & set(s1))
    assert head2[t_last]["stages"]["0"]["param_hash"] == full_b[t_last]["stages"]["0"]["param_hash"]
    ours, theirs = s1[t_last]["stages"]["1"], full_b[t_last]["stages"]["1"]
    if ours["param_hash"] != theirs["param_hash"]:
        # full-b closed its last round without the new head's payload, which s1 held (its own, as the
        # head's stage peer): s1 never takes a set that leaves out a payload it validated; the larger set
        # wins RECONCILE, which full-b, leaving, did not run any more (docs/protocol.md, FOLLOW)
        assert t_last == max(full_b) and set(theirs["committed"]) < set(ours["committed"]), (ours, theirs)

"""A full replica over two torchrun processes (gloo, CPU) beside a compressed pipeline, as real processes.

One swarm, one test (it is the slowest part of the suite):
- Every round and stage: the pipeline's holders and the two-rank replica commit the same state; rank 1
  holds rank 0's live parameters after each outer step's inner steps and adopts each committed state
  bit for bit; the replica's record says 2 ranks and a global batch of 2 × b.
- `kill -9` of one rank: the other rank and torchrun's agent exit, no process of the replica is left
  (its DHT process and p2pd included), and the pipeline goes on committing rounds.
"""

from __future__ import annotations

import json
import signal
import time

import psutil
import pytest

from tests.e2e.cli_swarm import LOOPBACK

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

GONE_WITHIN_S = 15.0


def _torchrun(sw, name: str, *flags: str, ranks: int = 2) -> None:
    args = ["--nproc-per-node", str(ranks), "--standalone", "--max-restarts", "0"]
    args += ["-m", "peer", "join", "--full-replica"]
    args += ["--host", LOOPBACK, "--initial-peers", sw.maddr, "--data-dir", str(sw.tmp / name), *flags]
    sw.start(name, args, module="torch.distributed.run")  # cwd: the repository, so the workers import this peer


def _ranks(sw, name: str) -> dict[int, psutil.Process]:
    """{rank: process} of a torchrun replica (its workers carry RANK in their environment)."""
    out = {}
    for p in psutil.Process(sw.procs[name].pid).children():  # not the DHT process a rank forked
        try:
            if "peer" in p.cmdline() and "join" in p.cmdline():
                out[int(p.environ().get("RANK", "-1"))] = p
        except psutil.Error:
            continue
    return out


def _rank_events(sw, name: str, rank: int, kind: str) -> list[dict]:
    path = sw.tmp / name / f"metrics-rank{rank}.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in map(json.loads, filter(None, lines)) if e["event"] == kind]


def _check_lockstep(sw, name: str, holders: tuple[str, ...], rounds: int) -> None:
    """Every round and stage committed by all of `holders` has one state; rank 1 of the replica `name`
    held rank 0's live parameters after each outer step's inner steps and adopted each committed state."""
    states: dict[tuple[int, str], set[str]] = {}
    done = [set(sw.rounds(h)) for h in holders]
    common = set.intersection(*done)
    assert len(common) >= rounds, done
    for h in holders:
        for t, rec in sw.rounds(h).items():
            if t in common:
                for s, st in rec["stages"].items():
                    states.setdefault((t, s), set()).add(st["param_hash"])
    assert all(len(v) == 1 for v in states.values()), f"holders disagree: {states}"
    full = {t: r for t, r in sw.rounds(name).items() if t in common}
    assert all(r["stages"]["0"]["participants"] == 2 for r in full.values()), full
    # rank 1 trained in lockstep with rank 0 (same live parameters after every outer step's inner steps) ...
    lead = {e["t"]: e["stages"] for e in sw.events(name, "replica_hash")}
    follower = {e["t"]: e["stages"] for e in _rank_events(sw, name, 1, "replica_hash")}
    both = set(lead) & set(follower)
    assert len(both) >= rounds and all(lead[t] == follower[t] for t in both), (lead, follower)
    # ... and adopted every committed state bit for bit
    adopted = {e["outer_step"]: e["stages"] for e in _rank_events(sw, name, 1, "replica_state")}
    for t, rec in full.items():
        if t + 1 in adopted:
            got = adopted[t + 1]
            for s, st in rec["stages"].items():
                assert got[s]["param_hash"] == st["param_hash"] and got[s]["live_hash"] == got[s]["param_hash"]
    assert len([t for t in full if t + 1 in adopted]) >= rounds - 1, (sorted(full), sorted(adopted))
    # two different batches per step: rank 1's losses are its own
    losses0 = [e["loss"] for e in sw.events(name, "step")][:4]
    losses1 = [e["loss"] for e in _rank_events(sw, name, 1, "step")][:4]
    assert len(losses1) == len(losses0) == 4 and losses0 != losses1


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _kill_rank_and_check(sw, name: str, rank: int) -> None:
    """kill -9 one rank: torchrun's agent exits, no process of its tree is left, the pipeline goes on."""
    agent = psutil.Process(sw.procs[name].pid)
    tree = [agent, *agent.children(recursive=True)]
    cmds = [" ".join(p.cmdline()) for p in tree if _alive(p)]
    assert any("p2pd" in c for c in cmds) and any("peer.net.watchdog" in c for c in cmds), cmds
    head_rounds = len(sw.rounds("head"))
    _ranks(sw, name)[rank].send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    assert sw.procs[name].wait(timeout=GONE_WITHIN_S) != 0, sw.log(name)
    while any(_alive(p) for p in tree) and time.monotonic() - t0 < GONE_WITHIN_S:
        time.sleep(0.1)
    left = [" ".join(p.cmdline()) for p in tree if _alive(p)]
    assert not left, f"kill -9 of rank {rank} left {left}\n{sw.log(name)}"
    print(f"\nkill -9 of rank {rank}: every process of the replica gone in {time.monotonic() - t0:.2f} s")
    sw.wait_for(lambda: len(sw.rounds("head")) >= head_rounds + 1, timeout_s=90)


def test_a_two_rank_replica_agrees_with_the_swarm_and_kill_9_of_a_rank_leaves_no_process(swarm_factory):
    sw = swarm_factory(outer_steps=1000)
    sw.join("s1", "--stage", "1")
    sw.wait_for(lambda: sw.events("s1", "start"))
    _torchrun(sw, "full")
    sw.join("head", "--stage", "0")
    sw.wait_for(lambda: len(sw.rounds("full")) >= 3 and len(sw.rounds("head")) >= 3, timeout_s=150)
    _check_lockstep(sw, "full", ("head", "s1", "full"), rounds=2)
    # the replica's record: 2 ranks, a global batch of 2 x 8
    full = sw.status()["full_replicas"]
    assert [(r["ranks"], r["global_batch"]) for r in full] == [(2, 16)], full
    _kill_rank_and_check(sw, "full", 1)
    assert "a rank of this replica is gone" in sw.log("full") or "stopped" in sw.log("full"), sw.log("full")
    _torchrun(sw, "full2", "--precision", "bf16")
    sw.wait_for(lambda: sw.rounds("full2"), timeout_s=120)
    # rank 1 computes in rank 0's precision, not its own default (fp32 on a CPU)
    assert [e["precision"] for e in _rank_events(sw, "full2", 1, "start")] == ["bf16"]
    _kill_rank_and_check(sw, "full2", 0)

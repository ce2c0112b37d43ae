"""Random churn on a real loopback swarm (`peer bench chaos`, issue 8): 9 faults in a few minutes.

kill -9 + restart (--resume or fresh), SIGTERM + restart, SIGSTOP/SIGCONT of heads, stage peers and
the full replica, plus one bootstrap kill; short deadlines so the run fits a CI job on 2 cores.
The swarm must recover from every fault, never stall, never keep two states of one (t, s), never
commit alone, leave within seconds when the whole swarm gets SIGTERM at once, leave no process
behind and log no traceback.
"""

from __future__ import annotations

import pytest

from peer.research.bench.chaos import KINDS, ChaosConfig, run_chaos
from peer.research.bench.chaos_report import fault_line

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]


FAULTS = 9  # `peer bench chaos` defaults to 20; seed 62's 9 draw every kind, kill every role (the full replica
# fresh), stop the head past two round deadlines twice and SIGTERM it and a stage peer: the fewest faults that do
# all of that (no seed of 8 does, none of 200 tried), so the suite's time goes to where the risk is
SEED = 62


def test_random_faults_of_every_kind_leave_a_live_agreeing_swarm_and_nothing_behind(tmp_path):
    cfg = ChaosConfig(
        faults=FAULTS,
        seed=SEED,
        workdir=tmp_path / "chaos",
        inner_steps=3,
        round_timeout_s=8.0,
        pause_s=(0.2, 0.8),
        stop_s=(0.6, 2.0),
        long_stop_rounds=(2.05, 2.2),
        recovery_cap_s=90.0,  # `peer bench chaos`'s cap: a fresh full replica under CI load took 64 s (18 s to start)
        overlap=1,  # every round in the background of the next outer step (the synchronous schedule: test_churn)
        leave_s=15.0,  # five processes leaving at once on 2 slow cores: up to 13.3 s (ci42; `peer bench chaos`: 10 s)
    )
    result = run_chaos(cfg)
    s = result.summary
    report = "\n".join(f"{k}: {v}" for k, v in s.items())
    report += "".join(f"\ncrash of {f['target']}: {f.get('why')}" for f in result.faults if f["kind"] == "crash")
    t0 = min((float(f["time"]) for f in result.faults), default=0.0)  # the report's times: from the first fault
    report += "".join(f"\nat {float(f['time']) - t0:.1f}s {fault_line(f)}" for f in result.faults)
    assert s["faults"] == FAULTS and sum(s["faults_by_kind"].values()) >= FAULTS, report
    assert s["faults_by_kind"].get("bootstrap_kill") == 1, report
    assert set(s["faults_by_kind"]) == {*KINDS, "long_stop", "bootstrap_kill"}, report  # every kind was drawn
    assert s["not_recovered"] == 0, report
    assert s["stalls"] == 0, report
    assert s["hash_disagreements_unresolved"] == 0, report
    assert s["hash_disagreement_longest_run"] <= 2, report  # resolved within one round of being seen
    # a holder whose round's other payload sits in a frozen process closes alone at the deadline by design
    # (a set of one payload logs the records it was decided on: `views.log_short_close`)
    assert s["lone_commits_outside_freezes"] == 0, report
    assert s["refusals"] == 0, report  # every holder is honest here: a refusal is a false one
    assert s["orphans"] == 0, report
    assert s["slow_leaves"] == [], report  # every peer left within leave_s of the swarm-wide SIGTERM
    assert s["tracebacks"] == 0, report

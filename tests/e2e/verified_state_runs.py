"""The measurement behind docs/results.md "One state on mixed hardware, and forged states".

    python -m tests.e2e.verified_state_runs RUN [ROUNDS]     # from the repository root

RUN is one of `RUNS`: the swarm of tests/e2e/test_verified_state.py (a head and a stage-1 peer
beside a full replica, `tiny`, 2 stages, H = 4) on the kernel sets and with the forger it names,
for ROUNDS rounds (default 24). Prints one JSON line: rounds seen, (round, stage) pairs whose
holders hold more than one state, re-syncs, switches and refusals per peer, the head's validation
loss per round and the full replica's per-round states. The same harness as the tests, so a run
here is a longer run of what CI asserts.
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
from pathlib import Path

from tests.e2e.cli_swarm import Swarm

OTHER = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "NUMBA_CPU_NAME": "generic"}
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
RUNS = {  # run: (pipeline's kernels, full replica's kernels, a stage-1 spare's kernels or None, forger's FAKE_REPLICAS)
    "mixed": ({}, OTHER, None, None),
    "mixed-avx2-2t": (AVX2, {"OMP_NUM_THREADS": "2"}, OTHER, None),
    "forge-pad": ({}, OTHER, None, "8"),
    "forge-params": ({}, OTHER, None, "0"),
}


def run(name: str, rounds: int) -> dict:
    pipe_env, full_env, spare_env, fake = RUNS[name]
    sw = Swarm(Path(tempfile.mkdtemp(prefix=f"verified-state-{name}-")), outer_steps=rounds)
    names = ["head", "s1", "full"]
    try:
        sw.join("s1", "--stage", "1", extra_env=pipe_env)
        sw.wait_for(lambda: sw.events("s1", "start"))
        if spare_env is not None:
            sw.join("s1b", "--stage", "1", extra_env=spare_env)
            sw.wait_for(lambda: sw.events("s1b", "start"))
            names.append("s1b")
        sw.join("full", "--full-replica", extra_env=full_env)
        sw.join("head", "--stage", "0", extra_env=pipe_env)
        forger = None
        if fake is not None:
            sw.wait_for(lambda: sw.events("head", "step"))
            sw.join("forger", "--stage", "1", module="tests.e2e.forger", extra_env={"FORGER_FAKE_REPLICAS": fake})
            sw.wait_for(lambda: sw.events("forger", "start"))
            forger = sw.events("forger", "start")[0]["peer_id"]
        for n in ("head", "s1", "full"):
            rc = sw.wait_exit(n, timeout_s=900)
            if rc != 0:
                raise SystemExit(f"{n} exited {rc}\n{sw.log(n)}")
        if forger is not None:
            sw.procs["forger"].send_signal(signal.SIGTERM)
        states: dict[tuple[int, str], set] = {}
        for n in names:
            for t, rec in sw.rounds(n).items():
                for s, st in rec["stages"].items():
                    states.setdefault((t, s), set()).add((st["param_hash"], st["perp_hash"]))
        head, full = sw.rounds("head"), sw.rounds("full")
        return {
            "run": name,
            "rounds": rounds,
            "rounds_seen": len({t for t, _ in states}),
            "split": sum(1 for v in states.values() if len(v) != 1),
            "syncs": {n: len(sw.events(n, "sync")) for n in names},
            "switches": {n: len(sw.events(n, "switch")) for n in names},
            "refused": {n: [(e["peer"][:12], e.get("t"), e["reason"]) for e in sw.events(n, "refused")] for n in names},
            "forger": forger,
            "val_loss": [head[t]["val_loss"] for t in sorted(head)],
            "states": {
                t: [full[t]["stages"][s]["param_hash"] for s in sorted(full[t]["stages"])] for t in sorted(full)
            },
        }
    finally:
        sw.close()


if __name__ == "__main__":
    print(json.dumps(run(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 24)))

"""The measurement behind docs/results.md "One state on mixed hardware, and forged states".

    python -m tests.e2e.verified_state_runs RUN [ROUNDS]     # from the repository root

RUN is one of `RUNS` or `ATTACKS`: the swarm of tests/e2e/test_verified_state.py (a head and a stage-1 peer
beside a full replica, `tiny`, 2 stages, H = 4) on the kernel sets and with the forger it names,
for ROUNDS rounds (default 24). Prints one JSON line: rounds seen, (round, stage) pairs whose
holders hold more than one state, re-syncs, switches and refusals per peer, the head's validation
loss per round and the full replica's per-round states. The same harness as the tests, so a run
here is a longer run of what CI asserts.

`ATTACKS` are the swarms of tests/e2e/test_dishonest_claims.py (issue 34: the stage-1 attackers of
tests/e2e/attackers.py up before round 0 beside the same head, s1 and full replica; `colluders` adds
a stage-1 peer joining after round 2). Their JSON line adds the attacks made, the refusals of each
attacker by each honest holder, the rounds an honest holder committed fewer than both payloads, the
rounds whose honest holders' T⊥ differ between stages, the rounds any honest holder held a negated
(colluders') state, and the head's seconds per round; `honest-spares` is the baseline (the same
spares, no attack).
"""

from __future__ import annotations

import json
import signal
import sys
import tempfile
from pathlib import Path

from tests.e2e.cli_swarm import Swarm, join_with_attackers

OTHER = {"ATEN_CPU_CAPABILITY": "default", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2", "NUMBA_CPU_NAME": "generic"}
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
RUNS = {  # run: (pipeline's kernels, full replica's kernels, a stage-1 spare's kernels or None, forger's FAKE_REPLICAS)
    "mixed": ({}, OTHER, None, None),
    "mixed-avx2-2t": (AVX2, {"OMP_NUM_THREADS": "2"}, OTHER, None),
    "forge-pad": ({}, OTHER, None, "8"),
    "forge-params": ({}, OTHER, None, "0"),
}

ATTACKS = {  # run: (the attackers' env, their names, a stage-1 peer joining after round 2)
    "honest-spares": ({"ATTACK": "none"}, ("spare",), False),
    "censor": ({"ATTACK": "censor", "ATTACK_TARGET": "last"}, ("censor",), False),
    "censor-full-late": ({"ATTACK": "censor", "ATTACK_TARGET": "full", "ATTACK_DELAY_S": "1"}, ("censor",), False),
    "replay": ({"ATTACK": "replay"}, ("replayer",), False),
    "embed": ({"ATTACK": "embed"}, ("splitter",), False),
    "colluders": ({"ATTACK": "negate"}, ("c1", "c2", "c3"), True),
}
LATE_AFTER = 2  # `colluders`: the late stage-1 peer joins once the head committed this round


def run_attack(name: str, rounds: int) -> dict:
    attack, attackers, late = ATTACKS[name]
    sw = Swarm(Path(tempfile.mkdtemp(prefix=f"dishonest-{name}-")), outer_steps=rounds)
    honest = ["head", "s1", "full"] + (["late"] if late else [])
    try:
        join_with_attackers(sw, attack, attackers)
        if late:
            sw.wait_for(lambda: LATE_AFTER in sw.rounds("head"), timeout_s=900)
            sw.join("late", "--stage", "1")
        for n in honest:
            if sw.wait_exit(n, timeout_s=900) != 0:
                raise SystemExit(f"{n} exited {sw.procs[n].returncode}\n{sw.log(n)}")
        pids = {a: sw.events(a, "start")[0]["peer_id"] for a in attackers}
        made = [e for a in attackers for e in sw.events(a, "attack")]
        negated = {e["param_hash"] for e in made if "param_hash" in e}
        perps: dict[int, set[str]] = {}
        short, held_negated = [], []
        for n in honest:
            for t, rec in sw.rounds(n).items():
                for s, st in rec["stages"].items():
                    perps.setdefault(t, set()).add(st["perp_hash"])
                    if min(st["participants"], len(st["committed"])) != 2:
                        short.append((n, t, s, st["participants"]))
                    if st["param_hash"] in negated:
                        held_negated.append((n, t, s))
        head = sw.rounds("head")
        times = [head[t]["time"] for t in sorted(head)]
        return {
            "run": name,
            "rounds": rounds,
            "rounds_seen": {n: len(sw.rounds(n)) for n in honest},
            "attacks": len(made),
            "attack_rounds": sorted({e["t"] for e in made}),
            "refused": {
                a: {n: len([e for e in sw.events(n, "refused") if e["peer"] == p]) for n in honest}
                for a, p in pids.items()
            },
            "short_rounds": short,
            "perp_split_rounds": sorted(t for t, p in perps.items() if len(p) != 1),
            "held_negated": held_negated,
            "syncs": {n: [(e["t"], e["param_hash"] in negated) for e in sw.events(n, "sync")] for n in honest},
            "switches": {n: [(e["round"], e["peer"] in pids.values()) for e in sw.events(n, "switch")] for n in honest},
            "val_loss": [head[t]["val_loss"] for t in sorted(head)],
            "round_s": [round(b - a, 2) for a, b in zip(times, times[1:], strict=False)],
        }
    finally:
        sw.close()


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
    which, n_rounds = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 24
    print(json.dumps(run_attack(which, n_rounds) if which in ATTACKS else run(which, n_rounds)))

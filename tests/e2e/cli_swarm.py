"""A swarm of `peer` CLI processes on loopback for end-to-end tests, and its metrics.

`Swarm` starts a bootstrap (short deadlines: `DEADLINES`), joins peers as separate processes
(`join`; any module with a `peer`-like CLI, e.g. tests/e2e/forger.py, via `module`), reads each
peer's metrics.jsonl (`events`, `rounds`), waits with a deadline that prints every log on failure
(`wait_for`), and kills every process group at `close`. The fixture `swarm_factory`
(tests/e2e/conftest.py) closes every swarm a test made. `join_with_attackers` starts the 2-stage
swarm of the dishonest-claim tests (tests/e2e/attackers.py beside a head, its stage-1 peer and a
full replica).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = "127.0.0.1"  # test swarms listen and announce here only (the CLI's default is every interface)
DEADLINES = {
    "PEER_SWARM__RPC_TIMEOUT_S": "3",
    "PEER_SWARM__RECORD_TTL_S": "5",
    "PEER_SWARM__ANNOUNCE_INTERVAL_S": "0.5",
    "PEER_SWARM__ROUND_TIMEOUT_S": "10",
    "PEER_SWARM__CLAIM_TIMEOUT_S": "60",
}
# A longer round deadline for swarms whose rounds all close complete (so it costs nothing there) and whose checks
# need slack before it on a loaded 2-core machine: a censor is proven only more than the grace (6 s) before the
# round's earliest deadline, and a replica on slow kernels must send its first payload before the pipeline closes
# round 0 without it (stop 49: both missed 10 s under load).
LONG_ROUNDS = {"PEER_SWARM__ROUND_TIMEOUT_S": "30"}


class Swarm:
    """The processes of one test swarm and their metrics."""

    def __init__(
        self,
        tmp: Path,
        outer_steps: int,
        min_replicas: int = 2,
        batch: str = "8",
        seq_len: str = "64",
        deadlines: dict[str, str] | None = None,
        bootstrap_flags: tuple[str, ...] = (),
        host: str = LOOPBACK,
        prefix: tuple[str, ...] = (),
    ):
        """`host`, `prefix`: the bootstrap's (and by default every join's) address and command prefix,
        e.g. `ip netns exec NS` (`peer.research.bench.netns`)."""
        self.tmp, self.host, self.prefix = tmp, host, prefix
        self.env = {
            **os.environ,
            "PEER_CACHE_DIR": str(tmp / "cache"),
            "HF_HUB_OFFLINE": "1",
            "PEER_LOG_LEVEL": "INFO",
            "OMP_NUM_THREADS": "1",
        }
        self.procs: dict[str, subprocess.Popen] = {}
        address = tmp / "bootstrap.json"
        self.start(
            "bootstrap",
            [
                "bootstrap",
                "--host",
                host,
                "--inner-steps",
                "4",
                "--outer-steps",
                str(outer_steps),
                "--batch-size",
                batch,
                "--seq-len",
                seq_len,
                "--max-chars",
                "200000",
                "--address-file",
                str(address),
                *bootstrap_flags,
            ],
            extra_env={**(deadlines or DEADLINES), "PEER_SWARM__MIN_REPLICAS": str(min_replicas)},
        )
        deadline = time.monotonic() + 120
        while not address.exists():
            assert self.procs["bootstrap"].poll() is None, self.log("bootstrap")
            assert time.monotonic() < deadline
            time.sleep(0.2)
        self.address = json.loads(address.read_text())  # the bootstrap's address record
        self.maddr = self.address["initial_peers"][0]

    def start(
        self, name: str, args: list[str], extra_env: dict | None = None, module: str = "peer", prefix: tuple = ()
    ) -> None:
        log = (self.tmp / f"{name}.log").open("a")
        self.procs[name] = subprocess.Popen(
            [*(prefix or self.prefix), sys.executable, "-m", module, *args],
            cwd=ROOT,  # `module` may be a test's (tests/e2e/forger.py)
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**self.env, **(extra_env or {})},
            start_new_session=True,
        )

    def join(
        self,
        name: str,
        *flags: str,
        extra_env: dict | None = None,
        module: str = "peer",
        host: str | None = None,
        prefix: tuple[str, ...] = (),
    ) -> None:
        """`host`, `prefix`: this peer's own (default: the bootstrap's)."""
        where = host or self.host
        args = ["join", *flags, "--host", where, "--initial-peers", self.maddr, "--data-dir", str(self.tmp / name)]
        self.start(name, args, extra_env, module, prefix)

    def events(self, name: str, kind: str | None = None) -> list[dict]:
        path = self.tmp / name / "metrics.jsonl"
        recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
        return [r for r in recs if kind is None or r["event"] == kind]

    def rounds(self, name: str) -> dict[int, dict]:
        return {r["t"]: r for r in self.events(name, "round")}

    def settled(self, name: str) -> dict[int, dict]:
        """`rounds`, each stage's parameter hash as it settled: a holder that committed a smaller set at
        its deadline switches to the checked larger one after the round (a `switch` event), and holds
        that state from then on (docs/protocol.md, RECONCILE)."""
        out = {t: {**r, "stages": {s: dict(v) for s, v in r["stages"].items()}} for t, r in self.rounds(name).items()}
        for e in self.events(name, "switch"):
            stage = out.get(e["round"], {}).get("stages", {}).get(str(e["stage"]))
            if stage is not None:
                stage["param_hash"] = e["param_hash"]
        return out

    def log(self, name: str) -> str:
        return (self.tmp / f"{name}.log").read_text()[-4000:]

    def wait_for(self, what, timeout_s: float = 180, poll_s: float = 0.1) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            assert time.monotonic() < deadline, "timed out waiting; logs:\n" + "\n".join(
                f"--- {n}\n{self.log(n)[-1500:]}" for n in self.procs
            )
            time.sleep(poll_s)

    def claimed_stage_peer(self, names: list[str], t: int) -> str:
        """Which stage peer the head uses: the one that contributed (not just observed) at step t."""
        starts = {n: e["address"] for n in names for e in self.events(n, "start")}
        head_log = (self.tmp / "head.log").read_text()
        last = {n: head_log.rfind(f"at {addr}") for n, addr in starts.items()}
        name = max(last, key=last.get)
        assert last[name] >= 0, head_log[-3000:]
        return name

    def status(self) -> dict:
        """`peer status --json` of the swarm, as a user runs it (a failed run raises with its stderr)."""
        args = [sys.executable, "-m", "peer", "status", "--initial-peers", self.maddr, "--timeout-s", "20", "--json"]
        out = subprocess.run(args, capture_output=True, text=True, timeout=120, env=self.env)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def wait_exit(self, name: str, timeout_s: float = 240) -> int:
        return self.procs[name].wait(timeout=timeout_s)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


ATTACKERS = "tests.e2e.attackers"  # the dishonest stage holders' module (never imported here: it patches `peer`)


def join_with_attackers(
    sw: Swarm,
    attack: dict[str, str],
    attackers: list[str] | tuple[str, ...],
    each: dict[str, dict[str, str]] | None = None,
) -> None:
    """s1 (`--stage 1`) and `attackers` (stage-1 holders of tests/e2e/attackers.py with `attack`'s
    env, plus `each[name]`'s), then the full replica and the head: the attackers are up before round 0
    (a join takes longer than a short run on 2 cores) and publish unclaimable records, so the head
    claims s1."""
    sw.join("s1", "--stage", "1")
    for name in attackers:
        sw.join(name, "--stage", "1", module=ATTACKERS, extra_env={**attack, **(each or {}).get(name, {})})
    for name in ("s1", *attackers):
        sw.wait_for(lambda n=name: sw.events(n, "start"))
    sw.join("full", "--full-replica")
    sw.join("head", "--stage", "0")

"""`peer bench chaos`: random churn on a loopback swarm, then the liveness table (issue 8).

Starts a bootstrap (fixed identity and ports, so it can come back at the same address), one
pipeline head, two stage-1 peers (one a hot spare) and a full replica of the `tiny` 2-stage model
as real `python -m peer` processes with short deadlines, waits for the first committed round, then
injects `faults` faults one at a time, each on a random non-bootstrap role:
- ``kill_resume`` / ``kill_fresh``: ``kill -9``, restart with --resume (same key and data) or with a
  fresh data directory and a new key (a new peer, which replays the rounds from a state it trusts:
  past the history window, the state the bootstrap's attester reached; docs/protocol.md, "Joining by
  replay");
- ``term_resume``: SIGTERM (a clean leave), restart with --resume;
- ``stop``: SIGSTOP for a few seconds, then SIGCONT;
- ``long_stop``: SIGSTOP for longer than two round deadlines (a frozen machine, a long swap), then
  SIGCONT: the woken peer must follow what the others committed meanwhile or re-sync, never
  commit a stale set of its own (`long_stops` of the faults, at random places);
and one ``bootstrap_kill`` halfway (``kill -9``, restart with the same identity and ports). After a
fault the harness waits until every live role has committed a round after it (the recovery time,
capped), then a random pause. After a ``kill -9`` the victim's descendants must be gone within
`orphan_wait_s` (else they count as orphans, and are killed). At the end every role's process group
gets SIGTERM at the same moment (the whole swarm stops): a role that takes longer than `leave_s` to
exit is a slow leave, and whatever still runs after `orphan_wait_s` counts as an orphan. The table
is `peer.research.bench.chaos_report.summary` plus `leave_max_s` and `slow_leaves`.

Invariants: every process started here is stopped on the way out (`Children.stop_all`, and each
child's watchdog should this process be killed); a fault never targets a role that is down.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import signal
import socket
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from peer.demo.processes import Child, Children
from peer.demo.run import LOOPBACK, peer_command
from peer.errors import NetworkError
from peer.node.metrics import MetricsTail
from peer.research.bench.chaos_report import fault_line, holder_name, summary

log = logging.getLogger(__name__)

KINDS = ("kill_resume", "kill_fresh", "term_resume", "stop")
ROLES = {"head": ("--stage", "0"), "s1a": ("--stage", "1"), "s1b": ("--stage", "1"), "full": ("--full-replica",)}


@dataclass(frozen=True)
class ChaosConfig:
    faults: int = 20
    seed: int = 0
    workdir: Path = Path("runs/chaos")
    inner_steps: int = 5
    microbatches: int = 4  # per inner step (batch 8): with in_flight 0 several are in the pipeline at a fault
    in_flight: int = 0  # the heads' window: 0 = auto (1F1B), 1 = the sequential schedule
    overlap: int = 0  # train.overlap: 1 = every round in the background of the next outer step
    round_timeout_s: float = 20.0
    rpc_timeout_s: float = 3.0
    record_ttl_s: float = 5.0
    announce_interval_s: float = 1.0
    pause_s: tuple[float, float] = (2.0, 6.0)  # between a recovery and the next fault
    stop_s: tuple[float, float] = (3.0, 8.0)  # SIGSTOP duration
    long_stops: int = 2  # faults that are a SIGSTOP longer than two round deadlines
    long_stop_rounds: tuple[float, float] = (2.2, 3.0)  # its duration, in round deadlines
    recovery_cap_s: float = 90.0  # a fault not recovered from by then counts as not recovered
    orphan_wait_s: float = 10.0
    leave_s: float = 10.0  # at the end every process group gets SIGTERM at once; a slower leave is counted
    startup_timeout_s: float = 240.0
    bootstrap_kill: bool = True
    # a restart replays from its own state or the initial one (docs/protocol.md, "Joining by replay");
    # past the window (payloads of holders killed fresh die with them) from the bootstrap's attested one.
    # Rounds here last under a second, so the window is 48 rounds (about 40 s; 16 of a real run's rounds
    # are an hour): the bootstrap kill keeps its attester away for about 12 s, and it must find the
    # rounds it missed still served when it is back
    history_rounds: int = 48

    @property
    def stall_s(self) -> float:
        return 2 * self.round_timeout_s


@dataclass
class Role:
    name: str
    flags: tuple[str, ...]
    generation: int = 0
    child: Child | None = None
    tail: MetricsTail | None = None
    last_round: float = 0.0  # wall time of its newest round event
    starts: int = 0

    @property
    def data_dir_name(self) -> str:
        return holder_name(self.name, self.generation)


@dataclass
class ChaosResult:
    summary: dict[str, Any]
    faults: list[dict[str, Any]] = field(default_factory=list)
    workdir: Path = Path()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ChaosRun:
    """One chaos run: the swarm's processes, the fault loop and what it observed."""

    def __init__(self, cfg: ChaosConfig, progress: Callable[[str], None] | None = None) -> None:
        self.cfg, self.progress = cfg, progress or (lambda _line: None)
        self.workdir = Path(cfg.workdir).resolve()
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PEER_LOG_LEVEL": "INFO"}
        self.children = Children(self.workdir, env=env)
        self.rng = random.Random(cfg.seed)
        self.roles = {name: Role(name, flags) for name, flags in ROLES.items()}
        self.bootstrap: Child | None = None
        self.ports = (_free_port(), _free_port())
        self.maddr = ""
        self.faults: list[dict[str, Any]] = []
        self.orphans = 0
        self.kill_windows: list[tuple[str, int, int]] = []  # (log name, offset before, after a kill -9)

    # ------------------------------------------------------------------ processes
    def _bootstrap_env(self) -> dict[str, str]:
        c = self.cfg
        return {
            "PEER_SWARM__ROUND_TIMEOUT_S": str(c.round_timeout_s),
            "PEER_SWARM__RPC_TIMEOUT_S": str(c.rpc_timeout_s),
            "PEER_SWARM__RECORD_TTL_S": str(c.record_ttl_s),
            "PEER_SWARM__ANNOUNCE_INTERVAL_S": str(c.announce_interval_s),
            "PEER_SWARM__CLAIM_TIMEOUT_S": str(3 * c.round_timeout_s),
            "PEER_SWARM__MIN_REPLICAS": "2",
            "PEER_SWARM__HISTORY_ROUNDS": str(c.history_rounds),
            "PEER_SWARM__CHECKPOINT_EVERY_ROUNDS": "1",
            "PEER_TRAIN__MICROBATCHES": str(c.microbatches),
            "PEER_TRAIN__IN_FLIGHT": str(c.in_flight),  # the run's window; every join also passes --in-flight
        }

    def start_bootstrap(self) -> None:
        address_file = self.workdir / "bootstrap.json"
        address_file.unlink(missing_ok=True)
        argv = peer_command(
            "bootstrap",
            "--preset",
            "tiny",
            "--stages",
            2,
            "--inner-steps",
            self.cfg.inner_steps,
            "--outer-steps",
            100_000,
            "--overlap",
            self.cfg.overlap,
            "--host",
            LOOPBACK,
            "--port",
            self.ports[0],
            "--grpc-port",
            self.ports[1],
            "--identity",
            self.workdir / "bootstrap.key",
            "--address-file",
            address_file,
        )
        self.bootstrap = self.children.spawn("bootstrap", argv, runs_until_stopped=True, env=self._bootstrap_env())
        deadline = time.monotonic() + self.cfg.startup_timeout_s
        while time.monotonic() < deadline:
            try:
                peers = json.loads(address_file.read_text()).get("initial_peers") or []
                if peers:
                    self.maddr = next((m for m in peers if "/127.0.0.1/" in m), peers[0])
                    return
            except (OSError, json.JSONDecodeError):
                pass
            if self.bootstrap.poll() is not None:
                break
            time.sleep(0.2)
        raise NetworkError(f"the bootstrap did not come up; see {self.workdir}/bootstrap.log")

    def _key(self, holder: str) -> Path:
        """The key of one incarnation of a role (`holder_name`): kept by a `--resume` restart, new for a
        `kill_fresh` one (a new peer)."""
        return self.workdir / f"{holder}.identity.key"

    def start(self, role: Role, resume: bool) -> None:
        data_dir = self.workdir / role.data_dir_name
        flags = [*role.flags, "--host", LOOPBACK, "--initial-peers", self.maddr, "--data-dir", data_dir]
        flags += ["--identity", self._key(role.data_dir_name), "--device", "cpu", "--manifest-timeout-s", 60]
        flags += ["--in-flight", self.cfg.in_flight]  # a head's own schedule (stage peers size their memory by it)
        argv = peer_command("join", *flags, *(["--resume"] if resume else []))
        role.child = self.children.spawn(role.data_dir_name, argv)
        metrics = data_dir / "metrics.jsonl"
        role.tail = MetricsTail(metrics)
        role.tail.offset = metrics.stat().st_size if metrics.exists() else 0  # only this start's events
        role.starts += 1

    def poll_metrics(self) -> None:
        for role in self.roles.values():
            for ev in role.tail.read_new() if role.tail else []:
                if ev.get("event") == "round":
                    role.last_round = max(role.last_round, float(ev.get("time", 0.0)))

    def _restart_exited(self) -> None:
        """A role that exited by itself (a crash) comes back with --resume; it is logged in the faults."""
        for role in self.roles.values():
            if role.child is not None and role.child.poll() is not None:
                rc = role.child.poll()
                log.warning("%s exited by itself (rc %s); restarting it with --resume", role.name, rc)
                why = role.child.log_tail(2, 300)
                self.faults.append(
                    {
                        "kind": "crash",
                        "target": role.name,
                        "time": time.time(),
                        "rc": rc,
                        "why": why,
                        "recovery_s": None,
                    }
                )
                self.start(role, resume=True)

    # ------------------------------------------------------------------ faults
    def _kill9(self, child: Child) -> None:
        before = child.descendants()
        start = child.log_path.stat().st_size if child.log_path.exists() else 0
        os.kill(child.pid, signal.SIGKILL)
        child.popen.wait()
        deadline = time.monotonic() + self.cfg.orphan_wait_s
        left = [p for p in before if _alive(p)]
        while left and time.monotonic() < deadline:
            time.sleep(0.2)
            left = [p for p in left if _alive(p)]
        if left:
            self.orphans += len(left)
            log.warning("%s left %d processes running after kill -9: %s", child.name, len(left), [p.pid for p in left])
            for p in left:
                p.kill()
        # what its DHT child printed while it noticed its parent was gone (a broken pipe) is the kill's
        self.kill_windows.append((child.log_path.name, start, child.log_path.stat().st_size))

    def inject(self, kind: str, role: Role) -> None:
        assert role.child is not None
        if kind in ("kill_resume", "kill_fresh"):
            self._kill9(role.child)
            if kind == "kill_fresh":
                role.generation += 1
            self.start(role, resume=kind == "kill_resume")
        elif kind == "term_resume":
            role.child.popen.send_signal(signal.SIGTERM)
            try:
                role.child.popen.wait(timeout=30)
            except Exception:  # noqa: BLE001 - a peer that ignores SIGTERM is killed and counted below
                self._kill9(role.child)
            self.start(role, resume=True)
        elif kind in ("stop", "long_stop"):
            lo, hi = (
                self.cfg.stop_s if kind == "stop" else [r * self.cfg.round_timeout_s for r in self.cfg.long_stop_rounds]
            )
            os.kill(role.child.pid, signal.SIGSTOP)
            time.sleep(self.rng.uniform(lo, hi))
            os.kill(role.child.pid, signal.SIGCONT)

    def kill_bootstrap(self) -> None:
        assert self.bootstrap is not None
        self._kill9(self.bootstrap)
        time.sleep(3.0)
        self.start_bootstrap()

    def wait_recovered(self, since: float) -> float | None:
        """Seconds from `since` until every live role committed a round after it (None: capped)."""
        deadline = time.monotonic() + self.cfg.recovery_cap_s
        while time.monotonic() < deadline:
            self.poll_metrics()
            self._restart_exited()
            if all(r.last_round > since for r in self.roles.values()):
                return max(r.last_round for r in self.roles.values()) - since
            time.sleep(0.5)
        return None

    # ------------------------------------------------------------------ the run
    def run(self) -> ChaosResult:
        try:
            self.start_bootstrap()
            for name in ("s1a", "s1b", "head", "full"):
                self.start(self.roles[name], resume=False)
            if self.wait_recovered(0.0) is None:
                raise NetworkError(f"the swarm committed no round in time; see the logs in {self.workdir}")
            self.progress("swarm up: every role committed a round")
            bootstrap_at = self.cfg.faults // 2 if self.cfg.bootstrap_kill else -1
            others = [i for i in range(self.cfg.faults) if i != bootstrap_at]
            long_at = set(self.rng.sample(others, min(self.cfg.long_stops, len(others))))
            for i in range(self.cfg.faults):
                time.sleep(self.rng.uniform(*self.cfg.pause_s))
                self._restart_exited()
                since = time.time()
                if i == bootstrap_at:
                    kind, target = "bootstrap_kill", "bootstrap"
                    self.kill_bootstrap()
                else:
                    kind = "long_stop" if i in long_at else self.rng.choice(KINDS)
                    target = self.rng.choice(sorted(self.roles))
                    self.inject(kind, self.roles[target])
                fault = {"i": i, "kind": kind, "target": target, "time": since, "until": time.time()}  # a freeze ends
                fault["recovery_s"] = self.wait_recovered(since)
                self.faults.append(fault)
                self.progress(f"fault {i + 1}/{self.cfg.faults}: {fault_line(fault)}")
            end = time.time()
            leaves = self._leave_all()
        finally:
            self.children.stop_all(grace_s=5.0)
        start = min((float(f["time"]) for f in self.faults), default=None)  # churn starts at the first fault
        result = summary(self.workdir, self.faults, self.cfg.stall_s, self.orphans, end, self.kill_windows, start)
        result["leave_max_s"] = max((v for v in leaves.values() if v is not None), default=None)
        result["slow_leaves"] = sorted(k for k, v in leaves.items() if v is None or v > self.cfg.leave_s)
        result["leave_s"] = leaves
        (self.workdir / "chaos.json").write_text(
            json.dumps({"config": asdict(self.cfg), "summary": result, "faults": self.faults}, indent=2, default=str)
        )
        return ChaosResult(result, self.faults, self.workdir)

    def _leave_all(self) -> dict[str, float | None]:
        """SIGTERM every live child's process group at the same moment, as stopping a whole swarm (or
        Ctrl-C in its terminal) does: each peer, its DHT process and p2pd get it together. Returns
        {name: seconds until it exited, None if it never did}; what of the run still runs after the
        wait counts as orphans."""
        live = [c for c in self.children.children if c.poll() is None]
        t0 = time.monotonic()
        for c in live:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(c.pid, signal.SIGTERM)  # each child leads its own session (Children.spawn)
        left: dict[str, float | None] = {c.name: None for c in live}
        deadline = t0 + self.cfg.orphan_wait_s + 10.0
        while time.monotonic() < deadline and any(v is None for v in left.values()):
            for c in live:
                if left[c.name] is None and c.poll() is not None:
                    left[c.name] = round(time.monotonic() - t0, 2)
            time.sleep(0.1)
        time.sleep(min(3.0, self.cfg.orphan_wait_s))  # watchdogs stop what a dead parent left
        stray = self.children.sweep()
        stuck = [c.name for c in live if c.poll() is None]
        if stray or stuck:
            log.warning("after SIGTERM still running: %s; %d other processes", stuck, len(stray))
        self.orphans += len(stray) + len(stuck)
        return left


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def run_chaos(cfg: ChaosConfig, progress: Callable[[str], None] | None = None) -> ChaosResult:
    """Run the swarm under `cfg.faults` random faults; the table of `peer.research.bench.chaos_report`."""
    return ChaosRun(cfg, progress).run()


def config_from_flags(args: dict[str, Any], runs: Path) -> ChaosConfig:
    """`peer bench chaos`'s flags checked and made a `ChaosConfig` (logs under `runs` unless --workdir)."""
    from peer.errors import ConfigError

    if args["faults"] < 1:
        raise ConfigError("--faults must be 1 or more")
    if not 0 <= args["long_stops"] < args["faults"]:
        raise ConfigError("--long-stops must be between 0 and --faults − 1 (one fault is a bootstrap kill)")
    where = args["workdir"] or runs / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    keys = ("faults", "seed", "round_timeout_s", "inner_steps", "microbatches", "in_flight", "overlap", "long_stops")
    return ChaosConfig(workdir=where, **{k: args[k] for k in keys})

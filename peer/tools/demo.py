"""`peer demo`: a whole swarm on one machine, as real processes on loopback.

Starts a bootstrap, P compressed pipelines of S stage peers and F full replicas, each as its own
`python -m peer …` process in its own process group (its log in WORKDIR/<name>.log, its metrics in
WORKDIR/<name>/metrics.jsonl), follows their metrics files while they train the `tiny` model for T
outer rounds, and summarises the run: per round the mean train/validation loss of the heads and
full replicas, every stage's parameter hash (the same on every holder, DESIGN §3), and the bytes
each kind of link carried (subspace-compressed activations vs SparseLoCo pseudo-gradients).

Invariants:
- every process the demo starts is stopped when `run_demo` returns or raises (success, a child
  failure, a timeout, SIGINT, SIGTERM): SIGTERM to its whole process group, SIGKILL after a grace
  period, plus a sweep of every process that inherited this run's marker environment variable;
- a child that exits non-zero (or a bootstrap that exits at all) before the end becomes a one-line
  `PeerError` naming the process and the tail of its log;
- this module prints nothing: live state goes to a callback, the CLI renders it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from peer.errors import ConfigError, NetworkError, PeerError
from peer.node.metrics import MetricsTail, read_events
from peer.tools.plots import figure

log = logging.getLogger(__name__)

MARKER_ENV = "PEERDEMO_RUN"  # not PEER_*: those are config overrides (peer.config.env_overrides)
LOSS_ROLES = ("head", "full")  # roles that report a training loss
BYTE_KINDS = ("activations", "activations_uncompressed_equiv", "pseudo_gradients")


class DemoInterrupted(PeerError):
    """The demo was stopped by a signal; every process it started has been stopped."""


# --- processes -----------------------------------------------------------------------------------


def _proc_start(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live, non-zombie `pid`, else None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields_ = raw[raw.rindex(")") + 2 :].split()
    return None if fields_[0] in ("Z", "X") else int(fields_[19])


def _pids_with_marker(marker: str) -> dict[int, int]:
    """{pid: start time} of every live process whose environment holds MARKER_ENV=marker (Linux)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    out: dict[int, int] = {}
    try:
        entries = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return out
    for pid in entries:
        if pid == os.getpid():
            continue
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            start = _proc_start(pid)
            if start is not None:
                out[pid] = start
    return out


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process is left in process group `pgid`."""
    try:
        entries = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # no /proc: ask the kernel (zombies count there)
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    for p in entries:
        try:
            raw = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields_ = raw[raw.rindex(")") + 2 :].split()
        if int(fields_[2]) == pgid and fields_[0] not in ("Z", "X"):
            return True
    return False


@dataclass
class Child:
    """One process the demo started: its name, command, log file and Popen handle."""

    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen
    runs_until_stopped: bool = False  # the bootstrap; join peers exit by themselves

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def log_tail(self, n_lines: int = 6, max_chars: int = 600) -> str:
        """The last non-empty lines of the log, joined on one line."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(0, os.SEEK_END)
                f.seek(max(0, f.tell() - 16_384))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return "(no log)"
        lines = [ln.strip() for ln in text.splitlines() if ln.strip()][-n_lines:]
        tail = " | ".join(lines) or "(empty log)"
        return tail if len(tail) <= max_chars else "…" + tail[-max_chars:]


class Children:
    """Spawns child processes, each in its own process group, and stops all of them.

    Every child inherits `MARKER_ENV=<run marker>`, and so do its descendants (hivemind's DHT
    process and its p2pd daemon), which lets `stop_all` find processes that left the group.
    """

    def __init__(self, workdir: Path, env: Mapping[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.marker = uuid.uuid4().hex
        self.env = dict(os.environ if env is None else env)
        self.env[MARKER_ENV] = self.marker
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.children: list[Child] = []

    def spawn(
        self, name: str, argv: Sequence[str], runs_until_stopped: bool = False, env: Mapping[str, str] | None = None
    ) -> Child:
        """Start `argv` with stdout+stderr to WORKDIR/<name>.log, in a new session/process group."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        log_path = self.workdir / f"{name}.log"
        child_env = {**self.env, **(env or {}), MARKER_ENV: self.marker}
        with open(log_path, "ab") as log_file:
            popen = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=child_env,
                start_new_session=True,
                close_fds=True,
            )
        child = Child(name, list(argv), log_path, popen, runs_until_stopped)
        self.children.append(child)
        log.info("started %s (pid %d): %s", name, popen.pid, " ".join(argv))
        return child

    def check(self) -> None:
        """Raise PeerError if a child exited non-zero, or a run-until-stopped child exited at all."""
        for c in self.children:
            rc = c.poll()
            if rc is None or (rc == 0 and not c.runs_until_stopped):
                continue
            raise PeerError(
                f"{c.name} (pid {c.pid}) exited with code {rc} before the demo finished; "
                f"see {c.log_path} — last lines: {c.log_tail()}"
            )

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Stop every child and everything it started; safe to call twice; signals are held off meanwhile.

        1. SIGTERM each child itself, so it can leave the swarm cleanly (its own DHT process and
           p2pd are shut down by it, not killed under it);
        2. once a child has exited, SIGTERM what is left of its process group (and every process
           carrying the run's marker), within the same `grace_s`;
        3. SIGKILL whatever is still alive when `grace_s` is over, and reap.
        """
        with _signals_deferred():
            groups = [c.pid for c in self.children]
            known = _pids_with_marker(self.marker)
            for c in self.children:
                if c.poll() is None:
                    _kill(c.pid, _proc_start(c.pid), signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            while time.monotonic() < deadline and any(c.poll() is None for c in self.children):
                time.sleep(0.02)
            known.update(_pids_with_marker(self.marker))
            for pgid in groups:
                _signal_group(pgid, signal.SIGTERM)
            for pid, start in known.items():
                _kill(pid, start, signal.SIGTERM)
            while time.monotonic() < deadline and self._anything_alive(groups, known):
                time.sleep(0.02)
            if self._anything_alive(groups, known):
                stuck = [c.name for c in self.children if _group_alive(c.pid)] or ["a process that left its group"]
                log.warning("%s still running %.1f s after SIGTERM; sending SIGKILL", ", ".join(stuck), grace_s)
            for _ in range(3):  # SIGKILL until nothing is left (a dying process may have forked)
                known.update(_pids_with_marker(self.marker))
                for pgid in groups:
                    _signal_group(pgid, signal.SIGKILL)
                for pid, start in known.items():
                    _kill(pid, start, signal.SIGKILL)
                kill_deadline = time.monotonic() + 2.0
                while time.monotonic() < kill_deadline and self._anything_alive(groups, known):
                    time.sleep(0.02)
                if not self._anything_alive(groups, known):
                    break
            for c in self.children:
                try:
                    c.popen.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    log.error("%s (pid %d) did not die after SIGKILL", c.name, c.pid)

    def _anything_alive(self, groups: Iterable[int], known: Mapping[int, int]) -> bool:
        for c in self.children:
            c.poll()  # reap zombies so an exited leader no longer counts
        return any(_group_alive(g) for g in groups) or any(_proc_start(p) == s for p, s in known.items())


def _kill(pid: int, start: int | None, sig: int) -> None:
    if start is not None and _proc_start(pid) == start:  # still the same process, not a reused pid
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


class _signals_deferred:
    """Hold SIGINT/SIGTERM off (main thread only) so a second Ctrl-C cannot interrupt cleanup."""

    def __enter__(self) -> None:
        self.saved: dict[int, object] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, signal.SIG_IGN)

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self.saved.items():
            signal.signal(sig, handler)


# --- metrics files -------------------------------------------------------------------------------


def _mean(xs: Sequence[float]) -> float | None:
    xs = [float(x) for x in xs if x is not None and math.isfinite(float(x))]
    return sum(xs) / len(xs) if xs else None


def summarize_runs(metrics_paths: Sequence[Path]) -> dict:
    """Aggregate the `round` events of every process's metrics.jsonl (contract in DESIGN/issue 3).

    Returns {"rounds": [{"t", "train_loss", "val_loss", "param_hash": {stage: hash},
    "participants": {stage: n}, "reporters": n}], "params_consistent": bool, "bytes": {...}}.
    Rounds are the union over processes (a process that missed a round does not hide it);
    train/val loss = mean over the heads and full replicas that reported one; param_hash[s] = the
    most reported hash; params_consistent is False if two processes report different param_hash or
    perp_hash for the same (t, s); bytes = sum over processes of their last cumulative counters.
    """
    per_t: dict[int, list[dict]] = {}
    totals = {k: 0 for k in BYTE_KINDS}
    for path in metrics_paths:
        rounds = [ev for ev in read_events(path) if ev.get("event") == "round" and isinstance(ev.get("t"), int)]
        for ev in rounds:
            per_t.setdefault(ev["t"], []).append(ev)
        if rounds:
            last = rounds[-1].get("bytes") or {}
            for k in BYTE_KINDS:
                totals[k] += int(last.get(k) or 0)
    consistent = True
    out_rounds = []
    for t in sorted(per_t):
        events = per_t[t]
        losses = [ev.get("train_loss") for ev in events if ev.get("role") in LOSS_ROLES]
        vals = [ev.get("val_loss") for ev in events if ev.get("role") in LOSS_ROLES]
        hashes: dict[str, list[str]] = {}
        perps: dict[str, set[str]] = {}
        participants: dict[str, int] = {}
        for ev in events:
            for s, rec in (ev.get("stages") or {}).items():
                s = str(s)
                if rec.get("param_hash") is not None:
                    hashes.setdefault(s, []).append(rec["param_hash"])
                if rec.get("perp_hash") is not None:
                    perps.setdefault(s, set()).add(rec["perp_hash"])
                if rec.get("participants") is not None:
                    participants[s] = max(participants.get(s, 0), int(rec["participants"]))
        if any(len(set(h)) > 1 for h in hashes.values()) or any(len(p) > 1 for p in perps.values()):
            consistent = False
        order = sorted(set(hashes) | set(participants), key=lambda s: (int(s) if s.isdigit() else 1 << 30, s))
        out_rounds.append(
            {
                "t": t,
                "train_loss": _mean(losses),
                "val_loss": _mean(vals),
                "param_hash": {s: max(hashes[s], key=hashes[s].count) for s in order if s in hashes},
                "participants": {s: participants[s] for s in order if s in participants},
                "reporters": len(events),
            }
        )
    return {"rounds": out_rounds, "params_consistent": consistent, "bytes": totals}


# --- live state ----------------------------------------------------------------------------------


@dataclass
class ProcessView:
    """What the demo knows about one join process, from its metrics file and exit code."""

    name: str
    role: str  # "head" | "stage" | "full"
    stage: int | None
    rounds_done: int = 0
    outer_step: int | None = None
    inner_step: int | None = None
    loss: float | None = None
    tokens_per_s: float = 0.0
    exit_code: int | None = None
    started: bool = False
    bytes: dict = field(default_factory=lambda: {k: 0 for k in BYTE_KINDS})
    _steps: deque = field(default_factory=lambda: deque(maxlen=20), repr=False)

    def apply(self, ev: Mapping) -> None:
        kind = ev.get("event")
        if kind == "start":
            self.started = True
        elif kind == "step":
            self.outer_step, self.inner_step = ev.get("t"), ev.get("h")
            if ev.get("loss") is not None:
                self.loss = float(ev["loss"])
            if ev.get("time") is not None:
                self._steps.append((float(ev["time"]), int(ev.get("tokens") or 0)))
                if len(self._steps) >= 2 and self._steps[-1][0] > self._steps[0][0]:
                    tokens = sum(n for _, n in list(self._steps)[1:])
                    self.tokens_per_s = tokens / (self._steps[-1][0] - self._steps[0][0])
        elif kind == "round" and isinstance(ev.get("t"), int):
            self.rounds_done = max(self.rounds_done, ev["t"] + 1)
            self.bytes = {k: int((ev.get("bytes") or {}).get(k) or 0) for k in BYTE_KINDS}


@dataclass
class DemoState:
    """Snapshot handed to the progress callback."""

    phase: str  # "starting bootstrap" | "starting peers" | "training" | "stopping"
    elapsed_s: float
    outer_steps: int
    workdir: Path
    processes: list[ProcessView]

    @property
    def round(self) -> int:
        """Rounds committed by every join process (the swarm's clock)."""
        return min((p.rounds_done for p in self.processes), default=0)

    @property
    def train_loss(self) -> float | None:
        return _mean([p.loss for p in self.processes if p.role in LOSS_ROLES and p.loss is not None])

    @property
    def tokens_per_s(self) -> float:
        return sum(p.tokens_per_s for p in self.processes if p.role in LOSS_ROLES and p.exit_code is None)

    @property
    def bytes(self) -> dict[str, int]:
        return {k: sum(p.bytes[k] for p in self.processes) for k in BYTE_KINDS}


# --- the demo ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DemoConfig:
    pipelines: int = 1
    stages: int = 2
    full_replicas: int = 1
    outer_steps: int = 4
    inner_steps: int = 10
    preset: str = "tiny"
    workdir: Path | None = None  # default: a fresh ./runs/demo-<timestamp>
    timeout_s: float = 900.0  # the whole run, from the first process to the last round
    startup_timeout_s: float = 300.0  # bootstrap address file; each stage peer's start event
    grace_s: float = 5.0  # SIGTERM → SIGKILL
    poll_interval_s: float = 0.25

    def __post_init__(self) -> None:
        _check_config(self)


@dataclass
class DemoResult:
    summary: dict  # summarize_runs(...) + wall_s
    workdir: Path
    metrics: dict[str, Path]  # join process name -> metrics.jsonl
    processes: list[ProcessView]


def default_workdir(root: Path = Path("runs")) -> Path:
    """A fresh directory runs/demo-<timestamp>[-n]."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = root / (f"demo-{stamp}" if n == 0 else f"demo-{stamp}-{n}")
        try:
            path.mkdir(parents=True, exist_ok=False)
            return path
        except FileExistsError:
            continue
    raise PeerError(f"cannot create a fresh demo directory under {root}; pass --workdir")


def _check_config(cfg: DemoConfig) -> None:
    for name in ("pipelines", "full_replicas"):
        if getattr(cfg, name) < 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be 0 or more")
    for name in ("stages", "outer_steps", "inner_steps"):
        if getattr(cfg, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be 1 or more")
    if cfg.pipelines + cfg.full_replicas < 1:
        raise ConfigError("the demo needs at least one trainer: pass --pipelines 1 or --full-replicas 1")


def peer_command(*args: object) -> list[str]:
    """`python -m peer ARGS…` with this interpreter."""
    return [sys.executable, "-m", "peer", *(str(a) for a in args)]


def _wait_address_file(path: Path, children: Children, deadline: float) -> dict:
    while True:
        children.check()
        try:
            info = json.loads(path.read_text())
            if info.get("initial_peers"):
                return info
        except (OSError, json.JSONDecodeError):
            pass
        if time.monotonic() > deadline:
            raise NetworkError(
                f"the bootstrap wrote no address file {path} in time; see {children.workdir}/bootstrap.log"
            )
        time.sleep(0.1)


def _pick_maddr(maddrs: Sequence[str]) -> str:
    loopback = [m for m in maddrs if "/127.0.0.1/" in m]
    return (loopback or list(maddrs))[0]


def _thread_env(n_compute: int) -> dict[str, str]:
    """Split the CPU cores between the training processes unless the user chose a thread count."""
    if "OMP_NUM_THREADS" in os.environ:
        return {}
    threads = max(1, (os.cpu_count() or 1) // max(1, n_compute))
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def _quorum_env(cfg: DemoConfig) -> dict[str, str]:
    """The bootstrap's manifest makes every trainer wait for all P + F replicas before its first step,
    so no replica commits round 0 before the others have announced themselves."""
    key = "PEER_SWARM__MIN_REPLICAS"  # peer.config env override of swarm.min_replicas
    return {} if key in os.environ else {key: str(cfg.pipelines + cfg.full_replicas)}


def run_demo(
    cfg: DemoConfig,
    progress: Callable[[DemoState], None] | None = None,
    command: Callable[..., list[str]] = peer_command,
) -> DemoResult:
    """Run the whole swarm to the end; stop every process on the way out, whatever happens.

    `command(*args)` turns `peer` arguments into an argv (tests pass stand-in children)."""
    workdir = Path(cfg.workdir) if cfg.workdir is not None else default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    workdir = workdir.resolve()
    t0 = time.monotonic()
    n_compute = cfg.pipelines * cfg.stages + cfg.full_replicas
    children = Children(workdir, env={**os.environ, **_thread_env(n_compute)})
    views: list[ProcessView] = []
    tails: dict[str, MetricsTail] = {}
    joins: dict[str, Child] = {}

    def state(phase: str) -> DemoState:
        for v in views:
            for ev in tails[v.name].read_new():
                v.apply(ev)
            v.exit_code = joins[v.name].poll() if v.name in joins else None
        return DemoState(phase, time.monotonic() - t0, cfg.outer_steps, workdir, list(views))

    def report(phase: str) -> DemoState:
        s = state(phase)
        if progress is not None:
            progress(s)
        return s

    def on_sigterm(signum: int, frame: object) -> None:
        raise DemoInterrupted("demo stopped by SIGTERM; every process it started was stopped")

    in_main = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    try:
        report("starting bootstrap")
        address_file = workdir / "bootstrap.json"
        address_file.unlink(missing_ok=True)
        children.spawn(
            "bootstrap",
            command(
                "bootstrap",
                "--preset",
                cfg.preset,
                "--stages",
                cfg.stages,
                "--outer-steps",
                cfg.outer_steps,
                "--inner-steps",
                cfg.inner_steps,
                "--port",
                0,
                "--address-file",
                address_file,
            ),
            runs_until_stopped=True,
            env=_quorum_env(cfg),
        )
        info = _wait_address_file(address_file, children, t0 + cfg.startup_timeout_s)
        maddr = _pick_maddr(info["initial_peers"])
        log.info("bootstrap is up at %s", maddr)

        def join(name: str, role: str, stage: int | None, *flags: object) -> None:
            data_dir = workdir / name
            joins[name] = children.spawn(
                name, command("join", *flags, "--initial-peers", maddr, "--data-dir", data_dir)
            )
            views.append(ProcessView(name, role, stage))
            tails[name] = MetricsTail(data_dir / "metrics.jsonl")

        for i in range(cfg.pipelines):  # downstream stages first, so heads find them when they start
            for s in range(cfg.stages - 1, 0, -1):
                join(f"p{i}-s{s}", "stage", s, "--stage", s)
        deadline = time.monotonic() + cfg.startup_timeout_s
        while not all(v.started for v in views):
            children.check()
            if time.monotonic() > deadline:
                late = ", ".join(v.name for v in views if not v.started)
                raise NetworkError(
                    f"{late} did not start within {cfg.startup_timeout_s:.0f} s; see their logs in {workdir}"
                )
            report("starting peers")
            time.sleep(cfg.poll_interval_s)
        for i in range(cfg.pipelines):  # the trainers start together, so their first rounds line up
            join(f"p{i}-s0", "head", 0, "--stage", 0)
        for j in range(cfg.full_replicas):
            join(f"full{j}", "full", None, "--full-replica")

        deadline = t0 + cfg.timeout_s
        while True:
            children.check()
            s = report("training")
            if all(c.poll() == 0 for c in joins.values()):
                break
            if time.monotonic() > deadline:
                raise PeerError(
                    f"the demo did not finish within {cfg.timeout_s:.0f} s (round {s.round}/{cfg.outer_steps}); "
                    f"raise --timeout-s or read the logs in {workdir}"
                )
            time.sleep(cfg.poll_interval_s)
        final = report("stopping")
    finally:
        children.stop_all(cfg.grace_s)
        if in_main:
            signal.signal(signal.SIGTERM, old_handler)
    metrics = {name: workdir / name / "metrics.jsonl" for name in joins}
    summary = summarize_runs(list(metrics.values()))
    summary["wall_s"] = round(time.monotonic() - t0, 3)
    for v in final.processes:
        if v.rounds_done < cfg.outer_steps:
            log.warning("%s exited after %d of %d rounds", v.name, v.rounds_done, cfg.outer_steps)
    return DemoResult(summary, workdir, metrics, final.processes)


# --- plot ----------------------------------------------------------------------------------------


def plot_demo(result: DemoResult, path: Path, inner_steps: int, title: str = "peer demo") -> Path:
    """Per-process train loss against the global inner step, round means and validation loss."""
    with figure(path, title) as ax:
        roles = {v.name: v.role for v in result.processes}
        for i, (name, mpath) in enumerate(sorted(result.metrics.items())):
            if roles.get(name) not in LOSS_ROLES:
                continue
            pts = [
                (ev["t"] * inner_steps + ev["h"], ev["loss"])
                for ev in read_events(mpath)
                if ev.get("event") == "step"
                and ev.get("loss") is not None
                and isinstance(ev.get("t"), int)
                and isinstance(ev.get("h"), int)
            ]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, color=f"C{i}", alpha=0.6, linewidth=1, label=f"{name} train")
        rounds = result.summary["rounds"]
        # a round's train loss is the mean over its inner steps: drawn mid-round; validation is after the commit
        tr = [
            (r["t"] * inner_steps + (inner_steps - 1) / 2, r["train_loss"])
            for r in rounds
            if r["train_loss"] is not None
        ]
        va = [((r["t"] + 1) * inner_steps, r["val_loss"]) for r in rounds if r["val_loss"] is not None]
        if tr:
            ax.plot(*zip(*tr), "s--", color="black", markersize=4, label="round mean train")
        if va:
            ax.plot(*zip(*va), "o-", color="crimson", markersize=4, label="round mean val")
    return Path(path)

"""`peer demo`: a whole swarm on one machine, as real processes on loopback.

Starts a bootstrap, P compressed pipelines of S stage peers and F full replicas, each as its own
`python -m peer …` process in its own process group (its log in WORKDIR/<name>.log, its metrics in
WORKDIR/<name>/metrics.jsonl), follows their metrics files while they train the `tiny` model for T
outer rounds, and summarises the run (`peer.demo.summary`).

Invariants:
- every process the demo starts is stopped when `run_demo` returns or raises (success, a child
  failure, a timeout, SIGINT, SIGTERM): `peer.demo.processes.Children.stop_all`;
- a child that exits non-zero (or a bootstrap that exits at all) before the end becomes a one-line
  `PeerError` naming the process and the tail of its log;
- everything is written under the work directory (default a fresh runs/demo-<timestamp>);
- this module prints nothing: live state goes to a callback, the CLI renders it.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from peer.demo.processes import Child, Children
from peer.demo.summary import DemoResult, DemoState, ProcessView, summarize_runs
from peer.errors import ConfigError, NetworkError, PeerError
from peer.node.metrics import MetricsTail

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"  # the demo's peers listen here only: nothing of it is reachable from elsewhere


class DemoInterrupted(PeerError):
    """The demo was stopped by a signal; every process it started has been stopped."""


@dataclass(frozen=True)
class DemoConfig:
    pipelines: int = 1
    stages: int = 2
    full_replicas: int = 1
    # T = 18 rounds of H = 8 at a peak inner lr of 1e-2 (warmup 5) with top-64 of each 64×64 chunk:
    # validation loss falls by more than 1 nat in under 150 s on 2 cores (issue 10; README).
    outer_steps: int = 18
    inner_steps: int = 8
    lr: float = 1e-2  # peak inner learning rate of the swarm (the bootstrap's train.lr)
    warmup_steps: int = 5
    topk: int = 64  # sparseloco.topk of the swarm
    preset: str = "tiny"
    workdir: Path | None = None  # default: a fresh ./runs/demo-<timestamp>
    timeout_s: float = 900.0  # the whole run, from the first process to the last round
    startup_timeout_s: float = 300.0  # bootstrap address file; each stage peer's start event
    grace_s: float = 5.0  # SIGTERM → SIGKILL
    poll_interval_s: float = 0.25

    def __post_init__(self) -> None:
        _check_config(self)


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


def _wait_address_file(path: Path, children: Children, deadline: float) -> dict[str, Any]:
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


def _train_env(cfg: DemoConfig) -> dict[str, str]:
    """The demo's training settings for the bootstrap's manifest (PEER_* set by the user win)."""
    wanted = {
        "PEER_TRAIN__LR": str(cfg.lr),
        "PEER_TRAIN__WARMUP_STEPS": str(cfg.warmup_steps),
        "PEER_SPARSELOCO__TOPK": str(cfg.topk),
    }
    return {k: v for k, v in wanted.items() if k not in os.environ}


class _DemoRun:
    """One demo run's processes and their live views: started in order, followed to the end."""

    def __init__(
        self,
        cfg: DemoConfig,
        workdir: Path,
        progress: Callable[[DemoState], None] | None,
        command: Callable[..., list[str]],
    ) -> None:
        self.cfg, self.workdir, self.progress, self.command = cfg, workdir, progress, command
        self.t0 = time.monotonic()
        n_compute = cfg.pipelines * cfg.stages + cfg.full_replicas
        self.children = Children(workdir, env={**os.environ, **_thread_env(n_compute)})
        self.views: list[ProcessView] = []
        self.tails: dict[str, MetricsTail] = {}
        self.joins: dict[str, Child] = {}

    def report(self, phase: str) -> DemoState:
        """Fold new metrics into the views, hand the state to the progress callback, and return it."""
        for v in self.views:
            for ev in self.tails[v.name].read_new():
                v.apply(ev)
            v.exit_code = self.joins[v.name].poll() if v.name in self.joins else None
        s = DemoState(phase, time.monotonic() - self.t0, self.cfg.outer_steps, self.workdir, list(self.views))
        if self.progress is not None:
            self.progress(s)
        return s

    def start_bootstrap(self) -> str:
        """Start the bootstrap and return the loopback address the peers join at."""
        cfg = self.cfg
        self.report("starting bootstrap")
        address_file = self.workdir / "bootstrap.json"
        address_file.unlink(missing_ok=True)
        args: list[object] = ["--preset", cfg.preset, "--stages", cfg.stages, "--outer-steps", cfg.outer_steps]
        args += ["--inner-steps", cfg.inner_steps, "--host", LOOPBACK, "--port", 0, "--address-file", address_file]
        self.children.spawn(
            "bootstrap",
            self.command("bootstrap", *args),
            runs_until_stopped=True,
            env=_quorum_env(cfg) | _train_env(cfg),
        )
        info = _wait_address_file(address_file, self.children, self.t0 + cfg.startup_timeout_s)
        maddr = _pick_maddr(info["initial_peers"])
        log.info("bootstrap is up at %s", maddr)
        return maddr

    def join(self, maddr: str, name: str, role: str, stage: int | None, *flags: object) -> None:
        data_dir = self.workdir / name
        argv = self.command("join", *flags, "--host", LOOPBACK, "--initial-peers", maddr, "--data-dir", data_dir)
        self.joins[name] = self.children.spawn(name, argv)
        self.views.append(ProcessView(name, role, stage))
        self.tails[name] = MetricsTail(data_dir / "metrics.jsonl")

    def start_peers(self, maddr: str) -> None:
        """Downstream stages first (so heads find them when they start), then every trainer together
        (so their first rounds line up)."""
        cfg = self.cfg
        for i in range(cfg.pipelines):
            for s in range(cfg.stages - 1, 0, -1):
                self.join(maddr, f"p{i}-s{s}", "stage", s, "--stage", s)
        deadline = time.monotonic() + cfg.startup_timeout_s
        while not all(v.started for v in self.views):
            self.children.check()
            if time.monotonic() > deadline:
                late = ", ".join(v.name for v in self.views if not v.started)
                raise NetworkError(
                    f"{late} did not start within {cfg.startup_timeout_s:.0f} s; see their logs in {self.workdir}"
                )
            self.report("starting peers")
            time.sleep(cfg.poll_interval_s)
        for i in range(cfg.pipelines):  # compressed on loopback too: the demo shows both kinds of replica
            self.join(maddr, f"p{i}-s0", "head", 0, "--stage", 0, "--compression", "always")
        for j in range(cfg.full_replicas):
            self.join(maddr, f"full{j}", "full", None, "--full-replica")

    def train_to_end(self) -> DemoState:
        """Follow the run until every peer exited cleanly; a failed child or the deadline raises."""
        cfg = self.cfg
        deadline = self.t0 + cfg.timeout_s
        while True:
            self.children.check()
            now = self.report("training")
            if all(c.poll() == 0 for c in self.joins.values()):
                return self.report("stopping")
            if time.monotonic() > deadline:
                raise PeerError(
                    f"the demo did not finish within {cfg.timeout_s:.0f} s (round {now.round}/{cfg.outer_steps}); "
                    f"raise --timeout-s or read the logs in {self.workdir}"
                )
            time.sleep(cfg.poll_interval_s)

    def result(self, final: DemoState) -> DemoResult:
        metrics = {name: self.workdir / name / "metrics.jsonl" for name in self.joins}
        summary = summarize_runs(list(metrics.values()))
        summary["wall_s"] = round(time.monotonic() - self.t0, 3)
        for v in final.processes:
            if v.rounds_done < self.cfg.outer_steps:
                log.warning("%s exited after %d of %d rounds", v.name, v.rounds_done, self.cfg.outer_steps)
        return DemoResult(summary, self.workdir, metrics, final.processes)


def run_demo(
    cfg: DemoConfig,
    progress: Callable[[DemoState], None] | None = None,
    command: Callable[..., list[str]] = peer_command,
) -> DemoResult:
    """Run the whole swarm to the end; stop every process on the way out, whatever happens.

    `command(*args)` turns `peer` arguments into an argv (tests pass stand-in children)."""
    workdir = Path(cfg.workdir) if cfg.workdir is not None else default_workdir()
    workdir.mkdir(parents=True, exist_ok=True)
    run = _DemoRun(cfg, workdir.resolve(), progress, command)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise DemoInterrupted("demo stopped by SIGTERM; every process it started was stopped")

    in_main = threading.current_thread() is threading.main_thread()
    old_handler = signal.signal(signal.SIGTERM, on_sigterm) if in_main else None
    try:
        run.start_peers(run.start_bootstrap())
        final = run.train_to_end()
    finally:
        run.children.stop_all(cfg.grace_s)
        if in_main and old_handler is not None:
            signal.signal(signal.SIGTERM, old_handler)
    return run.result(final)

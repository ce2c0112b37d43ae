"""Process plumbing: the children of `peer demo` (spawn, detect failures, stop them all) and signals.

Process trees are read with psutil: a child's descendants with `Process.children(recursive=True)`,
processes that left the tree (re-parented after their parent died, or in a new session) by a
sweep of `psutil.process_iter()` for this run's marker environment variable or a child's process
group, and waits with `psutil.wait_procs`. psutil remembers each process's `create_time()`, so a
signal never reaches an unrelated process that reused a pid.

Invariants:
- `Children.stop_all` leaves nothing of the run alive (SIGTERM, a grace period, then SIGKILL),
  is safe to call twice and cannot be interrupted by a second Ctrl-C;
- direct children are waited for through their `Popen` handle only, so their exit codes stay
  readable (`psutil` would reap them and lose the code);
- zombies count as gone: their parent (or init) reaps them, no signal can;
- every child is guarded by a `peer.net.watchdog.Watchdog`: should this process die without
  `stop_all` (``kill -9``), the watchdog stops the child and everything under it;
- `stop_on_signals` turns SIGINT/SIGTERM into a graceful-leave event and puts the previous
  handlers back afterwards, and in any process forked meanwhile.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import Any

import psutil

from peer.errors import PeerError
from peer.net.watchdog import Watchdog

log = logging.getLogger(__name__)

MARKER_ENV = "PEERDEMO_RUN"  # not PEER_*: those are config overrides (peer.config.env_overrides)
POLL_S = 0.02  # pause between two looks at processes that are stopping
KILL_ROUNDS = 3  # SIGKILL sweeps: a dying process may have forked after the previous one
KILL_WAIT_S = 2.0  # how long one SIGKILL sweep waits for its victims


def _alive(proc: psutil.Process) -> bool:
    """Whether `proc` (the same process, not a reused pid) still runs and is not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _signal(procs: Iterable[psutil.Process], sig: int) -> None:
    for proc in procs:
        with contextlib.suppress(psutil.Error):  # gone already, or not ours to signal: nothing to do
            proc.send_signal(sig)  # psutil refuses (NoSuchProcess) when the pid was reused


def _wait_gone(procs: Iterable[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to `timeout_s` for `procs` to exit; returns those still alive (zombies count as gone)."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in procs if _alive(p)]
    while alive and (left := deadline - time.monotonic()) > 0:
        _, still = psutil.wait_procs(alive, timeout=min(POLL_S, left))
        alive = [p for p in still if _alive(p)]
    return alive


@dataclass
class Child:
    """One process the demo started: its name, command, log file and Popen handle."""

    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen[bytes]
    runs_until_stopped: bool = False  # the bootstrap; join peers exit by themselves

    def __post_init__(self) -> None:
        try:  # taken right after the start: it pins the child's create_time against pid reuse
            self.process: psutil.Process | None = psutil.Process(self.popen.pid)
        except psutil.Error:
            self.process = None  # exited already; nothing below it to find

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def descendants(self) -> list[psutil.Process]:
        """Every process below this child in the process tree (while the child exists)."""
        if self.process is None:
            return []
        try:
            return self.process.children(recursive=True)
        except psutil.Error:
            return []

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
    process and its p2pd daemon), which lets `stop_all` find processes that left the tree.
    """

    def __init__(self, workdir: Path, env: Mapping[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        self.marker = uuid.uuid4().hex
        self.env = dict(os.environ if env is None else env)
        self.env[MARKER_ENV] = self.marker
        self.env.setdefault("PYTHONUNBUFFERED", "1")
        self.children: list[Child] = []
        self.watchdogs: list[Watchdog] = []  # one per child: stops it should this process be killed

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
        watchdog = Watchdog()  # a bare environment: it is no process of the run (no marker, no test tags)
        watchdog.start(popen.pid, env={k: v for k, v in os.environ.items() if k in ("PATH", "HOME", "LANG")})
        self.watchdogs.append(watchdog)
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

    def sweep(self) -> dict[int, tuple[psutil.Process, str | None]]:
        """{pid: (process, owning child's name or None)} of every live process of this run but the children.

        The children's descendants, plus any process in a child's process group or carrying this
        run's marker (a process that was re-parented or started a session of its own).
        """
        own = {c.pid for c in self.children} | {os.getpid()}
        groups = {c.pid: c.name for c in self.children}  # each child leads its own group
        found: dict[int, tuple[psutil.Process, str | None]] = {}
        for c in self.children:
            found.update({p.pid: (p, c.name) for p in c.descendants() if p.pid not in own})
        for proc in psutil.process_iter():
            if proc.pid in own or proc.pid in found:
                continue
            try:
                owner = groups.get(os.getpgid(proc.pid))
                if owner is None and proc.environ().get(MARKER_ENV) != self.marker:
                    continue
            except (psutil.Error, OSError):  # gone meanwhile, or another user's process
                continue
            found[proc.pid] = (proc, owner)
        return {pid: entry for pid, entry in found.items() if _alive(entry[0])}

    def stop_all(self, grace_s: float = 5.0) -> None:
        """Stop every child and everything it started; safe to call twice; signals are held off meanwhile.

        1. SIGTERM each child itself, so it can leave the swarm cleanly (its own DHT process and
           p2pd are shut down by it, not killed under it);
        2. once the children have exited, SIGTERM what is left of their trees, groups and every
           process carrying the run's marker, within the same `grace_s`;
        3. SIGKILL whatever is still alive when `grace_s` is over, and reap.
        """
        with _SignalsDeferred():
            deadline = time.monotonic() + grace_s
            known = self.sweep()
            self._signal_children(signal.SIGTERM)
            while time.monotonic() < deadline and self._running_children():
                time.sleep(POLL_S)
            known.update(self.sweep())
            _signal((p for p, _ in known.values()), signal.SIGTERM)
            left = _wait_gone((p for p, _ in known.values()), deadline - time.monotonic())
            while time.monotonic() < deadline and self._running_children():
                time.sleep(POLL_S)
            late = self.sweep()  # still running, or started while the others stopped
            known.update(late)
            stuck = [c.name for c in self._running_children()]
            stuck += [known[p.pid][1] or "a process that left its group" for p in left]
            stuck += [owner or "a process that left its group" for _, owner in late.values()]
            if stuck:
                names = ", ".join(dict.fromkeys(stuck))
                log.warning("%s still running %.1f s after SIGTERM; sending SIGKILL", names, grace_s)
                self._kill_everything(known)
            for c in self.children:
                try:
                    c.popen.wait(timeout=1.0)
                except subprocess.TimeoutExpired:
                    log.error("%s (pid %d) did not die after SIGKILL", c.name, c.pid)
            for watchdog in self.watchdogs:  # everything is stopped: they exit without touching anything
                watchdog.stop()

    def _kill_everything(self, known: dict[int, tuple[psutil.Process, str | None]]) -> None:
        for _ in range(KILL_ROUNDS):
            known.update(self.sweep())
            self._signal_children(signal.SIGKILL)
            _signal((p for p, _ in known.values()), signal.SIGKILL)
            kill_deadline = time.monotonic() + KILL_WAIT_S
            left = _wait_gone((p for p, _ in known.values()), KILL_WAIT_S)
            while time.monotonic() < kill_deadline and self._running_children():
                time.sleep(POLL_S)
            if not left and not self._running_children() and not self.sweep():
                return

    def _running_children(self) -> list[Child]:
        return [c for c in self.children if c.poll() is None]  # poll() also reaps an exited child

    def _signal_children(self, sig: int) -> None:
        for c in self._running_children():
            with contextlib.suppress(ProcessLookupError, PermissionError):  # exited since poll()
                c.popen.send_signal(sig)  # an unreaped child still holds its pid: no reuse possible


_Handler = Callable[[int, FrameType | None], Any] | int | signal.Handlers | None


class _SignalsDeferred:
    """Hold SIGINT/SIGTERM off (main thread only) so a second Ctrl-C cannot interrupt cleanup."""

    def __enter__(self) -> None:
        self.saved: dict[int, _Handler] = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.saved[sig] = signal.signal(sig, signal.SIG_IGN)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for sig, handler in self.saved.items():
            if handler is not None:  # None: a handler installed outside Python, which cannot be put back
                signal.signal(sig, handler)


@contextlib.contextmanager
def stop_on_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT/SIGTERM set `stop` (graceful leave) while the body runs.

    A process forked meanwhile (the hivemind DHT child) gets the previous handlers back, or it
    would ignore the SIGTERM with which shutdown reaps it.
    """
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}

    def restore_in_child() -> None:
        for s, handler in previous.items():
            signal.signal(s, handler)

    os.register_at_fork(after_in_child=restore_in_child)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)

"""A watchdog process that stops a peer's DHT process tree when the peer dies without stopping it.

hivemind starts a DHT process, which starts the libp2p daemon (`p2pd`). A peer that shuts down
stops both (`SwarmDHT.shutdown`); a peer killed by a signal it cannot handle (`kill -9`, the OOM
killer) cannot, and both used to run on for hours, re-parented to init. So next to each DHT
process, the peer starts ``python -m peer.net.watchdog PARENT_PID ROOT_PID ROOT_CREATE_TIME`` in a
session of its own (a Ctrl-C or a `kill` of the peer's process group does not reach it). While
the parent lives, the watchdog records the root's descendant tree every `SCAN_S`; when the
parent is gone it stops what it recorded (SIGTERM, so p2pd removes its socket file, then SIGKILL
after `TERM_GRACE_S`) and exits. A parent that shuts its DHT down writes ``stop`` to the
watchdog's stdin, and the watchdog exits without touching anything.

Why a watchdog and not a parent-death signal (``prctl(PR_SET_PDEATHSIG)``): the signal fires
when the *thread* that forked exits, and `peer` starts DHT nodes from threads (an in-process
bootstrap, tests), so it would kill a live peer's DHT; it is not inherited by `p2pd`, which
hivemind's event loop (uvloop/libuv) spawns without running any Python code in between; and a
DHT process killed at once would leave `p2pd` re-parented before anyone could find it. The
watchdog keeps the DHT process alive until it has looked under it, is plain psutil, and works
wherever `os.getppid` changes when a parent dies (Linux, macOS).

Invariants:
- only the root (checked to be a child or grandchild of the parent (the DHT process is forked by
  the peer's forkserver, `peer.net.dht_child`), by pid and creation time) and processes
  found under a recorded process are ever signalled; psutil re-checks each process's creation
  time before a signal, so a reused pid is never hit;
- nothing is signalled while the parent runs, and a ``stop`` line ends the watchdog at once;
- the watchdog exits on its own within `POLL_S` plus the stopping time once the parent is gone,
  and within `SCAN_S` once every process it recorded has exited by itself;
- this module imports only the standard library, psutil and `peer.net.processes`, so the
  watchdog starts in a fraction of a second.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

import psutil

from peer.net.processes import descendants, running, terminate

logger = logging.getLogger(__name__)

POLL_S = 0.1  # how often the watchdog looks whether its parent is still there
SCAN_S = 1.0  # how often it records the root's descendant tree while the parent lives
TERM_GRACE_S = 1.0  # SIGTERM -> SIGKILL once the parent is gone
KILL_ROUNDS = 3  # a process found under a dying one is stopped in the next round
STOP_WAIT_S = 3.0  # how long `Watchdog.stop` waits for the watchdog to exit
CREATE_TIME_SLACK_S = 1.0  # creation times read by two processes may differ by clock adjustments
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the folder that holds `peer/`


class Watchdog:
    """This process's handle on the watchdog of one process tree. Not started until `start`."""

    def __init__(self) -> None:
        self._popen: subprocess.Popen[bytes] | None = None
        self._owner = os.getpid()  # a forked copy of this handle must not stop the owner's watchdog

    @property
    def pid(self) -> int | None:
        """The watchdog's process id (None unless it was started)."""
        return None if self._popen is None else self._popen.pid

    def start(self, root_pid: int, env: dict[str, str] | None = None) -> None:
        """Start a watchdog that stops `root_pid` and its descendants if this process dies first.

        `env`: the watchdog's environment (default: this process's). A watchdog that cannot start
        is logged, not raised: the peer runs on without it.
        """
        if self._popen is not None:
            raise RuntimeError("this watchdog was started already")
        try:
            create_time = psutil.Process(root_pid).create_time()
        except psutil.Error:
            return  # the root is gone already: nothing to watch
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
        argv = [sys.executable, "-m", "peer.net.watchdog", str(os.getpid()), str(root_pid), repr(create_time)]
        try:
            self._popen = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                env=env,
                start_new_session=True,  # outside the peer's process group: a group signal spares it
                close_fds=True,
            )
        except (OSError, ValueError) as e:  # no executable, no memory, no file descriptors
            logger.warning("could not start the DHT watchdog (%s): a crash may leave the DHT process running", e)
            return
        logger.debug("watchdog %d guards process %d", self._popen.pid, root_pid)

    def stop(self) -> None:
        """Tell the watchdog that the tree was stopped cleanly and reap it. Idempotent."""
        popen, self._popen = self._popen, None
        if popen is None or os.getpid() != self._owner:
            return
        try:
            assert popen.stdin is not None  # started with stdin=PIPE
            popen.stdin.write(b"stop\n")
            popen.stdin.close()
        except OSError as e:  # it exited already (its parent check cannot fail while we run)
            logger.debug("watchdog %d: %r", popen.pid, e)
        try:
            popen.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            logger.warning("watchdog %d did not exit within %.0f s; killing it", popen.pid, STOP_WAIT_S)
            popen.kill()
            popen.wait()


# --- the watchdog process ------------------------------------------------------------------------


def _record(recorded: dict[int, psutil.Process]) -> None:
    """Add the live descendants of every recorded process that still runs."""
    for proc in [p for p in recorded.values() if running(p)]:
        for child in descendants(proc.pid):
            if child.pid not in recorded:
                recorded[child.pid] = child
                logger.debug("recorded process %d (a descendant of %d)", child.pid, proc.pid)


def _started_by(parent_pid: int, proc: psutil.Process) -> bool:
    """Whether `proc` is the parent's child, or a child of the parent's multiprocessing forkserver."""
    if proc.ppid() == parent_pid:
        return True
    middle = proc.parent()
    if middle is None or middle.ppid() != parent_pid:
        return False
    return "multiprocessing.forkserver" in " ".join(middle.cmdline())


def _root(parent_pid: int, root_pid: int, create_time: float) -> psutil.Process | None:
    """The root process if it is the one the parent named (and its child, while the parent runs)."""
    try:
        root = psutil.Process(root_pid)
        if abs(root.create_time() - create_time) > CREATE_TIME_SLACK_S:
            return None
        if os.getppid() == parent_pid and not _started_by(parent_pid, root):
            return None  # our parent lives, so its child (or its forkserver's) would still be under it
    except psutil.Error:
        return None
    return root


def _read_stop(stop: threading.Event) -> None:
    """Set `stop` when the parent writes "stop"; end of input alone means nothing (the parent may be dying)."""
    for line in sys.stdin.buffer:
        if line.strip() == b"stop":
            stop.set()
            return


def watch(parent_pid: int, root_pid: int, create_time: float, stop: threading.Event) -> list[int]:
    """Watch until `stop` is set (return []) or the parent is gone (stop the tree; return its pids)."""
    root = _root(parent_pid, root_pid, create_time)
    if root is None:
        return []
    recorded = {root.pid: root}
    try:
        parent: psutil.Process | None = psutil.Process(parent_pid)
    except psutil.Error:
        parent = None
    next_scan = 0.0
    while parent is not None and os.getppid() == parent_pid and running(parent):
        if time.monotonic() >= next_scan:
            _record(recorded)
            recorded = {pid: p for pid, p in recorded.items() if running(p)}
            if not recorded:  # the whole tree exited by itself: nothing left to guard
                return []
            next_scan = time.monotonic() + SCAN_S
        if stop.wait(POLL_S):
            return []
    t0 = time.monotonic()
    stopped: set[int] = set()
    for _ in range(KILL_ROUNDS):
        _record(recorded)
        live = [p for p in recorded.values() if running(p)]
        if not live:
            break
        stopped.update(p.pid for p in live)
        terminate(live, TERM_GRACE_S)
    if stopped:
        logger.warning(
            "process %d died without stopping its DHT; stopped the %d processes it left (%s) in %.2f s",
            parent_pid,
            len(stopped),
            ", ".join(map(str, sorted(stopped))),
            time.monotonic() - t0,
        )
    return sorted(stopped)


def main(argv: Sequence[str]) -> int:
    """Entry point: ``python -m peer.net.watchdog PARENT_PID ROOT_PID ROOT_CREATE_TIME``."""
    level = os.environ.get("PEER_LOG_LEVEL", "WARNING").upper()  # as the CLI reads it
    logging.basicConfig(level=level, format="%(asctime)s peer watchdog[%(process)d]: %(message)s")
    if len(argv) != 3:
        logger.error("usage: python -m peer.net.watchdog PARENT_PID ROOT_PID ROOT_CREATE_TIME")
        return 2
    parent_pid, root_pid, create_time = int(argv[0]), int(argv[1]), float(argv[2])
    stop = threading.Event()
    threading.Thread(target=_read_stop, args=(stop,), name="stdin", daemon=True).start()
    watch(parent_pid, root_pid, create_time, stop)
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1:])
    logging.shutdown()
    os._exit(code)  # the stdin reader may still block in a read: a normal exit would abort on its lock

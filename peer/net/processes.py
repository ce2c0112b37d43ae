"""The DHT daemon's child-process tree: remember it while it runs, make sure it is gone at the end.

hivemind runs its DHT node in a child process, which starts the libp2p daemon (`p2pd`). A crash
or an interrupted shutdown can leave either behind, so a node remembers the whole tree once it
has started and terminates what is left of it after shutting down; should the node's own process
die first, `peer.net.watchdog` does it with the same helpers. `stop_dht_node` is the whole end
of a hivemind DHT node: its graceful shutdown, then the tree, then its watchdog.

Invariants: processes are remembered as `psutil.Process` objects, which carry their creation
time, so a pid reused by an unrelated process is never signalled (psutil checks before every
signal); zombies count as gone; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable
from typing import Any, Protocol

import psutil

logger = logging.getLogger(__name__)


def descendants(pid: int) -> list[psutil.Process]:
    """Every live descendant of `pid` (children, grandchildren, ...); empty once `pid` is gone."""
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def running(proc: psutil.Process) -> bool:
    """True while `proc` is the same process it was and is not a zombie."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_gone(procs: Iterable[psutil.Process], timeout_s: float) -> list[psutil.Process]:
    """Wait up to `timeout_s` for `procs` to exit (reaping our own children); those still running."""
    live = [p for p in procs if running(p)]
    deadline = time.monotonic() + timeout_s
    while live and time.monotonic() < deadline:
        # wait_procs blocks until the timeout on a zombie another process has to reap: poll briefly
        _, live = psutil.wait_procs(live, timeout=min(0.05, max(0.0, deadline - time.monotonic())))
        live = [p for p in live if running(p)]
    return live


def terminate(procs: Iterable[psutil.Process], grace_s: float = 2.0) -> None:
    """SIGTERM `procs`, then SIGKILL whatever still runs after `grace_s`, and wait for them."""
    live = [p for p in procs if running(p)]
    for stop in (psutil.Process.terminate, psutil.Process.kill):
        if not live:
            return
        for p in live:
            logger.debug("%s leftover hivemind process %d", stop.__name__, p.pid)
            with contextlib.suppress(psutil.Error):  # gone meanwhile (or its pid now belongs to someone else)
                stop(p)
        live = wait_gone(live, grace_s)


class ProcessTree:
    """The processes of one child's tree, remembered by identity (pid and creation time)."""

    def __init__(self) -> None:
        self._procs: dict[int, psutil.Process] = {}

    def add(self, pid: int) -> None:
        """Remember `pid` and its current descendants (a process that is already gone is skipped)."""
        try:
            procs = [psutil.Process(pid), *descendants(pid)]
        except psutil.Error:
            procs = descendants(pid)
        for p in procs:
            self._procs.setdefault(p.pid, p)

    @property
    def pids(self) -> list[int]:
        """Every remembered pid, sorted (gone or not)."""
        return sorted(self._procs)

    def terminate(self, grace_s: float = 2.0) -> None:
        """Terminate (then kill) whatever is still running of the remembered processes."""
        terminate(self._procs.values(), grace_s)


class Stoppable(Protocol):
    def stop(self) -> None: ...


def stop_dht_node(dht: Any, tree: ProcessTree, watchdog: Stoppable) -> None:
    """Shut a hivemind DHT down, make sure its child and p2pd are gone, then release its watchdog."""
    try:
        if dht.pid is None:
            return
        if dht.is_alive():
            tree.add(dht.pid)
            try:
                dht.shutdown()  # graceful: the child shuts p2pd down and waits for it; else SIGTERM
            except Exception as e:  # a broken pipe if the child already died
                logger.debug("hivemind DHT shutdown: %r", e)
        dht.join(timeout=5.0)
        tree.terminate()
        dht.join(timeout=1.0)
    finally:
        watchdog.stop()

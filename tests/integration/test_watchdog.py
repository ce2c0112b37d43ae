"""The DHT watchdog with plain processes: what it stops, what it never touches, when it exits.

A parent process starts a root (which starts a grandchild) and an unrelated sibling, and a
`Watchdog` for the root. `kill -9` of the parent must take the root and the grandchild down and
leave the sibling alone; a ``stop`` must end the watchdog and leave everything alone.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from peer.net.watchdog import SCAN_S, watch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

PARENT = """
import json, subprocess, sys, time
from peer.net.watchdog import Watchdog
ROOT = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
root = subprocess.Popen([sys.executable, "-c", ROOT])
sibling = subprocess.Popen(["sleep", "60"])
watchdog = Watchdog()
watchdog.start(root.pid)
print(json.dumps({"root": root.pid, "sibling": sibling.pid, "watchdog": watchdog.pid}), flush=True)
if sys.argv[1] == "stop":
    sys.stdin.readline()
    watchdog.stop()
    print("stopped", flush=True)
time.sleep(60)
"""


def _alive(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait(cond, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _start_parent(mode: str) -> tuple[subprocess.Popen, dict[str, psutil.Process], psutil.Process]:
    """The parent, its processes (root, grandchild, sibling, watchdog), once the watchdog has recorded them."""
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # the watchdog inherits it: its debug lines say what it recorded
        text=True,
        start_new_session=True,
        env={**os.environ, "PEER_LOG_LEVEL": "DEBUG"},
    )
    log: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [log.put(line) for line in parent.stderr], daemon=True).start()
    pids = json.loads(parent.stdout.readline())
    procs = {name: psutil.Process(pid) for name, pid in pids.items()}
    assert _wait(lambda: procs["root"].children(), 10), "the root started no grandchild"
    (procs["grandchild"],) = procs["root"].children()
    recorded = f"recorded process {procs['grandchild'].pid} "
    deadline = time.monotonic() + 10 * SCAN_S
    while True:  # wait for the watchdog's own word that it recorded the grandchild
        try:
            if recorded in log.get(timeout=max(0.0, deadline - time.monotonic())):
                break
        except queue.Empty:
            raise AssertionError("the watchdog never recorded the grandchild") from None
    return parent, procs, procs["watchdog"]


def _kill_all(procs: dict[str, psutil.Process]) -> None:
    for proc in procs.values():
        with contextlib.suppress(psutil.Error):
            proc.kill()  # psutil checks the creation time first: never a reused pid


def test_kill_9_of_the_parent_stops_the_root_tree_and_nothing_else(reap_children):
    parent, procs, watchdog = _start_parent("crash")
    try:
        parent.send_signal(signal.SIGKILL)
        parent.wait(5)
        t0 = time.monotonic()
        assert _wait(lambda: not _alive(procs["root"]) and not _alive(procs["grandchild"]), 5)
        print(f"\nroot tree gone {time.monotonic() - t0:.2f} s after kill -9 of its parent")
        assert _wait(lambda: not _alive(watchdog), 5), "the watchdog did not exit after its parent died"
        assert _alive(procs["sibling"]), "the watchdog killed a process outside the root's tree"
    finally:
        _kill_all(procs)


def test_stop_ends_the_watchdog_and_touches_nothing(reap_children):
    parent, procs, watchdog = _start_parent("stop")
    try:
        parent.stdin.write("\n")
        parent.stdin.flush()
        assert parent.stdout.readline().strip() == "stopped"
        assert not _alive(watchdog)
        assert _alive(procs["root"]) and _alive(procs["grandchild"])
        parent.send_signal(signal.SIGKILL)  # no watchdog any more: the root is left to us
        parent.wait(5)  # the watchdog that could have acted on this death exited above
        assert _alive(procs["root"]) and _alive(procs["grandchild"]) and _alive(procs["sibling"])
    finally:
        _kill_all(procs)


def test_watch_refuses_a_root_that_is_not_the_parents_child(reap_children):
    stranger = subprocess.Popen(["sleep", "30"])  # our child, not our parent's
    try:
        proc = psutil.Process(stranger.pid)
        stop = threading.Event()
        assert watch(os.getppid(), stranger.pid, proc.create_time(), stop) == []
        assert watch(os.getppid(), stranger.pid, proc.create_time() - 100.0, stop) == []  # another process
        assert stranger.poll() is None
    finally:
        stranger.kill()
        stranger.wait()

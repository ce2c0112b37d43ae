"""A peer asked to leave (SIGTERM to its process group, as a supervisor or Ctrl-C in its terminal
sends it) leaves within seconds whatever it is waiting on: its DHT node starting (the signal kills
the DHT child too: no 30 s wait for a node that will never be ready, no second start), the manifest,
the replay of a late join. Nothing of it keeps running. One bootstrap serves every case: each joins
a new full replica under its own name.
"""

from __future__ import annotations

import os
import signal
import time

import psutil
import pytest

from tests.e2e.cli_swarm import Swarm

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

LEAVE_S = 8.0  # the harness's `peer bench chaos` counts a leave slower than 10 s


def _group(pgid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if os.getpgid(p.pid) == pgid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    sw = Swarm(tmp_path_factory.mktemp("leave"), outer_steps=1000)
    try:
        yield sw
    finally:
        sw.close()


@pytest.mark.parametrize("after_s", [0.3, 1.5, 4.0, 9.0])
def test_a_joining_full_replica_leaves_within_seconds_of_sigterm(swarm, after_s):
    sw = swarm
    name = f"full-{after_s}"
    sw.join(name, "--full-replica", "--device", "cpu")
    sw.wait_for(lambda: "peer join:" in sw.log(name), timeout_s=120, poll_s=0.05)
    time.sleep(after_s)  # from the DHT node's start to the late join, depending on the machine
    proc = sw.procs[name]
    t0 = time.monotonic()
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        rc = proc.wait(timeout=LEAVE_S)
    except Exception:  # noqa: BLE001 - reported below with the log
        rc = None
    left_s = time.monotonic() - t0
    assert rc == 0, f"rc {rc} {left_s:.1f} s after SIGTERM:\n{sw.log(name)}"
    deadline = time.monotonic() + 5.0
    while _group(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _group(proc.pid), [p.cmdline()[:3] for p in _group(proc.pid)]

"""A peer whose hivemind DHT process dies (killed, crashed) says so and exits, instead of idling.

Nothing inside the peer can bring its DHT process back, and every DHT wait would time out for
ever, so a stage peer kept looking alive while doing nothing. Now the role ends at its next loop
(`Session.check_alive`): exit code 2, one `error:` line that says to start `peer join` again (with
`--resume`), no traceback, and nothing of its process tree left behind (p2pd, watchdog).
"""

from __future__ import annotations

import signal
import time

import psutil
import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]

EXIT_WITHIN_S = 20.0


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _dht_process(pid: int) -> psutil.Process:
    """The peer's hivemind DHT process: the process under it (forked by its forkserver) that runs p2pd."""
    for child in psutil.Process(pid).children(recursive=True):
        if any("p2pd" in " ".join(g.cmdline()) for g in child.children()):
            return child
    raise AssertionError(f"no DHT process under {pid}: {[c.cmdline() for c in psutil.Process(pid).children()]}")


def test_a_stage_peer_whose_dht_process_dies_exits_with_one_line(swarm_factory):
    sw = swarm_factory(outer_steps=1000)
    sw.join("s1", "--stage", "1")
    sw.wait_for(lambda: sw.events("s1", "start"))
    proc = sw.procs["s1"]
    tree = psutil.Process(proc.pid).children(recursive=True)
    _dht_process(proc.pid).send_signal(signal.SIGKILL)
    t0 = time.monotonic()
    code = proc.wait(timeout=EXIT_WITHIN_S)
    took = time.monotonic() - t0
    log = sw.log("s1")
    assert code == 2, log
    errors = [line for line in log.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "DHT process of this peer exited" in errors[0] and "--resume" in errors[0], log
    assert "Traceback" not in log, log
    while any(_alive(p) for p in tree) and time.monotonic() - t0 < EXIT_WITHIN_S:
        time.sleep(0.1)
    left = [" ".join(p.cmdline()) for p in tree if _alive(p)]
    assert not left, f"the peer left {left}"
    print(f"\nDHT process killed: the stage peer exited with code 2 after {took:.2f} s")

"""A process frozen mid-lookup (SIGSTOP) keeps its DHT: a wait that overslept its deadline while
frozen gets its answer instead of a "no answer within N s" error (peer.net.answers.await_answer).

The child runs a real hivemind DHT node and looks up a stage record in a tight loop, so its main
thread is almost always inside a lookup's wait; the test freezes only that process (its DHT child
keeps running) for longer than the lookup deadline + FROZEN_S, twice.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from peer.errors import NetworkError
from peer.net.answers import FROZEN_S
from tests.conftest import assert_no_leftover_children, live_descendants

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TIMEOUT_S = 2.0

CHILD = textwrap.dedent(
    f"""
    import os
    import sys
    import time
    from peer.net.dht import SwarmDHT
    dht = SwarmDHT(request_timeout_s={TIMEOUT_S})
    dht.set_run("frozen-run", n_stages=2)
    dht.announce_stage(1, {{"address": "127.0.0.1:1", "outer_step": 0}}, ttl_s=600)
    print("ready", flush=True)
    n, stop_at, done = 0, time.monotonic() + 60, sys.argv[1]  # until the parent is past its two freezes
    try:
        while time.monotonic() < stop_at and not os.path.exists(done):
            assert dht.get_stage_peers(1), "our own record vanished"
            n += 1
    except Exception as exc:
        print("error", type(exc).__name__, exc, flush=True)
        sys.exit(3)
    finally:
        dht.shutdown()
    print("lookups", n, flush=True)
    """
)


def test_a_lookup_frozen_past_its_deadline_still_gets_its_answer(tmp_path):
    before = live_descendants(os.getpid())
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(tmp_path / "done")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.strip() == "ready", line
        for _ in range(2):
            time.sleep(0.5)
            os.kill(proc.pid, signal.SIGSTOP)  # the Python process only: its hivemind child runs on
            time.sleep(TIMEOUT_S + FROZEN_S + 1.0)
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(1.0)  # lookups after the last freeze
        (tmp_path / "done").touch()
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    lookups = [int(x.split()[1]) for x in out.splitlines() if x.startswith("lookups ")]
    assert lookups and lookups[0] > 10, out
    assert_no_leftover_children(before, wait_s=10.0)


KILLED = textwrap.dedent(
    """
    import os
    import signal
    import threading
    from peer.errors import NetworkError
    from peer.net.dht import SwarmDHT
    dht = SwarmDHT(request_timeout_s=600.0)
    try:
        dht.set_run("gone-run", n_stages=2)
        dht_pid = dht.process_pid
        assert dht_pid in dht.child_pids
        os.kill(dht_pid, signal.SIGSTOP)
        outcome = []
        def lookup():
            try:
                dht.get_stage_peers(1)
            except BaseException as exc:
                outcome.append(exc)
        thread = threading.Thread(target=lookup)
        thread.start()
        os.kill(dht_pid, signal.SIGKILL)
        thread.join(300.0)
        print("alive" if thread.is_alive() else "ended", flush=True)
        for exc in outcome:
            print("error", type(exc).__name__, isinstance(exc, NetworkError), exc, flush=True)
    finally:
        dht.shutdown()
    """
)


def test_a_lookup_ends_when_its_dht_process_dies_instead_of_waiting_out_the_deadline(tmp_path):
    """A signal to the whole process group stops the DHT process too: a lookup then in flight must
    end with "the hivemind DHT process exited", not wait out its deadline for an answer that cannot
    come (leaving took 15 s per wait). The DHT process is frozen so the lookup is surely in flight,
    then killed. In a child process of its own: a DHT process killed while it answers can leave the
    answers' pipe that hivemind shares per process broken, and every later DHT of this pytest worker
    would then wait out its start (as happened on CI when another module followed on the worker)."""
    before = live_descendants(os.getpid())
    proc = subprocess.run(
        [sys.executable, "-c", KILLED], capture_output=True, text=True, timeout=360, start_new_session=True
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    lines = proc.stdout.splitlines()
    assert "ended" in lines, out
    (error,) = [line for line in lines if line.startswith("error ")]
    assert error.split()[2] == "True" and "the hivemind DHT process exited" in error, out  # a NetworkError
    assert_no_leftover_children(before, wait_s=10.0)


def _answer_late(future, delay_s: float) -> None:
    time.sleep(delay_s)
    future.set_result("late answer")


def test_an_answer_after_the_deadline_is_taken_by_the_future_never_raced_by_a_cancel():
    """A wait that gave up leaves its future pending: the answer that comes afterwards is delivered
    to it by hivemind's thread (a cancelled future made that thread log a traceback when the answer
    of a frozen wait arrived as the wait timed out)."""
    import multiprocessing as mp

    from hivemind.utils.mpfuture import MPFuture

    from peer.net.answers import await_answer

    future: MPFuture = MPFuture()
    child = mp.get_context("fork").Process(target=_answer_late, args=(future, 1.5))
    child.start()
    try:
        with pytest.raises(NetworkError, match="got no answer within 1 s"):
            await_answer(future, "a lookup", timeout_s=1.0, retry_s=1.0, hint="late")
        assert not future.cancelled()
        assert future.result(timeout=10) == "late answer"
    finally:
        child.join(timeout=10)
    assert child.exitcode == 0

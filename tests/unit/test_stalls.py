"""The stall watch (`peer.node.round.stalls`): a late tick is a stall, remembered with when it ended.

Driven by hand (`tick()` with a set monotonic clock), never by sleeping: what a SIGSTOP does to the
real thread is the e2e chaos run's and test_verified_state's frozen replica's to show."""

from __future__ import annotations

import time

from peer.node.round import stalls
from peer.node.round.stalls import StallWatch
from peer.node.round.timings import RoundTimings


def _watch(clock: list[float]) -> StallWatch:
    return StallWatch(tick_s=0.2, late_s=1.0, clock=lambda: clock[0], start=False)  # ticked by the test


def test_a_late_tick_is_a_stall_that_counts_after_the_time_it_ended():
    clock = [100.0]
    w = _watch(clock)
    for _ in range(5):
        clock[0] += 0.2
        w.tick()
    assert w.longest_since(0.0) == 0.0  # on time: no stall
    clock[0] += 18.0  # frozen
    w.tick()
    assert w.longest_since(100.0) == 18.0  # began before 100.5, ended after: it counts
    assert w.longest_since(clock[0]) == 0.0  # a round that began after it saw none
    clock[0] += 0.2
    w.tick()
    clock[0] += 3.0  # standing still now, not ticked yet
    assert w.longest_since(clock[0] - 1) == 3.0


def test_a_round_counts_a_stall_only_past_its_records_lifetime(monkeypatch):
    clock = [50.0]
    w = _watch(clock)
    monkeypatch.setattr(stalls, "_WATCH", w)
    t = RoundTimings(deadline_s=8.0, lapse_s=4.5)
    clock[0] += 4.0
    w.tick()
    assert not t.stalled(since=49.0)  # our records (5 s, refreshed every 0.5 s) outlived it
    clock[0] += 5.0
    w.tick()
    assert t.stalled(since=49.0)


def test_the_process_watch_ticks_on_its_own():
    w = stalls.stall_watch()
    assert w is stalls.stall_watch() and w.thread is not None and w.thread.is_alive()
    before = w._last
    deadline = time.monotonic() + 5
    while w._last == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert w._last > before

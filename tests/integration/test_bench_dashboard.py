"""`peer bench dashboard`'s two measurements, small (peer/research/bench/dashboard.py, browser.py): a real
collector, history file, HTTP server on 127.0.0.1 and, when installed, headless Chromium over its
DevTools pipe on the real clock."""

from __future__ import annotations

import pytest

from peer.research.bench.dashboard import first_paint, memory
from tests.browser import CHROMIUM

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_the_first_paint_is_timed_on_the_real_clock_and_the_memory_run_keeps_every_round(tmp_path):
    paint = first_paint(tmp_path, holders=40, stages=2, replicas=2, polls=3, repeats=2)
    assert paint["api_dashboard_bytes"] > 1000 and 0 < paint["api_dashboard_s"] < 10
    if CHROMIUM is not None:
        assert len(paint["first_paint_runs_s"]) == 2 and 0 < paint["first_paint_s"] < 30
        assert paint["navigate_to_seen_s"] >= paint["first_paint_s"] - 0.05  # seen from outside: no sooner
    else:
        assert paint["first_paint_s"] is None
    mem = memory(tmp_path, rounds=40, holders=8, stages=2, replicas=2)
    assert [s["rounds"] for s in mem["samples"]] == [10, 20, 30, 40]
    assert mem["points_kept_per_replica"] == 40 and all(s["history_bytes"] > 0 for s in mem["samples"])

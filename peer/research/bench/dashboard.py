"""`peer bench dashboard`: the dashboard's first paint with many holders, and its memory after many rounds.

Two measurements, both on loopback with the real collector, history file, HTTP server and (for the
first paint) headless Chromium:

1. `first_paint`: a run of `holders` stage holders over `stages` stages and `replicas` replicas, as
   `polls` reads of their records (simulated records, parsed types as the DHT hands them over:
   `peer.net.records`), is served; Chromium opens the page `repeats` times and the page's own
   `performance.now()` at the end of its first render (<body data-first-paint-ms>) is the figure,
   beside the wall time of the whole Chromium process (its start-up included) and the time and size
   of one `/api/dashboard` answer.
2. `memory`: a fresh history takes `rounds` reads, each one committed round of every replica (its
   record's last 8 rounds, as published) and `memory_holders` holders' claims; the process's RSS and
   the history file's size are sampled every quarter of the way. The rings are bounded, so both stop
   growing once the rings are full (capacity 4096 points per series).

Returns plain dicts; `peer.cli.bench` prints them.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

from peer.bootstrap.dashboard.collect import Collector
from peer.bootstrap.dashboard.history import History
from peer.bootstrap.dashboard.server import serve_dashboard
from peer.net.records import ReplicaRecord, StageRecord
from peer.net.round_points import MAX_ROUNDS, RoundPoint
from peer.research.bench.browser import Chromium

PAINTED = "document.body ? (document.body.dataset.firstPaintMs || '') : ''"  # set by dashboard.js


def chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _manifest(stages: int) -> dict[str, Any]:
    return {"run_id": "bench-dashboard", "k": 8, "config": {"preset": "tiny", "stages": stages, "train": {}}}


def _peer_id(kind: str, i: int) -> str:
    """A peer id as long and as varied as a real one (base58 of an RSA key's multihash: "Qm" + 44)."""
    return "Qm" + hashlib.sha256(f"{kind}-{i}".encode()).hexdigest()[:44]


def _records(
    t: int, holders: int, stages: int, replicas: int
) -> tuple[dict[int, dict[str, StageRecord]], dict[str, ReplicaRecord]]:
    """Round t's records: `holders` holders spread over the stages, `replicas` replicas with their last rounds."""
    by_stage: dict[int, dict[str, StageRecord]] = {s: {} for s in range(stages)}
    for i in range(holders):
        s = i % stages
        pid = _peer_id("holder", i)
        by_stage[s][pid] = StageRecord(
            address=f"10.0.{i // 250}.{i % 250}:4000", role="trainer", state="ready", outer_step=t,
            state_id=f"{s:02d}{t:014x}", tokens_per_s=1000.0 + i, peer_id=pid,
        )  # fmt: skip
    reps = {}
    for r in range(replicas):
        pid = _peer_id("replica", r)
        rounds = tuple(
            RoundPoint(x, 5.0 / (1 + x / 100), 5.1 / (1 + x / 100), 10.0) for x in range(max(0, t - MAX_ROUNDS), t)
        )
        kind = "full" if r % 2 else "pipeline"
        reps[pid] = ReplicaRecord(kind=kind, outer_step=t, tokens_per_s=5000.0, rounds=rounds, peer_id=pid)
    return by_stage, reps


def first_paint(
    workdir: Path, holders: int = 1000, stages: int = 4, replicas: int = 8, polls: int = 50, repeats: int = 3
) -> dict[str, Any]:
    """The first paint of a dashboard over `holders` holders (see the module docstring)."""
    browser = chromium()
    collector = Collector(History(workdir / "paint.sqlite"), _manifest(stages), poll_s=2.0)
    start = time.time() - polls * 2.0
    for t in range(1, polls + 1):
        collector.ingest(*_records(t, holders, stages, replicas), now=start + t * 2.0)
    server = serve_dashboard(collector, 0)
    try:
        api_s, size = [], 0
        for _ in range(5):
            began = time.perf_counter()
            with urllib.request.urlopen(server.url + "api/dashboard", timeout=30) as answer:
                size = len(answer.read())
            api_s.append(time.perf_counter() - began)
        paints, walls = [], []
        if browser is not None:
            with Chromium(browser) as tab:
                for _ in range(repeats):
                    painted_ms, wall = tab.first_paint(server.url, PAINTED)
                    paints.append(painted_ms / 1000)
                    walls.append(wall)
    finally:
        server.stop()
        collector.history.close()
    return {
        "holders": holders, "stages": stages, "replicas": replicas, "polls": polls, "chromium": browser,
        "first_paint_s": statistics.median(paints) if paints else None, "first_paint_runs_s": paints,
        "navigate_to_seen_s": statistics.median(walls) if walls else None,
        "api_dashboard_s": statistics.median(api_s), "api_dashboard_bytes": size,
    }  # fmt: skip


def memory(
    workdir: Path, rounds: int = 10_000, holders: int = 100, stages: int = 4, replicas: int = 8
) -> dict[str, Any]:
    """RSS and history size over `rounds` reads (see the module docstring)."""
    proc = psutil.Process()
    path = workdir / "memory.sqlite"
    collector = Collector(History(path), _manifest(stages), poll_s=2.0)
    start = time.time() - rounds * 2.0
    samples = []
    began = time.perf_counter()
    rss0 = proc.memory_info().rss
    for t in range(1, rounds + 1):
        collector.ingest(*_records(t, holders, stages, replicas), now=start + t * 2.0)
        if t % max(1, rounds // 4) == 0 or t == rounds:
            size = sum(p.stat().st_size for p in workdir.glob("memory.sqlite*"))
            samples.append({"rounds": t, "rss_bytes": proc.memory_info().rss, "history_bytes": size})
    seconds = time.perf_counter() - began
    points = len(collector.history.points(f"loss:{_peer_id('replica', 0)}"))
    collector.history.close()
    return {
        "rounds": rounds, "holders": holders, "stages": stages, "replicas": replicas,
        "rss_start_bytes": rss0, "samples": samples, "points_kept_per_replica": points,
        "ingest_s_per_round": seconds / rounds, "pid": os.getpid(),
    }  # fmt: skip

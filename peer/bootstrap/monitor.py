"""What `peer bootstrap --metrics-port` reports: the swarm as the bootstrap's DHT node sees it.

`SwarmMonitor.poll()` reads the run's stage and replica records (one DHT read per stage plus one)
and keeps a snapshot: peers holding each stage now, distinct peers seen per stage since start,
replicas online by kind (pipeline heads, full replicas), the largest outer step, plus the
bootstrap's own counters (manifest publications and failed refreshes, artefacts served) and its
up time. Each read is also handed to `on_read` (the dashboard: `peer.bootstrap.dashboard.collect`),
so metrics and dashboard share one read of the records. The HTTP endpoint
(`peer.net.prometheus.serve_swarm_metrics`) reads the snapshot at each scrape, so a scrape never
waits on the DHT; `BootstrapNode.serve` polls every `poll_s`.

Invariants: a failed read, or an `on_read` that raises, is counted and keeps the last snapshot
(never raises into the serve loop); the sets of peers seen only grow; `summarize` is pure.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from peer.errors import PeerError
from peer.net.dht import SwarmDHT
from peer.net.records import ReplicaRecord, StageRecord

logger = logging.getLogger(__name__)


def summarize(stages: Mapping[int, Mapping[str, StageRecord]], replicas: Mapping[str, ReplicaRecord]) -> dict[str, Any]:
    """Live peers per stage, replicas by kind and the largest outer step of a set of records."""
    kinds: dict[str, int] = {"pipeline": 0, "full": 0}
    for rec in replicas.values():
        if rec.kind:
            kinds[rec.kind] = kinds.get(rec.kind, 0) + 1
    steps = [rec.outer_step for recs in stages.values() for rec in recs.values()]
    steps += [rec.outer_step for rec in replicas.values()]
    outer = max([0, *(s for s in steps if s is not None)])
    return {"stage_peers": {s: len(recs) for s, recs in stages.items()}, "replicas": kinds, "outer_step": outer}


class SwarmMonitor:
    """The bootstrap's snapshot of the swarm (see the module docstring); thread-safe."""

    def __init__(
        self,
        dht: SwarmDHT,
        n_stages: int,
        counters: Callable[[], Mapping[str, int]],
        on_read: Callable[[dict[int, dict[str, StageRecord]], dict[str, ReplicaRecord]], None] | None = None,
    ) -> None:
        """`on_read(stages, replicas)` receives every successful read (the dashboard's collector)."""
        self.dht, self.n_stages, self.counters, self.on_read = dht, n_stages, counters, on_read
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._seen: dict[int, set[str]] = {s: set() for s in range(n_stages)}
        self._last = summarize({s: {} for s in range(n_stages)}, {})
        self._failures = 0

    def poll(self) -> None:
        """Read the stage and replica records once; a failed read is counted, the last snapshot kept."""
        try:
            stages = {s: self.dht.get_stage_peers(s) for s in range(self.n_stages)}
            replicas = self.dht.get_replicas()
        except PeerError as exc:
            with self._lock:
                self._failures += 1
            logger.debug("could not read the swarm's records for metrics: %s", exc)
            return
        summary = summarize(stages, replicas)
        with self._lock:
            for s, recs in stages.items():
                self._seen[s].update(recs)
            self._last = summary
        if self.on_read is not None:
            try:
                self.on_read(stages, replicas)
            except Exception:  # the dashboard (a full disk, a bug) must not take the manifest down: logged
                with self._lock:
                    self._failures += 1
                logger.exception("the dashboard could not take the swarm's records; it keeps its last view")

    def snapshot(self) -> dict[str, Any]:
        """What `SwarmCollector` reads at each scrape."""
        counters = self.counters()
        with self._lock:
            return {
                **self._last,
                "uptime_s": time.monotonic() - self.started,
                "stage_seen": {s: len(ids) for s, ids in self._seen.items()},
                "manifest_publications": 1 + counters.get("manifest_refreshes", 0),  # the first one, then refreshes
                "manifest_refresh_failures": counters.get("manifest_refresh_failures", 0),
                "artifacts_served": counters.get("artifacts_served", 0),
                "poll_failures": self._failures,
            }

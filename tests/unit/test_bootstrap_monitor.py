"""`peer bootstrap --metrics-port`: the swarm summary (`peer.bootstrap.monitor`) and its Prometheus series.

- `summarize` counts live peers per stage, replicas by kind and the largest outer step (junk ignored);
- `SwarmMonitor.snapshot` adds the bootstrap's counters (publications = the first + refreshes);
- `SwarmCollector` exposes a snapshot as `peer_bootstrap_*` series (parsed back from the text format).
The live process is scraped over HTTP in tests/e2e/test_bootstrap_cli.py.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from peer.bootstrap.monitor import SwarmMonitor, summarize
from peer.errors import NetworkError
from peer.net.prometheus import SwarmCollector
from peer.net.records import ReplicaRecord, StageRecord


def test_summarize_counts_live_peers_replicas_and_the_outer_step():
    stages = {0: {"h": StageRecord(outer_step=4)}, 1: {"a": StageRecord(outer_step=3), "b": StageRecord()}, 2: {}}
    replicas = {
        "h": ReplicaRecord(kind="pipeline", outer_step=4),
        "f": ReplicaRecord(kind="full", outer_step=5),
        "x": ReplicaRecord(),
    }
    out = summarize(stages, replicas)
    assert out == {"stage_peers": {0: 1, 1: 2, 2: 0}, "replicas": {"pipeline": 1, "full": 1}, "outer_step": 5}
    assert summarize({0: {}}, {})["outer_step"] == 0


class _Records:
    """The two reads SwarmMonitor makes, answering from a dict (fails once when told to)."""

    def __init__(self) -> None:
        self.stages: dict[int, dict] = {0: {}, 1: {}}
        self.replicas: dict[str, dict] = {}
        self.fail = False

    def get_stage_peers(self, stage: int) -> dict:
        if self.fail:
            raise NetworkError("timeout")
        return self.stages[stage]

    def get_replicas(self) -> dict:
        return self.replicas


def _samples(monitor: SwarmMonitor) -> dict:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(monitor.snapshot))
    families = text_string_to_metric_families(generate_latest(registry).decode())
    return {(s.name, tuple(s.labels.values())): s.value for f in families for s in f.samples}


def test_the_monitor_keeps_peers_seen_and_the_last_snapshot_when_a_read_fails():
    records = _Records()
    counters = {"manifest_refreshes": 2, "artifacts_served": 5}
    monitor = SwarmMonitor(records, 2, lambda: counters)  # type: ignore[arg-type]
    records.stages[1] = {"a": StageRecord(outer_step=1), "b": StageRecord(outer_step=1)}
    records.replicas = {"f": ReplicaRecord(kind="full", outer_step=1)}
    monitor.poll()
    records.stages[1] = {"b": StageRecord(outer_step=2)}  # a left
    monitor.poll()
    records.fail = True
    monitor.poll()
    got = _samples(monitor)
    assert got[("peer_bootstrap_stage_peers", ("1",))] == 1
    assert got[("peer_bootstrap_stage_peers_seen_total", ("1",))] == 2
    assert got[("peer_bootstrap_replicas", ("full",))] == 1
    assert got[("peer_bootstrap_outer_step", ())] == 2
    assert got[("peer_bootstrap_manifest_publications_total", ())] == 3
    assert got[("peer_bootstrap_artifacts_served_total", ())] == 5
    assert got[("peer_bootstrap_poll_failures_total", ())] == 1
    assert got[("peer_bootstrap_uptime_seconds", ())] >= 0


def test_each_read_goes_to_on_read_and_one_that_raises_is_counted_never_raised():
    """The dashboard takes the monitor's reads (one read for metrics and dashboard); if it fails (a full
    disk, a bug) the bootstrap's serve loop goes on and the failure is counted."""
    records, seen = _Records(), []
    records.stages[0] = {"h": StageRecord(outer_step=3)}

    def take(stages: dict, replicas: dict) -> None:
        seen.append((stages, replicas))
        if len(seen) == 2:
            raise OSError("disk full")

    monitor = SwarmMonitor(records, 2, dict, take)  # type: ignore[arg-type]
    monitor.poll()
    monitor.poll()  # raises inside: counted
    assert [s[0] for s, _ in seen] == [{"h": StageRecord(outer_step=3)}] * 2
    assert monitor.snapshot()["poll_failures"] == 1 and monitor.snapshot()["outer_step"] == 3

"""Prometheus metrics of one peer (`peer join --metrics-port`), served over HTTP by prometheus-client.

Fed three ways, so no training code has to know about Prometheus:
- `EventSink`: every `metrics.jsonl` event of this peer (`peer.node.metrics.add_sink`): tokens/s,
  loss, outer step, round latency, clipped and dropped contributions, activation and
  pseudo-gradient bytes, connectivity (a `connectivity` event with a `mode`);
- `watch_pool(pool)`: a collector that reads a `ClientPool`'s cumulative bytes per gRPC method at
  each scrape;
- `observe_rpc`, `count_bytes` (per kind and peer), `set_connectivity`: direct calls for the data
  plane.

Every series is named `peer_*`; the HTTP server starts lazily, on the first event (the session
logs none before its DHT daemon has forked, so no server thread exists at the fork).
`peer bootstrap --metrics-port` serves its own registry instead (`serve_swarm_metrics`): the swarm
as the bootstrap sees it (`peer_bootstrap_*`), read from a snapshot its serve loop refreshes, so a
scrape never waits on the DHT.
Invariants: cumulative inputs only ever increase the counters (a smaller total, e.g. after a
restart, counts from zero again); a sink never raises into the caller's event path.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

log = logging.getLogger(__name__)

REGISTRY = CollectorRegistry(auto_describe=True)
MODES = ("direct", "reverse", "relayed", "unknown")

INFO = Info("peer", "This peer: role, peer id, stage.", registry=REGISTRY)
TOKENS = Counter("peer_tokens", "Training tokens processed (inner steps).", registry=REGISTRY)
TOKENS_PER_S = Gauge("peer_tokens_per_second", "Tokens per second over the last inner step.", registry=REGISTRY)
INNER_STEPS = Counter("peer_inner_steps", "Inner steps done.", registry=REGISTRY)
LOSS = Gauge("peer_loss", "Training loss of the last inner step.", registry=REGISTRY)
VAL_LOSS = Gauge("peer_val_loss", "Validation loss at the last committed round.", registry=REGISTRY)
OUTER_STEP = Gauge("peer_outer_step", "Outer step this peer is at.", registry=REGISTRY)
ROUNDS = Counter("peer_rounds", "Outer rounds committed.", registry=REGISTRY)
ROUND_S = Histogram(
    "peer_round_seconds",
    "Wall time of a committed outer round.",
    buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600),
    registry=REGISTRY,
)
RPC_S = Histogram(
    "peer_rpc_seconds",
    "Latency of one data-plane call, by method.",
    ["method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
RPC_FAILED = Counter("peer_rpc_failures", "Data-plane calls that failed, by method.", ["method"], registry=REGISTRY)
SENT = Counter("peer_bytes_sent", "Bytes sent, by kind and peer.", ["kind", "peer"], registry=REGISTRY)
RECEIVED = Counter("peer_bytes_received", "Bytes received, by kind and peer.", ["kind", "peer"], registry=REGISTRY)
CLIPPED = Counter(
    "peer_contributions_clipped", "Contributions norm-clipped to the round's median.", ["stage"], registry=REGISTRY
)
DROPPED = Counter(
    "peer_contributions_dropped", "Contributions dropped as outliers of their round.", ["stage"], registry=REGISTRY
)
CONNECTIVITY = Gauge("peer_connectivity", "1 for this peer's connectivity mode.", ["mode"], registry=REGISTRY)
EVENTS = Counter("peer_events", "metrics.jsonl events, by kind.", ["event"], registry=REGISTRY)
ALL = "all"  # the `peer` label of totals that no single peer accounts for


def set_connectivity(mode: str) -> None:
    """Mark this peer's connectivity mode (direct, reverse, relayed; anything else reads unknown)."""
    mode = mode if mode in MODES else "unknown"
    for m in MODES:
        CONNECTIVITY.labels(mode=m).set(1.0 if m == mode else 0.0)


def observe_rpc(method: str, seconds: float, ok: bool = True) -> None:
    """One data-plane call: its latency (and whether it failed)."""
    RPC_S.labels(method=method).observe(seconds)
    if not ok:
        RPC_FAILED.labels(method=method).inc()


def count_bytes(kind: str, peer: str, sent: int = 0, received: int = 0) -> None:
    """Bytes exchanged with one peer (`peer` id or address) for one kind of traffic."""
    if sent:
        SENT.labels(kind=kind, peer=peer).inc(sent)
    if received:
        RECEIVED.labels(kind=kind, peer=peer).inc(received)


class _Totals:
    """Turns cumulative totals into counter increments (a total that shrank restarts from zero)."""

    def __init__(self) -> None:
        self.last: dict[tuple[str, ...], float] = {}

    def delta(self, key: tuple[str, ...], total: float) -> float:
        before = self.last.get(key, 0.0)
        self.last[key] = total
        return total - before if total >= before else total


class EventSink:
    """Maps one peer's metrics.jsonl events onto the registry; call it with every event record."""

    def __init__(self, on_first: Callable[[], object] | None = None) -> None:
        self._on_first = on_first
        self._lock = threading.Lock()
        self._last_step: float | None = None
        self._totals = _Totals()
        set_connectivity("unknown")

    def __call__(self, record: Mapping[str, Any]) -> None:
        try:
            with self._lock:
                if self._on_first is not None:
                    first, self._on_first = self._on_first, None
                    first()
                self._handle(record)
        except Exception:  # monitoring must never stop training: say so and go on
            log.exception("prometheus sink could not handle a %r event", record.get("event"))

    def _handle(self, ev: Mapping[str, Any]) -> None:
        kind = str(ev.get("event", ""))
        EVENTS.labels(event=kind).inc()
        if kind == "start":
            INFO.info(
                {"role": str(ev.get("role", "")), "peer_id": str(ev.get("peer_id", "")), "stage": str(ev.get("stage"))}
            )
        elif kind == "step":
            self._step(ev)
        elif kind == "round":
            self._round(ev)
        elif kind == "connectivity":
            set_connectivity(str(ev.get("mode", "unknown")))

    def _step(self, ev: Mapping[str, Any]) -> None:
        tokens, now = float(ev.get("tokens") or 0), float(ev.get("time") or time.time())
        TOKENS.inc(tokens)
        INNER_STEPS.inc()
        if ev.get("loss") is not None:
            LOSS.set(float(ev["loss"]))
        if ev.get("t") is not None:
            OUTER_STEP.set(int(ev["t"]))
        if self._last_step is not None and now > self._last_step:
            TOKENS_PER_S.set(tokens / (now - self._last_step))
        self._last_step = now

    def _round(self, ev: Mapping[str, Any]) -> None:
        ROUNDS.inc()
        OUTER_STEP.set(int(ev.get("t", 0)) + 1)
        if ev.get("round_wall_s") is not None:
            ROUND_S.observe(float(ev["round_wall_s"]))
        if ev.get("val_loss") is not None:
            VAL_LOSS.set(float(ev["val_loss"]))
        for stage, info in (ev.get("stages") or {}).items():
            CLIPPED.labels(stage=str(stage)).inc(int(info.get("clipped") or 0))
            dropped = info.get("dropped") or []
            DROPPED.labels(stage=str(stage)).inc(len(dropped) if isinstance(dropped, list) else int(dropped))
        counts = ev.get("bytes") or {}
        if "activations" in counts:
            SENT.labels(kind="activations", peer=ALL).inc(self._totals.delta(("act",), float(counts["activations"])))
        if "pseudo_gradients" in counts:
            pg = float(counts["pseudo_gradients"])
            RECEIVED.labels(kind="pseudo_gradients", peer=ALL).inc(self._totals.delta(("pg",), pg))


class _Pool(Protocol):
    def bytes_sent(self) -> dict[str, int]: ...

    def bytes_received(self) -> dict[str, int]: ...


class PoolCollector(Collector):
    """Reads a ClientPool's cumulative bytes per gRPC method at each scrape."""

    def __init__(self, pool: _Pool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[CounterMetricFamily]:
        for direction, read in (("sent", self.pool.bytes_sent), ("received", self.pool.bytes_received)):
            family = CounterMetricFamily(
                f"peer_client_bytes_{direction}",
                f"Bytes {direction} by this peer's gRPC clients.",
                labels=["method", "peer"],
            )
            for method, n in read().items():
                family.add_metric([method, ALL], float(n))
            yield family


_watched: list[PoolCollector] = []
_watch_lock = threading.Lock()


def watch_pool(pool: _Pool) -> PoolCollector:
    """Expose `pool`'s byte counters on the registry; a later call replaces the pool watched (one
    peer per process; in-process test swarms see the newest session's pool)."""
    collector = PoolCollector(pool)
    with _watch_lock:
        for old in _watched:
            REGISTRY.unregister(old)
        _watched[:] = [collector]
        REGISTRY.register(collector)
    return collector


class Exporter:
    """The HTTP endpoint: `start()` serves `registry` (REGISTRY) on host:port (port 0 picks a free one)."""

    def __init__(self, port: int, host: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY) -> None:
        self.host, self.port, self.registry = host, port, registry
        self._server: Any = None

    def start(self) -> int:
        if self._server is None:
            self._server, _thread = start_http_server(self.port, addr=self.host, registry=self.registry)
            self.port = int(self._server.server_address[1])
            log.info("prometheus metrics on http://%s:%d/metrics", self.host, self.port)
        return self.port

    def sink(self) -> EventSink:
        """An event sink that starts this endpoint at its first event."""
        return EventSink(on_first=self.start)

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class SwarmCollector(Collector):
    """`peer bootstrap --metrics-port`: the swarm seen from the bootstrap, from `read()` at each scrape.

    `read()` returns {"uptime_s", "outer_step", "stage_peers": {stage: live}, "stage_seen": {stage:
    distinct peer ids since start}, "replicas": {kind: live}, "manifest_publications",
    "manifest_refresh_failures", "artifacts_served", "poll_failures"} (`peer.bootstrap.monitor`).
    """

    def __init__(self, read: Callable[[], Mapping[str, Any]]) -> None:
        self.read = read

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        snap = self.read()
        yield GaugeMetricFamily("peer_bootstrap_uptime_seconds", "Seconds since it started.", snap["uptime_s"])
        yield GaugeMetricFamily("peer_bootstrap_outer_step", "Largest outer step in live records.", snap["outer_step"])
        live = GaugeMetricFamily("peer_bootstrap_stage_peers", "Peers holding each stage now.", labels=["stage"])
        seen = CounterMetricFamily("peer_bootstrap_stage_peers_seen", "Distinct peers seen.", labels=["stage"])
        for stage, n in sorted(snap["stage_peers"].items()):
            live.add_metric([str(stage)], float(n))
            seen.add_metric([str(stage)], float(snap["stage_seen"].get(stage, 0)))
        yield live
        yield seen
        replicas = GaugeMetricFamily("peer_bootstrap_replicas", "Replicas online, by kind.", labels=["kind"])
        for kind, n in sorted(snap["replicas"].items()):
            replicas.add_metric([kind], float(n))
        yield replicas
        for name, help_text in (
            ("manifest_publications", "Publications of the run's manifest (the first and every refresh)."),
            ("manifest_refresh_failures", "Manifest refreshes the DHT refused or timed out."),
            ("artifacts_served", "Artefacts (tokenizer, manifest) served over gRPC."),
            ("poll_failures", "Reads of the swarm's records that failed (the last snapshot is kept)."),
        ):
            yield CounterMetricFamily(f"peer_bootstrap_{name}", help_text, value=float(snap[name]))


def serve_swarm_metrics(read: Callable[[], Mapping[str, Any]], port: int, host: str = "0.0.0.0") -> Exporter:
    """Serve a `SwarmCollector` over `read` on its own registry at host:port; returns the started endpoint."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SwarmCollector(read))
    exporter = Exporter(port, host, registry)
    exporter.start()
    return exporter

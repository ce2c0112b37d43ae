"""What `peer join` does before its role starts: resolve the initial peers and start monitoring.

- `--initial-peers-file F`: wait (up to the manifest timeout) for the bootstrap's address file and
  join through its multiaddrs, after any `--initial-peers` given too (`peer.node.discovery`);
- `--metrics-port P`: serve Prometheus metrics on host:P (`peer.net.prometheus`), fed by every
  metrics.jsonl event of this process; the endpoint starts with the session's first event.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from peer.net.prometheus import EventSink, Exporter
from peer.node.discovery import wait_for_address_file
from peer.node.metrics import add_sink


def start_metrics(port: int, host: str) -> EventSink:
    """Register the Prometheus sink for this process's metrics events; returns it."""
    sink = Exporter(port, host).sink()
    add_sink(sink)
    return sink


def prepare_join(
    initial_peers: Sequence[str] | None,
    peers_file: Path | None,
    timeout_s: float,
    metrics_port: int | None,
    host: str,
    stop: threading.Event | None = None,
) -> tuple[str, ...]:
    """The initial peers to join through (flags first, then the address file's); starts metrics."""
    peers = tuple(initial_peers or ())
    if peers_file is not None:
        peers += wait_for_address_file(peers_file, timeout_s, stop)
    if metrics_port is not None:
        start_metrics(metrics_port, host)
    return peers

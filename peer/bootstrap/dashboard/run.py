"""Starting the dashboard: beside a bootstrap (`Dashboard.start`) or alone on any machine (`run_dashboard`).

Beside a bootstrap the collector is fed by the bootstrap's own reads of the records (`SwarmMonitor`'s
`on_read`). Alone (`peer dashboard --initial-peers …`) it joins the DHT as a client, waits for the
run's manifest (`peer.node.manifest.wait_for_manifest`) and reads the records every `poll_s` itself;
it sends nothing to any peer but those DHT reads.

The history file is `<history_dir>/<run id>.sqlite`, so a restarted bootstrap (or dashboard) of the
same run shows the history it had, and another run starts its own.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from peer.bootstrap.dashboard.collect import Collector
from peer.bootstrap.dashboard.history import History
from peer.bootstrap.dashboard.server import DashboardServer, serve_dashboard
from peer.errors import ConfigError
from peer.net.dht import SwarmDHT
from peer.node.manifest import wait_for_manifest

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DashboardOptions:
    """Where the dashboard listens and keeps its history."""

    port: int  # 0: a free port
    host: str = "127.0.0.1"
    history_dir: Path = Path("runs") / "dashboard"


@dataclass
class Dashboard:
    """A serving dashboard: its collector, history and HTTP server."""

    collector: Collector
    history: History
    server: DashboardServer

    @property
    def url(self) -> str:
        return self.server.url

    def url_for(self, advertised_host: str) -> str:
        """The URL to print: on `advertised_host` when it listens on every interface, else where it listens."""
        if self.server.host in ("0.0.0.0", "::", ""):
            return f"http://{advertised_host}:{self.server.port}/"
        return self.server.url

    @classmethod
    def start(cls, opts: DashboardOptions, manifest: Mapping[str, Any], poll_s: float) -> Dashboard:
        run_id = str(manifest.get("run_id") or "run")
        safe = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in run_id)[:128]
        path = opts.history_dir / f"{safe}.sqlite"
        try:
            history = History(path)
        except (OSError, sqlite3.Error) as exc:
            raise ConfigError(f"cannot keep the dashboard's history in {path}: {exc}; pass another folder") from exc
        collector = Collector(history, manifest, poll_s)
        try:
            server = serve_dashboard(collector, opts.port, opts.host)
        except OSError:
            history.close()
            raise
        return cls(collector, history, server)

    def stop(self) -> None:
        self.server.stop()
        self.history.close()


def run_dashboard(
    initial_peers: Sequence[str],
    opts: DashboardOptions,
    stop: threading.Event,
    on_ready: Callable[[Dashboard], None] | None = None,
    timeout_s: float = 20.0,
    poll_s: float = 2.0,
    secret: bytes | None = None,
) -> None:
    """`peer dashboard`: serve the run behind `initial_peers` until `stop` is set."""
    with SwarmDHT(
        initial_peers=list(initial_peers), client_mode=True, start_timeout_s=timeout_s, swarm_secret=secret
    ) as dht:
        manifest = wait_for_manifest(dht, timeout_s, ", ".join(initial_peers), stop)
        config = manifest.get("config")
        stages = config.get("stages") if isinstance(config, Mapping) else None
        dht.set_run(str(manifest["run_id"]), stages if isinstance(stages, int) else 0)
        board = Dashboard.start(opts, manifest, poll_s)
        try:
            if on_ready is not None:
                on_ready(board)
            while not stop.is_set():
                board.collector.poll(dht)
                stop.wait(poll_s)
        finally:
            board.stop()

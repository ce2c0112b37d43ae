"""The bootstrap node: one DHT node that publishes the run's manifest and serves its artefacts.

Start-up order (each step needs the one before it):
1. open the run's prepared dataset (`peer.bootstrap.dataset.run_dataset`: a prepared folder, or a source
   prepared into the cache once); its tokenizer.model is the run's tokenizer, whose sha256 goes
   into the manifest with the dataset's fingerprints and the sha256 of its index;
2. start the `peer.net.dht.SwarmDHT` node BEFORE any gRPC server (its DHT process is then forked
   at once; after gRPC it would come from a clean forkserver: `peer.net.dht_child`);
3. start a `peer.net.transport.PeerServer` with an `ArtifactHandler` (tokenizer, manifest, the
   dataset's index and shards, streamed from disk within `--max-upload-mbps`);
4. build the manifest (`peer.node.manifest.build_manifest`) naming the gRPC address and publish it
   under "peer.manifest" with ttl `swarm.record_ttl_s`, refreshed every ttl/3 until stopped.

Unless told not to (`attest_dir=None`), it runs the run's attester (`peer.bootstrap.attester`): it
follows every stage by replay, on a thread of its own started after the DHT fork, and attests the
states it reached, so a joiner past the history window has a trusted start (docs/protocol.md).

With `--metrics-port` it also serves Prometheus metrics of the swarm it sees (`peer.bootstrap.monitor`),
refreshed by the serve loop; the endpoint's URL goes into the address file ("metrics"). With
`--dashboard-port` the same reads feed the run's live dashboard (`peer.bootstrap.dashboard`), whose
history lives in `dashboard_history` (a file that survives restarts); its URL goes in as "dashboard".

Invariants: every network wait has a deadline (SwarmDHT's request timeout); a failed refresh is
logged, counted (visible in `info`) and retried after at most 2 s; a manifest left unrefreshed
for two ttls is fatal (`NetworkError`), since joiners can no longer find the run. `close()` stops
the gRPC server, then the DHT (its child process and p2pd); `run_bootstrap` then removes the
address file, so the file exists exactly while the manifest is being published.
A fixed identity file (`identity_path`) keeps the peer id, hence the multiaddr, stable across
restarts. This module imports no hivemind; it reuses `peer.net.dht`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from peer.bootstrap.artifacts import ArtifactHandler, manifest_bytes
from peer.bootstrap.dashboard.run import Dashboard, DashboardOptions
from peer.bootstrap.dataset import run_dataset
from peer.bootstrap.monitor import SwarmMonitor
from peer.config import RunConfig
from peer.core.files import atomic_write_bytes
from peer.errors import ConfigError, NetworkError
from peer.net.addresses import advertised_host, order_maddrs
from peer.net.admission import SECRET_ENV, load_swarm_secret
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.prometheus import Exporter, serve_swarm_metrics
from peer.net.ratelimit import Link, LinkCaps
from peer.net.transport import PeerServer, auth
from peer.net.transport.dialer import Outbound
from peer.net.transport.gate import Gate
from peer.node.data.serve import DatasetServer
from peer.node.manifest import build_manifest, run_id_for

logger = logging.getLogger(__name__)
ATTESTER_THREAD = "attester"  # the thread that builds and runs the attester (the CLI's exit looks for it)

RETRY_AFTER_FAILURE_S = 2.0  # a failed manifest refresh is retried this soon (or at the next interval)


class _Stopped(Exception):
    """Raised inside start-up when the stop event fired between two steps."""


@dataclass(frozen=True)
class BootstrapInfo:
    """What another machine needs to join: multiaddrs (preferred first), gRPC address, run id."""

    run_id: str
    peer_id: str
    initial_peers: tuple[str, ...]
    grpc_address: str
    tokenizer_sha256: str
    manifest: dict[str, Any] = field(repr=False)
    metrics_url: str = ""  # `--metrics-port`: where Prometheus scrapes this bootstrap ("" = not served)
    dashboard_url: str = ""  # `--dashboard-port`: the run's live dashboard ("" = not served)
    attest_dir: str = ""  # where the attester keeps its states ("" = it does not attest)

    def address_record(self) -> dict[str, Any]:
        """The JSON written to --address-file."""
        out = {
            "initial_peers": list(self.initial_peers),
            "grpc": self.grpc_address,
            "run_id": self.run_id,
            "peer_id": self.peer_id,
        }
        if self.metrics_url:
            out["metrics"] = self.metrics_url
        if self.dashboard_url:
            out["dashboard"] = self.dashboard_url
        return out


def write_address_file(path: str | os.PathLike[str], record: dict[str, Any]) -> Path:
    """Write `record` as JSON atomically (peer.core.files): a reader never sees half a file."""
    path = Path(path).expanduser()
    atomic_write_bytes(path, (json.dumps(record, indent=2) + "\n").encode())
    return path


class BootstrapNode:
    """A started bootstrap (see the module docstring for the order). Use as a context manager.

    `stop_event`, when given, is checked between start-up steps so a signal during a long
    tokenizer build ends start-up early (`run_bootstrap` then returns without serving).
    """

    def __init__(
        self,
        cfg: RunConfig,
        host: str = "127.0.0.1",
        dht_port: int = 0,
        grpc_port: int = 0,
        announce_host: str | None = None,
        identity_path: str | os.PathLike | None = None,
        stop_event: threading.Event | None = None,
        relay: bool = False,  # forward calls for peers that cannot be dialled (docs/connectivity.md)
        max_upload_mbps: float | None = None,  # cap on what it serves (the dataset's shards above all)
    ):
        self.cfg = cfg
        self.run_id = run_id_for(cfg)
        self.ttl_s = float(cfg.swarm.record_ttl_s)
        self.dht: SwarmDHT | None = None
        self.server: PeerServer | None = None
        self._closed = False

        def check_stop() -> None:
            if stop_event is not None and stop_event.is_set():
                raise _Stopped()

        t0 = time.monotonic()
        dataset = run_dataset(cfg)
        tokenizer_bytes = dataset.tokenizer_path.read_bytes()
        tok_sha = dataset.index.tokenizer_sha256  # run_dataset checked the file against it
        logger.info("dataset ready in %.1f s (tokenizer %s)", time.monotonic() - t0, tok_sha[:12])
        check_stop()
        try:
            self.dht = SwarmDHT(host=host, port=dht_port, announce_host=announce_host, identity_path=identity_path)
            maddrs = order_maddrs(self.dht.visible_maddrs())
            if not maddrs:
                raise NetworkError(f"the DHT node on {host} reports no reachable address; pass another --host")
            check_stop()
            grpc_host = advertised_host(host, announce_host, listening=maddrs)
            self.handler = ArtifactHandler(
                {"tokenizer": tokenizer_bytes},
                {
                    "run_id": self.run_id,
                    "peer_id": self.dht.peer_id,
                    "initial_peers": list(maddrs),
                    "tokenizer_sha256": tok_sha,
                    "stages": cfg.stages,
                    "preset": cfg.preset,
                },
                DatasetServer(dataset),
            )
            swarm = cfg.swarm  # admission on the data plane, relaying: peer.net.transport.gate
            verifier, credentials = auth.for_swarm(
                swarm.admission, frozenset(swarm.allowlist), self.dht.peer_id, *self.dht.auth_material
            )
            outbound = Outbound(credentials, Link(LinkCaps(upload_mbps=max_upload_mbps)))  # caps what it serves
            self.outbound = outbound
            self.gate = Gate(self.dht.peer_id, verifier, relay=relay, outbound=outbound)
            self.server = PeerServer(self.handler, host=host, port=grpc_port, interceptors=[self.gate])
            self.gate.bind(f"{host}:{self.server.port}")
            grpc_address = f"{grpc_host}:{self.server.port}"
            manifest = build_manifest(cfg, tok_sha, grpc_address, dataset.index)
            self.handler.add_artifact("manifest", manifest_bytes(manifest))
            self.info = BootstrapInfo(self.run_id, self.dht.peer_id, maddrs, grpc_address, tok_sha, manifest)
            self.dht.publish_manifest(manifest, ttl_s=self.ttl_s)
        except BaseException:
            self.close()
            raise
        self.last_refresh = time.monotonic()
        logger.info(
            "bootstrap of %s up in %.1f s: DHT %s, gRPC %s", self.run_id, time.monotonic() - t0, maddrs[0], grpc_address
        )

    @property
    def refresh_interval_s(self) -> float:
        return self.ttl_s / 3.0

    def refresh_manifest(self) -> bool:
        """Re-publish the manifest once; False (logged and counted) if the DHT refused or timed out.

        Raises NetworkError once the manifest has gone unrefreshed for two ttls.
        """
        assert self.dht is not None
        try:
            self.dht.publish_manifest(self.info.manifest, ttl_s=self.ttl_s)
        except NetworkError as exc:
            self.handler.count("manifest_refresh_failures")
            stale_s = time.monotonic() - self.last_refresh
            if stale_s > 2 * self.ttl_s:
                raise NetworkError(
                    f"the bootstrap could not refresh the run's manifest for {stale_s:.0f} s ({exc}); restart it"
                ) from exc
            logger.warning(
                "manifest refresh failed (%s); retrying in %.0f s",
                exc,
                min(RETRY_AFTER_FAILURE_S, self.refresh_interval_s),
            )
            return False
        self.handler.count("manifest_refreshes")
        self.last_refresh = time.monotonic()
        return True

    def serve(
        self,
        stop_event: threading.Event,
        poll_s: float = 0.5,
        tick: Callable[[], None] | None = None,
        tick_s: float = 2.0,
    ) -> None:
        """Refresh the manifest every ttl/3 until `stop_event` is set (checked every `poll_s`);
        `tick()` (the metrics' read of the swarm) runs now and every `tick_s`."""
        next_at = time.monotonic() + self.refresh_interval_s
        tick_at = time.monotonic()
        while not stop_event.is_set():
            now = time.monotonic()
            if tick is not None and now >= tick_at:
                tick()
                tick_at = time.monotonic() + tick_s
                continue
            if now >= next_at:
                ok = self.refresh_manifest()
                delay = self.refresh_interval_s if ok else min(RETRY_AFTER_FAILURE_S, self.refresh_interval_s)
                next_at = time.monotonic() + delay
                continue
            stop_event.wait(min(poll_s, next_at - now, tick_at - now if tick is not None else poll_s))

    def close(self) -> None:
        """Stop the gRPC server, then the DHT node. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.server is not None:
            self.server.stop(grace_s=1.0)
        if self.dht is not None:
            self.dht.shutdown()
        logger.info("bootstrap of %s stopped", self.run_id)

    def __enter__(self) -> BootstrapNode:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_bootstrap(
    cfg: RunConfig,
    host: str = "127.0.0.1",
    dht_port: int = 0,
    grpc_port: int = 0,
    announce_host: str | None = None,
    identity_path: str | os.PathLike | None = None,
    address_file: str | os.PathLike | None = None,
    on_ready: Callable[[BootstrapInfo], None] | None = None,
    stop_event: threading.Event | None = None,
    relay: bool = False,
    metrics_port: int | None = None,
    max_upload_mbps: float | None = None,
    attest_dir: Path | None = None,
    dashboard: DashboardOptions | None = None,
) -> BootstrapInfo | None:
    """Run a bootstrap until `stop_event` is set; return its BootstrapInfo (None if stopped during start-up).

    `on_ready(info)` is called once the manifest is published (the CLI prints the join lines from
    it); `address_file`, if given, receives `info.address_record()` as JSON at that moment and is
    removed again on a clean stop. `metrics_port` (0: any free port) serves Prometheus metrics of
    the swarm as this node sees it on host:port (`peer.bootstrap.monitor`), started after the DHT fork.
    `max_upload_mbps` caps what the bootstrap serves (Mbit/s; None: no cap). `attest_dir`: run the
    attester, keeping its states there (None: no attester; joiners past the window then wait).
    `dashboard`: serve the run's live dashboard (`peer.bootstrap.dashboard`) from the same reads.
    """
    stop_event = stop_event or threading.Event()
    follower: threading.Thread | None = None
    try:
        node = BootstrapNode(
            cfg, host, dht_port, grpc_port, announce_host, identity_path, stop_event, relay, max_upload_mbps
        )
    except _Stopped:
        logger.info("stopped during start-up")
        return None
    written: Path | None = None
    exporter: Exporter | None = None
    monitor: SwarmMonitor | None = None
    board: Dashboard | None = None
    tick_s = max(1.0, cfg.swarm.announce_interval_s)
    try:
        if (metrics_port is not None or dashboard is not None) and node.dht is not None:
            node.dht.set_run(node.run_id, cfg.stages)
            if dashboard is not None:
                board = Dashboard.start(dashboard, node.info.manifest, tick_s)
                url = board.url_for(node.info.grpc_address.rpartition(":")[0])  # where others reach this node
                node.info = dataclasses.replace(node.info, dashboard_url=url)
            on_read = board.collector.ingest if board is not None else None
            monitor = SwarmMonitor(node.dht, cfg.stages, node.handler.stats, on_read)
        if metrics_port is not None and monitor is not None:
            exporter = serve_swarm_metrics(monitor.snapshot, metrics_port, host)
            url_host = node.info.grpc_address.rpartition(":")[0]  # the host others reach this node at
            node.info = dataclasses.replace(node.info, metrics_url=f"http://{url_host}:{exporter.port}/metrics")
        if attest_dir is not None and node.dht is not None:
            follower = start_attester(node, cfg, attest_dir, stop_event)
        if address_file is not None:
            written = write_address_file(address_file, node.info.address_record())
        if on_ready is not None:
            on_ready(node.info)
        node.serve(stop_event, tick=monitor.poll if monitor is not None else None, tick_s=tick_s)
        return node.info
    finally:
        stop_event.set()
        if follower is not None:
            follower.join(timeout=10.0)
        if exporter is not None:
            exporter.stop()
        if board is not None:
            board.stop()
        node.close()
        if written is not None:
            written.unlink(missing_ok=True)


def export_swarm_secret(cfg: RunConfig, secret_file: Path | None) -> None:
    """Check the run's admission against `--swarm-secret-file` and hand a secret-mode swarm's secret
    to the bootstrap's DHT node (which reads it from $PEER_SWARM_SECRET); ConfigError naming the flag."""
    secret = load_swarm_secret(secret_file)
    if cfg.swarm.admission == "secret":
        if secret is None:
            raise ConfigError(f"--admission secret needs --swarm-secret-file FILE (or {SECRET_ENV})")
        os.environ[SECRET_ENV] = secret.decode()
    elif secret_file is not None:
        raise ConfigError(
            f"--swarm-secret-file needs --admission secret (this run's admission is {cfg.swarm.admission})"
        )


def start_attester(node: BootstrapNode, cfg: RunConfig, folder: Path, stop_event: threading.Event) -> threading.Thread:
    """Start the attester (`peer.bootstrap.attester`) on a daemon thread that builds it (torch, the
    model's initial states: seconds, while the first peers start) and then polls every announce interval
    until `stop_event`; its states are served by the node's `get_state` once it is built (before, a
    joiner past the window is told none is attested yet and waits, as without an attester)."""
    assert node.dht is not None
    node.dht.set_run(node.run_id, cfg.stages)
    clients = ClientPool(cfg.swarm.rpc_timeout_s, cfg.subspace.wire_dtype, node.outbound)
    folder = folder / f"{node.run_id}-{node.dht.peer_id[:12]}"  # this bootstrap's run: --identity keeps it
    poll_s = max(0.5, cfg.swarm.announce_interval_s)

    def follow() -> None:
        from peer.bootstrap.attester import Attester  # torch and the model: only a bootstrap that attests loads them

        assert node.dht is not None
        try:
            attester = Attester(cfg, node.dht, clients, node.info.grpc_address, folder)
        except Exception:  # the manifest and the dataset stay served without it
            logger.exception("the attester could not start; joiners past the window will wait")
            clients.close()
            return
        node.handler.attester = attester
        logger.info("attester of %s running: states kept in %s", node.run_id, folder)
        while not stop_event.is_set():
            started = time.monotonic()
            try:
                attester.poll()
            except Exception:  # a bug must not take the manifest down with it: logged, retried
                logger.exception("attester poll failed; retrying")
            stop_event.wait(max(0.0, poll_s - (time.monotonic() - started)))
        clients.close()

    thread = threading.Thread(target=follow, name=ATTESTER_THREAD, daemon=True)
    thread.start()
    node.info = dataclasses.replace(node.info, attest_dir=str(folder))
    return thread

"""What `peer join` does before its role starts: check its flags, resolve the initial peers and
start monitoring.

- `--initial-peers-file F`: wait (up to the manifest timeout) for the bootstrap's address file and
  join through its multiaddrs, after any `--initial-peers` given too (`peer.node.discovery`);
- `--metrics-port P`: serve Prometheus metrics on host:P (`peer.net.prometheus`), fed by every
  metrics.jsonl event of this process; the endpoint starts with the session's first event;
- `--wandb PROJECT`, `--tensorboard DIR`: the same events into W&B and TensorBoard (`peer.node.loggers`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from pathlib import Path

from peer.errors import ConfigError
from peer.net.prometheus import EventSink, Exporter
from peer.node.discovery import wait_for_address_file
from peer.node.metrics import add_sink
from peer.node.pipeline.mode import check_policy


def join_role(stage: int | None, full_replica: bool, device: str, precision: str, compression: str = "auto") -> str:
    """The role `peer join`'s flags ask for ("full", "head" or "stage"); a one-line ConfigError for
    flags that do not go together or an unknown device, precision or compression."""
    if (stage is None) == (not full_replica):
        raise ConfigError("pass exactly one of --stage N or --full-replica")
    check_policy(compression)
    if compression != "auto" and stage != 0:
        raise ConfigError("--compression is a head's choice: pass it with --stage 0 only")
    if device not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--device must be auto, cpu or cuda, got {device!r}")
    if precision not in ("auto", "bf16", "fp16", "fp32"):
        raise ConfigError(f"--precision must be auto, bf16, fp16 or fp32, got {precision!r}")
    return "full" if full_replica else ("head" if stage == 0 else "stage")


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
    if metrics_port is not None and os.environ.get("RANK", "0") == "0":  # torchrun: rank 0 speaks for the replica
        start_metrics(metrics_port, host)
    return peers


def start_loggers(wandb_project: str | None, tensorboard_dir: Path | None, data_dir: Path) -> None:
    """Register the W&B and TensorBoard sinks the flags ask for (rank 0 only under torchrun); a missing
    package is a one-line ConfigError before anything starts."""
    if os.environ.get("RANK", "0") != "0":
        return
    from peer.node.loggers import TensorBoardSink, WandbSink

    if tensorboard_dir is not None:
        add_sink(TensorBoardSink(tensorboard_dir.expanduser()))
    if wandb_project is not None:
        add_sink(WandbSink(wandb_project, data_dir))

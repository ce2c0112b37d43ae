"""`peer bootstrap`'s flags made into the run's config, and `--print-peer-id` (the command itself,
with its flags, is in `peer.cli.main`; the node it runs is `peer.bootstrap`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console

from peer.cli import options as o
from peer.errors import ConfigError

if TYPE_CHECKING:
    from peer.bootstrap.dashboard.run import DashboardOptions
    from peer.cli.args import BootstrapArgs
    from peer.config import RunConfig


def show_peer_id(identity: Path | None) -> None:
    """`peer bootstrap --print-peer-id`: the peer id of a key file (made if missing), for the join lines."""
    if identity is None:
        raise ConfigError("--print-peer-id needs --identity PATH (the key file whose peer id to print)")
    from peer.net.dht import make_identity

    typer.echo(make_identity(identity))


def bootstrap_config(a: BootstrapArgs, console: Console) -> RunConfig:
    """The run's config from `peer bootstrap`'s flags `a`; with --paper-settings, `PAPER_ALGORITHM` under it
    and a line per setting it changed."""
    from peer.config import build_config, paper_algorithm_config

    admission = a.admission or ("secret" if a.swarm_secret_file else "allowlist" if a.allow_peer else None)
    overrides = o.overrides(a) | {
        "swarm.admission": admission,
        "swarm.allowlist": tuple(a.allow_peer) if a.allow_peer else None,
    }
    if not a.paper_settings:
        return build_config(a.config, overrides)
    cfg, changed = paper_algorithm_config(a.config, overrides)
    for line in changed or ["nothing to change: the run already has the paper's round rule"]:
        console.print(f"--paper-settings: {line}", soft_wrap=True)
    return cfg


def dashboard_options(a: BootstrapArgs, cfg: RunConfig) -> DashboardOptions | None:
    """`--dashboard-port`, `--dashboard-host`, `--dashboard-history` (default: <cache>/dashboard); None without
    a port."""
    if a.dashboard_port is None:
        return None
    from peer.bootstrap.dashboard.run import DashboardOptions

    return DashboardOptions(a.dashboard_port, a.dashboard_host, a.dashboard_history or cfg.data.cache_dir / "dashboard")

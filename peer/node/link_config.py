"""One peer's own link: its upload and download caps and whether it relays for others.

Not part of the run's manifest (every peer sets its own): `peer join` flags, else `PEER_LINK__*`
environment variables, else no cap. `peer.net.ratelimit.Link` enforces what this holds.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, get_type_hints

from peer.config import coerce_value
from peer.errors import ConfigError

__all__ = ["LinkConfig", "build_link_config"]


@dataclass(frozen=True)
class LinkConfig:
    """One peer's own link, not part of the run's manifest (`peer join` flags, `PEER_LINK__*` env)."""

    max_upload_mbps: float = field(  # cap on everything this peer sends, Mbit/s (0 = no cap)
        default=0.0,
        metadata={"help": "Cap on what this peer sends, Mbit/s (default: no cap; PEER_LINK__MAX_UPLOAD_MBPS)."},
    )
    max_download_mbps: float = field(  # cap on everything this peer receives, Mbit/s (0 = no cap)
        default=0.0,
        metadata={"help": "Cap on what this peer receives, Mbit/s (default: no cap; PEER_LINK__MAX_DOWNLOAD_MBPS)."},
    )
    relay: bool = field(  # forward calls for peers that cannot be dialled (behind NAT)
        default=False,
        metadata={"help": "Relay calls for peers that cannot be dialled (behind NAT); see docs/connectivity.md."},
    )
    relay_max_mbps: float = field(  # cap on the bytes relayed for others, Mbit/s (0 = no cap)
        default=0.0, metadata={"help": "Cap on the bytes relayed for others, Mbit/s (default: no cap)."}
    )

    def __post_init__(self) -> None:
        for name in ("max_upload_mbps", "max_download_mbps", "relay_max_mbps"):
            if not getattr(self, name) >= 0:
                raise ConfigError(f"link.{name} must be >= 0 Mbit/s (0 = no cap), got {getattr(self, name)}")


def build_link_config(environ: Mapping[str, str] | None = None, *flags: Any, **named: Any) -> LinkConfig:
    """defaults < `PEER_LINK__FIELD` environment variables < `flags` (LinkConfig's fields in order, or
    `named` by field; None: not given)."""
    environ = os.environ if environ is None else environ
    known = get_type_hints(LinkConfig)
    values: dict[str, Any] = {}
    for key, value in environ.items():
        if key.startswith("PEER_LINK__"):
            name = key[len("PEER_LINK__") :].lower()
            if name not in known:
                raise ConfigError(f"unknown key 'link.{name}' ({key}); valid keys: {', '.join(sorted(known))}")
            values[name] = coerce_value(value, known[name], f"link.{name} (from {key})")
    for name, value in [*zip(known, flags, strict=False), *named.items()]:
        if name not in known:
            raise ConfigError(f"unknown key 'link.{name}'; valid keys: {', '.join(sorted(known))}")
        if value is not None:
            values[name] = coerce_value(value, known[name], f"link.{name}")
    return LinkConfig(**values)

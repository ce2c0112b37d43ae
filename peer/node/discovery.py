"""Finding the bootstrap without a manual peer-id step: read its address file, waiting for it.

`peer bootstrap --address-file F` writes {"initial_peers": [multiaddr, ...], "grpc", "run_id",
"peer_id"} atomically once its manifest is published (and removes F on a clean stop). A joiner
given `--initial-peers-file F` (e.g. F on a volume shared with the bootstrap's container) waits
until F holds at least one multiaddr, under one deadline, and joins through those addresses.

Invariants: the wait is a bounded poll with a deadline and an early exit on `stop`; a file that is
missing, torn or without multiaddrs is waited for, never half-used; the error says what to do.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from peer.errors import PeerError

log = logging.getLogger(__name__)


def read_address_file(path: Path) -> tuple[str, ...]:
    """The multiaddrs of an address file, () while it is missing, unreadable or holds none."""
    try:
        record = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return ()
    peers = record.get("initial_peers") if isinstance(record, dict) else None
    if not isinstance(peers, list):
        return ()
    return tuple(p for p in peers if isinstance(p, str) and p.startswith("/"))


def wait_for_address_file(
    path: Path, timeout_s: float, stop: threading.Event | None = None, poll_s: float = 0.5
) -> tuple[str, ...]:
    """Poll `path` until it names at least one multiaddr; PeerError after `timeout_s` or on `stop`."""
    deadline = time.monotonic() + timeout_s
    logged = False
    while True:
        peers = read_address_file(path)
        if peers:
            log.info("bootstrap address from %s: %s", path, peers[0])
            return peers
        if stop is not None and stop.is_set():
            raise PeerError(f"stopped while waiting for the bootstrap's address file {path}")
        if time.monotonic() >= deadline:
            raise PeerError(
                f"no bootstrap address in {path} after {timeout_s:.0f} s: start `peer bootstrap --address-file "
                f"{path}` (on a volume this peer shares), or pass --initial-peers"
            )
        if not logged:
            log.info("waiting up to %.0f s for the bootstrap's address file %s", timeout_s, path)
            logged = True
        time.sleep(poll_s)

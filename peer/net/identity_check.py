"""Refuses a second peer on an identity file that a running peer already uses, reliably.

Before a node starts on an existing `--identity` file, hivemind asks the swarm whether a peer with
that id is already up: a throw-away libp2p node joins through the initial peers and tries to
connect to the id. hivemind answers "free" on any failed connect, including the one a lookup
gets when the throw-away node has not yet added its initial peers to its routing table ("failed to
find any peer in table"). That happened in about 1 start in 30 on a loaded 2-core machine, and
the duplicate then took over the first peer's connections (same peer id).

`install_identity_check` replaces hivemind's check with one that retries that "not yet" answer
until the table fills (at most `LOOKUP_WINDOW_S`); any other failed connect still means "free".
The DHT process, which makes the check, installs it when it starts (`peer.net.dht_child`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import ControlFailure

__all__ = ["LOOKUP_WINDOW_S", "install_identity_check", "is_identity_taken"]

LOOKUP_WINDOW_S = 3.0  # how long a lookup may wait for the throw-away node's routing table
_EMPTY_TABLE = "failed to find any peer in table"


async def is_identity_taken(
    cls: type[P2P],
    identity_path: str,
    *,
    initial_peers: Sequence[Any] | None,
    tls: bool,
    use_auto_relay: bool,
    use_ipfs: bool,
    use_relay: bool,
) -> bool:
    """True if a live peer of the swarm runs as the id in `identity_path` (hivemind's signature)."""
    with open(identity_path, "rb") as f:
        peer_id = PeerID.from_identity(f.read())
    probe = await cls.create(
        initial_peers=initial_peers,
        dht_mode="client",
        tls=tls,
        use_auto_relay=use_auto_relay,
        use_ipfs=use_ipfs,
        use_relay=use_relay,
    )
    deadline = time.monotonic() + LOOKUP_WINDOW_S
    try:
        while True:
            try:
                await probe._client.connect(peer_id, [])
                return True
            except ControlFailure as e:
                if _EMPTY_TABLE not in str(e) or time.monotonic() > deadline:
                    return False
            await asyncio.sleep(0.1)
    finally:
        await probe.shutdown()


def install_identity_check() -> None:
    """Idempotent: hivemind's identity check becomes `is_identity_taken` in this process."""
    P2P.is_identity_taken = classmethod(is_identity_taken)

"""What this peer is in the swarm right now: the few facts its parts share and may change.

The session builds one `Presence` and hands it to the parts that read or move these facts: the
records publish them (`peer.node.records`), connectivity moves `address` to a routed one when
this peer cannot be dialled (`peer.node.connectivity`), a state download moves `joined_at`
(`peer.node.round.resync`), and the end of a role sets `finishing`.

Invariants: `peer_id` and `incarnation` never change; `joined_at` only grows after the join.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field


@dataclass
class Presence:
    """This process's identity in the swarm and its few changing facts."""

    peer_id: str
    role: str  # "stage", "head" or "full"
    incarnation: str = field(default_factory=lambda: secrets.token_hex(6))  # tells a restarted peer's records apart
    address: str = ""  # the data-plane address others dial ("PEERID@hub" when reached through a hub)
    joined_at: int = 0  # the first round this peer contributes to (DESIGN §3: late joiners)
    finishing: bool = False  # past the last round (published as "done" in the replica record)

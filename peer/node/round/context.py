"""The collaborators every part of a round takes, as one value (`RoundContext`).

A round's parts — `Rounds` (`peer.node.round.rounds`), `Resync` (`peer.node.round.resync`), the
all-to-all gather (`peer.node.round.gather.gather_round`) and the ranges gather
(`peer.node.round.ranges.exchange.gather_ranges`) — all read the same few things: the run's config,
the DHT, the gRPC clients, the payload store, this peer's presence, the refused holders, the metrics
writer and the callable that refreshes this peer's DHT records. The session builds one context and
hands it to each; a test builds one from fakes. What differs per gather (the round, the stage, our
contribution, the deadline) stays a parameter of that gather.

Invariants: frozen (a part never swaps another part's collaborator); `me` itself may change
(`Presence`: its address, `joined_at`), so a gather reads `me.address` and `me.incarnation` when it
announces, never a copy taken earlier.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from peer.config import RunConfig
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.node.metrics import MetricsWriter
from peer.node.presence import Presence
from peer.node.round.payloads import PayloadStore
from peer.node.round.refusals import Refusals


@dataclass(frozen=True)
class RoundContext:
    """What a round's parts share: config, DHT, clients, payload store, presence, refusals, metrics,
    and `publish` (refreshes this peer's DHT records after a commit, a switch or a download)."""

    cfg: RunConfig
    dht: SwarmDHT
    clients: ClientPool
    store: PayloadStore
    me: Presence
    refusals: Refusals
    metrics: MetricsWriter
    publish: Callable[[], None]

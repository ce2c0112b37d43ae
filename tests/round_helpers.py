"""A `RoundContext` for the gather tests (tests/integration/test_agreement.py, test_round_hash.py,
test_ranges_round.py): a gather takes one value for its collaborators; a test names the few it sets.
`own`: a test's payload bytes as the gather's own contribution."""

from __future__ import annotations

from typing import Any

from peer.config import RunConfig
from peer.core.sparseloco.codec.format import Payload
from peer.node.presence import Presence
from peer.node.round.context import RoundContext
from peer.node.round.contribution import Contribution, payload_id, received
from peer.node.round.payloads import PayloadStore
from peer.node.round.refusals import Refusals


def own(replica: str, data: bytes) -> Contribution:
    """A gather's own contribution from payload bytes a test made (identified once, as a fetch does)."""
    return received(replica, payload_id(data), data, Payload.from_bytes)


class Quiet:
    """A metrics writer that writes nothing (a gather logs no metrics)."""

    def log(self, *a: Any, **k: Any) -> None:
        pass


def round_context(
    dht: Any,
    clients: Any,
    store: Any = None,
    address: str = "",
    inc: str = "",
    refusals: Refusals | None = None,
    cfg: RunConfig | None = None,
) -> RoundContext:
    """`dht`'s peer as a full replica with `address` and incarnation `inc`; a fresh store and
    refusals unless given; the default run's config unless given."""
    me = Presence(dht.peer_id, "full", incarnation=inc, address=address)
    store = store if store is not None else PayloadStore()
    refusals = refusals if refusals is not None else Refusals()
    return RoundContext(cfg or RunConfig(), dht, clients, store, me, refusals, Quiet(), lambda: None)  # type: ignore[arg-type]

"""One contribution to a round, identified once: who sent it, its id, its bytes, its parsed payload.

docs/architecture.md, "The path of a pseudo-gradient"; STYLE §23. A payload enters a round in one of
two places and is identified there, once:
- our own, where it is encoded (`encoded`: serialized once, hashed once; the encoder's `Payload`
  object is kept — it commits to the same bits as the bytes parsed back, `tests/unit/test_contribution.py`);
- another's, where it is fetched (`received`: the bytes parsed once by the round's validator, then
  their id checked against the one their signed announcement carries). An observer of stage 0 whose
  T⊥ needs only stage 0's embedding change fetches each payload's view
  instead (`ViewReader`: the embedding's entry, the whole payload's norm, proven against the same id;
  `peer.core.sparseloco.codec.sections`) and holds a contribution with `view` set.
From there the same record travels through the gather (`peer.node.round.gather`), FOLLOW, the
checks of a claimed set (`peer.node.round.verify`), the commit (`peer.node.stage.state`) and the link
it publishes (`peer.node.stage.ledger.make_link`): nothing on the way hashes or parses it again.

`bare` names payloads that never crossed the network (a test's, a bench's, the simulator's): each is
serialized and hashed here, and without replica ids (`replica` "") a link names them by position.

A payload's id (`payload_id`, the field `sha256`: 64 hex digits like a sha256) is a hash over three
sections of its bytes, so that a view can be checked against it (`peer.core.sparseloco.codec.sections`);
`sha256` below is the plain digest of other bytes (a ranges round's parts and shards).

Invariants: `sha256 == payload_id(data)` and `payload` is `data` parsed (or the object `data` was
serialized from); for a view, `data` is the view, `payload` its embedding entry alone, `norm` the whole
payload's, and `sha256` the id the view proves. Frozen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from peer.core.sparseloco.codec.clip import payload_norm
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.codec.sections import View, payload_id, sections
from peer.errors import PeerError
from peer.node.round.claims import Entry, entry

__all__ = [
    "Contribution",
    "Mismatch",
    "Reading",
    "ViewReader",
    "bare",
    "encoded",
    "payload_id",
    "received",
    "sha256",
    "whole",
]


def sha256(data: bytes) -> str:
    """The plain digest of bytes (hex): a ranges round's parts and shards (a payload's id: `payload_id`)."""
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class ViewReader:
    """Read a round's payloads as their embedding views (`peer.core.sparseloco.codec.sections`): `read`
    parses and checks a view (the run's settings, the embedding's shape) and returns it with the id it
    proves; `whole` parses the whole payload, when one must be checked whole after all (a claim left
    it out: `peer.node.round.gather`). Passed where a whole payload's `parse` is otherwise passed
    (`Reading`). `relay`: the stage whose round's announcers are asked for a view before its sender
    (they observed stage 0 too and serve what they fetched: `peer.node.round.fetcher`); None: the
    sender first, as a holder of stage 1 does."""

    read: Callable[[bytes], View]
    whole: Callable[[bytes], Payload]
    relay: int | None = None


Reading = Callable[[bytes], Payload] | ViewReader  # how fetched bytes are read: whole (parsed) or as views


class Mismatch(PeerError):
    """Bytes that are not the payload their announcement names."""


@dataclass(frozen=True)
class Contribution:
    """One replica's payload of one round: its id, sha256, wire bytes and parsed payload."""

    replica: str  # the full replica id ("" for a bare payload: a link names it by position)
    sha256: str  # the payload's id (`payload_id`), checked against the announcement where it was received
    data: bytes = field(repr=False)
    payload: Payload = field(repr=False)
    norm: float | None = field(default=None, repr=False)  # ‖Δ̂‖ of the whole payload (None: read off `payload`)
    view: bool = False  # `data` is the payload's embedding view, `payload` its embedding entry alone

    @property
    def whole_norm(self) -> float:
        """‖Δ̂‖ of the whole payload, what the median clip reads (a view carries it in its index)."""
        return self.norm if self.norm is not None else payload_norm(self.payload)

    @property
    def entry(self) -> Entry:
        """How a committed set names it: (replica id prefix, sha256 prefix)."""
        return entry(self.replica, self.sha256)


def encoded(replica: str, payload: Payload) -> Contribution:
    """Our own payload, as the encoder made it: serialized and identified once."""
    data = payload.to_bytes()
    return whole(replica, data, payload)


def whole(replica: str, data: bytes, payload: Payload) -> Contribution:
    """A whole payload's contribution from its bytes and their parsed form (its id computed here)."""
    cut = sections(data, payload)
    return Contribution(replica, cut.id, data, payload, cut.norm)


def received(replica: str, want: str, data: bytes, reading: Reading) -> Contribution:
    """Bytes another peer served as the payload announced with id `want`: parsed once by `reading` (a
    malformed payload raises its PeerError), then checked against `want` (`Mismatch`). With a
    `ViewReader` the bytes are the payload's view, checked against the same id."""
    if isinstance(reading, ViewReader):
        view = reading.read(data)
        if view.id != want:
            raise Mismatch(f"the view of {replica[:12]}'s payload served does not match its announced id")
        return Contribution(replica, want, data, view.payload, view.norm, view=True)
    got = whole(replica, data, reading(data))
    if got.sha256 != want:
        raise Mismatch(f"the payload of {replica[:12]} served does not match its announced id")
    return got


def bare(payloads: Sequence[Payload], replicas: Sequence[str] = ()) -> list[Contribution]:
    """Payloads that never crossed the network, in commit order (module docstring): named by
    `replicas` when there is one id per payload, else anonymous."""
    named = len(replicas) == len(payloads)
    return [encoded(replicas[i] if named else "", p) for i, p in enumerate(payloads)]

"""One contribution to a round, identified once: who sent it, its sha256, its bytes, its parsed payload.

docs/architecture.md, "The path of a pseudo-gradient"; STYLE §23. A payload enters a round in one of
two places and is identified there, once:
- our own, where it is encoded (`encoded`: serialized once, hashed once; the encoder's `Payload`
  object is kept — it commits to the same bits as the bytes parsed back, `tests/unit/test_contribution.py`);
- another's, where it is fetched (`received`: the bytes checked against the sha256 their signed
  announcement carries, then parsed once by the round's validator).
From there the same record travels through the gather (`peer.node.round.gather`), FOLLOW, the
checks of a claimed set (`peer.node.round.verify`), the commit (`peer.node.stage.state`) and the link
it publishes (`peer.node.stage.ledger.make_link`): nothing on the way hashes or parses it again.

`bare` names payloads that never crossed the network (a test's, a bench's, the simulator's): each is
serialized and hashed here, and without replica ids (`replica` "") a link names them by position.

Invariants: `sha256 == sha256(data)` and `payload` is `data` parsed (or the object `data` was
serialized from); frozen.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from peer.core.sparseloco.codec.format import Payload
from peer.errors import PeerError
from peer.node.round.claims import Entry, entry

__all__ = ["Contribution", "Mismatch", "bare", "encoded", "received", "sha256"]


def sha256(data: bytes) -> str:
    """The digest announced with every payload (hex)."""
    return hashlib.sha256(data).hexdigest()


class Mismatch(PeerError):
    """Bytes that are not the payload their announcement names."""


@dataclass(frozen=True)
class Contribution:
    """One replica's payload of one round: its id, sha256, wire bytes and parsed payload."""

    replica: str  # the full replica id ("" for a bare payload: a link names it by position)
    sha256: str  # hex digest of `data`, checked against the announcement where it was received
    data: bytes = field(repr=False)
    payload: Payload = field(repr=False)

    @property
    def entry(self) -> Entry:
        """How a committed set names it: (replica id prefix, sha256 prefix)."""
        return entry(self.replica, self.sha256)


def encoded(replica: str, payload: Payload) -> Contribution:
    """Our own payload, as the encoder made it: serialized and hashed once."""
    data = payload.to_bytes()
    return Contribution(replica, sha256(data), data, payload)


def received(replica: str, want: str, data: bytes, parse: Callable[[bytes], Payload]) -> Contribution:
    """Bytes another peer served as the payload announced with sha256 `want`: checked (`Mismatch`),
    then parsed once by `parse` (a malformed payload raises its PeerError)."""
    if sha256(data) != want:
        raise Mismatch(f"the payload of {replica[:12]} served does not match its announced sha256")
    return Contribution(replica, want, data, parse(data))


def bare(payloads: Sequence[Payload], replicas: Sequence[str] = ()) -> list[Contribution]:
    """Payloads that never crossed the network, in commit order (module docstring): named by
    `replicas` when there is one id per payload, else anonymous."""
    named = len(replicas) == len(payloads)
    return [encoded(replicas[i] if named else "", p) for i, p in enumerate(payloads)]

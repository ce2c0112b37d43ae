"""The DHT records of a ranges round (docs/protocol.md, RANGES), parsed once where they leave the DHT.

- ``roster.{t}.{s}`` (`RosterRecord`): the round's contributions in roster order, as one holder closed
  them, named by their senders alone, and the roster's digest (`peer.core.sparseloco.ranges.owner.roster_digest`
  of the (replica, sha256) pairs): a holder resolves each sender into its signed announcement's
  (replica, payload sha256, merkle root, address) (`Roster`, `RosterEntry`) and checks the digest.
  Every holder takes the one of the best-ranked publisher (`peer.node.round.ranges.ownership.coordinator_order`).
- ``shards.{t}.{s}`` (`ShardsRecord`): an owner's shard hashes {range: sha256 of the shard's bytes}
  for the roster it aggregated against; the shards themselves are fetched over gRPC (kind SHARD).

- ``supports.{t}.{s}`` (a `ShardsRecord`): a voted round's owner's support hashes {range: sha256}.
- ``values.{t}.{s}`` (`ValuesRecord`): a voted round's sender's merkle root of its values parts.

All are per-peer records under the signer's owner subkey (`peer.net.records.RecordReader`), so a
roster or a shard hash is always the claim of a named peer: a holder checks it before it commits
anything (a roster's entries against the signed announcements, a shard against its owner's backup
or a recomputation).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from peer.net.records import _SIGNED, _fields, _is_int, _is_str

MAX_ROSTER = 4096  # entries a roster record may hold (a larger one is malformed)
MAX_SHARDS = 4096  # shard hashes one owner's record may hold


@dataclass(frozen=True)
class RosterEntry:
    """One contribution of a ranges round, in roster order, as a holder resolves it from the sender's
    signed announcement (the roster record names the sender alone)."""

    replica: str
    sha256: str  # of the parts concatenated (the announcement's sha256)
    root: str  # merkle root of the parts (the announcement's root)
    sender: str  # the peer that announced it (and serves its parts)
    address: str


@dataclass(frozen=True)
class Roster:
    """A roster a holder took: the record's digest and R, its senders resolved into entries."""

    digest: str
    ranges: int
    entries: tuple[RosterEntry, ...]

    def record(self) -> RosterRecord:
        return RosterRecord(self.digest, self.ranges, tuple(e.sender for e in self.entries))


def _senders(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and len(v) <= MAX_ROSTER and all(_is_str(x) for x in v)


def _hashes(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and len(v) <= MAX_SHARDS
        and all(isinstance(k, str) and k.isdigit() and len(k) < 10 and _is_str(x) for k, x in v.items())
    )


@dataclass(frozen=True)
class RosterRecord:
    """A holder's `roster.{t}.{s}` record: the senders of the contributions of the round it closed, in
    roster order, with the roster's digest and R. Only the senders: each holder has read their signed
    announcements (replica, sha256, root, address) and takes a roster only once it has, so repeating
    them would cost every holder ~4x the bytes for nothing it could trust more (`Roster`)."""

    digest: str = ""
    ranges: int = 0  # R, the plan's number of ranges
    senders: tuple[str, ...] = ()
    peer_id: str = ""
    time: float = 0.0

    SPEC: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "digest": _is_str,
        "ranges": _is_int,
        "senders": _senders,
        **_SIGNED,
    }

    @classmethod
    def parse(cls, raw: Any) -> RosterRecord | None:
        fields = _fields(raw, cls.SPEC)
        if fields is None:
            return None
        fields["senders"] = tuple(fields.get("senders", ()))
        return cls(**fields)

    def to_record(self) -> dict[str, Any]:
        return {"digest": self.digest, "ranges": self.ranges, "senders": list(self.senders)}


@dataclass(frozen=True)
class ShardsRecord:
    """An owner's `shards.{t}.{s}` record: {range: sha256 of its shard} for the roster `roster`."""

    roster: str = ""
    shards: Mapping[int, str] | None = None
    peer_id: str = ""
    time: float = 0.0

    SPEC: ClassVar[dict[str, Callable[[Any], bool]]] = {"roster": _is_str, "shards": _hashes, **_SIGNED}

    @classmethod
    def parse(cls, raw: Any) -> ShardsRecord | None:
        fields = _fields(raw, cls.SPEC)
        if fields is None:
            return None
        fields["shards"] = {int(k): v for k, v in fields.get("shards", {}).items()}
        return cls(**fields)

    def to_record(self) -> dict[str, Any]:
        return {"roster": self.roster, "shards": {str(r): h for r, h in sorted((self.shards or {}).items())}}


@dataclass(frozen=True)
class ValuesRecord:
    """A sender's `values.{t}.{s}` record in a voted round (docs/protocol.md, VOTED): the merkle root
    of its values parts (one per range, each at that range's agreed support) for the roster `roster`.
    A values part counts only when its merkle path proves it against this signed root, so a sender
    cannot serve one owner values and a backup others."""

    roster: str = ""
    root: str = ""
    peer_id: str = ""
    time: float = 0.0

    SPEC: ClassVar[dict[str, Callable[[Any], bool]]] = {"roster": _is_str, "root": _is_str, **_SIGNED}

    @classmethod
    def parse(cls, raw: Any) -> ValuesRecord | None:
        fields = _fields(raw, cls.SPEC)
        return None if fields is None else cls(**fields)

    def to_record(self) -> dict[str, Any]:
        return {"roster": self.roster, "root": self.root}

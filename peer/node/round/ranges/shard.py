"""One range's shard of a ranges round, identified once: its sha256, its wire bytes, its parsed shard.

docs/protocol.md, RANGES; STYLE §23. A shard enters a holder's round in one of two places and is
hashed there, once, like a contribution (`peer.node.round.contribution`):
- one we aggregate (an owner's range, or a range whose owners are gone): `made`, serialized and
  hashed where it is computed;
- one we take from others (`peer.node.round.ranges.fetch.RangeFetcher.shard`): its bytes checked
  against the sha256 its owners published, then parsed once.
From there the same record travels through the resolution (`peer.node.round.ranges.resolve`), the
round's result (`RangesResult.shards`), the commit (`peer.node.stage.state.StageState.apply_ranges`)
and the link it publishes (`peer.node.stage.ranges.ranges_link`, whose shards digest is made of
these sha256s): nothing on the way hashes or parses it again.

Invariants: `sha256 == sha256(data)` and `shard` is `data` parsed (or the object `data` was
serialized from); frozen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from peer.core.sparseloco.ranges.owner import Shard
from peer.node.round.contribution import sha256

__all__ = ["RangeShard", "made"]


T = TypeVar("T")


@dataclass(frozen=True)
class RangeShard(Generic[T]):
    """The shard of one range as a holder took it: its sha256 (hex), wire bytes and parsed shard (a
    `Shard`; in a voted round's support phase, the range's `Support`: the same record, hashed once)."""

    sha256: str  # hex digest of `data`: checked against the published one, or computed where made
    data: bytes = field(repr=False)
    shard: T = field(repr=False, compare=False)  # `data` parsed: equal bytes, equal shards


def made(shard: Shard) -> RangeShard[Shard]:
    """A shard we aggregated ourselves: serialized and hashed once."""
    data = shard.to_bytes()
    return RangeShard(sha256(data), data, shard)

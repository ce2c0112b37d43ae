"""Range-sharded rounds (issue 24): a stage's Δ̂ cut into R ranges, each aggregated by its owner.

Modules, each importing only the ones before it:
  plan    the ranges of a stage: bands of whole tile rows, R ranges of about equal element counts
  merkle  the root a contributor announces over its parts, and the proof of one part
  parts   a contribution as R parts: `compress`'s error feedback, band by band
  owner   an owner's portable aggregate of one range (the shard), and what it returns to senders
  voted   the voted support: a sender's vote, the owner's tally and the agreed k′ positions per tile
  voted_range  range r of a voted round: vote, support and values parts, the owner's exact mean shard

The swarm protocol that uses them is `peer.node.round` (docs/protocol.md).
"""

from peer.core.sparseloco.ranges.merkle import merkle_check, merkle_proof, merkle_root
from peer.core.sparseloco.ranges.owner import (
    RangeStats,
    Shard,
    aggregate_range,
    returned_to,
    roster_digest,
    shard_delta,
)
from peer.core.sparseloco.ranges.parts import encode_parts
from peer.core.sparseloco.ranges.plan import (
    Band,
    RangePlan,
    assemble,
    band_name,
    band_views,
    n_ranges_for,
    n_units,
    plan_ranges,
)

__all__ = [
    "Band",
    "RangePlan",
    "RangeStats",
    "Shard",
    "aggregate_range",
    "assemble",
    "band_name",
    "band_views",
    "encode_parts",
    "merkle_check",
    "merkle_proof",
    "merkle_root",
    "n_ranges_for",
    "n_units",
    "plan_ranges",
    "returned_to",
    "roster_digest",
    "shard_delta",
]

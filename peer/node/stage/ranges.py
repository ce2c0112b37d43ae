"""A stage holder's side of a ranges round (docs/protocol.md, RANGES): its plan, its commit, its feedback.

Pure functions of the holder's committed state and the round's agreed outcome, used by
`peer.node.stage.state.StageState` (`contribute_parts`, `apply_ranges`):
- `range_plan`: the ranges of this stage for a round whose predecessor committed `n_prev`
  contributions (R = `n_ranges_for(n_prev, n_units)`: every holder plans alike from agreed inputs);
- `commit_ranges`: the portable commit of the assembled shards (`peer.core.sparseloco.commit.commit_summed`, T⊥
  decayed as in an all-to-all round), ended by the same `peer.node.stage.commit.outcome` as
  `peer.node.stage.commit.compute`: the ban state advanced by the roster (a ranges round clips but
  screens no outlier), the state hashed;
- `returned`: what the round gives back to our error buffer, range by range
  (`peer.core.sparseloco.ranges.owner.returned_to`: the mass the shard dropped or clipped from our part; our
  whole part where the roster lacks us or the range was not committed);
- `ranges_link`: the claim of the committed state: the roster's (replica, sha256) entries, and
  (roster digest, sha256 of the shards' digests in range order), which pins the exact shards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

from torch import Tensor

from peer.config import RunConfig
from peer.core.sparseloco.algorithm import decompress
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.commit import commit_summed, perp_decay
from peer.core.sparseloco.ranges import RangePlan, assemble, n_ranges_for, n_units, plan_ranges
from peer.core.sparseloco.ranges.owner import Shard, returned_to, shard_delta
from peer.node.round.bans import Bans
from peer.node.round.claims import SHA_CHARS, Entry, Link, entry
from peer.node.round.ranges.shard import RangeShard
from peer.node.stage.commit import Outcome, outcome

__all__ = ["commit_ranges", "parts_delta", "range_plan", "ranges_link", "returned"]


def _shapes(start: Mapping[str, Tensor]) -> dict[str, tuple[int, ...]]:
    return {name: tuple(v.shape) for name, v in start.items()}


def range_plan(cfg: SparseLoCoConfig, shapes: Mapping[str, Sequence[int]], n_prev: int) -> RangePlan:
    """The plan of a ranges round of the stage whose parameters have `shapes` (θ_start's tensor order)."""
    return plan_ranges(shapes, cfg.chunk, n_ranges_for(n_prev, n_units(shapes, cfg.chunk)))


def parts_delta(plan: RangePlan, parts: Sequence[Payload], start: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Our parts decoded into dense tensors by parameter name (what an unsent contribution returns)."""
    return assemble(plan, {r: decompress(p) for r, p in enumerate(parts)}, _shapes(start))


def commit_ranges(
    cfg: RunConfig,
    stage: int,
    U: Tensor | None,
    t: int,
    start: Mapping[str, Tensor],
    perp: Tensor | None,
    bans: Bans,
    plan: RangePlan,
    replicas: Sequence[str],
    shards: Mapping[int, Shard],
    embed_update: Tensor | None,
) -> Outcome:
    """Commit round t from (start, perp, bans) with the agreed shards of the roster `replicas`: Δ̄
    assembled from the shards, the portable commit of it, then `peer.node.stage.commit.outcome` as
    an all-to-all commit ends (a ranges round screens no outlier: nothing is dropped)."""
    summed = assemble(plan, {r: shard_delta(s) for r, s in shards.items()}, _shapes(start))
    done = commit_summed(start, perp, summed, cfg.sparseloco, U, embed_update, perp_decay(cfg.train, t))
    return outcome(cfg, stage, t, bans, done, replicas, ())


def returned(
    plan: RangePlan,
    start: Mapping[str, Tensor],
    parts: Sequence[Payload],
    position: int | None,
    shards: Mapping[int, Shard],
) -> dict[str, Tensor]:
    """What the round returns to our error buffer, by parameter name (module docstring); `position`
    is our contribution's place in the roster (None: not in it)."""
    back = {}
    for r, part in enumerate(parts):
        shard = shards.get(r)
        back[r] = decompress(part) if position is None or shard is None else returned_to(part, position, shard)
    return assemble(plan, back, _shapes(start))


def shards_digest(shards: Mapping[int, RangeShard]) -> str:
    """sha256 over the shards' sha256 digests in range order (SHA_CHARS hex chars): pins every shard
    (each digest the one its record carries, never recomputed)."""
    h = hashlib.sha256()
    for r in sorted(shards):
        h.update(bytes.fromhex(shards[r].sha256))
    return h.hexdigest()[:SHA_CHARS]


def ranges_link(
    t: int,
    prev_state: str,
    out: Outcome,
    roster: Sequence[tuple[str, str]],
    roster_digest: str,
    shards: Mapping[int, RangeShard],
    embed_set: Sequence[Entry] | None,
) -> Link:
    """The link of a ranges commit: the roster's (replica, sha256) entries and (roster digest, shards digest)."""
    entries = tuple(entry(rid, sha) for rid, sha in roster)
    embed = None if embed_set is None else tuple(embed_set)
    return Link(t, prev_state, out.state, entries, embed, ranges=(roster_digest, shards_digest(shards)))

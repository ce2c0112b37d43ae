"""What one simulated round moves and how long a peer computes: real sizes on the real stage shapes.

Where this sits: `peer bench swarm` (`peer.research.swarm.sim`) takes every byte count and compute time from
here, never from a formula of its own:
- payload bytes: `peer.core.sparseloco.codec.format.payload_nbytes` over
  `peer.core.model.decoder.stage_shapes` of the preset
  (the exact layout `Payload.to_bytes` writes);
- part bytes (range r of one contribution) and shard bytes (an owner's aggregate of range r): the range
  plan's own sizes (`peer.core.sparseloco.ranges.plan.plan_ranges` for R = `n_ranges_for(n, n_units)`,
  `RangePlan.part_nbytes`, `peer.core.sparseloco.ranges.owner.shard_payload_nbytes`; an exact shard,
  `swarm.shard` = "exact": `peer.core.sparseloco.ranges.exact.exact_nbytes_at`, per band min(sparse, dense)
  at the expected union of the round's contributions' supports), plus a part's merkle proof
  (log2 R nodes of `NODE_BYTES`) and a shard's header (`Shard.to_bytes`: magic, version, round, stage,
  range, roster digest and size, then the lists of missing and clipped roster positions);
- the voted round's four messages per range (`voted_sizes`): a vote (k indices per tile), an agreed
  support (k′ indices per tile), a sender's values at it (k′ codes per tile and codebook, no indices) and
  the owners' mean shard (k′ positions and values at `swarm.mean_bits` per tile: `mean_shard_nbytes`, the
  exact shard's own size functions), the others by `peer.core.sparseloco.aligned`'s `indices_nbytes` and
  `values_nbytes` on range r's bands — the functions `peer simulate --round voted`'s `RoundBytes` counts
  with; 1-D tensors go through the codec as the designs send them (8-bit; float32 in the mean shard);
- compute time of H inner steps: `peer.research.plan.command.plan_rows` (the planner's model: m micro-batches of
  max(compute, boundary message) each, at the flags' FLOP/s and the peer's link).
The simulation is one stage's round: the later stages' fetches of stage 0 for T⊥ (whole, or embedding views
with screening off: `peer.research.plan.round.stage0_fetch_nbytes`) are not part of it; `peer plan` counts them.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, replace
from functools import lru_cache

from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.aligned import indices_nbytes, sparse_names, values_nbytes
from peer.core.sparseloco.codec.format import (
    HEADER_NBYTES,
    SPARSE,
    SparseLoCoConfig,
    entry_kind,
    payload_nbytes,
)
from peer.core.sparseloco.ranges.exact import (
    BODY_HEAD_NBYTES,
    band_bits,
    band_nbytes,
    exact_nbytes_at,
    max_unary_len,
    rice_bits,
    union_count,
)
from peer.core.sparseloco.ranges.merkle import NODE_BYTES
from peer.core.sparseloco.ranges.owner import shard_config, shard_payload_nbytes
from peer.core.sparseloco.ranges.plan import RangePlan, n_ranges_for, n_units, plan_ranges
from peer.research.plan.command import PlanInputs, plan_rows, resolve_model

SHARD_HEAD = struct.calcsize("<4sBQII16sI")  # magic, version, t, stage, r, roster digest, roster size (`Shard`)


@dataclass(frozen=True)
class Sizes:
    """Byte counts of one stage's round for one range count R."""

    payload: int  # one contribution, whole (rule "all")
    parts: tuple[int, ...]  # part r of one contribution (its band entries), r = 0 … R − 1
    shards: tuple[int, ...]  # shard r without its header (re-sparsified at shard_topk, or exact)
    proof: int  # merkle proof bytes per part

    @property
    def n(self) -> int:
        return len(self.parts)

    def shard(self, r: int, n_roster: int, n_clipped: int = 0, n_missing: int = 0) -> int:
        """Shard r's wire bytes (`Shard.to_bytes`): payload, header, the lists of missing roster positions
        (u32 count + u32 each) and of clipped ones (u32 count + u32 position and f32 scale each). The
        roster's size does not count: a shard names exceptions, not every contribution."""
        assert 0 <= n_missing <= n_roster and 0 <= n_clipped <= n_roster
        return self.shards[r] + SHARD_HEAD + 4 + 4 * n_missing + 4 + 8 * n_clipped


@lru_cache(maxsize=64)
def stage_sizes(
    preset: str, stages: int, stage: int, n_contributors: int, shard_topk: int = 0, shard: str = "topk"
) -> Sizes:
    """The round's byte counts at stage `stage` of `preset` split in `stages`, for a previous set of
    `n_contributors` (R = n_ranges_for(n_contributors, tiles)); codec at `SparseLoCoConfig()` defaults;
    `shard` as `swarm.shard` (exact shards of n_contributors contributions, or topk at `shard_topk`)."""
    _, model = resolve_model(PlanInputs(preset=preset))
    shapes = stage_shapes(model, stage, stages)
    cfg = SparseLoCoConfig()
    plan = plan_ranges(shapes, cfg.chunk, n_ranges_for(n_contributors, n_units(shapes, cfg.chunk)))
    parts = tuple(plan.part_nbytes(r, cfg) for r in range(plan.n))
    if shard == "exact":
        shards = tuple(exact_nbytes_at(plan, r, cfg, n_contributors) for r in range(plan.n))
    else:
        shards = tuple(shard_payload_nbytes(plan, r, shard_config(cfg, shard_topk or None)) for r in range(plan.n))
    proof = NODE_BYTES * math.ceil(math.log2(plan.n)) if plan.n > 1 else 0
    return Sizes(payload_nbytes(shapes, cfg), parts, shards, proof)


@dataclass(frozen=True)
class VotedSizes:
    """Byte counts of one stage's voted round per range r = 0 … R − 1 (module docstring); a vote and a
    sender's values carry a merkle proof (`proof`) as a part does, a support and a mean a shard's header
    (`head`)."""

    votes: tuple[int, ...]  # range r of one sender's vote: k indices per tile
    values: tuple[int, ...]  # range r of one sender's values at the agreed support: k′ codes per tile
    supports: tuple[int, ...]  # range r's agreed support: k′ indices per tile
    means: tuple[int, ...]  # range r's mean shard: k′ positions and values (at mean_bits) per tile
    proof: int
    head: int = SHARD_HEAD + 8  # `Sizes.shard`'s header with empty lists of missing and clipped members

    @property
    def n(self) -> int:
        return len(self.votes)


def mean_shard_nbytes(plan: RangePlan, r: int, cfg: SparseLoCoConfig, keep: int, bits: int) -> int:
    """Range r's mean shard body as the swarm sends it (`voted_range.mean_shard`: an exact shard of k′
    entries per tile of each voted band, values at `bits`, positions Rice-coded; a band `compress` sends
    dense: every entry, float32), each band at its largest Rice length (`max_unary_len`)."""
    at = replace(cfg, topk=keep, quant_bits=bits)
    total = BODY_HEAD_NBYTES
    for b in plan.ranges[r]:
        n = min(b.numel, union_count(b.shape, at, 1)) if entry_kind(b.shape, cfg) == SPARSE else b.numel
        total += band_nbytes(b.numel, n, max_unary_len(b.numel, n, rice_bits(b.numel, n)), band_bits(b.shape, at))
    return total


def _voted_range(
    plan: RangePlan, r: int, cfg: SparseLoCoConfig, keep: int, mean_bits: int
) -> tuple[int, int, int, int]:
    """(vote, values, support, mean) bytes of range r: its bands as the aligned designs size a stage, the
    mean as the swarm's mean shard (`mean_shard_nbytes`)."""
    shapes = {b.entry: b.shape for b in plan.ranges[r]}
    sparse = sparse_names(shapes, cfg.dense_1d)
    dense = {n: s for n, s in shapes.items() if n not in sparse}
    codec = payload_nbytes(dense, cfg) - HEADER_NBYTES  # 1-D tensors as the codec sends them
    return (
        indices_nbytes(shapes, cfg.chunk, cfg.topk, sparse),
        values_nbytes(shapes, cfg.chunk, keep, cfg.quant_bits, sparse) + codec,
        indices_nbytes(shapes, cfg.chunk, keep, sparse),
        mean_shard_nbytes(plan, r, cfg, keep, mean_bits),
    )


@lru_cache(maxsize=64)
def voted_sizes(
    preset: str, stages: int, stage: int, n_contributors: int, support_topk: int, mean_bits: int = 0
) -> VotedSizes:
    """The voted round's byte counts at stage `stage` of `preset` split in `stages`, R as `stage_sizes`
    gives for `n_contributors`, k′ = `support_topk` positions per tile, the means at `mean_bits`
    (`swarm.mean_bits`); codec at `SparseLoCoConfig()`."""
    _, model = resolve_model(PlanInputs(preset=preset))
    shapes = stage_shapes(model, stage, stages)
    cfg = SparseLoCoConfig()
    plan = plan_ranges(shapes, cfg.chunk, n_ranges_for(n_contributors, n_units(shapes, cfg.chunk)))
    per = [_voted_range(plan, r, cfg, support_topk, mean_bits) for r in range(plan.n)]
    proof = NODE_BYTES * math.ceil(math.log2(plan.n)) if plan.n > 1 else 0
    votes, values, supports, means = (tuple(x) for x in zip(*per, strict=True))
    return VotedSizes(votes, values, supports, means, proof)


@lru_cache(maxsize=64)
def compute_s(preset: str, stages: int, inner_steps: int, flops: float, link_mbps: float) -> float:
    """Wall time of H inner steps of one pipeline on links of `link_mbps`, by the planner's model
    (`peer plan`: m micro-batches of max(compute, boundary message), compressed boundaries)."""
    inputs = PlanInputs(preset=preset, stages=stages, inner_steps=inner_steps, flops=flops)
    row = plan_rows(inputs, [link_mbps])[0]
    return float(row["inner_s_compressed"])

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
- compute time of H inner steps: `peer.research.plan.command.plan_rows` (the planner's model: m micro-batches of
  max(compute, boundary message) each, at the flags' FLOP/s and the peer's link).
The simulation is one stage's round: the later stages' fetches of stage 0 for T⊥ (whole, or embedding views
with screening off: `peer.research.plan.round.stage0_fetch_nbytes`) are not part of it; `peer plan` counts them.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from functools import lru_cache

from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.codec.format import SparseLoCoConfig, payload_nbytes
from peer.core.sparseloco.ranges.exact import exact_nbytes_at
from peer.core.sparseloco.ranges.merkle import NODE_BYTES
from peer.core.sparseloco.ranges.owner import shard_config, shard_payload_nbytes
from peer.core.sparseloco.ranges.plan import n_ranges_for, n_units, plan_ranges
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


@lru_cache(maxsize=64)
def compute_s(preset: str, stages: int, inner_steps: int, flops: float, link_mbps: float) -> float:
    """Wall time of H inner steps of one pipeline on links of `link_mbps`, by the planner's model
    (`peer plan`: m micro-batches of max(compute, boundary message), compressed boundaries)."""
    inputs = PlanInputs(preset=preset, stages=stages, inner_steps=inner_steps, flops=flops)
    row = plan_rows(inputs, [link_mbps])[0]
    return float(row["inner_s_compressed"])

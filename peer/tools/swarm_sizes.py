"""What one simulated round moves and how long a peer computes: real sizes on the real stage shapes.

Where this sits: `peer bench swarm` (`peer.tools.swarm_sim`) takes every byte count and compute time from
here, never from a formula of its own:
- payload bytes: `peer.core.codec.format.payload_nbytes` over `peer.core.model.stage_shapes` of the preset
  (the exact layout `Payload.to_bytes` writes);
- part bytes (range r of one contribution) and shard bytes (an owner's aggregate of range r): the same
  `payload_nbytes` over range r's band entries, for the range plan of R = n_ranges_for(n, tiles) ranges
  (`range_band_shapes`: the one place that reads the range plan), plus a part's merkle proof
  (log2 R nodes of 16 bytes) and a shard's header (round, stage, range, roster digest, the contributor
  and clip bitmaps over the roster);
- compute time of H inner steps: `peer.tools.plan.plan_rows` (the planner's model: m micro-batches of
  max(compute, boundary message) each, at the flags' FLOP/s and the peer's link).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

from peer.core.codec.format import SparseLoCoConfig, payload_nbytes
from peer.core.model import stage_shapes
from peer.tools.plan import PlanInputs, plan_rows, resolve_model

MERKLE_NODE = 16  # bytes per merkle proof node (sha256 truncated to 16 bytes: peer.core.ranges.parts)
SHARD_FIXED = 3 * 4 + 16 + 4  # t, stage, r; roster digest; payload length (peer.core.ranges.owner.Shard)


@dataclass(frozen=True)
class Sizes:
    """Byte counts of one stage's round for one range count R."""

    payload: int  # one contribution, whole (rule "all")
    parts: tuple[int, ...]  # part r of one contribution (its band entries), r = 0 … R − 1
    shards: tuple[int, ...]  # shard r without its header (re-sparsified at shard_topk)
    proof: int  # merkle proof bytes per part

    @property
    def n(self) -> int:
        return len(self.parts)

    def shard(self, r: int, n_roster: int, n_clipped: int = 0) -> int:
        """Shard r's wire bytes: payload, header, two bitmaps over the roster, one scale per clipped part."""
        return self.shards[r] + SHARD_FIXED + 2 * math.ceil(n_roster / 8) + 4 * n_clipped


def _bands(shapes: Mapping[str, Sequence[int]], chunk: int) -> list[tuple[str, int, int, tuple[int, ...]]]:
    """(name, row0, row1, tensor shape) row blocks of `chunk` rows of every 2-D tensor, whole other tensors."""
    out = []
    for name, shape in shapes.items():
        shape = tuple(shape)
        if len(shape) != 2:
            out.append((name, 0, shape[0] if shape else 1, shape))
            continue
        for row0 in range(0, shape[0], chunk):
            out.append((name, row0, min(shape[0], row0 + chunk), shape))
    return out


def n_tiles(shapes: Mapping[str, Sequence[int]], chunk: int) -> int:
    """Row blocks a range plan can cut the stage into (the most ranges it can have)."""
    return len(_bands(shapes, chunk))


def range_band_shapes(shapes: Mapping[str, Sequence[int]], chunk: int, R: int) -> list[dict[str, tuple[int, ...]]]:
    """Range r's band entries {f"{name}@{row0}": band shape}, r = 0 … R − 1: row blocks in tensor order,
    cut into R runs of about equal element counts, a run of one tensor's blocks being one band.
    (The shape of helper A's `peer.core.ranges.plan.plan_ranges`; swapped for it once merged.)"""
    bands = _bands(shapes, chunk)
    sizes = [(r1 - r0) * s[1] if len(s) == 2 else math.prod(s) for _, r0, r1, s in bands]
    total = sum(sizes)
    ranges: list[dict[str, tuple[int, ...]]] = [{} for _ in range(R)]
    spans: list[list[tuple[str, int, int, tuple[int, ...]]]] = [[] for _ in range(R)]
    acc = 0
    for band, size in zip(bands, sizes, strict=True):
        r = min(R - 1, int(acc * R // total)) if total else 0
        spans[r].append(band)
        acc += size
    for r, span in enumerate(spans):
        for name, row0, row1, shape in span:
            if len(shape) != 2:
                ranges[r][f"{name}@0"] = shape
                continue
            prev = next((k for k in ranges[r] if k.startswith(name + "@")), None)
            if prev is not None:  # a run of this tensor's blocks: one band
                rows = ranges[r].pop(prev)[0] + (row1 - row0)
                ranges[r][prev] = (rows, shape[1])
            else:
                ranges[r][f"{name}@{row0}"] = (row1 - row0, shape[1])
    return ranges


def n_ranges_for(n_contributors: int, tiles: int) -> int:
    """R: the smallest power of two >= the contributors, at least 1, at most the stage's tiles."""
    R = 1
    while n_contributors > R:
        R *= 2
    return max(1, min(R, tiles))


@lru_cache(maxsize=64)
def stage_sizes(preset: str, stages: int, stage: int, n_contributors: int, shard_topk: int = 0) -> Sizes:
    """The round's byte counts at stage `stage` of `preset` split in `stages`, for a previous set of
    `n_contributors` (R = n_ranges_for(n_contributors, tiles)); codec at `SparseLoCoConfig()` defaults."""
    _, model = resolve_model(PlanInputs(preset=preset))
    shapes = stage_shapes(model, stage, stages)
    cfg = SparseLoCoConfig()
    shard_cfg = SparseLoCoConfig(topk=shard_topk or cfg.topk)
    R = n_ranges_for(n_contributors, n_tiles(shapes, cfg.chunk))
    bands = range_band_shapes(shapes, cfg.chunk, R)
    parts = tuple(payload_nbytes(b, cfg) for b in bands)
    shards = tuple(payload_nbytes(b, shard_cfg) for b in bands)
    proof = MERKLE_NODE * max(0, math.ceil(math.log2(R))) if R > 1 else 0
    return Sizes(payload_nbytes(shapes, cfg), parts, shards, proof)


@lru_cache(maxsize=64)
def compute_s(preset: str, stages: int, inner_steps: int, flops: float, link_mbps: float) -> float:
    """Wall time of H inner steps of one pipeline on links of `link_mbps`, by the planner's model
    (`peer plan`: m micro-batches of max(compute, boundary message), compressed boundaries)."""
    inputs = PlanInputs(preset=preset, stages=stages, inner_steps=inner_steps, flops=flops)
    row = plan_rows(inputs, [link_mbps])[0]
    return float(row["outer_s_compressed"] - row["round_s"])

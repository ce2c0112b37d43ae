"""How big a range shard is, exact or re-sparsified, against the payloads it replaces (issue 37).

A holder of a ranges round downloads about one shard of every range. With `swarm.shard` = "topk" that is
about one payload whatever M (each shard keeps k per tile); with "exact" it is the round's exact aggregate,
which grows with M while it is sparse and stops at the dense size (`peer.core.sparseloco.ranges.exact`):
min(≈ the M contributions' bytes, the dense size). `shard_rows` gives, for a stage and several M, the
bytes of all R shards of each kind next to one payload P and all-to-all's M − 1 payloads:

- `exact_model`: the size model (`exact.exact_nbytes_at`, the expected union of M random top-k
  supports per tile, `exact.union_count`), any preset;
- `exact_measured`: the real shards of M random payloads (independent Gaussian Δ, `encode_parts`, then
  `aggregate_range(exact=True)` of every range), only where `measure` is set (small stages);
- `topk`: `shard_payload_nbytes` (its size is a function of the shapes);
- `dense`: every band of every range dense (`exact.max_body_nbytes`): the cap whatever M.
Shard headers and exception lists (< 50 bytes a shard) are left out of all of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.codec.format import SparseLoCoConfig, payload_nbytes
from peer.core.sparseloco.ranges import aggregate_range, encode_parts, n_ranges_for, n_units, plan_ranges
from peer.core.sparseloco.ranges.exact import exact_nbytes_at, max_body_nbytes
from peer.core.sparseloco.ranges.owner import roster_digest, shard_payload_nbytes
from peer.research.plan.command import PlanInputs, resolve_model

__all__ = ["ShardRow", "shard_rows"]


@dataclass(frozen=True)
class ShardRow:
    """The bytes of one stage's R shards (all ranges) at M contributions."""

    m: int
    n_ranges: int
    payload: int  # P: one contribution, whole
    topk: int
    exact_model: int
    dense: int
    exact_measured: int | None = None

    def in_payloads(self, nbytes: int | None) -> float | None:
        return None if nbytes is None else nbytes / self.payload


def _measured(shapes: dict[str, tuple[int, ...]], cfg: SparseLoCoConfig, m: int, n_ranges: int, seed: int) -> int:
    plan = plan_ranges(shapes, cfg.chunk, n_ranges)
    parts = []
    for i in range(m):
        gen = torch.Generator().manual_seed(seed * 100_003 + i)
        delta = {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}
        parts.append(encode_parts(delta, None, cfg, plan)[0])
    roster = roster_digest([(f"r{i}", "00" * 32) for i in range(m)])
    total = 0
    for r in range(plan.n):
        shard, _ = aggregate_range(0, 0, r, plan, [p[r] for p in parts], roster, cfg, exact=True)
        total += len(shard.payload.to_bytes())
    return total


def shard_rows(
    preset: str,
    stages: int,
    stage: int,
    ms: Sequence[int],
    cfg: SparseLoCoConfig | None = None,
    measure: bool = False,
    seed: int = 0,
) -> list[ShardRow]:
    """One `ShardRow` per M of `ms` for stage `stage` of `preset` in `stages` (module docstring)."""
    cfg = cfg or SparseLoCoConfig()
    _, model = resolve_model(PlanInputs(preset=preset))
    shapes = stage_shapes(model, stage, stages)
    rows = []
    for m in ms:
        plan = plan_ranges(shapes, cfg.chunk, n_ranges_for(m, n_units(shapes, cfg.chunk)))
        rng = range(plan.n)
        rows.append(
            ShardRow(
                m,
                plan.n,
                payload_nbytes(shapes, cfg),
                sum(shard_payload_nbytes(plan, r, cfg) for r in rng),
                sum(exact_nbytes_at(plan, r, cfg, m) for r in rng),
                sum(max_body_nbytes(plan, r, cfg) for r in rng),
                _measured(shapes, cfg, m, plan.n, seed) if measure else None,
            )
        )
    return rows

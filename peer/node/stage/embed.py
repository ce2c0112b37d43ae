"""Stage 0's committed embedding change u = fl32(−η·Δ̄[embed.weight]): every other stage's T⊥ update.

Stage 0's holders get u from their own commit (`RoundCommit.embed_update`). A holder of another
stage that only observes stage 0 (a stage peer; RECONCILE's recomputation and a joiner's replay of
a claimed set) gets the same bits from stage 0's committed round through `stage0_change`, the one
function that turns that round into u, from either
- its committed contributions (all-to-all): clipped and screened over the whole contributions,
  with the replica ids as the screening's keys, exactly as stage 0's holders commit them
  (`peer.node.stage.commit.compute`, its set named by `peer.node.stage.commit.named`); a contribution
  may be a view (`Contribution.view`: the embedding's entry and the whole payload's norm, all that u
  reads: the embedding is screened apart, `peer.core.sparseloco.robust.sections`), clipped by that norm;
- the shards of the ranges that hold embed.weight's bands (a ranges round, `embed_ranges`): Δ̄ of
  embed.weight assembled band by band as `assemble` writes it for stage 0's holders (`embed_change`).

Invariant: u is bit-identical to the `embed_update` of stage 0's holders' commit of the same round
(tests/unit/test_stage_ranges.py, tests/unit/test_robust.py), so T⊥ stays one tensor across stages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.config import RunConfig
from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.commit import embedding_update, outer_delta
from peer.core.sparseloco.ranges import RangePlan
from peer.core.sparseloco.ranges.owner import Shard, shard_delta
from peer.core.subspace.state import EMBED
from peer.node.round.contribution import Contribution
from peer.node.stage.commit import named, screening_keys

__all__ = ["EmbedShards", "embed_change", "embed_ranges", "stage0_change"]


@dataclass(frozen=True)
class EmbedShards:
    """What an observer holds of stage 0's ranges round: its plan and the shards of (at least) the
    ranges that hold embed.weight's bands."""

    plan: RangePlan
    shards: Mapping[int, Shard]


def stage0_change(cfg: RunConfig, committed: Sequence[Contribution] | EmbedShards) -> Tensor | None:
    """u of stage 0's committed round (module docstring) from its committed contributions in commit
    order or from its embedding ranges' shards; None when the set is empty (stage 0 did not move)."""
    if isinstance(committed, EmbedShards):
        shape = stage_shapes(cfg.model, 0, cfg.stages)[EMBED]
        return embed_change(cfg.sparseloco, committed.plan, committed.shards, shape)
    if not committed:
        return None
    payloads, replicas = named(committed)
    keys = screening_keys(payloads, replicas)
    if not any(c.view for c in committed):
        return embedding_update(payloads, cfg.sparseloco, keys=keys)
    return embedding_update(payloads, cfg.sparseloco, keys=keys, norms=[c.whole_norm for c in committed])


def embed_ranges(plan: RangePlan) -> list[int]:
    """The ranges of a stage-0 plan that hold a band of embed.weight (what a stage peer reads)."""
    return [r for r, bands in enumerate(plan.ranges) if any(b.name == EMBED for b in bands)]


def embed_change(cfg: SparseLoCoConfig, plan: RangePlan, shards: Mapping[int, Shard], shape: Sequence[int]) -> Tensor:
    """u of a stage-0 ranges round from the shards of `embed_ranges(plan)`: Δ̄[embed.weight] is
    assembled band by band as `assemble` writes it for stage 0's holders, so u has the bits their
    `commit_summed` gives (KeyError: a needed shard is missing)."""
    dense = torch.zeros(tuple(int(d) for d in shape), dtype=torch.float32)
    for r in embed_ranges(plan):
        delta = shard_delta(shards[r])
        for b in plan.ranges[r]:
            if b.name == EMBED:
                view = dense[b.row0 : b.row1] if dense.dim() >= 2 else dense
                view.copy_(delta[b.entry].reshape(view.shape))
    return outer_delta(dense, cfg.outer_lr)

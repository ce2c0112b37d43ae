"""A contribution cut into parts, one per range: `compress`'s error feedback, band by band.

    e  = β·e + Δ                 per band view of the error buffer (in place where it can be)
    Δ̂ = Q(TOP-k per chunk(e))    a band's tiles are the tensor's own tiles: the same top-k positions
    e  = e − Δ̂                   Δ̂ exactly as a receiver decodes it
    part_r = Payload(band entries of range r, in plan order)

This is `peer.core.sparseloco.algorithm.compress` (DESIGN.md §2, SparseLoCo Alg. 1) with one difference: the
quantizer's codebook is per band entry, not per tensor, so values (not positions) may differ from a
whole-tensor payload when quant_bits > 0; with quant_bits == 0 the parts carry exactly compress's
values and leave exactly its error buffer. Each part is checked by its owner against the
contribution's merkle root (`peer.core.sparseloco.ranges.merkle`) and by `RangePlan.validator`.

Invariants: every band is encoded by the codec's own `encode_tensor` (the same kernels, ties and
checks as a whole payload); error tensors that are contiguous CPU float32 are updated in place
through band views (a round allocates nothing of the model's size), others are copied first.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from peer.core.sparseloco.codec.encode import encode_tensor
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig, TensorEntry
from peer.core.sparseloco.codec.fused import run_each
from peer.core.sparseloco.ranges.plan import Band, RangePlan

__all__ = ["encode_parts"]


def _band(t: Tensor, b: Band) -> Tensor:
    return t[b.row0 : b.row1] if t.dim() >= 2 else t


def _inputs(
    delta: Mapping[str, Tensor], errors: Mapping[str, Tensor] | None, plan: RangePlan
) -> tuple[dict[str, Tensor], dict[str, Tensor | None]]:
    """Δ and e as contiguous CPU float32 (e: the caller's own tensor where it already is one)."""
    planned = list(dict.fromkeys(b.name for bands in plan.ranges for b in bands))
    if planned != list(delta):
        raise ValueError(f"encode_parts: the plan covers {planned[:3]}…, the delta {list(delta)[:3]}…: replan")
    ds, es = {}, {}
    for name, d in delta.items():
        ds[name] = d.detach().to("cpu", torch.float32).contiguous()
        prev = None if errors is None else errors.get(name)
        if prev is not None:
            if tuple(prev.shape) != tuple(d.shape):
                raise ValueError(f"error buffer of {name!r} has shape {tuple(prev.shape)}, delta has {tuple(d.shape)}")
            prev = prev.detach().to("cpu", torch.float32).contiguous()
        es[name] = prev
    return ds, es


def encode_parts(
    delta: Mapping[str, Tensor], errors: Mapping[str, Tensor] | None, cfg: SparseLoCoConfig, plan: RangePlan
) -> tuple[list[Payload], dict[str, Tensor]]:
    """(one part per range of the plan, the new error buffers e − Δ̂ per tensor).

    `delta` must hold exactly the plan's tensors, in its order. The error tensors of `errors` that
    are contiguous CPU float32 are written in place (and returned); `delta` is never modified.
    """
    ds, es = _inputs(delta, errors, plan)
    out = {name: e if e is not None else torch.empty(ds[name].shape, dtype=torch.float32) for name, e in es.items()}
    items = [(b, _band(ds[b.name], b), es[b.name]) for bands in plan.ranges for b in bands]
    for b, d, _ in items:
        if tuple(d.shape) != b.shape:
            raise ValueError(f"encode_parts: band {b.entry!r} is {b.shape}, the delta gives {tuple(d.shape)}: replan")

    def encode(item: tuple[Band, Tensor, Tensor | None]) -> TensorEntry:
        b, d, prev = item
        if prev is not None:
            entry, _ = encode_tensor(b.entry, d, _band(prev, b), cfg, in_place=True)
        else:
            entry, e = encode_tensor(b.entry, d, None, cfg)
            _band(out[b.name], b).copy_(e)
        return entry

    entries = iter(run_each(encode, items, [max(1, d.numel()) for _, d, _ in items]))
    parts = [Payload([next(entries) for _ in bands], cfg.chunk, cfg.topk, cfg.quant_bits) for bands in plan.ranges]
    return parts, out

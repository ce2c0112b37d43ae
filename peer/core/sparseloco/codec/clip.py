"""Robust aggregation: exactly rounded global norms and clipping to the round's median norm.

    Δ̂ ← Δ̂·min(1, c·med/‖Δ̂‖)   (DESIGN.md §2; med = the lower median of the round's norms)

Invariants: norms are exactly rounded (math.fsum of float32 squares, exact in float64, or the same
sum in integers: `peer.core.sparseloco.codec.exact`), so every holder of a stage clips the same
committed list to the same bits, whatever the summation order, thread count or hardware;
`payload_norm(p)` equals `global_norm(decompress(p))` bit for bit. What clipping removes from a
sender's contribution (`clipped_mass`) goes back into that sender's error buffer, so nothing is lost.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.codec.decode import values_of
from peer.core.sparseloco.codec.exact import square_sum
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.codec.fused import run_each
from peer.errors import ConfigError


@dataclass(frozen=True)
class ClipStats:
    """What `clip_to_median` did to one round's contributions."""

    n_clipped: int  # contributions scaled down to the bound, or zeroed for a non-finite norm
    norms: tuple[float, ...]  # global L2 norm of each contribution before clipping, in input order
    median: float  # lower median of the finite, non-zero norms (0.0 when there are none)
    max_ratio: float  # largest finite norm / median before clipping (0.0 when the median is 0)
    scales: tuple[float | None, ...] = ()  # per contribution: None (kept), else the factor applied


def global_norm(d: Mapping[str, Tensor]) -> float:
    """‖Δ̂‖₂ over every tensor of one contribution, exactly rounded: the same bits on every peer.

    Squares of float32 values are exact in float64 and `math.fsum` rounds their sum once, so the
    result depends neither on summation order, thread count nor hardware. Only non-zero entries
    are visited (Δ̂ is sparse). nan if any entry is nan, else inf if any entry is infinite.
    """
    squares = []
    for name in sorted(d):
        flat = d[name].detach().reshape(-1).cpu()
        nz = flat[flat != 0]  # (n_nonzero,) nan != 0, so nan entries are kept
        squares.append(nz.to(torch.float64).square().numpy())
    return _exact_norm(squares)


def _exact_norm(squares: Sequence[np.ndarray]) -> float:
    sq = np.concatenate(squares) if squares else np.zeros(0)
    if np.isnan(sq).any():
        return math.nan
    if np.isinf(sq).any():
        return math.inf
    return math.sqrt(math.fsum(sq.tolist()))


def payload_norm(payload: Payload, names: Collection[str] | None = None) -> float:
    """global_norm(decompress(payload)), exactly, from the payload's values without decoding it
    (compiled and split over the cores where it can be: `codec.exact.square_sum`, the same bits);
    `names`: over those tensors only (global_norm of that part of the decoded payload)."""
    entries = [e for e in payload.entries if names is None or e.name in names]
    values = [values_of(e) for e in entries]  # the values alone: no positions are decoded
    total = square_sum(values)
    if total is not None:
        return math.sqrt(total)
    return _exact_norm([vals[vals != 0].astype(np.float64) ** 2 for vals in values])


def payload_norms(payloads: Sequence[Payload], names: Collection[str] | None = None) -> list[float]:
    """`payload_norm` of each payload (over `names` only, if given), the payloads shared out over the cores."""
    work = [sum(math.prod(e.shape) for e in p.entries if names is None or e.name in names) for p in payloads]
    return run_each(lambda p: payload_norm(p, names), payloads, work)


def clip_plan(norms: Sequence[float], factor: float) -> tuple[list[float | None], ClipStats]:
    """What `clip_to_median` does to contributions with these global norms, and its stats.

    Per contribution: None (kept as is), 0.0 (non-finite norm: zeroed) or the float32 scale
    float32(factor·median / norm). The reference is the LOWER median of the finite, non-zero norms.
    """
    if not factor >= 0 or math.isinf(factor):
        raise ConfigError(f"sparseloco.clip_median_factor must be a finite number >= 0, got {factor}")
    norms = tuple(norms)
    voters = sorted(n for n in norms if math.isfinite(n) and n > 0)
    median = voters[(len(voters) - 1) // 2] if voters else 0.0
    max_ratio = max((n / median for n in norms if math.isfinite(n)), default=0.0) if median > 0 else 0.0
    if factor == 0:
        return [None] * len(norms), ClipStats(0, norms, median, max_ratio, (None,) * len(norms))
    bound = factor * median
    plan: list[float | None] = []
    for norm in norms:
        if not math.isfinite(norm):
            plan.append(0.0)
        elif norm > bound:
            plan.append(float(np.float32(bound / norm)))  # exactly a float32: the same product on any device
        else:
            plan.append(None)
    return plan, ClipStats(sum(s is not None for s in plan), norms, median, max_ratio, tuple(plan))


def clipped_mass(decoded: Mapping[str, Tensor], scale: float | None) -> dict[str, Tensor] | None:
    """What clipping by `scale` removed from one contribution: Δ̂ − fl(Δ̂·scale), or None.

    The sender adds it back to its error buffer (`peer.core.sparseloco.feedback`), so clipping delays an
    update instead of losing it. None when nothing was removed (scale None) or the contribution
    is not finite (a non-finite Δ̂ is zeroed, never fed back).
    """
    if scale is None or not math.isfinite(global_norm(decoded)):
        return None
    return {name: t.to(torch.float32) - t.to(torch.float32) * scale for name, t in decoded.items()}


def clip_to_median(decoded: Sequence[Mapping[str, Tensor]], factor: float) -> tuple[list[dict[str, Tensor]], ClipStats]:
    """Norm-clip each contribution Δ̂ to `factor` × the round's median norm (robust aggregation).

    The reference is the LOWER median of the finite, non-zero global norms, so with two
    participants (one honest, one huge) it is the honest one, and a poisoned peer needs a
    majority to move it. A contribution with norm > factor·median is scaled by
    float32(factor·median / norm), landing on the bound (to float32 rounding); a non-finite one
    becomes zeros; the others are returned as they came (the same tensors, bit for bit).
    `factor` == 0 disables clipping (stats are still computed). Pure and deterministic: every
    holder of a stage that clips the same committed list in the same order gets the same bits.
    """
    plan, stats = clip_plan([global_norm(d) for d in decoded], factor)
    out: list[dict[str, Tensor]] = []
    for d, scale, norm in zip(decoded, plan, stats.norms, strict=True):
        if scale is None:
            out.append(dict(d))
        elif not math.isfinite(norm):
            out.append({name: torch.zeros_like(t) for name, t in d.items()})
        else:
            out.append({name: t * scale for name, t in d.items()})
    return out, stats

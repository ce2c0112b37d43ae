"""Cutting a stage's parameters into R ranges of bands: the unit of a range-sharded round.

In a "ranges" round (issue 24, docs/protocol.md) each contribution is sent as R *parts*, one per
range, and an owner per range aggregates that range of every contribution. This module is the
plan every holder computes alike from (tensor names and shapes in `start` order, chunk, R):

    unit   = one tile row of a tensor of >= 2 dims (`chunk` rows × all columns; the last ragged),
             or a whole tensor of < 2 dims (sent dense, or as one row of chunk²-wide tiles)
    band   = consecutive units of one tensor: (name, row0, row1), entry f"{name}@{row0}"
    range  = consecutive bands, cut where the running element count is closest to r·N/R

Invariants: every element belongs to exactly one band and every band to one range; a band of a
row-major tensor is a contiguous view `t[row0:row1]` whose tile grid is the tensor's own (row0 is a
multiple of chunk), so top-k per tile picks in a band exactly what it picks in the whole tensor;
the cut is integer arithmetic (no float), so it is the same on every machine; R <= number of units
gives R non-empty ranges (more ranges than units leave some empty, which is still a valid plan).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from peer.core.sparseloco.codec.format import (
    DENSE_F32,
    SPARSE,
    Payload,
    PayloadError,
    SparseLoCoConfig,
    entry_kind,
    payload_nbytes,
)

__all__ = [
    "Band",
    "RangePlan",
    "assemble",
    "band_name",
    "band_views",
    "n_ranges_for",
    "n_units",
    "plan_ranges",
]


def band_name(name: str, row0: int) -> str:
    """The payload entry name of the band of tensor `name` that starts at row `row0`."""
    return f"{name}@{row0}"


@dataclass(frozen=True)
class Band:
    """Rows [row0, row1) of tensor `name` (a tensor of < 2 dims: the whole of it, row1 = shape[0]
    or 1 for a scalar); `shape` is the band entry's shape."""

    name: str
    row0: int
    row1: int
    shape: tuple[int, ...]

    @property
    def entry(self) -> str:
        return band_name(self.name, self.row0)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class RangePlan:
    """R ranges, each a tuple of bands in the stage's tensor order (`plan_ranges`)."""

    ranges: tuple[tuple[Band, ...], ...]

    @property
    def n(self) -> int:
        return len(self.ranges)

    def range_elements(self, r: int) -> int:
        """Elements of range r (the sum over its bands)."""
        return sum(b.numel for b in self.ranges[r])

    def part_nbytes(self, r: int, cfg: SparseLoCoConfig) -> int:
        """Exact size of a part of range r (every size is a function of shapes and settings)."""
        return payload_nbytes({b.entry: b.shape for b in self.ranges[r]}, cfg)

    def validator(self, r: int, cfg: SparseLoCoConfig) -> Callable[[bytes], Payload]:
        """A parser of part r of a contribution: Payload.from_bytes under `cfg`, then its entries must
        be range r's bands, in plan order, with the kinds `compress` gives them. Raises PayloadError."""
        return lambda b: check_entries(self, r, _parse(b, self.part_nbytes(r, cfg), self.range_elements(r), cfg), cfg)


def _parse(b: bytes, nbytes: int, elements: int, cfg: SparseLoCoConfig) -> Payload:
    if not isinstance(b, (bytes, bytearray, memoryview)) or len(b) != nbytes:
        got = len(b) if isinstance(b, (bytes, bytearray, memoryview)) else type(b).__name__
        raise PayloadError(f"a part of this range is {nbytes} bytes, got {got}; drop it (the sender is faulty)")
    return Payload.from_bytes(b, max_bytes=nbytes, max_elements=max(elements, 1), cfg=cfg)


def check_entries(plan: RangePlan, r: int, payload: Payload, cfg: SparseLoCoConfig, dense_f32: bool = False) -> Payload:
    """`payload` if its entries are range r's bands in order (names, shapes, kinds), else PayloadError.
    `dense_f32`: an entry `compress` sends dense must be DENSE_F32 (a shard's exact mean)."""
    bands = plan.ranges[r]
    if len(payload.entries) != len(bands):
        raise PayloadError(f"range {r} has {len(bands)} bands, the payload {len(payload.entries)} entries")
    for band, e in zip(bands, payload.entries, strict=True):
        kind = entry_kind(band.shape, cfg)
        kind = DENSE_F32 if dense_f32 and kind != SPARSE else kind
        if (e.name, tuple(e.shape), e.kind) != (band.entry, band.shape, kind):
            raise PayloadError(
                f"range {r}: entry {e.name!r} {tuple(e.shape)} kind {e.kind} is not band {band.entry!r} "
                f"{band.shape} kind {kind}; drop it (the sender planned other ranges)"
            )
    return payload


def _units(shapes: Mapping[str, Sequence[int]], chunk: int) -> list[tuple[str, int, int, int]]:
    """(name, row0, row1, elements) of every unit, in tensor order (module docstring)."""
    out = []
    for name, shape in shapes.items():
        shape = tuple(int(d) for d in shape)
        if len(shape) >= 2:
            cols = math.prod(shape[1:])
            out += [
                (name, r0, min(r0 + chunk, shape[0]), (min(r0 + chunk, shape[0]) - r0) * cols)
                for r0 in range(0, shape[0], chunk)
            ]
            if shape[0] == 0:
                out.append((name, 0, 0, 0))
        else:
            out.append((name, 0, shape[0] if shape else 1, math.prod(shape)))
    return out


def n_units(shapes: Mapping[str, Sequence[int]], chunk: int) -> int:
    """Number of units (tile rows of >= 2-D tensors, plus the other tensors): the most ranges a plan
    can fill without leaving one empty."""
    return len(_units(shapes, chunk))


def _cuts(cum: list[int], n_ranges: int) -> list[int]:
    """Unit boundaries b_0 = 0 <= b_1 <= … <= b_R = U: b_r is the boundary whose running count is
    closest to r·N/R (ties: the lower one), kept strictly increasing where U >= R allows."""
    U, N = len(cum) - 1, cum[-1]
    cuts = [0]
    for r in range(1, n_ranges):
        target = r * N  # compare cum[j]·R with r·N: integers, no rounding
        j = next((j for j in range(cuts[-1], U + 1) if cum[j] * n_ranges >= target), U)
        if j > 0 and target - cum[j - 1] * n_ranges <= cum[j] * n_ranges - target:
            j -= 1
        lo, hi = cuts[-1] + 1, U - (n_ranges - r)
        j = max(j, lo) if lo <= hi else max(j, cuts[-1])
        j = min(j, hi) if lo <= hi else min(j, U)
        cuts.append(j)
    return [*cuts, U]


def plan_ranges(shapes: Mapping[str, Sequence[int]], chunk: int, n_ranges: int) -> RangePlan:
    """The plan of R = `n_ranges` ranges over tensors of these shapes, in the mapping's order."""
    if n_ranges < 1 or chunk < 1:
        raise ValueError(f"plan_ranges: need n_ranges >= 1 and chunk >= 1, got {n_ranges}, {chunk}")
    units = _units(shapes, chunk)
    cum = [0]
    for *_, n in units:
        cum.append(cum[-1] + n)
    cuts = _cuts(cum, n_ranges)
    full = {name: tuple(int(d) for d in s) for name, s in shapes.items()}
    ranges = []
    for lo, hi in zip(cuts[:-1], cuts[1:], strict=True):
        bands: list[Band] = []
        for name, r0, r1, _ in units[lo:hi]:
            if bands and bands[-1].name == name:  # extend the band of this tensor
                r0 = bands.pop().row0
            shape = full[name]
            bands.append(Band(name, r0, r1, (r1 - r0, *shape[1:]) if len(shape) >= 2 else shape))
        ranges.append(tuple(bands))
    return RangePlan(tuple(ranges))


def n_ranges_for(n_contributors: int, n_tiles: int) -> int:
    """R of a round: the smallest power of two >= n_contributors (at least 1), capped at the largest
    power of two <= n_tiles (pass `n_units` to keep every range non-empty)."""
    r = 1
    while r < n_contributors:
        r *= 2
    cap = 1
    while cap * 2 <= n_tiles:
        cap *= 2
    return max(1, min(r, cap))


def band_views(tensors: Mapping[str, Tensor], plan: RangePlan, r: int) -> dict[str, Tensor]:
    """{entry: tensor[row0:row1]} of range r: views (contiguous when the tensor is)."""
    out = {}
    for b in plan.ranges[r]:
        t = tensors[b.name]
        out[b.entry] = t[b.row0 : b.row1] if t.dim() >= 2 else t
    return out


def assemble(
    plan: RangePlan, shards: Mapping[int, Mapping[str, Tensor]], shapes: Mapping[str, Sequence[int]]
) -> dict[str, Tensor]:
    """Dense float32 tensors of `shapes` (in order) from per-range band tensors {r: {entry: band}};
    a range missing from `shards` (or a band missing from one) stays zero."""
    out = {name: torch.zeros(tuple(int(d) for d in s), dtype=torch.float32) for name, s in shapes.items()}
    for r, bands in shards.items():
        views = band_views(out, plan, r)
        for entry, band in bands.items():
            view = views[entry]
            view.copy_(band.reshape(view.shape))
    return out

"""An entry's Δ̂ as every receiver decodes it: its float32 values, its flat positions, and its writes into
dense accumulators (`write_entry`, `add_entries`) — the one decoding every commit, clip and shard shares.

The wire layout itself (what an entry's bytes are, how they are parsed) is `peer.core.sparseloco.codec.format`;
this module only reads parsed entries. Sparse entries with ranked indices scatter straight from their
index bytes (`peer.core.sparseloco.codec.index.scatter`), never expanding positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from peer.core.sparseloco.codec.format import DENSE_F32, DENSE_U8, SPARSE, TensorEntry, _arr, _bytes, dequantize
from peer.core.sparseloco.codec.fused import run_each
from peer.core.sparseloco.codec.index import index_positions, positions, scatter, scatter_add_all

__all__ = ["add_entries", "entry_values", "values_of", "write_entry"]


def values_of(e: TensorEntry) -> np.ndarray:
    """The float32 values of Δ̂ an entry sends (every entry of a dense one), as every receiver decodes them."""
    if e.kind == DENSE_F32:
        return _arr(e.values).astype(np.float32)
    if e.kind == DENSE_U8:
        cb = _arr(e.codebook)
        out: np.ndarray = cb[0] + cb[1] * _arr(e.codes).astype(np.float32)  # float32: one multiply, one add
        return out
    qb = (len(e.codebook) - 1).bit_length() + 1 if e.codebook is not None else 0
    vals = _arr(e.values) if e.codebook is None else dequantize(_arr(e.codes), e.codebook, qb)
    return vals.astype(np.float32)


def entry_values(e: TensorEntry, chunk: int, topk: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(flat positions or None for every entry, float32 values) of Δ̂, as every receiver decodes it."""
    vals = values_of(e)
    if e.kind != SPARSE:
        return None, vals
    if e.ranked(chunk, topk):
        return index_positions(e.shape, chunk, topk, _bytes(e.index_bytes)), vals
    return positions(e.shape, chunk, topk, _arr(e.indices)), vals


def write_entry(
    e: TensorEntry,
    chunk: int,
    topk: int,
    out: np.ndarray,
    add: bool,
    scale: float | None = None,
    cnt: np.ndarray | None = None,
    zeroed: bool = False,
) -> None:
    """Write Δ̂ of one entry into the flat float32 `out`: out = Δ̂ (add False: every entry is written,
    so `out` may be uninitialized; `zeroed`: it holds zeros, which need not be written again) or
    out += Δ̂·scale (scale None: unscaled; a float32 product, then one add). With `cnt`, cnt += 1
    where the added value is non-zero. Sparse entries scatter straight in."""
    vals = values_of(e)
    if e.kind == SPARSE and e.ranked(chunk, topk):
        scatter(e.shape, chunk, topk, _bytes(e.index_bytes), vals, out, add, scale, cnt, zeroed)
        return
    pos = None if e.kind != SPARSE else positions(e.shape, chunk, topk, _arr(e.indices))
    if scale is not None:
        vals = vals * np.float32(scale)
    if not add:
        if pos is None:
            out[:] = vals
        else:
            out[:] = 0
            out[pos] = vals
        return
    if pos is None:
        out += vals
    else:
        out[pos] += vals  # positions are distinct within a payload
    if cnt is not None:
        if pos is None:
            cnt += vals != 0
        else:
            cnt[pos] += vals != 0


def add_entries(
    items: Sequence[tuple[TensorEntry, int, int, float | None]],
    out: np.ndarray,
    cnt: np.ndarray | None,
    fresh: bool = False,
    divisor: int | None = None,
) -> None:
    """`write_entry(e, chunk, topk, out, add=True, scale, cnt)` of every (e, chunk, topk, scale) of
    `items`, in order: ranked sparse entries of one geometry a block of bands at a time, every entry
    in cache (`scatter_add_all`); the same bits, since each coordinate still adds them in order.
    `fresh`: `out` (and `cnt`) hold anything and are zeroed first; `divisor`: `out` ends divided by
    it (one correctly rounded float32 division per element) — both a block at a time, in cache,
    where the scatter runs."""
    if items and all(e.kind == SPARSE and e.ranked(c, k) and (c, k) == items[0][1:3] for e, c, k, _ in items):
        e0, chunk, topk, _ = items[0]
        values = run_each(values_of, [e for e, _, _, _ in items], [math.prod(e.shape) for e, _, _, _ in items], True)
        sources = [(_bytes(e.index_bytes), v, scale) for (e, _, _, scale), v in zip(items, values, strict=True)]
        if scatter_add_all(tuple(e0.shape), chunk, topk, sources, out, cnt, fresh, divisor):
            return
    if fresh:
        out.fill(0)
        if cnt is not None:
            cnt.fill(0)
    for e, chunk, topk, scale in items:
        write_entry(e, chunk, topk, out, True, scale, cnt)
    if divisor is not None:
        np.divide(out, np.float32(divisor), out=out)

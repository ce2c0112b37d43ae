"""Encoding one error-feedback buffer: e = β·e + Δ, per-chunk top-k, sign-true quantization, e − Δ̂.

    e  = β·e_prev + Δ;   Δ̂ = Q(TOP-k per chunk(e));   e_new = e − Δ̂      (SparseLoCo, Alg. 1)

`encode_tensor` runs the fused kernels (peer.core.sparseloco.codec.fused: one pass over the tensor per
tile writes e, selects the top-k and writes the index ranks, split over the CPU cores) when numba
is in use, else the torch/numpy path below; both give the same bits, which tests check. With
`in_place` the new error buffer is written over the old one, and the encoder's work arrays are
kept per thread (`_scratch`): a steady-state round allocates nothing of the model's size.

Q is per tensor and sign-true: each code is the value's sign bit plus one of 2^(bits−1) magnitude
bins, and the codebook holds the bins' mean |v| (equal-count bins refined by Lloyd steps, which stop
at a fixed point), so a sent value never changes sign. quant_bits == 0 sends float32 values.

Invariants: top-k picks what torch.topk(|e| per chunk, sorted=True) picks, ties included (a chunk
tied at its k-th entry is ranked by torch.topk itself); e is computed as torch does (β·e rounded
to float32, then + Δ); Δ̂ is exactly what a receiver decodes, so e_new keeps the quantization error.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.codec import kernels as pk
from peer.core.sparseloco.codec.decode import entry_values
from peer.core.sparseloco.codec.format import (
    DENSE_F32,
    DENSE_U8,
    SPARSE,
    PayloadError,
    SparseLoCoConfig,
    TensorEntry,
    dequantize,
    positions,
    tile_dims,
    valid_extent,
)
from peer.core.sparseloco.codec.fused import run_split
from peer.core.sparseloco.codec.index import Layout, enumerative, layout, rerank, tables

_kept = threading.local()  # per-thread work arrays of `_scratch`
LLOYD_ROUNDS = 16  # refinements of the magnitude bins after the equal-count start


def quantize(v: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Sign-magnitude codes (n,) uint8 and magnitude codebook (2^(bits−1),) float32 of v (n,).

    A code is sign << (bits − 1) | bin: the sign bit is v's own, so no value ever changes sign,
    and the bin indexes up to 2^(bits−1) levels of |v|, each the mean |v| of its members. Bins
    start as equal-count bins of |v| (a bin left empty by ties or a step is merged into its
    neighbour; unused trailing levels repeat the last) and take `LLOYD_ROUNDS` Lloyd steps
    (edges at the midpoints of neighbouring means), on the sorted magnitudes and their prefix
    sums: deterministic float64.
    """
    n_bins = 2 ** (bits - 1)
    if v.size == 0:
        return np.zeros(0, np.uint8), np.zeros(n_bins, np.float32)
    kern = pk.compiled(v.size * 64)  # the compiled twin: no GIL, no per-step numpy calls
    if kern is not None and v.ndim == 1 and v.dtype == np.float32:
        codes, codebook = np.empty(v.size, np.uint8), np.empty(n_bins, np.float32)
        kern.quantize(v, np.sort(np.abs(v)), bits, LLOYD_ROUNDS, codes, codebook)  # numpy's sort: SIMD
        return codes, codebook
    a = np.abs(v)  # sorted in v's own dtype (float32: twice as fast), summed in float64: exact widening
    s = np.sort(a).astype(np.float64)
    csum = np.concatenate([[0.0], np.cumsum(s)])
    edges = np.unique(s[(np.arange(1, n_bins) * a.size) // n_bins])  # equal-count start, ties merged
    edges, means = _merge_empty(s, csum, edges)
    for _ in range(LLOYD_ROUNDS):
        step, means = _merge_empty(s, csum, (means[:-1] + means[1:]) / 2)
        if np.array_equal(step, edges):  # a fixed point: every later step gives these again
            break
        edges = step
    if len(edges) == 1:  # bin = #edges <= |v|, compared in float64
        mag = np.greater_equal(a, np.float64(edges[0])).astype(np.uint8)
    else:
        mag = np.searchsorted(edges, a.astype(np.float64), side="right").astype(np.uint8)
    sign = (v < 0).astype(np.uint8) << (bits - 1)
    codebook = np.full(n_bins, means[-1], dtype=np.float32)  # bins past the used ones: never decoded
    codebook[: len(means)] = means
    return sign | mag, codebook


def _merge_empty(s: np.ndarray, csum: np.ndarray, edges: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(edges, bin means) with every empty bin merged into its upper neighbour (or its lower one)."""
    means = _bin_means(s, csum, edges)
    while np.isnan(means).any():
        edges = np.delete(edges, min(int(np.argmax(np.isnan(means))), len(edges) - 1))
        means = _bin_means(s, csum, edges)
    return edges, means


def _bin_means(s: np.ndarray, csum: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean of the sorted magnitudes s in each bin [edge_{i−1}, edge_i) (nan for an empty bin)."""
    bounds = np.empty(len(edges) + 2, dtype=np.int64)
    bounds[0], bounds[-1] = 0, s.size
    bounds[1:-1] = np.searchsorted(s, edges, side="left")
    counts = bounds[1:] - bounds[:-1]
    means: np.ndarray = (csum[bounds[1:]] - csum[bounds[:-1]]) / np.maximum(counts, 1)
    means[counts == 0] = np.nan
    return means


def _chunk_magnitudes(e: Tensor, chunk: int) -> Tensor:
    """|e| laid out one chunk per row, padding = −inf so it is never selected. (n_chunks, chunk²)."""
    rows, cols, th, tw = tile_dims(tuple(e.shape), chunk)
    n_r, n_c = -(-rows // th), -(-cols // tw)
    if rows % th == 0 and cols % tw == 0:  # no padding: |e| straight into the tiled layout
        tiles = torch.empty(n_r * n_c, th * tw)
        torch.abs(e.view(n_r, th, n_c, tw), out=tiles.view(n_r, n_c, th, tw).permute(0, 2, 1, 3))
        return tiles  # (n_chunks, th·tw)
    padded = torch.full((n_r * th, n_c * tw), -math.inf)
    torch.abs(e.view(rows, cols), out=padded[:rows, :cols])
    return padded.view(n_r, th, n_c, tw).permute(0, 2, 1, 3).reshape(n_r * n_c, th * tw)  # (n_chunks, th·tw)


def _select(e: Tensor, cfg: SparseLoCoConfig) -> np.ndarray:
    """Local indices (n_sel,) uint16 of the top-k |e| of every chunk, chunk by chunk, ascending (torch.topk)."""
    if e.numel() == 0:
        return np.zeros(0, dtype=np.uint16)
    k = min(cfg.topk, cfg.chunk * cfg.chunk)
    vr, vc = valid_extent(tuple(e.shape), cfg.chunk)
    k_c = torch.from_numpy(np.minimum(k, vr * vc))  # (n_chunks,) real entries to send
    keep = torch.arange(k)[None, :] < k_c[:, None]  # (n_chunks, k)
    top = torch.topk(_chunk_magnitudes(e, cfg.chunk), k, dim=1, sorted=True).indices  # (n_chunks, k)
    top = torch.sort(torch.where(keep, top, cfg.chunk * cfg.chunk), dim=1).values  # padding picks sort last
    return top[keep].numpy().astype(np.uint16)  # (n_sel,) chunk by chunk, ascending


def _encode_tensor(name: str, e: Tensor, cfg: SparseLoCoConfig) -> TensorEntry:
    """Select, quantize and pack one error-feedback buffer e (any shape, float32, CPU, contiguous)."""
    shape = tuple(e.shape)
    flat = e.reshape(-1)
    if e.dim() <= 1 and cfg.dense_1d:
        x = flat.numpy()
        check_finite(name, x)
        if cfg.quant_bits == 0:
            return TensorEntry(name, DENSE_F32, shape, values=x.copy())
        lo = np.float32(x.min()) if x.size else np.float32(0)
        span = float(x.max()) - float(lo) if x.size else 0.0
        scale = np.float32(span / 255)
        if scale > 0:
            codes = np.clip(np.rint((x.astype(np.float64) - float(lo)) / float(scale)), 0, 255)
        else:
            codes = np.zeros(x.size)
        return TensorEntry(
            name, DENSE_U8, shape, codes=codes.astype(np.uint8), codebook=np.array([lo, scale], dtype=np.float32)
        )
    local = _select(e, cfg)
    vals = flat.numpy()[positions(shape, cfg.chunk, cfg.topk, local)]  # (n_sel,)
    check_finite(name, vals)
    if cfg.quant_bits == 0:
        return TensorEntry(name, SPARSE, shape, indices=local, values=vals.copy())
    codes, codebook = quantize(vals, cfg.quant_bits)
    return TensorEntry(name, SPARSE, shape, indices=local, codes=codes, codebook=codebook)


def check_finite(name: str, x: np.ndarray) -> None:
    if not np.all(np.isfinite(x)):
        raise PayloadError(
            f"pseudo-gradient of {name!r} is not finite; training diverged: lower "
            "the learning rate or resume from a checkpoint"
        )


def encode_tensor(
    name: str, d: Tensor, prev: Tensor | None, cfg: SparseLoCoConfig, in_place: bool = False
) -> tuple[TensorEntry, Tensor]:
    """(entry of Δ̂, new error buffer e − Δ̂) for Δ `d` and the previous error buffer `prev` (or None).

    d and prev: float32, CPU, contiguous, of one shape. d is not modified; prev is not either,
    unless `in_place`: then the new error buffer is written into prev (and returned), so a round
    allocates nothing of the tensor's size.
    """
    shape = tuple(d.shape)
    dense = d.dim() <= 1 and cfg.dense_1d
    in_place = in_place and prev is not None
    kern = None if dense or not enumerative(cfg.topk) else pk.compiled(d.numel() // 16)
    if kern is not None:
        return _encode_fused(kern, name, d, prev, cfg, in_place)
    if prev is None:
        e = d.clone(memory_format=torch.contiguous_format)
    else:
        e = prev.mul_(cfg.beta) if in_place else prev.mul(cfg.beta).contiguous()
        e.add_(d)  # e = β·e + Δ (two roundings, as written)
    entry = _encode_tensor(name, e, cfg)
    pos, vals = entry_values(entry, cfg.chunk, cfg.topk)
    _check_update(name, vals)
    flat = e.view(-1)
    if pos is None:
        flat.sub_(torch.from_numpy(vals))
    else:
        idx = torch.from_numpy(pos)
        flat[idx] = flat[idx] - torch.from_numpy(vals)  # e − Δ̂, where Δ̂ ≠ 0
    assert tuple(e.shape) == shape
    return entry, e


def _check_update(name: str, vals: np.ndarray) -> None:
    if not np.all(np.isfinite(vals)):
        raise PayloadError(f"quantized update of {name!r} overflows float32; lower the learning rate")


def _encode_fused(
    kern: Any, name: str, d: Tensor, prev: Tensor | None, cfg: SparseLoCoConfig, in_place: bool
) -> tuple[TensorEntry, Tensor]:
    """encode_tensor of a sparse tensor with the fused kernels (see the module docstring)."""
    lay, rank_buf, vals, pos, error = select_fused(kern, name, d, prev, cfg, in_place)
    coding = {"index_bytes": rank_buf.tobytes(), "chunk": cfg.chunk, "topk": cfg.topk}
    if cfg.quant_bits == 0:
        entry, sent = TensorEntry(name, SPARSE, tuple(d.shape), values=vals, **coding), vals  # type: ignore[arg-type]
    else:
        codes, codebook = quantize(vals, cfg.quant_bits)
        entry = TensorEntry(name, SPARSE, tuple(d.shape), codes=codes, codebook=codebook, **coding)  # type: ignore[arg-type]
        sent = dequantize(codes, codebook, cfg.quant_bits)
    _check_update(name, sent)
    subtract_fused(kern, lay, error, pos, sent)
    return entry, error


def select_fused(
    kern: Any, name: str, d: Tensor, prev: Tensor | None, cfg: SparseLoCoConfig, in_place: bool
) -> tuple[Layout, np.ndarray, np.ndarray, np.ndarray, Tensor]:
    """The fused kernels' first half: e = β·prev + d written into the returned error buffer, and the
    top-k of every chunk: (layout, index ranks (bytes of every chunk, in order), the sent values
    (n_sel,) and their flat positions in e (n_sel,)). The arrays are this thread's work arrays
    (`_scratch`): used up before the next call on the thread, or copied."""
    shape, chunk, topk = tuple(d.shape), cfg.chunk, cfg.topk
    lay = layout(shape, chunk, topk)
    n_chunks, k, n_sel = lay.n_chunks, lay.k, int(lay.sel[-1])
    table = tables(chunk, topk)[0]
    error = prev if in_place and prev is not None else torch.empty(shape, dtype=torch.float32)  # all written
    e = error.view(-1).numpy()
    local = _scratch("local", n_chunks * k, np.int64).reshape(n_chunks, k)
    tie, bad = _scratch("tie", n_chunks, np.bool_), _scratch("bad", n_chunks, np.bool_)
    tie[:], bad[:] = False, False
    rank_buf = _scratch("ranks", int(lay.off[-1]), np.uint8)  # copied into the entry
    pos = _scratch("pos", n_sel, np.int64)
    vals = np.empty(n_sel, dtype=np.float32) if cfg.quant_bits == 0 else _scratch("vals", n_sel, np.float32)
    p = np.zeros(0, dtype=np.float32) if prev is None else prev.reshape(-1).numpy()
    geometry = (lay.rows, lay.cols, lay.th, lay.tw, k)
    out = (local, tie, bad, rank_buf, lay.sel, vals, pos)
    args = (d.reshape(-1).numpy(), p, np.float32(cfg.beta), *geometry, table, lay.off, e, *out)
    if sum(run_split(kern.encode, lay.n_bands, e.size, *args)):
        check_finite(name, np.array([np.nan]))
    tied = np.flatnonzero(tie)
    if len(tied):  # the set is ambiguous there: let torch.topk break the tie as it always has
        mags = np.empty((len(tied), lay.th * lay.tw), dtype=np.float32)  # their rows of _chunk_magnitudes
        kern.tiles(e, tied, lay.rows, lay.cols, lay.th, lay.tw, mags)
        top = torch.topk(torch.from_numpy(mags), k, dim=1, sorted=True).indices
        local[tied] = torch.sort(top, dim=1).values.numpy()
        rerank(lay, local, tied, table, rank_buf)
        _gather_tiles(lay, local, tied, e, vals, pos)
    return lay, rank_buf, vals, pos, error


def subtract_fused(kern: Any, lay: Layout, error: Tensor, pos: np.ndarray, sent: np.ndarray) -> None:
    """e − Δ̂ in place at the sent positions (distinct), split over the cores as the encoder is."""
    n_c = -(-lay.cols // lay.tw)
    run_split(kern.subtract, lay.n_bands, len(sent) * 64, error.view(-1).numpy(), pos, sent, lay.sel, n_c)


def _scratch(key: str, n: int, dtype: type) -> np.ndarray:
    """A work array of n entries that never leaves the encoder, kept per thread and reused by the next
    tensor and round (fresh pages cost more than the work on them)."""
    kept: dict[str, np.ndarray] = _kept.__dict__.setdefault("arrays", {})
    buf = kept.get(key)
    if buf is None or buf.size < n:
        buf = kept[key] = np.empty(max(n, 1), dtype=dtype)
    return buf[:n]


def _gather_tiles(
    lay: Layout, local: np.ndarray, tiles: np.ndarray, e: np.ndarray, vals: np.ndarray, pos: np.ndarray
) -> None:
    """pos/vals of the sent entries of the given full tiles from their local indices local[tiles] (t, k)."""
    n_c = -(-lay.cols // lay.tw)
    li = local[tiles]
    flat = ((tiles // n_c)[:, None] * lay.th + li // lay.tw) * lay.cols + (tiles % n_c)[:, None] * lay.tw + li % lay.tw
    at = lay.sel[tiles][:, None] + np.arange(lay.k)[None, :]  # (t, k)
    pos[at] = flat
    vals[at] = e[flat]

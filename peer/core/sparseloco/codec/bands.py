"""Encoding one tensor in bands of tile rows, one band per rank, into the bytes the whole tensor gives.

A sharded replica (`peer join --full-replica --sharded`) keeps each tensor's pseudo-gradient and error
buffer as bands of whole tile rows (`band_rows`: rank i holds rows [a_i, b_i) of dim 0, a_i and b_i
multiples of the chunk, so no 64×64 tile is split). The encoder's work is per tile except one step:
the quantizer's codebook is per tensor. So a tensor is encoded in three steps:

    select(band)            on every rank: e = β·e + Δ on its rows, and the top-k of each of its tiles
    join(every band)        everywhere: the codebook of all bands' sent values; on the speaking
                            rank, the whole tensor's entry (bands in row order = tiles in wire order)
    settle(band, Δ̂ part)    on every rank: e − Δ̂ on its rows

and the entry is byte for byte `encode_tensor`'s of the whole tensor, the new error bands the rows of
its new error buffer (tests check both, on the fused kernels and the torch path). What travels between
ranks is what a payload carries: the sent values (n_sel float32) and the index ranks of each band.

Invariants: tensors of one dimension or less (biases, norms: small) are not banded, the speaking rank
encodes them whole (`encode_tensor`); an empty band (more ranks than tile rows) selects nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.codec import kernels as pk
from peer.core.sparseloco.codec.decode import entry_values
from peer.core.sparseloco.codec.encode import (
    _check_update,
    _encode_tensor,
    check_finite,
    quantize,
    select_fused,
)
from peer.core.sparseloco.codec.format import SPARSE, SparseLoCoConfig, TensorEntry, dequantize
from peer.core.sparseloco.codec.index import decode_indices, enumerative, layout


def banded(shape: Sequence[int]) -> bool:
    """Whether a tensor of this shape is encoded in bands (two or more dimensions), else whole."""
    return len(shape) >= 2


def band_rows(shape: Sequence[int], chunk: int, ranks: int) -> list[tuple[int, int]]:
    """Rows [a, b) of dim 0 held by each of `ranks` ranks: whole tile rows (of `chunk` rows; the last
    may be shorter), rank i the tile rows [⌊i·T/N⌋, ⌊(i+1)·T/N⌋) of the tensor's T, so the bands differ
    by at most one tile row and a rank past the last tile row holds none (a = b)."""
    rows = int(shape[0]) if len(shape) else 0
    tiles = -(-rows // chunk)
    cuts = [min(rows, (i * tiles // ranks) * chunk) for i in range(ranks + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(ranks)]


@dataclass
class Band:
    """One rank's rows of one tensor, selected and not yet settled (`select`).

    `e`: β·e + Δ on the band's rows (float32, the band's shape); `values`: its sent values before the
    quantizer, tile by tile (n_sel,) float32; `positions`: theirs in e's flat (n_sel,) int64;
    `index_bytes`: the band's index ranks (enumerative coding: a whole number of bytes per tile) or
    None, then `indices`: its local indices (n_sel,) uint16."""

    name: str
    e: Tensor
    values: np.ndarray
    positions: np.ndarray
    index_bytes: bytes | None = None
    indices: np.ndarray | None = None

    def wire(self) -> BandWire:
        """What the band sends to the speaking rank: its index coding and its values."""
        return BandWire(tuple(self.e.shape), self.values, self.index_bytes, self.indices)


@dataclass(frozen=True)
class BandWire:
    """One band of one tensor as it travels between ranks (`Band.wire`)."""

    shape: tuple[int, ...]
    values: np.ndarray
    index_bytes: bytes | None
    indices: np.ndarray | None


def select(name: str, d: Tensor, prev: Tensor | None, cfg: SparseLoCoConfig, in_place: bool = False) -> Band:
    """e = β·prev + d and the top-k of each tile of one band (float32, CPU, contiguous, ≥ 2-D, whole
    tile rows); `in_place` writes e over prev. Nothing is quantized or subtracted yet."""
    shape = tuple(d.shape)
    kern = pk.compiled(d.numel() // 16) if enumerative(cfg.topk) and d.numel() else None
    if kern is not None:
        _, ranks, vals, pos, e = select_fused(kern, name, d, prev, cfg, in_place and prev is not None)
        return Band(name, e, vals.copy(), pos.copy(), index_bytes=ranks.tobytes())
    if prev is None:
        e = d.clone(memory_format=torch.contiguous_format)
    else:
        e = prev.mul_(cfg.beta) if in_place else prev.mul(cfg.beta).contiguous()
        e.add_(d)  # as encode_tensor: β·e rounded to float32, then + Δ
    plain = dataclasses.replace(cfg, quant_bits=0)  # the selection and its float32 values
    entry = _encode_tensor(name, e, plain)
    at, sent = entry_values(entry, cfg.chunk, cfg.topk)
    assert at is not None and tuple(e.shape) == shape
    return Band(name, e, np.asarray(sent, dtype=np.float32), at, indices=entry.indices)


def join(
    name: str, shape: Sequence[int], bands: Sequence[BandWire], cfg: SparseLoCoConfig
) -> tuple[TensorEntry, np.ndarray]:
    """(the whole tensor's entry, Δ̂'s sent values of every band in order) from its bands in row order:
    the codebook of all their values, as `encode_tensor` makes it of the whole tensor's."""
    values = np.concatenate([b.values for b in bands]) if bands else np.zeros(0, np.float32)
    check_finite(name, values)
    if enumerative(cfg.topk) and all(b.index_bytes is not None for b in bands):
        coding: dict[str, object] = {"index_bytes": b"".join(b.index_bytes or b"" for b in bands)}
    else:
        coding = {"indices": np.concatenate([_indices(b, cfg) for b in bands]).astype(np.uint16)}
    coding.update(chunk=cfg.chunk, topk=cfg.topk)
    shape = tuple(int(s) for s in shape)
    if cfg.quant_bits == 0:
        entry, sent = TensorEntry(name, SPARSE, shape, values=values, **coding), values  # type: ignore[arg-type]
    else:
        codes, codebook = quantize(values, cfg.quant_bits)
        entry = TensorEntry(name, SPARSE, shape, codes=codes, codebook=codebook, **coding)  # type: ignore[arg-type]
        sent = dequantize(codes, codebook, cfg.quant_bits)
    _check_update(name, sent)
    return entry, sent


def _indices(b: BandWire, cfg: SparseLoCoConfig) -> np.ndarray:
    if b.indices is not None:
        return b.indices
    assert b.index_bytes is not None
    return decode_indices(b.shape, cfg.chunk, cfg.topk, b.index_bytes)


def sent_parts(bands: Sequence[BandWire], sent: np.ndarray) -> list[np.ndarray]:
    """`sent` (every band's Δ̂ values, in order) cut into each band's part."""
    cuts = np.cumsum([0] + [len(b.values) for b in bands])
    return [sent[cuts[i] : cuts[i + 1]] for i in range(len(bands))]


def settle(band: Band, sent: np.ndarray, cfg: SparseLoCoConfig) -> Tensor:
    """The band's new error buffer e − Δ̂ (written over `band.e`), `sent` its part of Δ̂'s values."""
    if len(sent) != len(band.values):
        raise ValueError(f"{band.name}: {len(sent)} sent values for a band of {len(band.values)}")
    flat, idx = band.e.view(-1), torch.from_numpy(band.positions)
    flat[idx] = flat[idx] - torch.from_numpy(np.ascontiguousarray(sent))
    return band.e


def entry_rows(entry: TensorEntry, a: int, b: int, chunk: int, topk: int) -> TensorEntry:
    """Rows [a, b) of a sparse entry of two or more dimensions, as the entry of a tensor of those rows:
    the index ranks (or indices) and values (or codes) of their tiles, the same codebook, so it decodes
    to exactly those rows of the whole entry's Δ̂. a and b are tile-row edges (multiples of `chunk`, b
    may be the last row): what a rank needs of a payload for its band, and what it can serve of one."""
    shape = tuple(entry.shape)
    if entry.kind != SPARSE or len(shape) < 2:
        raise ValueError(f"{entry.name}: only sparse entries of two or more dimensions have rows")
    lay = layout(shape, chunk, topk)
    if not (0 <= a <= b <= lay.rows and a % lay.th == 0 and (b % lay.th == 0 or b == lay.rows)):
        raise ValueError(f"{entry.name}: rows [{a}, {b}) are not whole tile rows of {lay.rows}")
    n_c = -(-lay.cols // lay.tw)
    t0, t1 = a // lay.th * n_c, -(-b // lay.th) * n_c
    s0, s1 = int(lay.sel[t0]), int(lay.sel[t1])
    coding: dict[str, Any] = {"chunk": chunk, "topk": topk}
    if entry.ranked(chunk, topk) and enumerative(topk):
        coding["index_bytes"] = (entry.index_bytes or b"")[int(lay.off[t0]) : int(lay.off[t1])]
    else:
        indices = entry.indices
        assert indices is not None
        coding["indices"] = indices[s0:s1]
    cut = (b - a, *shape[1:])
    codes = None if entry.codes is None else entry.codes[s0:s1]
    values = None if entry.values is None else entry.values[s0:s1]
    return TensorEntry(entry.name, SPARSE, cut, codes=codes, values=values, codebook=entry.codebook, **coding)

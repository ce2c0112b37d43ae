"""Exact shards (issue 37): an owner's range of the exact aggregate Δ̄_r, every entry it touched.

`swarm.shard = "exact"` (docs/protocol.md, RANGES): instead of re-sparsifying Δ̄_r to top-k per tile
(`peer.core.sparseloco.ranges.owner`), the owner sends every entry of Δ̄_r whose float32 bits are not
+0.0 (the support: every coordinate some counted contribution touched, less exact cancellations), each
band coded in whichever of two forms is smaller, chosen from the data alone so every parser agrees:

    sparse  the sent positions as gaps, Rice-coded (each gap's high part in unary, its b low bits in
            binary, b = `rice_bits`(band size, count)); then the values
    dense   every value of the band (quant_bits 0: float32, no positions at all), or with quant_bits > 0
            a presence bitmap (1 bit per entry) and the codes of the present entries

Rice-coded gaps cost about log2(numel/n) + 2 bits per sent entry, within about half a bit of the
enumerative ranks a payload sends its k per tile in (`codec.index`), so the sparse form of the union
of M payloads stays near the M payloads' own bytes (a payload sends ~9.5 bits per entry at 2-bit
codes) while the dense form caps it at the band's size whatever M.

Why a bitmap in the quantized dense form: the codec's codes are sign-magnitude (`codec.encode.quantize`)
and have no zero, so coding every entry of a band would move each coordinate nobody touched by the
smallest magnitude level. One bit per entry keeps zero exact; the dense form is then at most
(1 + quant_bits)/8 bytes per entry plus a codebook (3 bits at 2-bit codes, where a payload's sent
entries cost about 9–10 bits each), and with float32 values exactly 4 bytes per entry.

Values: float32 as computed at quant_bits 0 (the shard is then Δ̄_r to the bit, so the assembled shards
commit all-to-all's state when the contributions and clip scales agree: `aggregate_range`), and at any
quant_bits for a band `compress` sends dense (a 1-D norm gain: a few bytes, as a topk shard sends it,
`band_bits`); else the codec's sign-magnitude codes of the band's support with one codebook per band
(the codec's own quantizer, as a payload's sparse entry). The requantization error ‖Δ̄_r − Q(Δ̄_r)‖² is
MEASURED, not returned (`RangeStats.quant_sq`): no contributor knows Δ̄_r, so none can take its share of
the error back; the simulator reports it per round (`RangeMass.quant_fraction`).

Wire form of the body (after the shard's header and lists, little-endian), canonical:
  b"SHRX" | u8 quant_bits | u8 chunk | per band of range r, in plan order:
  u8 form (0 sparse, 1 dense; dense iff its size is strictly smaller) |
  sparse: u32 n | u32 L | [f32 × 2^(qb−1) codebook] | L unary bits (g_i >> b ones, then a zero) |
          n × b low bits of g_i | f32 values (bits ≠ +0.0) or codes, qb bits each
          (g_0 = p_0, g_i = p_i − p_{i−1} − 1: positions strictly ascending by construction)
  dense:  qb 0: f32 × numel  |  qb > 0: f32 codebook | bitmap, numel bits | codes of the set bits
(bit streams LSB-first, zero-padded to a byte). Every read is bounded by the bytes left before it
allocates (L ≤ n + (numel − n) >> b), and a body is never longer than `max_body_nbytes` (every band
dense with every entry sent), which the parser checks first.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.codec.encode import quantize
from peer.core.sparseloco.codec.format import (
    SPARSE,
    PayloadError,
    SparseLoCoConfig,
    dequantize,
    entry_kind,
    pack_bits,
    unpack_bits,
)
from peer.core.sparseloco.codec.index import tile_classes
from peer.core.sparseloco.ranges.plan import Band, RangePlan

__all__ = [
    "ExactBody",
    "ExactEntry",
    "band_nbytes",
    "exact_nbytes_at",
    "encode_band",
    "band_bits",
    "max_body_nbytes",
    "parse_body",
    "rice_bits",
    "union_count",
]

MAGIC = b"SHRX"
_HEAD = struct.Struct("<4sBB")
BODY_HEAD_NBYTES = _HEAD.size  # magic, quant_bits, chunk: before the bands
_COUNTS = struct.Struct("<II")
SPARSE_FORM, DENSE_FORM = 0, 1
MAX_RICE_BITS = 16  # `pack_bits` packs up to 16-bit fields


def rice_bits(numel: int, n_nz: int) -> int:
    """b, the low bits of each gap sent in binary: floor(log2(0.69·numel/n_nz)), in integers (≤ 16).
    A function of (numel, n_nz) alone, so it is never sent and every parser agrees."""
    return min(MAX_RICE_BITS, max(0, ((numel * 69) // (100 * max(1, n_nz))).bit_length() - 1))


def gaps(pos: np.ndarray) -> np.ndarray:
    """g_0 = p_0, g_i = p_i − p_{i−1} − 1 of ascending positions (n,) int64."""
    return np.diff(pos, prepend=-1) - 1


def unary_len(pos: np.ndarray, b: int) -> int:
    """L = Σ (g_i >> b) + n: the bits of the gaps' high parts, each in unary (ones, then a zero)."""
    return int((gaps(pos) >> b).sum()) + len(pos)


def max_unary_len(numel: int, n_nz: int, b: int) -> int:
    """The largest L of n_nz positions below numel: Σ g_i ≤ numel − n_nz."""
    return n_nz + ((numel - n_nz) >> b)


def _codebook_nbytes(qb: int) -> int:
    return 4 * (1 << (qb - 1)) if qb else 0


def _packed(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def sparse_nbytes(numel: int, n_nz: int, unary: int, qb: int) -> int:
    """Bytes of a band in the sparse form: n_nz entries sent, `unary` = L (the form byte included)."""
    values = 4 * n_nz if qb == 0 else _packed(n_nz, qb)
    rice = _packed(unary, 1) + _packed(n_nz, rice_bits(numel, n_nz))
    return 1 + _COUNTS.size + _codebook_nbytes(qb) + rice + values


def dense_nbytes(numel: int, n_nz: int, qb: int) -> int:
    """Bytes of a band in the dense form (the form byte included)."""
    if qb == 0:
        return 1 + 4 * numel
    return 1 + _codebook_nbytes(qb) + _packed(numel, 1) + _packed(n_nz, qb)


def is_dense(numel: int, n_nz: int, unary: int, qb: int) -> bool:
    """The form of a band: dense iff strictly smaller than sparse (ties: sparse)."""
    return dense_nbytes(numel, n_nz, qb) < sparse_nbytes(numel, n_nz, unary, qb)


def band_nbytes(numel: int, n_nz: int, unary: int, qb: int) -> int:
    """Bytes of a band: min(sparse, dense)."""
    return min(dense_nbytes(numel, n_nz, qb), sparse_nbytes(numel, n_nz, unary, qb))


def band_bits(shape: tuple[int, ...], cfg: SparseLoCoConfig) -> int:
    """The bits of a band's values in an exact shard: `quant_bits`, but 0 (float32) for a band `compress`
    sends dense (1-D tensors with `dense_1d`), as a topk shard sends it: a few bytes, no requantization."""
    return cfg.quant_bits if entry_kind(shape, cfg) == SPARSE else 0


def max_body_nbytes(plan: RangePlan, r: int, cfg: SparseLoCoConfig) -> int:
    """The most bytes an exact body of range r can take: every band dense with every entry sent."""
    return _HEAD.size + sum(dense_nbytes(b.numel, b.numel, band_bits(b.shape, cfg)) for b in plan.ranges[r])


def union_count(shape: tuple[int, ...], cfg: SparseLoCoConfig, n_contributors: int) -> int:
    """The expected number of entries of a sparse band that n top-k payloads touch, positions drawn at
    random in each tile: Σ over tiles of n_c·(1 − (1 − min(k, n_c)/n_c)^n) (n_c: the tile's real entries,
    `tile_classes`), rounded up. A size model: real supports overlap more than random ones."""
    total = 0.0
    for count, n_c in tile_classes(shape, cfg.chunk):
        total += count * n_c * (1.0 - (1.0 - min(cfg.topk, n_c) / n_c) ** n_contributors)
    return math.ceil(total)


def exact_nbytes_at(plan: RangePlan, r: int, cfg: SparseLoCoConfig, n_contributors: int) -> int:
    """The size model of an exact body of range r summing n contributions: per band min(dense, sparse
    at the largest L) at `union_count` entries (a band `compress` sends dense: every entry)."""
    total = _HEAD.size
    for b in plan.ranges[r]:
        n = union_count(b.shape, cfg, n_contributors) if entry_kind(b.shape, cfg) == SPARSE else b.numel
        n = min(b.numel, n)
        total += band_nbytes(b.numel, n, max_unary_len(b.numel, n, rice_bits(b.numel, n)), band_bits(b.shape, cfg))
    return total


@dataclass(frozen=True, eq=False)  # arrays: compare the bytes (`ExactBody.to_bytes`), as for a Payload
class ExactEntry:
    """One band of an exact shard: the flat positions sent (None: every entry, dense float32), their
    float32 values as every parser decodes them, and (quant_bits > 0) their codes and codebook."""

    name: str
    shape: tuple[int, ...]
    dense: bool
    pos: np.ndarray | None  # (n_nz,) int64, ascending
    values: np.ndarray  # (n_nz,) float32, or (numel,) when pos is None
    codes: np.ndarray | None = None  # (n_nz,) uint8
    codebook: np.ndarray | None = None  # (2^(qb−1),) float32

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def decoded(self) -> Tensor:
        """The band's dense float32 values (zeros where nothing was sent)."""
        if self.pos is None:
            return torch.from_numpy(self.values.copy()).view(self.shape)
        out = np.zeros(self.numel, dtype=np.float32)
        out[self.pos] = self.values
        return torch.from_numpy(out).view(self.shape)

    def to_bytes(self, qb: int) -> bytes:
        out = [struct.pack("<B", DENSE_FORM if self.dense else SPARSE_FORM)]
        if self.pos is None:  # dense float32
            out.append(self.values.astype("<f4").tobytes())
            return b"".join(out)
        cb = [] if self.codebook is None else [self.codebook.astype("<f4").tobytes()]
        if self.dense:
            bitmap = np.zeros(self.numel, dtype=np.uint8)
            bitmap[self.pos] = 1
            out += [*cb, np.packbits(bitmap, bitorder="little").tobytes()]
        else:
            n, b = len(self.pos), rice_bits(self.numel, len(self.pos))
            g = gaps(self.pos)
            high = g >> b
            unary = np.ones(int(high.sum()) + n, dtype=np.uint8)
            unary[np.cumsum(high + 1) - 1] = 0  # each gap's high part: that many ones, then a zero
            low = pack_bits(g & ((1 << b) - 1), b) if b else b""
            out += [_COUNTS.pack(n, len(unary)), *cb, np.packbits(unary, bitorder="little").tobytes(), low]
        out.append(self.values.astype("<f4").tobytes() if self.codes is None else pack_bits(self.codes, qb))
        return b"".join(out)


@dataclass(frozen=True, eq=False)
class ExactBody:
    """The bands of one exact shard, in plan order (module docstring)."""

    entries: tuple[ExactEntry, ...]
    chunk: int
    quant_bits: int

    def to_bytes(self) -> bytes:
        head = _HEAD.pack(MAGIC, self.quant_bits, self.chunk)
        return head + b"".join(e.to_bytes(self.quant_bits) for e in self.entries)

    def decoded(self) -> dict[str, Tensor]:
        return {e.name: e.decoded() for e in self.entries}


def _sq(a: np.ndarray) -> float:
    return float(np.square(a.astype(np.float64)).sum())


def _form(numel: int, pos: np.ndarray, qb: int) -> bool:
    """Whether a band sending these positions goes dense (the smaller form)."""
    return is_dense(numel, len(pos), unary_len(pos, rice_bits(numel, len(pos))), qb)


def encode_band(band: Band, x: np.ndarray, qb: int) -> tuple[ExactEntry, float]:
    """The exact entry of one band's Δ̄ `x` (flat float32) and its requantization error ‖x − Q(x)‖²."""
    pos = np.flatnonzero(x.view(np.uint32) != 0)  # the support: every entry whose bits are not +0.0
    dense = _form(band.numel, pos, qb)
    if qb == 0:
        if dense:
            return ExactEntry(band.entry, band.shape, True, None, x.copy()), 0.0
        return ExactEntry(band.entry, band.shape, False, pos, x[pos]), 0.0
    vals = x[pos]
    codes, codebook = quantize(vals, qb)
    got = dequantize(codes, codebook, qb)
    entry = ExactEntry(band.entry, band.shape, dense, pos, got, codes, codebook)
    return entry, _sq(vals.astype(np.float64) - got.astype(np.float64))


class _Reader:
    """Reads a body front to back; every read is checked against the bytes left first."""

    def __init__(self, b: bytes, pos: int) -> None:
        self.b, self.pos = b, pos

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.b):
            left = len(self.b) - self.pos
            raise PayloadError(f"truncated while reading {what} ({n} bytes at {self.pos}, {left} left)")
        out = self.b[self.pos : self.pos + n]
        self.pos += n
        return out

    def left(self) -> int:
        return len(self.b) - self.pos

    def floats(self, n: int, what: str) -> np.ndarray:
        out = np.frombuffer(self.take(4 * n, what), dtype="<f4").astype(np.float32)
        if not np.all(np.isfinite(out)):
            raise PayloadError(f"non-finite {what}")
        return out

    def codebook(self, qb: int, what: str) -> np.ndarray:
        cb = self.floats(1 << (qb - 1), f"codebook of {what}")
        if np.any(cb < 0) or np.any(np.signbit(cb)):
            raise PayloadError(f"negative magnitude in the codebook of {what}")
        return cb


def _check_form(band: Band, pos: np.ndarray, dense: bool, qb: int) -> None:
    if _form(band.numel, pos, qb) != dense:
        form = "dense" if dense else "sparse"
        raise PayloadError(f"band {band.entry!r} with {len(pos)} entries is sent {form}, not in its smaller form")


def _parse_band(rd: _Reader, band: Band, qb: int) -> ExactEntry:
    (form,) = rd.take(1, f"form of {band.entry!r}")
    if form not in (SPARSE_FORM, DENSE_FORM):
        raise PayloadError(f"band {band.entry!r} has unknown form {form}")
    numel, what = band.numel, repr(band.entry)
    if form == DENSE_FORM and qb == 0:
        values = rd.floats(numel, f"values of {what}")
        _check_form(band, np.flatnonzero(values.view(np.uint32)), True, qb)
        return ExactEntry(band.entry, band.shape, True, None, values)
    if form == DENSE_FORM:
        cb = rd.codebook(qb, what)
        raw = np.frombuffer(rd.take(_packed(numel, 1), f"bitmap of {what}"), dtype=np.uint8)
        if numel % 8 and raw[-1] >> (numel % 8):
            raise PayloadError(f"non-zero padding bits after the bitmap of {what}")
        pos = np.flatnonzero(np.unpackbits(raw, count=numel, bitorder="little"))
        _check_form(band, pos, True, qb)
        codes = unpack_bits(rd.take(_packed(len(pos), qb), f"codes of {what}"), len(pos), qb)
        return ExactEntry(band.entry, band.shape, True, pos, dequantize(codes, cb, qb), codes, cb)
    n, unary = _COUNTS.unpack(rd.take(_COUNTS.size, f"counts of {what}"))
    b = rice_bits(numel, n)
    if n > numel or unary > max_unary_len(numel, n, b) or unary < n:
        raise PayloadError(f"band {what} of {numel} entries cannot send {n} with {unary} unary bits")
    if sparse_nbytes(numel, n, unary, qb) - 1 - _COUNTS.size > rd.left():
        raise PayloadError(f"truncated body of {what} ({n} entries)")  # sizes bounded before allocating
    book = rd.codebook(qb, what) if qb else None
    raw = np.frombuffer(rd.take(_packed(unary, 1), f"gaps of {what}"), dtype=np.uint8)
    if unary % 8 and raw[-1] >> (unary % 8):
        raise PayloadError(f"non-zero padding bits after the gaps of {what}")
    ends = np.flatnonzero(np.unpackbits(raw, count=unary, bitorder="little") == 0)
    if len(ends) != n or (n and ends[-1] != unary - 1):
        raise PayloadError(f"the gaps of {what} do not end {n} unary codes")
    high = np.diff(ends, prepend=-1) - 1
    low = unpack_bits(rd.take(_packed(n, b), f"gaps of {what}"), n, b).astype(np.int64) if b else 0
    pos = np.cumsum((high << b) + low + 1) - 1
    if n and pos[-1] >= numel:
        raise PayloadError(f"a position of {what} is past its {numel} entries")
    _check_form(band, pos, False, qb)
    if book is None:
        values = rd.floats(n, f"values of {what}")
        if np.any(values.view(np.uint32) == 0):
            raise PayloadError(f"a sparse value of {what} is +0.0 (not sent canonically)")
        return ExactEntry(band.entry, band.shape, False, pos, values)
    codes = unpack_bits(rd.take(_packed(n, qb), f"codes of {what}"), n, qb)
    return ExactEntry(band.entry, band.shape, False, pos, dequantize(codes, book, qb), codes, book)


def parse_body(b: bytes, at: int, plan: RangePlan, r: int, cfg: SparseLoCoConfig) -> ExactBody:
    """The exact body of range r that is all of b[at:], canonical for these settings; PayloadError else."""
    chunk, qb = cfg.chunk, cfg.quant_bits
    if len(b) - at > max_body_nbytes(plan, r, cfg):
        raise PayloadError(f"{len(b) - at} bytes exceed the largest body of range {r}")
    rd = _Reader(b, at)
    magic, got_qb, got_chunk = struct.unpack(_HEAD.format, rd.take(_HEAD.size, "the exact body's header"))
    if magic != MAGIC or (got_qb, got_chunk) != (qb, chunk):
        raise PayloadError(f"not an exact body of quant_bits {qb}, chunk {chunk} ({magic!r}, {got_qb}, {got_chunk})")
    entries = tuple(_parse_band(rd, band, band_bits(band.shape, cfg)) for band in plan.ranges[r])
    if rd.left():
        raise PayloadError(f"{rd.left()} trailing bytes after the last band")
    return ExactBody(entries, chunk, qb)

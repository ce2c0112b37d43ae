"""SparseLoCo: error feedback, chunked top-k, 2-bit quantization, packing and the outer SGD step.

One outer round of SparseLoCo (arXiv 2508.15706, Alg. 1; DESIGN.md §2), per stage and replica:

    Δ  = θ_start − θ_now                  pseudo_gradient
    e  = β·e + Δ                           compress: error feedback
    Δ̂ = Q(TOP-k per chunk(e))              compress: k entries of every 64×64 tile, quantized
    e  = e − Δ̂                             compress: the new error buffer it returns
    Δ̂ ← Δ̂·min(1, c·med/‖Δ̂‖)              clip_to_median: robust to a poisoned contribution
    Δ̄ = aggregate(Δ̂ over participants)    aggregate ("mean-over-all" or "mean-over-contributors")
    θ  = θ_start − η·Δ̄                     outer_step

Chunking: tensors with ndim >= 2 are viewed as (shape[0], rest) and tiled into chunk×chunk tiles,
each dimension zero-padded up to a multiple of `chunk`; 1-D tensors are cut into flat chunks of
chunk² entries. A chunk with fewer than k real entries sends all of them, so padding is never
selected. With `dense_1d`, 1-D tensors (norm gains) are sent whole: 8-bit linear (float32 when
quant_bits == 0). Q is per tensor: 2^bits quantile bins of the selected values, and a codebook of
the bin means (the paper's per-tensor shift is folded into the codebook entries, which are
absolute values). quant_bits == 0 sends float32 values.

Invariants:
- Δ̂ is exactly what a receiver decodes from the payload (compress decodes its own entries), so
  e_new = fl(e − Δ̂) keeps the quantization error, and `restore_unsent` puts a payload that missed
  the commit back into the buffer.
- Clipping uses exactly rounded norms (math.fsum), so every holder of a stage clips the same
  committed list to the same bits; med is the lower median of the round's norms.
- `Payload.to_bytes` is deterministic little-endian. `from_bytes` accepts only the canonical form
  (indices strictly ascending inside a chunk, zero pad bits), so to_bytes(from_bytes(b)) == b, and
  on any other input raises PayloadError and nothing else.

Wire format, version 1, little-endian (idx_bits = bits of chunk²−1: 12 for 64×64):
  header   b"SLCO" | u8 version | u8 quant_bits | u8 chunk | u16 topk | u32 n_tensors
  tensor   u16 name_len | utf-8 name | u8 kind | u8 ndim | u32 × ndim shape | body
  SPARSE   [f32 × 2^quant_bits codebook] | indices, idx_bits each, LSB-first bit stream |
           codes, quant_bits each, LSB-first (quant_bits > 0)  or  f32 values (quant_bits == 0)
  DENSE_F32  f32 × numel
  DENSE_U8   f32 lo | f32 scale | u8 × numel           (value = lo + scale·code, in float32)
Pure torch/numpy: no networking imports.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from peer.errors import ConfigError, PeerError

log = logging.getLogger(__name__)

MAGIC = b"SLCO"
VERSION = 1
AGGREGATIONS = ("mean-over-all", "mean-over-contributors")
QUANT_BITS = (0, 2, 4, 8)
SPARSE, DENSE_F32, DENSE_U8 = 0, 1, 2
MAX_NDIM = 8
MAX_CHUNK = 64  # chunk² − 1 must fit the 12-bit index
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_MAX_ELEMENTS = 2**31
_HEADER = struct.Struct("<4sBBBHI")


class PayloadError(PeerError):
    """A SparseLoCo payload (or the tensors to encode) is malformed or violates a limit."""


@dataclass(frozen=True)
class SparseLoCoConfig:
    topk: int = 32  # entries sent per chunk
    chunk: int = 64  # tile side: a chunk holds chunk² = 4096 entries
    quant_bits: int = 2  # 0 (float32 values), 2, 4 or 8
    beta: float = 0.95  # error-feedback decay
    outer_lr: float = 1.0  # η of the outer SGD step
    aggregation: str = "mean-over-all"  # or "mean-over-contributors"
    dense_1d: bool = True  # send 1-D tensors dense (8-bit)
    clip_median_factor: float = 2.0  # clip each Δ̂ to this × the round's median norm; 0 disables

    def __post_init__(self) -> None:
        if self.quant_bits not in QUANT_BITS:
            raise ConfigError(f"sparseloco.quant_bits must be 0, 2, 4 or 8, got {self.quant_bits}")
        if not 1 <= self.chunk <= MAX_CHUNK:
            raise ConfigError(f"sparseloco.chunk must be in 1..{MAX_CHUNK}, got {self.chunk}")
        if not 0 < self.topk <= self.chunk * self.chunk:
            raise ConfigError(f"sparseloco.topk must be in 1..{self.chunk * self.chunk}, got {self.topk}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"sparseloco.aggregation must be 'mean-over-all' or 'mean-over-contributors', got {self.aggregation!r}"
            )
        if not 0.0 <= self.beta < 1.0:
            raise ConfigError(f"sparseloco.beta must be in [0, 1), got {self.beta}")
        if not self.outer_lr > 0:
            raise ConfigError(f"sparseloco.outer_lr must be > 0, got {self.outer_lr}")
        if not self.clip_median_factor >= 0 or math.isinf(self.clip_median_factor):
            raise ConfigError(
                "sparseloco.clip_median_factor must be a finite number >= 0 (0 disables "
                f"clipping), got {self.clip_median_factor}"
            )


def payload_density(cfg: SparseLoCoConfig) -> float:
    """Fraction of a (full) chunk's entries that are sent: topk / chunk²."""
    return cfg.topk / (cfg.chunk * cfg.chunk)


def index_bits(chunk: int) -> int:
    """Bits of one index inside a chunk (12 for 64×64)."""
    return max(1, (chunk * chunk - 1).bit_length())


def ideal_bytes_per_param(cfg: SparseLoCoConfig) -> float:
    """Bytes per parameter of the sparse part alone: k·(idx_bits + quant_bits) / 8 / chunk²."""
    value_bits = cfg.quant_bits if cfg.quant_bits else 32
    return cfg.topk * (index_bits(cfg.chunk) + value_bits) / 8 / (cfg.chunk * cfg.chunk)


# ------------------------------------------------------------------------------------------
# Chunk geometry (pure integer arithmetic, shared by encoder, decoder and validator)
# ------------------------------------------------------------------------------------------


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _tiles(shape: tuple[int, ...], chunk: int) -> tuple[int, int, int, int]:
    """(rows, cols, row tiles, col tiles) for ndim >= 2; a 1-D/0-D tensor is one row of flat chunks."""
    if len(shape) >= 2:
        rows, cols = shape[0], _numel(shape[1:])
        return rows, cols, -(-rows // chunk), -(-cols // chunk)
    n, cc = _numel(shape), chunk * chunk
    return 1, n, 1 if n else 0, -(-n // cc)


def _n_selected(shape: tuple[int, ...], chunk: int, k: int) -> int:
    """Number of sent entries: Σ over chunks of min(k, real entries of the chunk), in O(1)."""
    rows, cols, n_r, n_c = _tiles(shape, chunk)
    if n_r == 0 or n_c == 0:
        return 0
    if len(shape) < 2:
        cc = chunk * chunk
        return (n_c - 1) * min(k, cc) + min(k, cols - (n_c - 1) * cc)
    last_r, last_c = rows - (n_r - 1) * chunk, cols - (n_c - 1) * chunk
    return (
        (n_r - 1) * (n_c - 1) * min(k, chunk * chunk)
        + (n_r - 1) * min(k, chunk * last_c)
        + (n_c - 1) * min(k, last_r * chunk)
        + min(k, last_r * last_c)
    )


def _valid_extent(shape: tuple[int, ...], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk, real rows and real columns (1-D: 1 row × real entries). Each (n_chunks,)."""
    rows, cols, n_r, n_c = _tiles(shape, chunk)
    if len(shape) < 2:
        cc = chunk * chunk
        vc = np.minimum(cc, cols - cc * np.arange(n_c, dtype=np.int64))
        return np.ones(n_c, dtype=np.int64), vc
    vr = np.minimum(chunk, rows - chunk * np.arange(n_r, dtype=np.int64))
    vc = np.minimum(chunk, cols - chunk * np.arange(n_c, dtype=np.int64))
    return np.repeat(vr, n_c), np.tile(vc, n_r)


def _positions(shape: tuple[int, ...], chunk: int, k: int, local: np.ndarray, check: bool = False) -> np.ndarray:
    """Flat positions in the real tensor of the sent entries (chunk by chunk). (n_sel,) int64.

    With `check`, raises PayloadError unless every index lies inside its chunk's real (unpadded)
    part and indices are strictly ascending inside each chunk.
    """
    vr, vc = _valid_extent(shape, chunk)
    k_c = np.minimum(k, vr * vc)  # (n_chunks,)
    chunk_id = np.repeat(np.arange(len(k_c), dtype=np.int64), k_c)  # (n_sel,)
    local = local.astype(np.int64)
    rows, cols, n_r, n_c = _tiles(shape, chunk)
    if len(shape) < 2:
        r_in, c_in = np.zeros_like(local), local
    else:
        r_in, c_in = local // chunk, local % chunk
    if check:
        if np.any(r_in >= vr[chunk_id]) or np.any(c_in >= vc[chunk_id]):
            raise PayloadError("an index points outside the tensor (into padding or past its chunk)")
        same = chunk_id[1:] == chunk_id[:-1]
        if np.any(same & (local[1:] <= local[:-1])):
            raise PayloadError("duplicate or unsorted indices inside a chunk")
    if len(shape) < 2:
        return chunk_id * (chunk * chunk) + local
    t_r, t_c = chunk_id // n_c, chunk_id % n_c
    return (t_r * chunk + r_in) * cols + t_c * chunk + c_in


# ------------------------------------------------------------------------------------------
# Bit packing (LSB-first bit stream; two 12-bit indices fill exactly 3 bytes)
# ------------------------------------------------------------------------------------------


def _pack_bits(values: np.ndarray, bits: int) -> bytes:
    if bits == 8:
        return values.astype(np.uint8).tobytes()
    v = values.astype(np.uint16)
    bit_matrix = ((v[:, None] >> np.arange(bits, dtype=np.uint16)) & 1).astype(np.uint8)  # (n, bits)
    return np.packbits(bit_matrix.reshape(-1), bitorder="little").tobytes()


def _packed_len(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def _unpack_bits(buf: bytes, n: int, bits: int) -> np.ndarray:
    """Inverse of _pack_bits; PayloadError if the unused high bits of the last byte are not zero."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if bits == 8:
        return raw.copy()
    if (n * bits) % 8 and raw[-1] >> ((n * bits) % 8):
        raise PayloadError("non-zero padding bits after packed values")
    bit_matrix = np.unpackbits(raw, count=n * bits, bitorder="little").reshape(n, bits)  # (n, bits)
    return (bit_matrix.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(axis=1, dtype=np.uint16)


# ------------------------------------------------------------------------------------------
# Payload
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TensorEntry:
    """One tensor of a payload. Arrays are numpy, little-endian on the wire.

    SPARSE: indices (n_sel,) uint16 local to their chunk, chunk by chunk, ascending; codes
    (n_sel,) uint8 + codebook (2^bits,) float32, or values (n_sel,) float32 when quant_bits == 0.
    DENSE_F32: values (numel,) float32.  DENSE_U8: codes (numel,) uint8, codebook = [lo, scale].
    """

    name: str
    kind: int
    shape: tuple[int, ...]
    indices: np.ndarray | None = None
    codes: np.ndarray | None = None
    values: np.ndarray | None = None
    codebook: np.ndarray | None = None


class Payload:
    """The encoded Δ̂ of one participant for one round: a header plus one entry per tensor."""

    def __init__(self, entries: Sequence[TensorEntry], chunk: int, topk: int, quant_bits: int):
        self.entries = tuple(entries)
        self.chunk, self.topk, self.quant_bits = chunk, topk, quant_bits
        self._bytes: bytes | None = None

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    @property
    def nbytes(self) -> int:
        return len(self.to_bytes())

    def to_bytes(self) -> bytes:
        if self._bytes is None:
            self._bytes = self._encode()
        return self._bytes

    def _encode(self) -> bytes:
        qb, ib = self.quant_bits, index_bits(self.chunk)
        parts = [_HEADER.pack(MAGIC, VERSION, qb, self.chunk, self.topk, len(self.entries))]
        for e in self.entries:
            name = e.name.encode("utf-8")
            entry = [
                struct.pack("<H", len(name)),
                name,
                struct.pack("<BB", e.kind, len(e.shape)),
                np.asarray(e.shape, dtype="<u4").tobytes(),
            ]
            if e.kind == SPARSE:
                if qb:
                    entry += [e.codebook.astype("<f4").tobytes(), _pack_bits(e.indices, ib), _pack_bits(e.codes, qb)]
                else:
                    entry += [_pack_bits(e.indices, ib), e.values.astype("<f4").tobytes()]
            elif e.kind == DENSE_F32:
                entry.append(e.values.astype("<f4").tobytes())
            else:
                entry += [e.codebook.astype("<f4").tobytes(), e.codes.astype(np.uint8).tobytes()]
            n = sum(len(x) for x in entry)
            expected = _entry_nbytes(e.name, e.kind, e.shape, self.chunk, self.topk, qb)
            if n != expected:  # the layout below is what `payload_nbytes` (and `peer plan`) counts
                raise AssertionError(f"{e.name}: encoded {n} bytes, layout says {expected}")
            parts += entry
        return b"".join(parts)

    @classmethod
    def from_bytes(
        cls,
        b: bytes,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        cfg: SparseLoCoConfig | None = None,
    ) -> Payload:
        """Parse and fully validate `b`. With `cfg`, chunk, topk and quant_bits must match it.

        `max_elements` bounds the total size of the declared tensors (pass the stage's parameter
        count). Raises PayloadError, and nothing else, on any invalid input.
        """
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise PayloadError(f"payload must be bytes, got {type(b).__name__}")
        b = bytes(b)
        if len(b) > max_bytes:
            raise _invalid(f"{len(b)} bytes exceeds the limit of {max_bytes}")
        try:
            with np.errstate(all="ignore"):
                payload = _decode(b, max_elements, cfg)
        except PayloadError as exc:
            raise _invalid(str(exc)) from None
        except (struct.error, ValueError, IndexError, OverflowError, MemoryError) as exc:
            raise _invalid(f"malformed ({type(exc).__name__}: {exc})") from exc
        payload._bytes = b
        return payload


def _entry_kind(shape: tuple[int, ...], cfg: SparseLoCoConfig) -> int:
    """How `compress` sends a tensor of this shape (mirrors `_encode_tensor`)."""
    if len(shape) <= 1 and cfg.dense_1d:
        return DENSE_F32 if cfg.quant_bits == 0 else DENSE_U8
    return SPARSE


def _entry_nbytes(name: str, kind: int, shape: Sequence[int], chunk: int, topk: int, qb: int) -> int:
    """Serialized size of one entry: the layout `Payload._encode` writes (and checks against)."""
    shape = tuple(shape)
    n = 2 + len(name.encode("utf-8")) + 2 + 4 * len(shape)
    if kind == SPARSE:
        n_sel = _n_selected(shape, chunk, topk)
        ib = index_bits(chunk)
        if qb:
            return n + 4 * 2**qb + _packed_len(n_sel, ib) + _packed_len(n_sel, qb)
        return n + _packed_len(n_sel, ib) + 4 * n_sel
    if kind == DENSE_F32:
        return n + 4 * _numel(shape)
    return n + 8 + _numel(shape)


def payload_nbytes(shapes: Mapping[str, Sequence[int]], cfg: SparseLoCoConfig) -> int:
    """Exact serialized size of a payload for tensors of these shapes, without building it.

    Used by `peer plan` for models too large to build; `Payload._encode` asserts every entry it
    writes has exactly this size, so the two cannot drift apart.
    """
    return _HEADER.size + sum(
        _entry_nbytes(name, _entry_kind(tuple(shape), cfg), shape, cfg.chunk, cfg.topk, cfg.quant_bits)
        for name, shape in shapes.items()
    )


def _invalid(detail: str) -> PayloadError:
    return PayloadError(
        f"invalid SparseLoCo payload: {detail}; drop it (the sender is faulty or runs an incompatible version)"
    )


class _Reader:
    def __init__(self, b: bytes):
        self.b, self.pos = b, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.b):
            raise PayloadError(
                f"truncated while reading {what} (need {n} bytes at offset {self.pos}, {len(self.b) - self.pos} left)"
            )
        out = self.b[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str, what: str) -> tuple:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def floats(self, n: int, what: str) -> np.ndarray:
        out = np.frombuffer(self.take(4 * n, what), dtype="<f4").astype(np.float32)
        if not np.all(np.isfinite(out)):
            raise PayloadError(f"non-finite {what}")
        return out


def _decode(b: bytes, max_elements: int, cfg: SparseLoCoConfig | None) -> Payload:
    r = _Reader(b)
    magic, version, qb, chunk, topk, n_tensors = _HEADER.unpack(r.take(_HEADER.size, "header"))
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise PayloadError(f"unsupported version {version}, this peer reads version {VERSION}")
    if qb not in QUANT_BITS or not 1 <= chunk <= MAX_CHUNK or not 1 <= topk <= chunk * chunk:
        raise PayloadError(f"bad settings quant_bits={qb} chunk={chunk} topk={topk}")
    if cfg is not None and (qb, chunk, topk) != (cfg.quant_bits, cfg.chunk, cfg.topk):
        raise PayloadError(
            f"settings quant_bits={qb} chunk={chunk} topk={topk} differ from this "
            f"run's {cfg.quant_bits}/{cfg.chunk}/{cfg.topk}"
        )
    if n_tensors > (len(b) - _HEADER.size) // 4:
        raise PayloadError(f"{n_tensors} tensors cannot fit in {len(b)} bytes")
    ib, total, entries, seen = index_bits(chunk), 0, [], set()
    for i in range(n_tensors):
        (name_len,) = r.unpack("<H", f"name length of tensor #{i}")
        try:
            name = r.take(name_len, f"name of tensor #{i}").decode("utf-8")
        except UnicodeDecodeError:
            raise PayloadError(f"name of tensor #{i} is not UTF-8") from None
        if not name or not name.isprintable() or name in seen:
            raise PayloadError(f"tensor #{i} has an empty, unprintable or duplicate name {name!r}")
        seen.add(name)
        kind, ndim = r.unpack("<BB", f"kind of {name!r}")
        if kind not in (SPARSE, DENSE_F32, DENSE_U8) or ndim > MAX_NDIM:
            raise PayloadError(f"tensor {name!r} has unknown kind {kind} or ndim {ndim} > {MAX_NDIM}")
        shape = tuple(int(d) for d in r.unpack(f"<{ndim}I", f"shape of {name!r}"))
        numel = _numel(shape)
        total += numel
        if total > max_elements:
            raise PayloadError(f"declared tensors exceed {max_elements} elements (at {name!r})")
        what = f"body of {name!r}"
        if kind == SPARSE:
            n_sel = _n_selected(shape, chunk, topk)
            codebook = r.floats(2**qb, f"codebook of {name!r}") if qb else None
            indices = _unpack_bits(r.take(_packed_len(n_sel, ib), what), n_sel, ib)
            _positions(shape, chunk, topk, indices, check=True)
            codes = _unpack_bits(r.take(_packed_len(n_sel, qb), what), n_sel, qb) if qb else None
            values = None if qb else r.floats(n_sel, f"values of {name!r}")
            entry = TensorEntry(name, kind, shape, indices, codes, values, codebook)
        elif kind == DENSE_F32:
            entry = TensorEntry(name, kind, shape, values=r.floats(numel, f"values of {name!r}"))
        else:
            lo_scale = r.floats(2, f"scale of {name!r}")
            top = lo_scale[0] + lo_scale[1] * np.float32(255)
            if lo_scale[1] < 0 or not np.isfinite(top):
                raise PayloadError(f"bad 8-bit range of {name!r}")
            codes = np.frombuffer(r.take(numel, what), dtype=np.uint8).copy()
            entry = TensorEntry(name, kind, shape, codes=codes, codebook=lo_scale)
        entries.append(entry)
    if r.pos != len(b):
        raise PayloadError(f"{len(b) - r.pos} trailing bytes after the last tensor")
    return Payload(entries, chunk, topk, qb)


# ------------------------------------------------------------------------------------------
# Encoding and decoding of values
# ------------------------------------------------------------------------------------------


def _quantize(v: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Codes (n,) uint8 and codebook (2^bits,) float32 of the quantile-bin means of v (n,)."""
    n_bins = 2**bits
    if v.size == 0:
        return np.zeros(0, np.uint8), np.zeros(n_bins, np.float32)
    s = np.sort(v).astype(np.float64)
    edges = s[(np.arange(1, n_bins) * v.size) // n_bins]  # (n_bins − 1,) quantile edges
    codes = np.searchsorted(edges, v, side="right").astype(np.uint8)  # bin = #edges <= v
    count = np.bincount(codes, minlength=n_bins)
    sums = np.bincount(codes, weights=v.astype(np.float64), minlength=n_bins)
    ext = np.concatenate([s[:1], edges, s[-1:]])
    centre = (ext[:-1] + ext[1:]) / 2  # used for empty bins only
    codebook = np.where(count > 0, sums / np.maximum(count, 1), centre).astype(np.float32)
    return codes, codebook


def _chunk_magnitudes(e: Tensor, chunk: int) -> Tensor:
    """|e| laid out one chunk per row, padding = −inf so it is never selected. (n_chunks, chunk²)."""
    shape, c, cc = tuple(e.shape), chunk, chunk * chunk
    rows, cols, n_r, n_c = _tiles(shape, c)
    if e.dim() < 2:
        mag = torch.full((n_c * cc,), -math.inf)
        torch.abs(e.reshape(-1), out=mag[:cols])
        return mag.view(n_c, cc)  # (n_chunks, c²)
    if rows % c == 0 and cols % c == 0:  # no padding: |e| straight into the tiled layout
        tiles = torch.empty(n_r * n_c, cc)
        torch.abs(e.view(n_r, c, n_c, c), out=tiles.view(n_r, n_c, c, c).permute(0, 2, 1, 3))
        return tiles  # (n_chunks, c²)
    padded = torch.full((n_r * c, n_c * c), -math.inf)
    torch.abs(e.view(rows, cols), out=padded[:rows, :cols])
    return padded.view(n_r, c, n_c, c).permute(0, 2, 1, 3).reshape(n_r * n_c, cc)  # (n_chunks, c²)


def _encode_tensor(name: str, e: Tensor, cfg: SparseLoCoConfig) -> TensorEntry:
    """Select, quantize and pack one error-feedback buffer e (any shape, float32, CPU, contiguous).

    A non-finite entry ranks above every finite one in torch.topk, so checking the selected
    values finds any non-finite entry of e.
    """
    shape = tuple(e.shape)
    flat = e.reshape(-1)
    if e.dim() <= 1 and cfg.dense_1d:
        x = flat.numpy()
        _check_finite(name, x)
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
    c, cc = cfg.chunk, cfg.chunk * cfg.chunk
    if flat.numel() == 0:
        local = np.zeros(0, dtype=np.uint16)
    else:
        k = min(cfg.topk, cc)
        top = torch.topk(_chunk_magnitudes(e, c), k, dim=1, sorted=True).indices  # (n_chunks, k)
        vr, vc = _valid_extent(shape, c)
        k_c = torch.from_numpy(np.minimum(k, vr * vc))  # (n_chunks,) real entries to send
        keep = torch.arange(k)[None, :] < k_c[:, None]  # (n_chunks, k)
        top = torch.sort(torch.where(keep, top, cc), dim=1).values  # padding picks sort last
        local = top[keep].numpy().astype(np.uint16)  # (n_sel,) chunk by chunk, ascending
    vals = flat.numpy()[_positions(shape, c, cfg.topk, local)]  # (n_sel,)
    _check_finite(name, vals)
    if cfg.quant_bits == 0:
        return TensorEntry(name, SPARSE, shape, indices=local, values=vals.copy())
    codes, codebook = _quantize(vals, cfg.quant_bits)
    return TensorEntry(name, SPARSE, shape, indices=local, codes=codes, codebook=codebook)


def _check_finite(name: str, x: np.ndarray) -> None:
    if not np.all(np.isfinite(x)):
        raise PayloadError(
            f"pseudo-gradient of {name!r} is not finite; training diverged: lower "
            "the learning rate or resume from a checkpoint"
        )


def _sent_values(e: TensorEntry, chunk: int, topk: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(flat positions or None for every entry, float32 values) of Δ̂, as every receiver decodes it."""
    if e.kind == DENSE_F32:
        return None, e.values.astype(np.float32)
    if e.kind == DENSE_U8:
        lo, scale = e.codebook[0], e.codebook[1]
        return None, lo + scale * e.codes.astype(np.float32)  # float32: one multiply, one add
    vals = e.values if e.codebook is None else e.codebook[e.codes.astype(np.int64)]
    return _positions(e.shape, chunk, topk, e.indices), vals.astype(np.float32)


def _decode_tensor(e: TensorEntry, chunk: int, topk: int) -> Tensor:
    """Dense float32 Δ̂ of one entry."""
    pos, vals = _sent_values(e, chunk, topk)
    if pos is None:
        return torch.from_numpy(vals.copy()).reshape(e.shape)
    out = torch.zeros(_numel(e.shape), dtype=torch.float32)
    out[torch.from_numpy(pos)] = torch.from_numpy(vals)
    return out.reshape(e.shape)


# ------------------------------------------------------------------------------------------
# The round
# ------------------------------------------------------------------------------------------


def pseudo_gradient(start: Mapping[str, Tensor], now: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Δ = θ_start − θ_now per name of `start`, in float32 on CPU."""
    missing = [n for n in start if n not in now]
    if missing:
        raise ValueError(f"pseudo_gradient: current parameters lack {missing[:3]}")
    return {n: start[n].detach().float().cpu() - now[n].detach().float().cpu() for n in start}


def compress(
    delta: Mapping[str, Tensor], errors: Mapping[str, Tensor] | None, cfg: SparseLoCoConfig
) -> tuple[Payload, dict[str, Tensor]]:
    """e = β·e + Δ; Δ̂ = Q(TOP-k per chunk(e)); returns (payload of Δ̂, new errors e − Δ̂).

    Inputs are not modified. Δ̂ is decoded from the entries exactly as a receiver decodes it.
    """
    entries, new_errors = [], {}
    for name, d in delta.items():
        d = d.detach().to("cpu", torch.float32)
        prev = None if errors is None else errors.get(name)
        if prev is None:
            e = d.clone(memory_format=torch.contiguous_format)
        else:
            if tuple(prev.shape) != tuple(d.shape):
                raise ValueError(f"error buffer of {name!r} has shape {tuple(prev.shape)}, delta has {tuple(d.shape)}")
            e = prev.detach().to("cpu", torch.float32).mul(cfg.beta).contiguous()
            e.add_(d)  # e = β·e + Δ (two roundings, as written)
        entry = _encode_tensor(name, e, cfg)
        pos, vals = _sent_values(entry, cfg.chunk, cfg.topk)
        if not np.all(np.isfinite(vals)):
            raise PayloadError(f"quantized update of {name!r} overflows float32; lower the learning rate")
        flat = e.view(-1)
        if pos is None:
            flat.sub_(torch.from_numpy(vals))
        else:
            idx = torch.from_numpy(pos)
            flat[idx] = flat[idx] - torch.from_numpy(vals)  # e − Δ̂, where Δ̂ ≠ 0
        entries.append(entry)
        new_errors[name] = e
    return Payload(entries, cfg.chunk, cfg.topk, cfg.quant_bits), new_errors


def decompress(payload: Payload) -> dict[str, Tensor]:
    """Dense float32 Δ̂ per name; shapes come from the payload."""
    return {e.name: _decode_tensor(e, payload.chunk, payload.topk) for e in payload.entries}


def aggregate(
    decoded: Sequence[Mapping[str, Tensor]], n_participants: int, rule: str = "mean-over-all"
) -> dict[str, Tensor]:
    """Δ̄ from the committed Δ̂s, summed in the given order (so every peer gets the same bits).

    "mean-over-all": Σ Δ̂ / n_participants (absent names count as zero).
    "mean-over-contributors": per coordinate Σ Δ̂ / #{Δ̂ ≠ 0 there}; 0 where nobody sent anything.
    """
    if rule not in AGGREGATIONS:
        raise ConfigError(f"sparseloco.aggregation must be 'mean-over-all' or 'mean-over-contributors', got {rule!r}")
    if n_participants < max(1, len(decoded)):
        raise ValueError(f"n_participants={n_participants} < {max(1, len(decoded))} payloads")
    sums: dict[str, Tensor] = {}
    counts: dict[str, Tensor] = {}
    for d in decoded:
        for name, t in d.items():
            t = t.to(torch.float32)
            if name not in sums:
                sums[name] = torch.zeros_like(t)
                if rule == "mean-over-contributors":
                    counts[name] = torch.zeros_like(t)
            if sums[name].shape != t.shape:
                raise PayloadError(
                    f"payloads disagree on the shape of {name!r}: "
                    f"{tuple(sums[name].shape)} vs {tuple(t.shape)}; drop the odd one"
                )
            sums[name] += t
            if rule == "mean-over-contributors":
                counts[name] += (t != 0).to(torch.float32)
    if rule == "mean-over-all":
        return {name: s / n_participants for name, s in sums.items()}
    return {
        name: torch.where(counts[name] > 0, s / counts[name].clamp_min(1), torch.zeros_like(s))
        for name, s in sums.items()
    }


@dataclass(frozen=True)
class ClipStats:
    """What `clip_to_median` did to one round's contributions."""

    n_clipped: int  # contributions scaled down to the bound, or zeroed for a non-finite norm
    norms: tuple[float, ...]  # global L2 norm of each contribution before clipping, in input order
    median: float  # lower median of the finite, non-zero norms (0.0 when there are none)
    max_ratio: float  # largest finite norm / median before clipping (0.0 when the median is 0)


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
    sq = np.concatenate(squares) if squares else np.zeros(0)
    if np.isnan(sq).any():
        return math.nan
    if np.isinf(sq).any():
        return math.inf
    return math.sqrt(math.fsum(sq.tolist()))


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
    if not factor >= 0 or math.isinf(factor):
        raise ConfigError(f"sparseloco.clip_median_factor must be a finite number >= 0, got {factor}")
    norms = tuple(global_norm(d) for d in decoded)
    voters = sorted(n for n in norms if math.isfinite(n) and n > 0)
    median = voters[(len(voters) - 1) // 2] if voters else 0.0
    max_ratio = max((n / median for n in norms if math.isfinite(n)), default=0.0) if median > 0 else 0.0
    if factor == 0:
        return [dict(d) for d in decoded], ClipStats(0, norms, median, max_ratio)
    bound = factor * median
    out: list[dict[str, Tensor]] = []
    n_clipped = 0
    for d, norm in zip(decoded, norms):
        if not math.isfinite(norm):
            out.append({name: torch.zeros_like(t) for name, t in d.items()})
            n_clipped += 1
        elif norm > bound:
            scale = float(np.float32(bound / norm))  # exactly a float32: the same product on any device
            out.append({name: t * scale for name, t in d.items()})
            n_clipped += 1
        else:
            out.append(dict(d))
    return out, ClipStats(n_clipped, norms, median, max_ratio)


def outer_step(start: Mapping[str, Tensor], agg: Mapping[str, Tensor], lr: float) -> dict[str, Tensor]:
    """θ = θ_start − lr·Δ̄ for every name of `start` (unchanged copy where Δ̄ has no entry)."""
    out = {}
    for name, s in start.items():
        if name in agg:
            out[name] = (s.float() - lr * agg[name].to(s.device, torch.float32)).to(s.dtype)
        else:
            out[name] = s.clone()
    return out


def restore_unsent(errors: Mapping[str, Tensor] | None, decoded: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A payload that missed the round's commit goes back into the error buffer: e + Δ̂."""
    out = {name: t.clone() for name, t in (errors or {}).items()}
    for name, d in decoded.items():
        out[name] = out[name] + d.to(torch.float32) if name in out else d.to(torch.float32).clone()
    return out

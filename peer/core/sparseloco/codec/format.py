"""The SparseLoCo payload: the wire format of one participant's Δ̂.

Chunking, bit packing and index coding live in `peer.core.sparseloco.codec.index` (re-exported here): a
tensor is cut into chunk×chunk tiles (1-D: chunk² entries) and each tile sends k_c of its n_c
real entries.

Wire format, version 3 (v2 + sign-magnitude codes), little-endian:
  header   b"SLCO" | u8 version | u8 quant_bits | u8 chunk | u16 topk | u32 n_tensors
  tensor   u16 name_len | utf-8 name | u8 kind | u8 ndim | u32 × ndim shape | body
  SPARSE   [f32 × 2^(quant_bits−1) magnitudes, each >= 0] | indices |
           codes, quant_bits each, LSB-first (quant_bits > 0)  or  f32 values (quant_bits == 0);
           a code is sign << (quant_bits − 1) | bin, its value ±magnitude[bin]
  indices  topk <= 64: per chunk, the rank of its sorted compact indices among the k_c-subsets of
           n_c (combinatorial number system, see codec.kernels) in ceil(log2 C(n_c, k_c) / 8)
           bytes; topk > 64: idx_bits-wide local indices, one LSB-first bit stream
  DENSE_F32  f32 × numel
  DENSE_U8   f32 lo | f32 scale | u8 × numel           (value = lo + scale·code, in float32)

Invariants: every size is a function of (shapes, settings) alone (`payload_nbytes`). `to_bytes` is
deterministic; `from_bytes` accepts only the canonical form (each rank < C(n_c, k_c), zero pad
bits), so to_bytes(from_bytes(b)) == b, checks every size before allocating, and on any other
input raises PayloadError and nothing else. A parsed sparse entry keeps its validated rank bytes;
positions are unranked only where they are used (decompress, aggregation), straight into the
output, so parsing never allocates per-index arrays.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from peer.core.sparseloco.codec.index import (
    PayloadError,
    check_ranks,
    decode_indices,
    encode_indices,
    enumerative,
    index_bits,
    index_nbytes,
    n_selected,
    pack_bits,
    packed_len,
    positions,
    rank_nbytes,
    tile_dims,
    unpack_bits,
    valid_extent,
)
from peer.errors import ConfigError

MAGIC = b"SLCO"
VERSION = 3
READ_VERSIONS = (3,)
QUANT_BITS = (0, 2, 4, 8)
SPARSE, DENSE_F32, DENSE_U8 = 0, 1, 2
MAX_NDIM = 8
MAX_CHUNK = 64  # chunk² − 1 must fit a 12-bit index
DEFAULT_MAX_BYTES = 256 * 2**20
DEFAULT_MAX_ELEMENTS = 2**31
_HEADER = struct.Struct("<4sBBBHI")
HEADER_NBYTES = _HEADER.size  # the header every payload starts with

__all__ = [
    "PayloadError",
    "index_bits",
    "index_nbytes",
    "n_selected",
    "pack_bits",
    "positions",
    "rank_nbytes",
    "tile_dims",
    "unpack_bits",
    "valid_extent",
]

AGGREGATIONS = ("mean-over-all", "mean-over-contributors")


@dataclass(frozen=True)
class SparseLoCoConfig:
    """The `[sparseloco]` section of a run: how a payload is encoded (topk, chunk, quant_bits,
    dense_1d) and the round's rule (β, η, aggregation, the median clip, outlier screening). It lives
    beside the format because its checks are the format's limits; `peer.config` assembles it into a
    `RunConfig`. Every holder of a stage commits by the same rule: the section is in the manifest
    and the config fingerprint. `peer.config.PAPER_ALGORITHM` lists the values of the paper's rule."""

    topk: int = 32  # entries sent per chunk
    chunk: int = 64  # tile side: a chunk holds chunk² = 4096 entries
    quant_bits: int = field(default=2, metadata={"help": "Bits per sent value: 0 (float32), 2, 4, 8."})
    beta: float = 0.95  # error-feedback decay
    outer_lr: float = 1.0  # η of the outer SGD step
    aggregation: str = "mean-over-all"  # or "mean-over-contributors"
    dense_1d: bool = True  # send 1-D tensors dense (8-bit); False: top-k of chunk²-entry tiles like the rest
    clip_median_factor: float = field(  # clip each Δ̂ to this × the round's median norm; 0 disables
        default=2.0,
        metadata={"help": "Clip each Δ̂ to this × the round's median norm (0: off)."},
    )
    screening: bool = True  # drop outlier contributions before aggregating (peer.core.sparseloco.robust)

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


# ------------------------------------------------------------------------------------------
# Payload
# ------------------------------------------------------------------------------------------


class TensorEntry:
    """One tensor of a payload. Arrays are numpy, little-endian on the wire.

    SPARSE: indices (n_sel,) uint16 local to their chunk, chunk by chunk, ascending; codes
    (n_sel,) uint8 + codebook (2^bits,) float32, or values (n_sel,) float32 when quant_bits == 0.
    With `index_bytes` (the validated wire form of the indices, topk <= 64, for `chunk`/`topk`)
    the indices are decoded from it on first use.
    DENSE_F32: values (numel,) float32.  DENSE_U8: codes (numel,) uint8, codebook = [lo, scale].
    """

    __slots__ = ("name", "kind", "shape", "codes", "values", "codebook", "index_bytes", "_indices", "_coding")

    def __init__(
        self,
        name: str,
        kind: int,
        shape: tuple[int, ...],
        indices: np.ndarray | None = None,
        codes: np.ndarray | None = None,
        values: np.ndarray | None = None,
        codebook: np.ndarray | None = None,
        *,
        index_bytes: bytes | None = None,
        chunk: int = 0,
        topk: int = 0,
    ):
        self.name, self.kind, self.shape = name, kind, tuple(shape)
        self.codes, self.values, self.codebook = codes, values, codebook
        self.index_bytes, self._indices, self._coding = index_bytes, indices, (chunk, topk)

    @property
    def indices(self) -> np.ndarray | None:
        if self._indices is None and self.index_bytes is not None:
            self._indices = decode_indices(self.shape, *self._coding, self.index_bytes)
        return self._indices

    def ranked(self, chunk: int, topk: int) -> bool:
        """Whether `index_bytes` holds this entry's indices for these settings."""
        return self.index_bytes is not None and self._coding == (chunk, topk)


def _arr(a: np.ndarray | None) -> np.ndarray:
    assert a is not None
    return a


def _bytes(b: bytes | None) -> bytes:
    assert b is not None
    return b


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
        qb = self.quant_bits
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
                if e.ranked(self.chunk, self.topk):
                    idx = _bytes(e.index_bytes)
                else:
                    idx = encode_indices(e.shape, self.chunk, self.topk, _arr(e.indices))
                if qb:
                    entry += [_arr(e.codebook).astype("<f4").tobytes(), idx, pack_bits(_arr(e.codes), qb)]
                else:
                    entry += [idx, _arr(e.values).astype("<f4").tobytes()]
            elif e.kind == DENSE_F32:
                entry.append(_arr(e.values).astype("<f4").tobytes())
            else:
                entry += [_arr(e.codebook).astype("<f4").tobytes(), _arr(e.codes).astype(np.uint8).tobytes()]
            n = sum(len(x) for x in entry)
            expected = entry_nbytes(e.name, e.kind, e.shape, self.chunk, self.topk, qb)
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


def _levels(qb: int) -> int:  # magnitude levels of a qb-bit sign-magnitude code: the codebook's length
    return 1 << (qb - 1)


def dequantize(codes: np.ndarray, codebook: np.ndarray, qb: int) -> np.ndarray:
    """±codebook[bin] of sign-magnitude codes (n,), float32: the sign bit is the value's sign."""
    mag = codebook.astype(np.float32)
    lut = np.concatenate([mag, -mag])  # code = sign << (qb − 1) | bin  →  ±mag[bin]
    out: np.ndarray = lut[codes]
    return out


def entry_kind(shape: tuple[int, ...], cfg: SparseLoCoConfig) -> int:
    """How `compress` sends a tensor of this shape."""
    if len(shape) <= 1 and cfg.dense_1d:
        return DENSE_F32 if cfg.quant_bits == 0 else DENSE_U8
    return SPARSE


def entry_nbytes(name: str, kind: int, shape: Sequence[int], chunk: int, topk: int, qb: int) -> int:
    """Serialized size of one entry: the layout `Payload._encode` writes (and checks against)."""
    shape = tuple(shape)
    n = 2 + len(name.encode("utf-8")) + 2 + 4 * len(shape)
    if kind == SPARSE:
        n_sel = n_selected(shape, chunk, topk)
        idx = index_nbytes(shape, chunk, topk)
        if qb:
            return n + 4 * _levels(qb) + idx + packed_len(n_sel, qb)
        return n + idx + 4 * n_sel
    if kind == DENSE_F32:
        return n + 4 * math.prod(shape)
    return n + 8 + math.prod(shape)


def payload_nbytes(shapes: Mapping[str, Sequence[int]], cfg: SparseLoCoConfig) -> int:
    """Exact serialized size of a payload for tensors of these shapes, without building it.

    Used by `peer plan` for models too large to build; `Payload._encode` asserts every entry it
    writes has exactly this size, so the two cannot drift apart.
    """
    return HEADER_NBYTES + sum(
        entry_nbytes(name, entry_kind(tuple(shape), cfg), shape, cfg.chunk, cfg.topk, cfg.quant_bits)
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

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        return struct.unpack(fmt, self.take(struct.calcsize(fmt), what))

    def floats(self, n: int, what: str) -> np.ndarray:
        out = np.frombuffer(self.take(4 * n, what), dtype="<f4").astype(np.float32)
        if not np.all(np.isfinite(out)):
            raise PayloadError(f"non-finite {what}")
        return out


def _decode(b: bytes, max_elements: int, cfg: SparseLoCoConfig | None) -> Payload:
    r = _Reader(b)
    qb, chunk, topk, n_tensors = read_header(r.take(HEADER_NBYTES, "header"), cfg)
    if n_tensors > (len(b) - HEADER_NBYTES) // 4:
        raise PayloadError(f"{n_tensors} tensors cannot fit in {len(b)} bytes")
    total, entries, seen = 0, [], set()
    for i in range(n_tensors):
        entry = _read_entry(r, i, chunk, topk, qb, max_elements - total)
        if entry.name in seen:
            raise PayloadError(f"tensor #{i} has a duplicate name {entry.name!r}")
        seen.add(entry.name)
        total += math.prod(entry.shape)
        entries.append(entry)
    if r.pos != len(b):
        raise PayloadError(f"{len(b) - r.pos} trailing bytes after the last tensor")
    return Payload(entries, chunk, topk, qb)


def read_header(head: bytes, cfg: SparseLoCoConfig | None) -> tuple[int, int, int, int]:
    """(quant_bits, chunk, topk, n_tensors) of a payload's header, checked (with `cfg`: its settings);
    PayloadError otherwise."""
    if len(head) != HEADER_NBYTES:
        raise PayloadError(f"a header is {HEADER_NBYTES} bytes, got {len(head)}")
    magic, version, qb, chunk, topk, n_tensors = _HEADER.unpack(head)
    if magic != MAGIC:
        raise PayloadError(f"bad magic {magic!r}, expected {MAGIC!r}")
    if version not in READ_VERSIONS:
        readable = ", ".join(str(v) for v in READ_VERSIONS)
        raise PayloadError(f"unsupported version {version}; this build reads version {readable}")
    if qb not in QUANT_BITS or not 1 <= chunk <= MAX_CHUNK or not 1 <= topk <= chunk * chunk:
        raise PayloadError(f"bad settings quant_bits={qb} chunk={chunk} topk={topk}")
    if cfg is not None and (qb, chunk, topk) != (cfg.quant_bits, cfg.chunk, cfg.topk):
        raise PayloadError(
            f"settings quant_bits={qb} chunk={chunk} topk={topk} differ from this "
            f"run's {cfg.quant_bits}/{cfg.chunk}/{cfg.topk}"
        )
    return qb, chunk, topk, n_tensors


def read_entry(b: bytes, chunk: int, topk: int, qb: int, max_elements: int) -> TensorEntry:
    """One tensor entry that is all of `b` (as a payload lays it out after its header), fully
    validated like `Payload.from_bytes` validates each entry; PayloadError on any invalid input."""
    r = _Reader(bytes(b))
    try:
        with np.errstate(all="ignore"):
            entry = _read_entry(r, 0, chunk, topk, qb, max_elements)
    except PayloadError as exc:
        raise _invalid(str(exc)) from None
    except (struct.error, ValueError, IndexError, OverflowError, MemoryError) as exc:
        raise _invalid(f"malformed ({type(exc).__name__}: {exc})") from exc
    if r.pos != len(b):
        raise _invalid(f"{len(b) - r.pos} trailing bytes after the entry")
    return entry


def _read_entry(r: _Reader, i: int, chunk: int, topk: int, qb: int, budget: int) -> TensorEntry:
    """The entry at the reader's position: its name, kind and shape checked, its size checked against
    the bytes left before anything is allocated, and at most `budget` elements declared."""
    (name_len,) = r.unpack("<H", f"name length of tensor #{i}")
    try:
        name = r.take(name_len, f"name of tensor #{i}").decode("utf-8")
    except UnicodeDecodeError:
        raise PayloadError(f"name of tensor #{i} is not UTF-8") from None
    if not name or not name.isprintable():
        raise PayloadError(f"tensor #{i} has an empty or unprintable name {name!r}")
    kind, ndim = r.unpack("<BB", f"kind of {name!r}")
    if kind not in (SPARSE, DENSE_F32, DENSE_U8) or ndim > MAX_NDIM:
        raise PayloadError(f"tensor {name!r} has unknown kind {kind} or ndim {ndim} > {MAX_NDIM}")
    shape = tuple(int(d) for d in r.unpack(f"<{ndim}I", f"shape of {name!r}"))
    numel = math.prod(shape)
    if numel > budget:
        raise PayloadError(f"declared tensors exceed the element limit ({budget} elements left at {name!r})")
    what = f"body of {name!r}"
    body = entry_nbytes(name, kind, shape, chunk, topk, qb) - (4 + name_len + 4 * ndim)
    if body > len(r.b) - r.pos:
        raise PayloadError(f"truncated while reading {what} (need {body} bytes, {len(r.b) - r.pos} left)")
    if kind == SPARSE:
        n_sel = n_selected(shape, chunk, topk)
        codebook = r.floats(_levels(qb), f"codebook of {name!r}") if qb else None
        if codebook is not None and np.any(codebook < 0):
            raise PayloadError(f"negative magnitude in the codebook of {name!r}")
        idx = r.take(index_nbytes(shape, chunk, topk), what)
        ranks = enumerative(topk)
        if ranks:
            check_ranks(shape, chunk, topk, idx)
        indices = None if ranks else decode_indices(shape, chunk, topk, idx)
        codes = unpack_bits(r.take(packed_len(n_sel, qb), what), n_sel, qb) if qb else None
        values = None if qb else r.floats(n_sel, f"values of {name!r}")
        coding: dict[str, Any] = {"index_bytes": idx, "chunk": chunk, "topk": topk} if ranks else {}
        return TensorEntry(name, kind, shape, indices, codes, values, codebook, **coding)
    if kind == DENSE_F32:
        return TensorEntry(name, kind, shape, values=r.floats(numel, f"values of {name!r}"))
    lo_scale = r.floats(2, f"scale of {name!r}")
    top = lo_scale[0] + lo_scale[1] * np.float32(255)
    if lo_scale[1] < 0 or not np.isfinite(top):
        raise PayloadError(f"bad 8-bit range of {name!r}")
    codes = np.frombuffer(r.take(numel, what), dtype=np.uint8).copy()
    return TensorEntry(name, kind, shape, codes=codes, codebook=lo_scale)

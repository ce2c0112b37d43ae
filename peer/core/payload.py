"""The SparseLoCo payload: chunk geometry and the wire format of one participant's Δ̂.

Chunking: tensors with ndim >= 2 are viewed as (shape[0], rest) and tiled into chunk×chunk tiles,
each dimension zero-padded up to a multiple of `chunk`; 1-D tensors are cut into flat chunks of
chunk² entries. A chunk with n_c real entries sends k_c = min(k, n_c) of them. Inside a chunk an
entry's local index is r·chunk + c (1-D: its offset); its compact index, r·(real columns) + c,
numbers the real entries 0 … n_c − 1 in the same order.

Wire format, version 3 (v2 + sign-magnitude codes), little-endian:
  header   b"SLCO" | u8 version | u8 quant_bits | u8 chunk | u16 topk | u32 n_tensors
  tensor   u16 name_len | utf-8 name | u8 kind | u8 ndim | u32 × ndim shape | body
  SPARSE   [f32 × 2^(quant_bits−1) magnitudes, each >= 0] | indices |
           codes, quant_bits each, LSB-first (quant_bits > 0)  or  f32 values (quant_bits == 0);
           a code is sign << (quant_bits − 1) | bin, its value ±magnitude[bin]
  indices  topk <= 64: per chunk, the rank of its sorted compact indices among the k_c-subsets of
           n_c (combinatorial number system, see payload_kernels) in ceil(log2 C(n_c, k_c) / 8)
           bytes; topk > 64: idx_bits-wide local indices, one LSB-first bit stream
  DENSE_F32  f32 × numel
  DENSE_U8   f32 lo | f32 scale | u8 × numel           (value = lo + scale·code, in float32)

Invariants: every size is a function of (shapes, settings) alone (`payload_nbytes`). `to_bytes` is
deterministic; `from_bytes` accepts only the canonical form (each rank < C(n_c, k_c), zero pad
bits), so to_bytes(from_bytes(b)) == b, checks every size before allocating, and on any other
input raises PayloadError and nothing else.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from peer.core.payload_kernels import ENUM_MAX_K, binomial_table, rank_subsets, unrank_subsets
from peer.errors import PeerError

if TYPE_CHECKING:
    from peer.core.sparseloco import SparseLoCoConfig

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


class PayloadError(PeerError):
    """A SparseLoCo payload (or the tensors to encode) is malformed or violates a limit."""


def index_bits(chunk: int) -> int:
    """Bits of one fixed-width index inside a chunk (12 for 64×64)."""
    return max(1, (chunk * chunk - 1).bit_length())


@functools.lru_cache(maxsize=1024)
def rank_nbytes(n: int, k: int) -> int:
    """Bytes of a chunk's index rank: ceil(log2 C(n, k) / 8) (0 when the chunk sends all n entries)."""
    return ((math.comb(n, k) - 1).bit_length() + 7) // 8


# ------------------------------------------------------------------------------------------
# Chunk geometry (pure integer arithmetic, shared by encoder, decoder and size counter)
# ------------------------------------------------------------------------------------------


def tile_dims(shape: tuple[int, ...], chunk: int) -> tuple[int, int, int, int]:
    """(rows, cols, tile height, tile width): a 1-D/0-D tensor is one row of chunk²-wide tiles."""
    if len(shape) >= 2:
        return shape[0], math.prod(shape[1:]), chunk, chunk
    return 1, math.prod(shape), 1, chunk * chunk


def _tile_classes(shape: tuple[int, ...], chunk: int) -> list[tuple[int, int]]:
    """(number of tiles, real entries per tile) for the ≤ 4 kinds of tile of a tensor."""
    rows, cols, th, tw = tile_dims(shape, chunk)
    if rows == 0 or cols == 0:
        return []
    n_r, n_c = -(-rows // th), -(-cols // tw)
    last_r, last_c = rows - (n_r - 1) * th, cols - (n_c - 1) * tw
    out = [
        ((n_r - 1) * (n_c - 1), th * tw),
        (n_r - 1, th * last_c),
        (n_c - 1, last_r * tw),
        (1, last_r * last_c),
    ]
    return [(m, n) for m, n in out if m > 0]


def n_selected(shape: tuple[int, ...], chunk: int, k: int) -> int:
    """Number of sent entries: Σ over chunks of min(k, real entries of the chunk), in O(1)."""
    return sum(m * min(k, n) for m, n in _tile_classes(shape, chunk))


def valid_extent(shape: tuple[int, ...], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk, real rows and real columns (1-D: 1 row × real entries). Each (n_chunks,) int64."""
    rows, cols, th, tw = tile_dims(shape, chunk)
    n_r, n_c = (-(-rows // th), -(-cols // tw)) if rows and cols else (0, 0)
    vr = np.minimum(th, rows - th * np.arange(n_r, dtype=np.int64))
    vc = np.minimum(tw, cols - tw * np.arange(n_c, dtype=np.int64))
    return np.repeat(vr, n_c), np.tile(vc, n_r)


def positions(shape: tuple[int, ...], chunk: int, k: int, local: np.ndarray, check: bool = False) -> np.ndarray:
    """Flat positions in the real tensor of the sent entries (chunk by chunk). (n_sel,) int64.

    With `check`, raises PayloadError unless every index lies inside its chunk's real (unpadded)
    part and indices are strictly ascending inside each chunk.
    """
    vr, vc = valid_extent(shape, chunk)
    k_c = np.minimum(k, vr * vc)  # (n_chunks,)
    chunk_id = np.repeat(np.arange(len(k_c), dtype=np.int64), k_c)  # (n_sel,)
    local = local.astype(np.int64)
    rows, cols, th, tw = tile_dims(shape, chunk)
    r_in, c_in = local // tw, local % tw
    if check:
        if np.any(r_in >= vr[chunk_id]) or np.any(c_in >= vc[chunk_id]):
            raise PayloadError("an index points outside the tensor (into padding or past its chunk)")
        same = chunk_id[1:] == chunk_id[:-1]
        if np.any(same & (local[1:] <= local[:-1])):
            raise PayloadError("duplicate or unsorted indices inside a chunk")
    n_c = -(-cols // tw) if cols else 1
    t_r, t_c = chunk_id // n_c, chunk_id % n_c
    flat: np.ndarray = (t_r * th + r_in) * cols + t_c * tw + c_in
    return flat


# ------------------------------------------------------------------------------------------
# Bit packing (LSB-first bit stream; two 12-bit indices fill exactly 3 bytes)
# ------------------------------------------------------------------------------------------


def pack_bits(values: np.ndarray, bits: int) -> bytes:
    """values (n,) < 2^bits as one LSB-first bit stream, zero-padded to whole bytes."""
    if bits == 8:
        return values.astype(np.uint8).tobytes()
    if bits in (1, 2, 4):  # whole codes per byte: shift and add
        per = 8 // bits
        v = np.zeros(-(-len(values) // per) * per, dtype=np.uint8)
        v[: len(values)] = values
        shifts = (np.arange(per, dtype=np.uint8) * bits)[None, :]
        packed: np.ndarray = np.bitwise_or.reduce(v.reshape(-1, per) << shifts, axis=1)
        return packed.astype(np.uint8).tobytes()
    v16 = values.astype(np.uint16)
    bit_matrix = ((v16[:, None] >> np.arange(bits, dtype=np.uint16)) & 1).astype(np.uint8)  # (n, bits)
    return np.packbits(bit_matrix.reshape(-1), bitorder="little").tobytes()


def packed_len(n: int, bits: int) -> int:
    return (n * bits + 7) // 8


def unpack_bits(buf: bytes, n: int, bits: int) -> np.ndarray:
    """Inverse of pack_bits; PayloadError if the unused high bits of the last byte are not zero."""
    raw = np.frombuffer(buf, dtype=np.uint8)
    if bits == 8:
        return raw.copy()
    if (n * bits) % 8 and raw[-1] >> ((n * bits) % 8):
        raise PayloadError("non-zero padding bits after packed values")
    if bits in (1, 2, 4):
        per = 8 // bits
        shifts = (np.arange(per, dtype=np.uint8) * bits)[None, :]
        return ((raw[:, None] >> shifts) & ((1 << bits) - 1)).reshape(-1)[:n].astype(np.uint8)
    bit_matrix = np.unpackbits(raw, count=n * bits, bitorder="little").reshape(n, bits)  # (n, bits)
    out: np.ndarray = (bit_matrix.astype(np.uint16) << np.arange(bits, dtype=np.uint16)).sum(axis=1, dtype=np.uint16)
    return out


# ------------------------------------------------------------------------------------------
# Index coding of one sparse tensor
# ------------------------------------------------------------------------------------------


def _enumerative(chunk: int, topk: int) -> bool:
    return topk <= ENUM_MAX_K


def index_nbytes(shape: tuple[int, ...], chunk: int, topk: int) -> int:
    """Serialized size of a sparse tensor's indices (a function of the shape and settings alone)."""
    if not _enumerative(chunk, topk):
        return packed_len(n_selected(shape, chunk, topk), index_bits(chunk))
    return sum(m * rank_nbytes(n, min(topk, n)) for m, n in _tile_classes(shape, chunk))


def _chunk_layout(shape: tuple[int, ...], chunk: int, topk: int) -> tuple[np.ndarray, ...]:
    """(real columns, real entries, sent entries, rank bytes) per chunk, each (n_chunks,) int64."""
    vr, vc = valid_extent(shape, chunk)
    n = vr * vc
    kc = np.minimum(topk, n)
    nb = np.zeros_like(n)
    for value in np.unique(n):  # ≤ 4 kinds of tile
        nb[n == value] = rank_nbytes(int(value), min(topk, int(value)))
    return vc, n, kc, nb


def encode_indices(shape: tuple[int, ...], chunk: int, topk: int, local: np.ndarray) -> bytes:
    """Wire bytes of the sent local indices (n_sel,) (chunk by chunk, ascending)."""
    if not _enumerative(chunk, topk):
        return pack_bits(local, index_bits(chunk))
    vc, n, kc, nb = _chunk_layout(shape, chunk, topk)
    if len(n) == 0:
        return b""
    tw = tile_dims(shape, chunk)[3]
    slot = np.arange(topk)[None, :] < kc[:, None]  # (n_chunks, k)
    lo = local.astype(np.int64)
    q = np.zeros(slot.shape, dtype=np.int64)
    q[slot] = (lo // tw) * np.repeat(vc, kc) + lo % tw  # compact indices, unused slots 0
    table = binomial_table(chunk * chunk, min(topk, chunk * chunk))
    limbs = rank_subsets(q, table).astype("<u4")  # (n_chunks, L)
    raw = limbs.view(np.uint8).reshape(len(q), -1)  # (n_chunks, 4L) little-endian
    return raw[np.arange(raw.shape[1])[None, :] < nb[:, None]].tobytes()


def decode_indices(shape: tuple[int, ...], chunk: int, topk: int, buf: bytes) -> np.ndarray:
    """Inverse of encode_indices: local indices (n_sel,) uint16; PayloadError if not canonical."""
    if not _enumerative(chunk, topk):
        local = unpack_bits(buf, n_selected(shape, chunk, topk), index_bits(chunk))
        positions(shape, chunk, topk, local, check=True)
        return local
    vc, n, kc, nb = _chunk_layout(shape, chunk, topk)
    if len(n) == 0:
        return np.zeros(0, dtype=np.uint16)
    table = binomial_table(chunk * chunk, min(topk, chunk * chunk))
    raw = np.zeros((len(n), 4 * table.shape[2]), dtype=np.uint8)
    raw[np.arange(raw.shape[1])[None, :] < nb[:, None]] = np.frombuffer(buf, dtype=np.uint8)
    ranks = raw.view("<u4").astype(np.int64)  # (n_chunks, L)
    q, bad = unrank_subsets(ranks, kc, n, table, min(topk, chunk * chunk))
    if bad >= 0:
        raise PayloadError(f"index rank of chunk {bad} is out of range")
    tw = tile_dims(shape, chunk)[3]
    q = q[np.arange(q.shape[1])[None, :] < kc[:, None]]  # (n_sel,)
    vcs = np.repeat(vc, kc)
    out: np.ndarray = ((q // vcs) * tw + q % vcs).astype(np.uint16)
    return out


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


def _arr(a: np.ndarray | None) -> np.ndarray:
    assert a is not None
    return a


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
    mag = codebook[(codes & (_levels(qb) - 1)).astype(np.int64)].astype(np.float32)
    out: np.ndarray = np.where(codes >> (qb - 1) != 0, -mag, mag)
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
    return _HEADER.size + sum(
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
    magic, version, qb, chunk, topk, n_tensors = _HEADER.unpack(r.take(_HEADER.size, "header"))
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
    if n_tensors > (len(b) - _HEADER.size) // 4:
        raise PayloadError(f"{n_tensors} tensors cannot fit in {len(b)} bytes")
    total, entries, seen = 0, [], set()
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
        numel = math.prod(shape)
        total += numel
        if total > max_elements:
            raise PayloadError(f"declared tensors exceed {max_elements} elements (at {name!r})")
        what = f"body of {name!r}"
        # sizes are checked against the bytes left before anything is allocated
        body = entry_nbytes(name, kind, shape, chunk, topk, qb) - (4 + name_len + 4 * ndim)
        if body > len(b) - r.pos:
            raise PayloadError(f"truncated while reading {what} (need {body} bytes, {len(b) - r.pos} left)")
        entry: TensorEntry
        if kind == SPARSE:
            n_sel = n_selected(shape, chunk, topk)
            codebook = r.floats(_levels(qb), f"codebook of {name!r}") if qb else None
            if codebook is not None and np.any(codebook < 0):
                raise PayloadError(f"negative magnitude in the codebook of {name!r}")
            indices = decode_indices(shape, chunk, topk, r.take(index_nbytes(shape, chunk, topk), what))
            codes = unpack_bits(r.take(packed_len(n_sel, qb), what), n_sel, qb) if qb else None
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


def entry_values(e: TensorEntry, chunk: int, topk: int) -> tuple[np.ndarray | None, np.ndarray]:
    """(flat positions or None for every entry, float32 values) of Δ̂, as every receiver decodes it."""
    if e.kind == DENSE_F32:
        return None, _arr(e.values).astype(np.float32)
    if e.kind == DENSE_U8:
        cb = _arr(e.codebook)
        return None, cb[0] + cb[1] * _arr(e.codes).astype(np.float32)  # float32: one multiply, one add
    qb = (len(e.codebook) - 1).bit_length() + 1 if e.codebook is not None else 0
    vals = _arr(e.values) if e.codebook is None else dequantize(_arr(e.codes), e.codebook, qb)
    return positions(e.shape, chunk, topk, _arr(e.indices)), vals.astype(np.float32)

"""Chunk geometry, bit packing and the index coding of the SparseLoCo payload (see peer.core.sparseloco.codec.format).

Tensors with ndim >= 2 are viewed as (shape[0], rest) and tiled into chunk×chunk tiles, each
dimension zero-padded up to a multiple of `chunk`; 1-D tensors are cut into flat chunks of chunk²
entries. A chunk with n_c real entries sends k_c = min(k, n_c) of them. Inside a chunk an entry's
local index is r·chunk + c (1-D: its offset); its compact index, r·(real columns) + c, numbers the
real entries 0 … n_c − 1 in the same order. For topk <= 64 a chunk's sorted compact indices are
sent as their rank among the k_c-subsets of n_c (peer.core.sparseloco.codec.kernels), in ceil(log2 C(n_c, k_c) / 8)
little-endian bytes; for larger topk as fixed-width local indices in one LSB-first bit stream.

Invariants: every size is a function of (shape, chunk, topk) alone. A rank below C(n_c, k_c) is
all a valid index set needs, so `check_ranks` validates a payload without unranking it; the
positions are produced later, straight where they are used (`index_positions`, `scatter`), by the
fused kernels when numba is in use and by the numpy path otherwise, with the same results.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from peer.core.sparseloco.codec import kernels as pk
from peer.core.sparseloco.codec.fused import run_split
from peer.errors import PeerError

BLOCK_BYTES = 1 << 18  # of an output a block of bands of `scatter_add_all` spans (it stays in L2)


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


def tile_classes(shape: tuple[int, ...], chunk: int) -> list[tuple[int, int]]:
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
    return sum(m * min(k, n) for m, n in tile_classes(shape, chunk))


def valid_extent(shape: tuple[int, ...], chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Per chunk, real rows and real columns (1-D: 1 row × real entries). Each (n_chunks,) int64."""
    rows, cols, th, tw = tile_dims(shape, chunk)
    n_r, n_c = (-(-rows // th), -(-cols // tw)) if rows and cols else (0, 0)
    vr = np.minimum(th, rows - th * np.arange(n_r, dtype=np.int64))
    vc = np.minimum(tw, cols - tw * np.arange(n_c, dtype=np.int64))
    return np.repeat(vr, n_c), np.tile(vc, n_r)


@dataclass(frozen=True, eq=False)
class Layout:
    """Per-chunk bookkeeping of one sparse tensor. Arrays are read-only int64."""

    rows: int
    cols: int
    th: int
    tw: int
    k: int  # min(topk, chunk²)
    vc: np.ndarray  # (n_chunks,) real columns
    nc: np.ndarray  # (n_chunks,) real entries
    kc: np.ndarray  # (n_chunks,) sent entries
    off: np.ndarray  # (n_chunks + 1,) byte offset of each rank (enumerative coding)
    sel: np.ndarray  # (n_chunks + 1,) offset of each chunk's first sent entry

    @property
    def n_chunks(self) -> int:
        return len(self.kc)

    @property
    def n_bands(self) -> int:
        """Rows of tiles."""
        return -(-self.rows // self.th) if self.n_chunks else 0


@functools.lru_cache(maxsize=256)
def layout(shape: tuple[int, ...], chunk: int, topk: int) -> Layout:
    """The Layout of a sparse tensor of this shape (cached: model tensors repeat a few shapes)."""
    rows, cols, th, tw = tile_dims(shape, chunk)
    vr, vc = valid_extent(shape, chunk)
    k = min(topk, chunk * chunk)
    nc = vr * vc
    kc = np.minimum(k, nc)
    nb = np.zeros_like(nc)
    for value in np.unique(nc):  # ≤ 4 kinds of tile
        nb[nc == value] = rank_nbytes(int(value), min(k, int(value)))
    zero = np.zeros(1, dtype=np.int64)
    off, sel = np.concatenate([zero, np.cumsum(nb)]), np.concatenate([zero, np.cumsum(kc)])
    for a in (vc, nc, kc, off, sel):
        a.flags.writeable = False
    return Layout(rows, cols, th, tw, k, vc, nc, kc, off, sel)


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


def enumerative(topk: int) -> bool:
    """Whether indices are sent as subset ranks (topk <= 64) rather than fixed-width."""
    return topk <= pk.ENUM_MAX_K


def tables(chunk: int, topk: int) -> tuple[np.ndarray, np.ndarray]:
    """(exact binomial limbs, float64 binomials) for ranks of up to min(topk, chunk²) of chunk²."""
    n, k = chunk * chunk, min(topk, chunk * chunk)
    return pk.binomial_table(n, k), pk.float_table(n, k)


def index_nbytes(shape: tuple[int, ...], chunk: int, topk: int) -> int:
    """Serialized size of a sparse tensor's indices (a function of the shape and settings alone)."""
    if not enumerative(topk):
        return packed_len(n_selected(shape, chunk, topk), index_bits(chunk))
    return sum(m * rank_nbytes(n, min(topk, n)) for m, n in tile_classes(shape, chunk))


def _rank_bytes(limbs: np.ndarray, nb: np.ndarray) -> np.ndarray:
    """The first nb[i] little-endian bytes of each rank (m, L); their concatenation. (Σ nb,) uint8."""
    raw = limbs.astype("<u4").view(np.uint8).reshape(len(limbs), -1)  # (m, 4L)
    out: np.ndarray = raw[np.arange(raw.shape[1])[None, :] < nb[:, None]]
    return out


def encode_indices(shape: tuple[int, ...], chunk: int, topk: int, local: np.ndarray) -> bytes:
    """Wire bytes of the sent local indices (n_sel,) (chunk by chunk, ascending)."""
    if not enumerative(topk):
        return pack_bits(local, index_bits(chunk))
    lay = layout(shape, chunk, topk)
    if lay.n_chunks == 0:
        return b""
    slot = np.arange(lay.k)[None, :] < lay.kc[:, None]  # (n_chunks, k)
    lo = local.astype(np.int64)
    q = np.zeros(slot.shape, dtype=np.int64)
    q[slot] = (lo // lay.tw) * np.repeat(lay.vc, lay.kc) + lo % lay.tw  # compact indices, unused slots 0
    return _rank_bytes(pk.rank_subsets(q, tables(chunk, topk)[0]), np.diff(lay.off)).tobytes()


def rerank(lay: Layout, local: np.ndarray, tiles: np.ndarray, table: np.ndarray, rank_buf: np.ndarray) -> None:
    """Write the ranks of the given full tiles' sorted local indices local[tiles] (m, k) into rank_buf."""
    sub = local[tiles]
    q = (sub // lay.tw) * lay.vc[tiles, None] + sub % lay.tw  # (m, k) compact indices
    nb = lay.off[tiles + 1] - lay.off[tiles]
    where = lay.off[tiles, None] + np.arange(int(nb.max()))[None, :]  # (m, max nb)
    rank_buf[where[np.arange(where.shape[1])[None, :] < nb[:, None]]] = _rank_bytes(pk.rank_subsets(q, table), nb)


def check_ranks(shape: tuple[int, ...], chunk: int, topk: int, buf: bytes) -> None:
    """PayloadError unless every chunk's rank is below C(n_c, k_c) (the only rule for valid indices)."""
    lay = layout(shape, chunk, topk)
    nb = np.diff(lay.off)
    if lay.n_chunks == 0 or not nb.any():
        return
    width = 8 * -(-int(nb.max()) // 8)
    raw = np.zeros((lay.n_chunks, width), dtype=np.uint8)
    data = np.frombuffer(buf, dtype=np.uint8)
    if np.all(nb == nb[0]):
        raw[:, : nb[0]] = data.reshape(lay.n_chunks, -1)
    else:
        raw[np.arange(width)[None, :] < nb[:, None]] = data
    kinds, which = np.unique(lay.nc, return_inverse=True)
    tops = [math.comb(int(n), min(lay.k, int(n))).to_bytes(width, "little") for n in kinds]
    top = np.frombuffer(b"".join(tops), dtype="<u8").reshape(len(kinds), -1)[which]  # (n_chunks, W)
    bad = pk.less_equal(top, raw.view("<u8"))  # C(n, k) <= rank
    if bad.any():
        raise PayloadError(f"index rank of chunk {int(np.argmax(bad))} is out of range")


def decode_indices(shape: tuple[int, ...], chunk: int, topk: int, buf: bytes) -> np.ndarray:
    """Inverse of encode_indices: local indices (n_sel,) uint16; PayloadError if not canonical."""
    if not enumerative(topk):
        local = unpack_bits(buf, n_selected(shape, chunk, topk), index_bits(chunk))
        positions(shape, chunk, topk, local, check=True)
        return local
    lay = layout(shape, chunk, topk)
    if lay.n_chunks == 0:
        return np.zeros(0, dtype=np.uint16)
    table = tables(chunk, topk)[0]
    raw = np.zeros((lay.n_chunks, 4 * table.shape[2]), dtype=np.uint8)
    raw[np.arange(raw.shape[1])[None, :] < np.diff(lay.off)[:, None]] = np.frombuffer(buf, dtype=np.uint8)
    ranks = raw.view("<u4").astype(np.int64)  # (n_chunks, L)
    q, bad = pk.unrank_subsets(ranks, lay.kc, lay.nc, table, lay.k)
    if bad >= 0:
        raise PayloadError(f"index rank of chunk {bad} is out of range")
    q = q[np.arange(q.shape[1])[None, :] < lay.kc[:, None]]  # (n_sel,)
    vcs = np.repeat(lay.vc, lay.kc)
    out: np.ndarray = ((q // vcs) * lay.tw + q % vcs).astype(np.uint16)
    return out


def _walk(
    shape: tuple[int, ...], chunk: int, topk: int, buf: bytes, mode: int, **arrays: np.ndarray | np.float32
) -> bool:
    """Run the fused unrank-and-visit kernel over a validated rank buffer; False if numba is not in use."""
    lay = layout(shape, chunk, topk)
    kern = pk.compiled(int(lay.sel[-1]) * 8)
    if kern is None:
        return False
    empty = np.zeros(0, dtype=np.float32)
    table, ftab = tables(chunk, topk)
    data = np.frombuffer(buf, dtype=np.uint8)
    args = (data, lay.off, lay.kc, lay.sel, lay.rows, lay.cols, lay.th, lay.tw, table, ftab)
    vals, scale = arrays.get("vals", empty), arrays.get("scale", np.float32(1))
    out, cnt, pos = arrays.get("out", empty), arrays.get("cnt", empty), arrays.get("pos", np.zeros(0, np.int64))
    run_split(kern.walk, lay.n_bands, lay.rows * lay.cols, *args, vals, scale, mode, out, cnt, pos)
    return True


def index_positions(shape: tuple[int, ...], chunk: int, topk: int, buf: bytes) -> np.ndarray:
    """Flat positions (n_sel,) int64 of the entries sent by a validated rank buffer."""
    pos = np.empty(n_selected(shape, chunk, topk), dtype=np.int64)
    if not _walk(shape, chunk, topk, buf, 0, pos=pos):
        pos = positions(shape, chunk, topk, decode_indices(shape, chunk, topk, buf))
    return pos


def scatter(
    shape: tuple[int, ...],
    chunk: int,
    topk: int,
    buf: bytes,
    vals: np.ndarray,
    out: np.ndarray,
    add: bool,
    scale: float | None = None,
    cnt: np.ndarray | None = None,
    zeroed: bool = False,
) -> None:
    """out = vals at the positions a validated rank buffer sends and 0 elsewhere (add False; out may
    be uninitialized unless `zeroed` says it holds zeros already), or out[p] += vals (× float32
    scale); with cnt, cnt[p] += 1 where the added value is non-zero. out, cnt: flat float32 of the
    tensor's size."""
    mode = (4 if zeroed else 1) if not add else 2 if scale is None else 3
    s = np.float32(1 if scale is None else scale)
    extra = {} if cnt is None else {"cnt": cnt}
    if _walk(shape, chunk, topk, buf, mode, vals=vals, scale=s, out=out, **extra):
        return
    pos = positions(shape, chunk, topk, decode_indices(shape, chunk, topk, buf))
    v = vals if scale is None else vals * s  # float32 × float32, then one float32 add
    if not add:
        out[:] = 0
        out[pos] = v
        return
    out[pos] += v  # positions are distinct within a tensor
    if cnt is not None:
        cnt[pos] += v != 0


def scatter_add_all(
    shape: tuple[int, ...],
    chunk: int,
    topk: int,
    sources: Sequence[tuple[bytes, np.ndarray, float | None]],
    out: np.ndarray,
    cnt: np.ndarray | None = None,
    fresh: bool = False,
    divisor: int | None = None,
) -> bool:
    """`scatter(..., add=True)` of every (rank buffer, values, scale) of `sources` into `out`, in the
    given order, a block of bands at a time: each block takes every source's entries in turn while
    its part of `out` (about BLOCK_BYTES) is in cache, and the blocks are shared over the cores. An
    entry lies in exactly one band, so every coordinate still adds the sources in their order (the
    same bits as one `scatter` per source). `fresh`: `out` (and `cnt`) hold anything, and each block
    is zeroed just before its adds; `divisor`: each block is then divided by it (one correctly
    rounded float32 division per element, as `np.divide` of the whole), so `out` ends as the mean —
    both while the block is in cache, never a pass of their own over the tensor. False (nothing
    written) when numba is not in use."""
    lay = layout(shape, chunk, topk)
    kern = pk.compiled(int(lay.sel[-1]) * 8 * len(sources))
    if kern is None or lay.n_bands == 0:
        return kern is not None
    table, ftab = tables(chunk, topk)
    geometry = (lay.off, lay.kc, lay.sel, lay.rows, lay.cols, lay.th, lay.tw, table, ftab)
    calls = [
        (np.frombuffer(buf, dtype=np.uint8), vals, np.float32(1 if s is None else s), 2 if s is None else 3)
        for buf, vals, s in sources
    ]
    c, no_pos = (np.zeros(0, dtype=np.float32) if cnt is None else cnt), np.zeros(0, dtype=np.int64)
    step = max(1, BLOCK_BYTES // (4 * lay.th * lay.cols))  # bands per block

    by = None if divisor is None else np.float32(divisor)

    def blocks(b0: int, b1: int) -> None:
        for lo in range(b0 * step, min(lay.n_bands, b1 * step), step):
            hi = min(lay.n_bands, lo + step)
            a, b = lo * lay.th * lay.cols, min(lay.rows, hi * lay.th) * lay.cols  # the block's entries
            if fresh:
                out[a:b] = 0
                c[a:b] = 0
            for data, vals, s, mode in calls:
                kern.walk(data, *geometry, vals, s, mode, out, c, no_pos, lo, hi)
            if by is not None:
                np.divide(out[a:b], by, out=out[a:b])

    run_split(blocks, -(-lay.n_bands // step), lay.rows * lay.cols * len(sources))
    return True

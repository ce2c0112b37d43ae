"""A voted round's range r on the wire and at its owner (docs/protocol.md, VOTED): votes, support, values, mean.

The voted support (`peer.core.sparseloco.ranges.voted`) cut by the ranges plan: an owner of range r
tallies, selects and averages the bands of range r alone, since a band is whole tile rows and its
tiles are the tensor's own (`select_support`'s `first_tile`). Only the bands `compress` sends sparse
are voted; a band it sends dense (1-D tensors with `dense_1d`) is sent whole, float32, by every sender.

    vote part r    = b"VOTE" | per voted band of r: the codec's index set of k per tile (`encode_indices`)
    support r      = b"SUPP" | u64 t | u32 stage | u32 r | 16 bytes roster digest | u32 n_roster |
                     u32 n_counted | u32 × n_counted roster positions whose vote counted, ascending |
                     per voted band: the codec's index set of k′ per tile
    values part r  = b"VALS" | u8 quant_bits | per band of r: voted: [f32 codebook] + codes of
                     Q(e[S_band]) (qb 0: f32 values); dense: f32 × numel
    mean shard r   = an exact shard (`Shard`, version 3) of range r of Δ̄ = Σ v̂_m / n_roster, its values at
                     `swarm.mean_bits` (the codec's quantizer, one codebook per band; 0: float32)

Every size is a function of (plan, chunk, k, k′, quant_bits): a vote, support or values part of
another length, a rank out of range (two positions alike, one in padding, more than k in a tile) or
a non-canonical padding bit is refused whole (PayloadError), so a stuffed vote never parses. The
codec's index coding sends exactly min(k, real entries) distinct positions per tile.

Invariants: `range_support` and `mean_shard` are portable (integer counts, the PCG64 draw, float32
sums in roster order into zeros, one correctly rounded division): every owner, backup and checker
of range r computes the same bytes. `values_part` writes e ← e − v̂ on the support (v̂ exactly as the
owner decodes it) and e ← 0 on a dense band.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.aligned import support_seed
from peer.core.sparseloco.codec.encode import quantize
from peer.core.sparseloco.codec.format import (
    SPARSE,
    PayloadError,
    SparseLoCoConfig,
    dequantize,
    entry_kind,
    n_selected,
    pack_bits,
    tile_dims,
    unpack_bits,
)
from peer.core.sparseloco.codec.index import decode_indices, encode_indices, index_nbytes, positions
from peer.core.sparseloco.ranges.exact import ExactBody, band_bits, encode_band
from peer.core.sparseloco.ranges.owner import Shard, _bitmap
from peer.core.sparseloco.ranges.plan import Band, RangePlan
from peer.core.sparseloco.ranges.voted import select_support, tile_of, tile_topk

__all__ = [
    "Support",
    "encode_votes",
    "first_tile",
    "mean_rounding",
    "mean_shard",
    "parse_values",
    "parse_votes",
    "range_support",
    "values_part",
    "vote_parts",
    "voted",
]

VOTE, SUPPORT, VALUES = b"VOTE", b"SUPP", b"VALS"
_SUPPORT_HEAD = struct.Struct("<4sQII16sI")


def voted(band: Band, cfg: SparseLoCoConfig) -> bool:
    """Whether a band is voted (sent sparse by `compress`) rather than sent whole."""
    return entry_kind(band.shape, cfg) == SPARSE


def first_tile(band: Band, chunk: int) -> int:
    """The tensor's tile index of the band's first tile (a band starts at a multiple of `chunk` rows)."""
    _, cols, th, tw = tile_dims(band.shape, chunk)
    return (band.row0 // th) * -(-cols // tw) if len(band.shape) >= 2 else 0


def _band_view(t: Tensor, b: Band) -> Tensor:
    return t[b.row0 : b.row1] if t.dim() >= 2 else t


def _local(pos: np.ndarray, shape: tuple[int, ...], chunk: int) -> np.ndarray:
    """Flat positions of a band → the codec's local indices, chunk by chunk, ascending inside each."""
    _, cols, th, tw = tile_dims(shape, chunk)
    tiles = tile_of(torch.from_numpy(pos), shape, chunk).numpy()
    local: np.ndarray = ((pos // cols) % th) * tw + (pos % cols) % tw
    return local[np.lexsort((local, tiles))]


def encode_votes(sets: Sequence[np.ndarray], bands: Sequence[Band], chunk: int, k: int) -> bytes:
    """The codec's index sets of k per tile of `bands` (band-local flat positions each), concatenated."""
    return b"".join(
        encode_indices(b.shape, chunk, k, _local(s, b.shape, chunk)) for s, b in zip(sets, bands, strict=True)
    )


def _parse_sets(b: bytes, at: int, bands: Sequence[Band], chunk: int, k: int) -> list[np.ndarray]:
    """Index sets of k per tile of `bands` that are exactly b[at:] (PayloadError else): flat, ascending."""
    sizes = [index_nbytes(band.shape, chunk, k) for band in bands]
    if len(b) - at != sum(sizes):
        raise PayloadError(f"{len(b) - at} bytes of index sets, these bands take {sum(sizes)}")
    out = []
    for band, n in zip(bands, sizes, strict=True):
        local = decode_indices(band.shape, chunk, k, b[at : at + n])
        out.append(np.sort(positions(band.shape, chunk, k, local, check=True)))
        at += n
    return out


def vote_parts(e: Mapping[str, Tensor], plan: RangePlan, cfg: SparseLoCoConfig) -> list[bytes]:
    """A sender's vote, one part per range: the top-k per tile of its error buffer e = β·e + Δ."""
    out = []
    for bands in plan.ranges:
        vb = [b for b in bands if voted(b, cfg)]
        sets = [tile_topk(_band_view(e[b.name], b), cfg.chunk, cfg.topk).numpy() for b in vb]
        out.append(VOTE + encode_votes(sets, vb, cfg.chunk, cfg.topk))
    return out


def parse_votes(b: bytes, plan: RangePlan, r: int, cfg: SparseLoCoConfig) -> list[np.ndarray]:
    """A vote part of range r: per voted band, its flat positions. PayloadError: refused whole."""
    if not isinstance(b, (bytes, bytearray)) or bytes(b[:4]) != VOTE:
        raise PayloadError("not a vote part")
    return _parse_sets(bytes(b), 4, [x for x in plan.ranges[r] if voted(x, cfg)], cfg.chunk, cfg.topk)


@dataclass(frozen=True, eq=False)
class Support:
    """Range r's agreed positions of round (t, stage): per voted band, band-local flat positions, and
    the roster positions whose votes were counted (module docstring)."""

    t: int
    stage: int
    r: int
    roster: str  # hex, 16 bytes
    n_roster: int
    counted: tuple[int, ...]
    sets: tuple[np.ndarray, ...]  # per voted band of range r, ascending int64

    def is_included(self, i: int) -> bool:
        """Whether roster member i's vote counted (as `Shard.is_included` of a contribution)."""
        return i in self.counted

    def to_bytes(self, plan: RangePlan, cfg: SparseLoCoConfig, keep: int) -> bytes:
        head = _SUPPORT_HEAD.pack(SUPPORT, self.t, self.stage, self.r, bytes.fromhex(self.roster), self.n_roster)
        vb = [b for b in plan.ranges[self.r] if voted(b, cfg)]
        counted = struct.pack(f"<I{len(self.counted)}I", len(self.counted), *self.counted)
        return head + counted + encode_votes(self.sets, vb, cfg.chunk, keep)

    @classmethod
    def from_bytes(cls, b: bytes, plan: RangePlan, cfg: SparseLoCoConfig, keep: int, n_roster: int) -> Support:
        """Parse a support record of this plan and k′; PayloadError unless canonical."""
        try:
            magic, t, stage, r, roster, n = _SUPPORT_HEAD.unpack_from(b)
            if magic != SUPPORT or n != n_roster or not 0 <= r < plan.n:
                raise PayloadError(f"not a support of a roster of {n_roster} ({magic!r}, {n}, range {r})")
            at = _SUPPORT_HEAD.size
            (count,) = struct.unpack_from("<I", b, at)
            if count > n:
                raise PayloadError(f"{count} counted votes in a roster of {n}")
            counted = struct.unpack_from(f"<{count}I", b, at + 4)
            if any(j <= i for i, j in zip(counted, counted[1:], strict=False)) or any(i >= n for i in counted):
                raise PayloadError("counted positions are not strictly ascending roster positions")
            vb = [x for x in plan.ranges[r] if voted(x, cfg)]
            sets = _parse_sets(bytes(b), at + 4 + 4 * count, vb, cfg.chunk, keep)
        except (struct.error, ValueError) as exc:
            raise PayloadError(f"invalid support: malformed ({type(exc).__name__}: {exc})") from None
        return cls(t, stage, r, roster.hex(), n, tuple(counted), tuple(sets))


def range_support(
    t: int, stage: int, r: int, plan: RangePlan, votes: Sequence[Sequence[np.ndarray] | None],
    roster: str, cfg: SparseLoCoConfig, keep: int, seed: int,
) -> Support:  # fmt: skip
    """Range r's support from the roster's parsed votes (roster order; None: absent or refused):
    per voted band, the tally then `select_support` seeded by (run `seed`, t, stage, tensor)."""
    vb = [b for b in plan.ranges[r] if voted(b, cfg)]
    counted = tuple(i for i, v in enumerate(votes) if v is not None)
    sets = []
    for j, band in enumerate(vb):
        count = torch.zeros(band.numel, dtype=torch.int64)
        for vote in votes:
            if vote is not None:
                count[torch.from_numpy(vote[j])] += 1  # a parsed vote: distinct positions, each counted once
        s = select_support(
            count, band.shape, cfg.chunk, keep, support_seed(seed, t, stage, band.name), first_tile(band, cfg.chunk)
        )
        sets.append(s.numpy())
    return Support(t, stage, r, roster, len(votes), counted, tuple(sets))


def _codebook_nbytes(qb: int) -> int:
    return 4 * (1 << (qb - 1)) if qb else 0


def _values_nbytes(bands: Sequence[Band], cfg: SparseLoCoConfig, keep: int) -> int:
    total = 5
    for b in bands:
        if voted(b, cfg):
            n = n_selected(b.shape, cfg.chunk, keep)
            qb = cfg.quant_bits
            total += _codebook_nbytes(qb) + ((n * qb + 7) // 8 if qb else 4 * n)
        else:
            total += 4 * b.numel
    return total


def values_part(e: Mapping[str, Tensor], plan: RangePlan, support: Support, cfg: SparseLoCoConfig) -> bytes:
    """A sender's values part of range r: Q(e) at the support of each voted band (per band codebook),
    e whole (float32) on a dense band; e ← e − v̂ there, in place (module docstring)."""
    qb, out, sets = cfg.quant_bits, [VALUES, struct.pack("<B", cfg.quant_bits)], iter(support.sets)
    for band in plan.ranges[support.r]:
        view = _band_view(e[band.name], band).reshape(-1)  # a view: e is contiguous float32 CPU
        if not voted(band, cfg):
            out.append(view.numpy().astype("<f4").tobytes())
            view.zero_()
            continue
        at = torch.from_numpy(next(sets))
        v = view[at].contiguous().numpy()
        if qb:
            codes, book = quantize(v, qb)
            out += [book.astype("<f4").tobytes(), pack_bits(codes, qb)]
            v = dequantize(codes, book, qb)
        else:
            out.append(v.astype("<f4").tobytes())
        view[at] = view[at] - torch.from_numpy(v)
    return b"".join(out)


def parse_values(b: bytes, plan: RangePlan, support: Support, cfg: SparseLoCoConfig, keep: int) -> list[np.ndarray]:
    """A values part of range r at `support`: per band, the float32 values as sent (voted: (|S_band|,),
    dense: (numel,)). PayloadError unless canonical and finite."""
    bands, qb = plan.ranges[support.r], cfg.quant_bits
    if (
        not isinstance(b, (bytes, bytearray))
        or len(b) != _values_nbytes(bands, cfg, keep)
        or b[:5] != VALUES + bytes([qb])
    ):
        raise PayloadError(
            f"a values part of range {support.r} is {_values_nbytes(bands, cfg, keep)} bytes of quant_bits {qb}"
        )
    at, out, sets = 5, [], iter(support.sets)
    for band in bands:
        n = len(next(sets)) if voted(band, cfg) else band.numel
        if voted(band, cfg) and qb:
            book = np.frombuffer(b, "<f4", 1 << (qb - 1), at).astype(np.float32)
            at += _codebook_nbytes(qb)
            if not np.all(np.isfinite(book)) or np.any(book < 0) or np.any(np.signbit(book)):
                raise PayloadError(f"the codebook of {band.entry!r} is not finite non-negative magnitudes")
            size = (n * qb + 7) // 8
            vals = dequantize(unpack_bits(bytes(b[at : at + size]), n, qb), book, qb)
            at += size
        else:
            vals = np.frombuffer(b, "<f4", n, at).astype(np.float32)
            at += 4 * n
            if not np.all(np.isfinite(vals)):
                raise PayloadError(f"non-finite values of {band.entry!r}")
        out.append(vals)
    return out


def mean_shard(
    plan: RangePlan,
    support: Support,
    values: Sequence[Sequence[np.ndarray] | None],
    cfg: SparseLoCoConfig,
    bits: int = 0,
) -> Shard:
    """Range r's mean Δ̄ = Σ v̂_m / n_roster on the support, from the roster's parsed values parts
    (roster order; None: absent; float32 sums in roster order), as an exact shard whose values are Q(Δ̄)
    at `bits` (`swarm.mean_bits`: the codec's quantizer per band, deterministic; 0: Δ̄ itself, float32;
    a band `compress` sends dense stays float32). A member whose vote the support did not count (refused,
    or never fetched) is left out of the range's mean, values or not, as a malformed part is left out of a
    ranges shard. `mean_rounding` measures what Q(Δ̄) changed."""
    return _mean_shard(plan, support, values, cfg, bits)[0]


def mean_rounding(
    plan: RangePlan,
    support: Support,
    values: Sequence[Sequence[np.ndarray] | None],
    cfg: SparseLoCoConfig,
    bits: int,
) -> tuple[float, float]:
    """(‖Δ̄ − Q(Δ̄)‖², ‖Δ̄‖²) of range r's mean shard at `bits`: the rounding nobody gets back."""
    _, quant_sq, mean_sq = _mean_shard(plan, support, values, cfg, bits)
    return quant_sq, mean_sq


def _mean_shard(
    plan: RangePlan,
    support: Support,
    values: Sequence[Sequence[np.ndarray] | None],
    cfg: SparseLoCoConfig,
    bits: int,
) -> tuple[Shard, float, float]:
    n, entries, sets = support.n_roster, [], iter(support.sets)
    at_bits = replace(cfg, quant_bits=bits)
    quant_sq = mean_sq = 0.0
    values = [v if support.is_included(i) else None for i, v in enumerate(values)]
    for j, band in enumerate(plan.ranges[support.r]):
        at = torch.from_numpy(next(sets)) if voted(band, cfg) else None
        total = torch.zeros(band.numel if at is None else len(at), dtype=torch.float32)
        for v in values:
            if v is not None:
                total += torch.from_numpy(v[j])
        x = torch.zeros(band.numel, dtype=torch.float32)
        if at is None:
            x = total / n
        else:
            x[at] = total / n
        entry, rounding = encode_band(band, x.numpy(), band_bits(band.shape, at_bits))
        entries.append(entry)
        quant_sq += rounding
        mean_sq += float(torch.square(x.double()).sum())
    included = _bitmap([v is not None for v in values])
    body = ExactBody(tuple(entries), cfg.chunk, bits)
    shard = Shard(support.t, support.stage, support.r, support.roster, included, _bitmap([False] * n), (), body, n)
    return shard, quant_sq, mean_sq

"""An owner's aggregate of one range (the shard), and what a round returns to each contributor.

An owner of range r fetches part r of every contribution of the round's roster and computes

    s_i   = min(1, c·med/‖Δ̂_i‖)               clip to c × the lower median of the range's part norms
    Δ̄_r  = (Σ_i s_i·Δ̂_i) / n                 in roster order, n = the roster's size ("mean-over-all")
    mask  = TOP-k per tile(|Δ̄_r|)             ties broken by position inside the tile
    shard = Q(Δ̄_r ⊙ mask)                     the codec's quantizer (entries sent dense: exact float32)

and publishes it with the roster's digest and two bitmaps over the roster (included, clipped) and the
clip scales. Every holder commits the assembled shards (`peer.core.sparseloco.commit.commit_summed`), and each
contributor takes back (`returned_to`) its share of what the shard dropped, so error feedback keeps
the re-sparsification's dropped mass: the mean over the roster of what is returned is exactly
Δ̄_r ⊙ (1 − mask) plus the clipped mass. The quantization error of the shard's kept values is not
returned (no contributor knows Δ̄_r); `RangeStats.quant_sq` measures it.

With `exact` (`swarm.shard = "exact"`, `peer.core.sparseloco.ranges.exact`) there is no mask: the shard
is Δ̄_r itself, every entry it touched, coded sparse or dense per band, whichever is smaller. Nothing
is dropped, so `returned_to` gives back only the clipped mass; with quant_bits > 0 the requantization
error is measured (`RangeStats.quant_sq`), not returned. With quant_bits 0 the assembled exact shards
are the all-to-all round's Δ̄ to the bit when both rounds count the same contributions in the same
order and clip nothing (clip_median_factor 0, or no scale below 1 in either: all-to-all clips by a
whole payload's norm, a range by its part's) and all-to-all's screening drops nothing (tested).

Why a shard is the same bits on every machine, kernel set and thread count (as `peer.core.sparseloco.commit`):
norms are exactly rounded (`peer.core.sparseloco.codec.clip`) and the lower median is a selection; sums are
elementwise float32 in roster order into a zeroed accumulator (one product by a float32 scale, then
one add, per value); the mean is one correctly rounded division per value; the top-k is a k-th-value
threshold (unique whatever the algorithm) and exact comparisons; the quantizer is deterministic
float64; bands are independent, so sharing them over threads changes nothing. A test runs it in
processes under other ATEN/MKL/numba instruction sets and thread counts.

Shard wire format (little-endian), canonical (`from_bytes` accepts nothing else):
  b"SHRD" | u8 version (2: topk, 3: exact) | u64 t | u32 stage | u32 r | 16 bytes roster digest | u32 n_roster |
  u32 n_missing | u32 × n_missing   roster positions NOT in the aggregate, strictly ascending, < n_roster |
  u32 n_clipped | (u32 position, f32 scale in [0, 1]) × n_clipped   strictly ascending, included ones |
  the Payload of range r's band entries (topk), or the exact body of range r (exact: `ranges.exact`)
(Exception lists, not bitmaps over the roster: a round in which every contribution arrives and none is
clipped costs 8 bytes of them at any M, where two bitmaps cost M/4 bytes per shard, R ≈ M shards.)
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.algorithm import decompress
from peer.core.sparseloco.codec.clip import clip_plan, payload_norm
from peer.core.sparseloco.codec.decode import entry_values, write_entry
from peer.core.sparseloco.codec.encode import quantize
from peer.core.sparseloco.codec.format import (
    DENSE_F32,
    SPARSE,
    Payload,
    PayloadError,
    SparseLoCoConfig,
    TensorEntry,
    dequantize,
    entry_kind,
    entry_nbytes,
    payload_nbytes,
    positions,
    tile_dims,
)
from peer.core.sparseloco.codec.fused import run_each
from peer.core.sparseloco.ranges.exact import ExactBody, ExactEntry, band_bits, encode_band, parse_body
from peer.core.sparseloco.ranges.plan import Band, RangePlan, check_entries

__all__ = ["RangeStats", "Shard", "aggregate_range", "returned_to", "roster_digest", "shard_delta"]

MAGIC = b"SHRD"
VERSION = 2  # a topk shard: a Payload follows the lists (unchanged since issue 24)
EXACT_VERSION = 3  # an exact shard: an exact body follows them (issue 37)
_HEAD = struct.Struct("<4sBQII16sI")


def _bitmap(bits: Sequence[bool]) -> bytes:
    out = bytearray((len(bits) + 7) // 8)
    for i, bit in enumerate(bits):
        if bit:
            out[i // 8] |= 1 << (i % 8)
    return bytes(out)


def _bit(bitmap: bytes, i: int) -> bool:
    return bool(bitmap[i // 8] >> (i % 8) & 1)


def _positions(b: bytes, pos: int, n: int, what: str) -> tuple[list[int], int]:
    """A u32 count and that many strictly ascending roster positions < n, from byte `pos` on."""
    (count,) = struct.unpack_from("<I", b, pos)
    if count > n:
        raise PayloadError(f"{count} {what} contributions in a roster of {n}")
    at = list(struct.unpack_from(f"<{count}I", b, pos + 4))
    if any(j <= i for i, j in zip(at, at[1:], strict=False)) or any(i >= n for i in at):
        raise PayloadError(f"{what} positions are not strictly ascending roster positions")
    return at, pos + 4 + 4 * count


def shard_config(cfg: SparseLoCoConfig, shard_topk: int | None) -> SparseLoCoConfig:
    """The settings a shard is encoded with: the run's, with topk = shard_topk (None or 0: the run's)."""
    return replace(cfg, topk=shard_topk) if shard_topk else cfg


def shard_kind(shape: tuple[int, ...], cfg: SparseLoCoConfig) -> int:
    """A shard sends a band `compress` sends dense as exact float32, and the others sparse."""
    return SPARSE if entry_kind(shape, cfg) == SPARSE else DENSE_F32


def shard_payload_nbytes(plan: RangePlan, r: int, cfg: SparseLoCoConfig) -> int:
    """Exact size of the Payload of a shard of range r under the shard's settings."""
    return payload_nbytes({}, cfg) + sum(  # the header, then the entries
        entry_nbytes(b.entry, shard_kind(b.shape, cfg), b.shape, cfg.chunk, cfg.topk, cfg.quant_bits)
        for b in plan.ranges[r]
    )


@dataclass(frozen=True)
class Shard:
    """The owner's aggregate of range r of stage `stage`'s round t: re-sparsified (a Payload) or
    exact (an ExactBody) (module docstring)."""

    t: int
    stage: int
    r: int
    roster: str  # hex, 16 bytes: `roster_digest` of the round's roster
    included: bytes  # bitmap over the roster: bit i = contribution i is in the aggregate
    clipped: bytes  # bitmap: bit i = contribution i was clipped (its clipped mass returns to it)
    scales: tuple[float, ...]  # the clip factor of each clipped contribution, in roster order
    payload: Payload | ExactBody  # the band entries of range r
    n_roster: int  # the roster's size (the bitmaps' length in bits)

    def is_included(self, i: int) -> bool:
        return 0 <= i < self.n_roster and _bit(self.included, i)

    def scale_of(self, i: int) -> float | None:
        """Contribution i's clip factor, or None when it was not clipped."""
        if not (0 <= i < self.n_roster and _bit(self.clipped, i)):
            return None
        return self.scales[sum(_bit(self.clipped, j) for j in range(i))]

    def to_bytes(self) -> bytes:
        version = EXACT_VERSION if isinstance(self.payload, ExactBody) else VERSION
        head = _HEAD.pack(MAGIC, version, self.t, self.stage, self.r, bytes.fromhex(self.roster), self.n_roster)
        missing = [i for i in range(self.n_roster) if not _bit(self.included, i)]
        clipped = [i for i in range(self.n_roster) if _bit(self.clipped, i)]
        lists = struct.pack(f"<I{len(missing)}I", len(missing), *missing) + struct.pack("<I", len(clipped))
        pairs = b"".join(struct.pack("<If", i, s) for i, s in zip(clipped, self.scales, strict=True))
        return b"".join([head, lists, pairs, self.payload.to_bytes()])

    @classmethod
    def from_bytes(
        cls,
        b: bytes,
        plan: RangePlan,
        cfg: SparseLoCoConfig,
        n_roster: int,
        shard_topk: int | None = None,
        *,
        exact: bool = False,
    ) -> Shard:
        """Parse a shard of a roster of `n_roster` for this plan and settings (`shard_topk`, `exact` as
        in `aggregate_range`). Raises PayloadError, and nothing else, unless `b` is canonical."""
        if not isinstance(b, (bytes, bytearray, memoryview)):
            raise PayloadError(f"a shard must be bytes, got {type(b).__name__}")
        b = bytes(b)
        try:
            return _parse_shard(b, plan, cfg if exact else shard_config(cfg, shard_topk), n_roster, exact)
        except PayloadError as exc:
            raise PayloadError(f"invalid shard: {exc}; refuse its owner (it is faulty or lying)") from None
        except (struct.error, ValueError, IndexError, OverflowError) as exc:
            raise PayloadError(f"invalid shard: malformed ({type(exc).__name__}: {exc})") from None


def _parse_shard(b: bytes, plan: RangePlan, scfg: SparseLoCoConfig, n_roster: int, exact: bool) -> Shard:
    if len(b) < _HEAD.size:
        raise PayloadError(f"{len(b)} bytes is shorter than the header")
    magic, version, t, stage, r, roster, n = _HEAD.unpack_from(b)
    if magic != MAGIC or version != (EXACT_VERSION if exact else VERSION):
        raise PayloadError(f"bad magic {magic!r} or version {version}")
    if n != n_roster or not 0 <= r < plan.n:
        raise PayloadError(f"roster of {n} (expected {n_roster}) or range {r} of {plan.n}")
    pos = _HEAD.size
    missing, pos = _positions(b, pos, n, "missing")
    (n_clip,) = struct.unpack_from("<I", b, pos)
    if n_clip > n:
        raise PayloadError(f"{n_clip} clipped contributions in a roster of {n}")
    pairs = struct.unpack_from("<" + "If" * n_clip, b, pos + 4)
    pos += 4 + 8 * n_clip
    clip_at, raw = list(pairs[0::2]), np.asarray(pairs[1::2], dtype=np.float32)
    if any(b_ <= a for a, b_ in zip(clip_at, clip_at[1:], strict=False)) or any(i >= n for i in clip_at):
        raise PayloadError("clipped positions are not strictly ascending roster positions")
    if set(clip_at) & set(missing):
        raise PayloadError("a contribution is clipped but not included")
    if not np.all((raw >= 0) & (raw <= 1)) or np.any(np.signbit(raw)):
        raise PayloadError("clip scales are outside [0, 1]")
    gone, clips = set(missing), set(clip_at)
    included, clipped = _bitmap([i not in gone for i in range(n)]), _bitmap([i in clips for i in range(n)])
    scales = tuple(float(s) for s in raw)
    if exact:
        body = parse_body(b, pos, plan, r, scfg)
        return Shard(t, stage, r, roster.hex(), included, clipped, scales, body, n)
    nbytes = shard_payload_nbytes(plan, r, scfg)
    if len(b) - pos != nbytes:
        raise PayloadError(f"its payload is {len(b) - pos} bytes, range {r} takes {nbytes}")
    payload = Payload.from_bytes(b[pos:], max_bytes=nbytes, max_elements=max(1, plan.range_elements(r)), cfg=scfg)
    check_entries(plan, r, payload, scfg, dense_f32=True)
    return Shard(t, stage, r, roster.hex(), included, clipped, scales, payload, n)


def roster_digest(entries: Sequence[tuple[str, str]]) -> str:
    """Hex (16 bytes) of sha256 over the roster's (replica id, payload sha256) pairs, in roster order,
    each string length-prefixed (u16) UTF-8."""
    h = hashlib.sha256(b"peer-roster-v1")
    for pair in entries:
        for s in pair:
            raw = s.encode("utf-8")
            h.update(struct.pack("<H", len(raw)) + raw)
    return h.digest()[:16].hex()


@dataclass(frozen=True)
class RangeStats:
    """What re-sparsifying range r did (squared L2 norms, float64; not part of the agreed bits)."""

    dense_sq: float  # ‖Δ̄_r‖²
    kept_sq: float  # ‖Δ̄_r ⊙ mask‖²
    dropped_sq: float = 0.0  # ‖Δ̄_r ⊙ (1 − mask)‖² = dense − kept (summed apart): error feedback keeps it
    quant_sq: float = 0.0  # ‖Δ̄_r ⊙ mask − shard‖²: the shard's quantization error (returned to nobody)
    n_included: int = 0
    n_clipped: int = 0


def top_k_tiles(x: np.ndarray, shape: tuple[int, ...], chunk: int, k: int) -> np.ndarray:
    """Local indices (n_sel,) uint16 of the k largest |x| of every tile, chunk by chunk, ascending;
    ties at a tile's k-th value go to the lowest positions inside the tile. x: flat float32 (finite)."""
    rows, cols, th, tw = tile_dims(shape, chunk)
    if rows * cols == 0:
        return np.zeros(0, dtype=np.uint16)
    n_r, n_c = -(-rows // th), -(-cols // tw)
    width = th * tw
    k = min(k, width)
    padded = np.full((n_r * th, n_c * tw), -np.inf, dtype=np.float32)
    np.abs(x.reshape(rows, cols), out=padded[:rows, :cols])
    tiles = padded.reshape(n_r, th, n_c, tw).transpose(0, 2, 1, 3).reshape(n_r * n_c, width)  # (n_tiles, th·tw)
    # (n_tiles, 1): each tile's k-th largest value, a value whatever algorithm finds it (np.partition is slow
    # on the many equal zeros of an aggregate)
    thr = torch.topk(torch.from_numpy(tiles), k, dim=1, sorted=False).values.amin(dim=1, keepdim=True).numpy()
    sel = tiles > thr
    need = k - sel.sum(axis=1)  # (n_tiles,) entries still to take at the threshold
    eq = tiles == thr
    ambiguous = np.flatnonzero(eq.sum(axis=1) > need)
    if len(ambiguous):  # take the first `need` tied entries by position
        first = np.cumsum(eq[ambiguous], axis=1) <= need[ambiguous, None]
        eq[ambiguous] &= first
    sel |= eq
    sel &= tiles != -np.inf  # padding is never sent (a tile with fewer than k real entries sends them all)
    local = np.nonzero(sel)[1]  # row-major: tile by tile, ascending inside each
    return local.astype(np.uint16)


def _check_parts(plan: RangePlan, r: int, parts: Sequence[Payload | None], cfg: SparseLoCoConfig) -> None:
    for i, part in enumerate(parts):
        if part is None:
            continue
        if (part.chunk, part.topk, part.quant_bits) != (cfg.chunk, cfg.topk, cfg.quant_bits):
            raise PayloadError(f"part of roster position {i} has other codec settings than the run")
        check_entries(plan, r, part, cfg)


def _sum_band(
    band: Band, j: int, parts: Sequence[Payload | None], scales: Sequence[float | None], cfg: SparseLoCoConfig
) -> np.ndarray:
    """Δ̄ of one band: Σ s_i·Δ̂_i in roster order, then the aggregation's division (flat float32)."""
    acc = np.zeros(band.numel, dtype=np.float32)
    contributors = cfg.aggregation == "mean-over-contributors"
    cnt = np.zeros(band.numel, dtype=np.float32) if contributors else None
    for part, scale in zip(parts, scales, strict=True):
        if part is not None:
            write_entry(part.entries[j], part.chunk, part.topk, acc, True, scale, cnt)
    if cnt is None:
        np.divide(acc, np.float32(max(1, len(parts))), out=acc)
    else:
        np.divide(acc, cnt, out=acc, where=cnt > 0)
    return acc


_Sq = tuple[float, float, float, float]


def _sq(a: np.ndarray) -> float:
    """Σ a² of a float64 array (numpy's pairwise sum: a BLAS dot would wake its threads for a statistic)."""
    return float(np.square(a).sum())


def _resparsify(band: Band, x: np.ndarray, scfg: SparseLoCoConfig) -> tuple[TensorEntry, _Sq]:
    """The shard entry of one band's Δ̄ `x`, and its (dense, kept, dropped, quant)
    squared norms (`RangeStats`)."""
    x64 = x.astype(np.float64)
    dense = _sq(x64)
    if shard_kind(band.shape, scfg) == DENSE_F32:
        return TensorEntry(band.entry, DENSE_F32, band.shape, values=x), (dense, dense, 0.0, 0.0)
    local = top_k_tiles(x, band.shape, scfg.chunk, scfg.topk)
    pos = positions(band.shape, scfg.chunk, scfg.topk, local)
    kept = x[pos]  # (n_sel,)
    k64 = x64[pos]
    x64[pos] = 0
    sq = (dense, _sq(k64), _sq(x64))
    if scfg.quant_bits == 0:
        return TensorEntry(band.entry, SPARSE, band.shape, indices=local, values=kept), (*sq, 0.0)
    codes, codebook = quantize(kept, scfg.quant_bits)
    err = k64 - dequantize(codes, codebook, scfg.quant_bits).astype(np.float64)
    entry = TensorEntry(band.entry, SPARSE, band.shape, indices=local, codes=codes, codebook=codebook)
    return entry, (*sq, _sq(err))


def aggregate_range(
    t: int,
    stage: int,
    r: int,
    plan: RangePlan,
    parts: Sequence[Payload | None],
    roster: str,
    cfg: SparseLoCoConfig,
    shard_topk: int | None = None,
    *,
    exact: bool = False,
) -> tuple[Shard, RangeStats]:
    """The shard of range r from the roster's parts (roster order; None = not fetched), and its stats.

    Parts must be range r's (`RangePlan.validator`); `roster` is `roster_digest` of the roster;
    `shard_topk` (None or 0: cfg.topk) is the shard's k per tile; `exact`: the exact aggregate instead
    (`ranges.exact`; `shard_topk` unused). Portable (module docstring).
    """
    if len(bytes.fromhex(roster)) != 16:
        raise ValueError(f"roster digest must be 16 bytes of hex, got {roster!r}")
    _check_parts(plan, r, parts, cfg)
    scfg = shard_config(cfg, shard_topk)
    present = [i for i, p in enumerate(parts) if p is not None]
    norms = [payload_norm(p) for p in parts if p is not None]
    plan_scales, _ = clip_plan(norms, cfg.clip_median_factor)
    scales: list[float | None] = [None] * len(parts)
    for i, s in zip(present, plan_scales, strict=True):
        scales[i] = s
    bands = plan.ranges[r]

    def one(j: int) -> tuple[TensorEntry, _Sq]:
        return _resparsify(bands[j], _sum_band(bands[j], j, parts, scales, cfg), scfg)

    def one_exact(j: int) -> tuple[ExactEntry, _Sq]:
        x = _sum_band(bands[j], j, parts, scales, cfg)
        entry, quant = encode_band(bands[j], x, band_bits(bands[j].shape, cfg))
        dense = _sq(x.astype(np.float64))
        return entry, (dense, dense, 0.0, quant)

    work = [b.numel * max(1, len(present)) for b in bands]
    payload: Payload | ExactBody
    if exact:
        done_x = run_each(one_exact, list(range(len(bands))), work)
        payload, sqs = ExactBody(tuple(e for e, _ in done_x), cfg.chunk, cfg.quant_bits), [s for _, s in done_x]
    else:
        done = run_each(one, list(range(len(bands))), work)
        payload, sqs = Payload([e for e, _ in done], scfg.chunk, scfg.topk, scfg.quant_bits), [s for _, s in done]
    clip_bits = [s is not None for s in scales]
    shard = Shard(
        t, stage, r, roster, _bitmap([p is not None for p in parts]), _bitmap(clip_bits),
        tuple(float(s) for s in scales if s is not None), payload, len(parts),
    )  # fmt: skip
    dense, kept, dropped, quant = (math.fsum(s[i] for s in sqs) for i in range(4))
    return shard, RangeStats(dense, kept, dropped, quant, len(present), sum(clip_bits))


def shard_delta(shard: Shard) -> dict[str, Tensor]:
    """The shard's band entries, decoded (dense float32 per band entry)."""
    if isinstance(shard.payload, ExactBody):
        return shard.payload.decoded()
    return decompress(shard.payload)


def returned_to(own_part: Payload, i: int, shard: Shard) -> dict[str, Tensor]:
    """What contributor i (roster position) takes back into its error buffer for this range, per band
    entry: its whole part when the shard does not include it, else Δ̂_i where the shard dropped a
    coordinate and Δ̂_i − fl(s_i·Δ̂_i) (the clipped mass; zero when not clipped) where it kept one.
    An exact shard keeps every coordinate: only the clipped mass comes back (its requantization error
    is measured, `RangeStats.quant_sq`, and returned to nobody)."""
    decoded = decompress(own_part)
    if not shard.is_included(i):
        return decoded
    scale = shard.scale_of(i)
    sp = shard.payload
    if isinstance(sp, ExactBody):
        if [e.name for e in sp.entries] != list(decoded):
            raise ValueError(f"returned_to: the part holds {list(decoded)[:3]}, shard {shard.r} other bands")
        return {name: _clipped(d, scale) for name, d in decoded.items()}
    kept_at = {e.name: entry_values(e, sp.chunk, sp.topk)[0] for e in sp.entries}
    if list(decoded) != list(kept_at):
        raise ValueError(f"returned_to: the part holds {list(decoded)[:3]}, shard {shard.r} {list(kept_at)[:3]}")
    out = {}
    for name, d in decoded.items():
        flat = d.reshape(-1).numpy()
        ret = flat.copy()  # Δ̂ everywhere, then the kept coordinates
        pos = kept_at[name]
        kept = flat if pos is None else flat[pos]
        back = np.zeros_like(kept) if scale is None else kept - kept * np.float32(scale)
        if pos is None:
            ret = back
        else:
            ret[pos] = back
        out[name] = torch.from_numpy(ret).view(d.shape)
    return out


def _clipped(d: Tensor, scale: float | None) -> Tensor:
    """Δ̂ − fl(s·Δ̂) of one decoded band (zeros when not clipped), as the kept coordinates above."""
    flat = d.reshape(-1).numpy()
    back = np.zeros_like(flat) if scale is None else flat - flat * np.float32(scale)
    return torch.from_numpy(back).view(d.shape)

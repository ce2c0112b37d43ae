"""SparseLoCo: error feedback, chunked top-k, 2-bit quantization, aggregation and the outer SGD step.

One outer round of SparseLoCo (arXiv 2508.15706, Alg. 1; DESIGN.md §2), per stage and replica:

    Δ  = θ_start − θ_now                  pseudo_gradient
    e  = β·e + Δ                           compress: error feedback
    Δ̂ = Q(TOP-k per chunk(e))              compress: k entries of every 64×64 tile, quantized
    e  = e − Δ̂                             compress: the new error buffer it returns
    Δ̂ ← Δ̂·min(1, c·med/‖Δ̂‖)              clip_to_median (peer.core.clip): robust to poisoning
    Δ̄ = aggregate(Δ̂ over participants)    aggregate ("mean-over-all" or "mean-over-contributors")
    θ  = θ_start − η·Δ̄                     outer_step

Chunking and the wire format live in `peer.core.payload` (re-exported here). A chunk with fewer
than k real entries sends all of them, so padding is never selected. With `dense_1d`, 1-D tensors
(norm gains) are sent whole: 8-bit linear (float32 when quant_bits == 0). Q is per tensor and
sign-true: each code is the value's sign bit plus one of 2^(bits−1) magnitude bins, and the
codebook holds the bins' mean |v| (equal-count bins refined by Lloyd steps), so a sent value
never changes sign. quant_bits == 0 (the paper's setting, §3) sends float32 values.
`clip_and_aggregate` is the fused form of clip_to_median + aggregate over decoded payloads: norms
come from the payloads' values, and each payload is scattered straight into one accumulator per
tensor, in the same order, so the result is the same bits. What median clipping removes from a
contribution (`clipped_mass`) goes back into its sender's error buffer.

Invariants:
- Δ̂ is exactly what a receiver decodes from the payload (compress decodes its own entries), so
  e_new = fl(e − Δ̂) keeps the quantization error, and `restore_unsent` puts a payload that missed
  the commit back into the buffer.
- Top-k picks what torch.topk(|e| per chunk, sorted=True) picks, ties included (a chunk tied at
  its k-th entry is ranked by torch.topk itself).
Pure torch/numpy: no networking imports.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from peer.core.clip import ClipStats, clip_plan, clip_to_median, clipped_mass, global_norm, payload_norm
from peer.core.payload import (
    DENSE_F32,
    DENSE_U8,
    MAX_CHUNK,
    QUANT_BITS,
    SPARSE,
    VERSION,
    Payload,
    PayloadError,
    TensorEntry,
    entry_values,
    index_bits,
    payload_nbytes,
    positions,
    rank_nbytes,
    tile_dims,
    valid_extent,
)
from peer.core.payload_kernels import chunk_topk
from peer.errors import ConfigError

__all__ = [
    "AGGREGATIONS",
    "DENSE_F32",
    "DENSE_U8",
    "SPARSE",
    "VERSION",
    "ClipStats",
    "Payload",
    "PayloadError",
    "SparseLoCoConfig",
    "TensorEntry",
    "aggregate",
    "aggregate_payloads",
    "clip_and_aggregate",
    "clip_plan",
    "clip_to_median",
    "clipped_mass",
    "compress",
    "decompress",
    "global_norm",
    "ideal_bytes_per_param",
    "index_bits",
    "outer_step",
    "payload_density",
    "payload_nbytes",
    "payload_norm",
    "pseudo_gradient",
    "restore_unsent",
]

AGGREGATIONS = ("mean-over-all", "mean-over-contributors")


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


def ideal_bytes_per_param(cfg: SparseLoCoConfig) -> float:
    """Bytes per parameter of the sparse part alone, for full chunks: (index bytes + k values) / chunk².

    Index bytes are ceil(log2 C(chunk², k) / 8) (the entropy of the index set, rounded up to a byte).
    """
    cc = cfg.chunk * cfg.chunk
    k = min(cfg.topk, cc)
    value_bits = cfg.quant_bits if cfg.quant_bits else 32
    idx = rank_nbytes(cc, k) if k <= 64 else (k * index_bits(cfg.chunk) + 7) // 8
    return (idx + k * value_bits / 8) / cc


# ------------------------------------------------------------------------------------------
# Selection and quantization
# ------------------------------------------------------------------------------------------


LLOYD_ROUNDS = 16  # refinements of the magnitude bins after the equal-count start


def _quantize(v: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
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
    a = np.abs(v.astype(np.float64))
    s = np.sort(a)
    csum = np.concatenate([[0.0], np.cumsum(s)])
    edges = np.unique(s[(np.arange(1, n_bins) * a.size) // n_bins])  # equal-count start, ties merged
    edges, means = _merge_empty(s, csum, edges)
    for _ in range(LLOYD_ROUNDS):
        edges, means = _merge_empty(s, csum, (means[:-1] + means[1:]) / 2)
    mag = np.searchsorted(edges, a, side="right").astype(np.uint8)  # bin = #edges <= |v|
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
    bounds = np.concatenate([[0], np.searchsorted(s, edges, side="left"), [s.size]])
    counts = np.diff(bounds)
    sums = csum[bounds[1:]] - csum[bounds[:-1]]
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


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


def _tied_magnitudes(e: Tensor, chunk: int, tiles: np.ndarray) -> Tensor:
    """The rows of `_chunk_magnitudes(e, chunk)` for the given tile numbers only. (len(tiles), chunk²)."""
    rows, cols, th, tw = tile_dims(tuple(e.shape), chunk)
    n_c = -(-cols // tw)
    r = (tiles // n_c)[:, None] * th + (np.arange(th * tw) // tw)[None, :]  # (t, th·tw)
    c = (tiles % n_c)[:, None] * tw + (np.arange(th * tw) % tw)[None, :]
    real = (r < rows) & (c < cols)
    flat = e.reshape(-1)[torch.from_numpy(np.where(real, r * cols + c, 0))].abs()
    return torch.where(torch.from_numpy(real), flat, -math.inf)


def _select(name: str, e: Tensor, cfg: SparseLoCoConfig) -> np.ndarray:
    """Local indices (n_sel,) uint16 of the top-k |e| of every chunk, chunk by chunk, ascending.

    A non-finite entry ranks above every finite one in torch.topk, so checking the selected
    values finds any non-finite entry of e (the numba kernel checks every entry itself).
    """
    shape, c, cc = tuple(e.shape), cfg.chunk, cfg.chunk * cfg.chunk
    if e.numel() == 0:
        return np.zeros(0, dtype=np.uint16)
    k = min(cfg.topk, cc)
    rows, cols, th, tw = tile_dims(shape, c)
    try:
        fast = chunk_topk(e.reshape(-1).numpy(), rows, cols, th, tw, k)
    except FloatingPointError:
        _check_finite(name, np.array([np.nan]))
        raise
    vr, vc = valid_extent(shape, c)
    k_c = torch.from_numpy(np.minimum(k, vr * vc))  # (n_chunks,) real entries to send
    keep = torch.arange(k)[None, :] < k_c[:, None]  # (n_chunks, k)
    if fast is None:
        top = torch.topk(_chunk_magnitudes(e, c), k, dim=1, sorted=True).indices  # (n_chunks, k)
    else:
        local, tie = fast
        top = torch.from_numpy(local)
        tied = np.flatnonzero(tie)
        if len(tied):  # the set is ambiguous there: let torch.topk break the tie as it always has
            top[torch.from_numpy(tied)] = torch.topk(_tied_magnitudes(e, c, tied), k, dim=1, sorted=True).indices
    top = torch.sort(torch.where(keep, top, cc), dim=1).values  # padding picks sort last
    return top[keep].numpy().astype(np.uint16)  # (n_sel,) chunk by chunk, ascending


def _encode_tensor(name: str, e: Tensor, cfg: SparseLoCoConfig) -> TensorEntry:
    """Select, quantize and pack one error-feedback buffer e (any shape, float32, CPU, contiguous)."""
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
    local = _select(name, e, cfg)
    vals = flat.numpy()[positions(shape, cfg.chunk, cfg.topk, local)]  # (n_sel,)
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


def _decode_tensor(e: TensorEntry, chunk: int, topk: int) -> Tensor:
    """Dense float32 Δ̂ of one entry."""
    pos, vals = entry_values(e, chunk, topk)
    if pos is None:
        return torch.from_numpy(vals.copy()).reshape(e.shape)
    out = torch.zeros(math.prod(e.shape), dtype=torch.float32)
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
        pos, vals = entry_values(entry, cfg.chunk, cfg.topk)
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


def _check_rule(rule: str, n_participants: int, n_payloads: int) -> None:
    if rule not in AGGREGATIONS:
        raise ConfigError(f"sparseloco.aggregation must be 'mean-over-all' or 'mean-over-contributors', got {rule!r}")
    if n_participants < max(1, n_payloads):
        raise ValueError(f"n_participants={n_participants} < {max(1, n_payloads)} payloads")


def _shape_mismatch(name: str, have: tuple[int, ...], got: tuple[int, ...]) -> PayloadError:
    return PayloadError(f"payloads disagree on the shape of {name!r}: {have} vs {got}; drop the odd one")


def _finish(sums: dict[str, Tensor], counts: dict[str, Tensor], n_participants: int, rule: str) -> dict[str, Tensor]:
    """Σ Δ̂ → Δ̄ by the aggregation rule (shared by `aggregate` and `aggregate_payloads`)."""
    if rule == "mean-over-all":
        return {name: s.div_(n_participants) for name, s in sums.items()}  # in place: no second dense copy
    return {
        name: torch.where(counts[name] > 0, s / counts[name].clamp_min(1), torch.zeros_like(s))
        for name, s in sums.items()
    }


def aggregate(
    decoded: Sequence[Mapping[str, Tensor]], n_participants: int, rule: str = "mean-over-all"
) -> dict[str, Tensor]:
    """Δ̄ from the committed Δ̂s, summed in the given order (so every peer gets the same bits).

    "mean-over-all": Σ Δ̂ / n_participants (absent names count as zero).
    "mean-over-contributors": per coordinate Σ Δ̂ / #{Δ̂ ≠ 0 there}; 0 where nobody sent anything.
    """
    _check_rule(rule, n_participants, len(decoded))
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
                raise _shape_mismatch(name, tuple(sums[name].shape), tuple(t.shape))
            sums[name] += t
            if rule == "mean-over-contributors":
                counts[name] += (t != 0).to(torch.float32)
    return _finish(sums, counts, n_participants, rule)


def aggregate_payloads(
    payloads: Sequence[Payload],
    n_participants: int,
    rule: str = "mean-over-all",
    scales: Sequence[float | None] | None = None,
    names: Collection[str] | None = None,
) -> dict[str, Tensor]:
    """aggregate([decompress(p) (× scales[i]) for p in payloads]), the same bits, without M dense copies.

    Each payload's values are scattered straight into one float32 accumulator per tensor, in the
    given order; an absent coordinate adds +0.0 in `aggregate`, which never changes a sum that
    starts at +0.0. `scales` (from `clip_plan`): None keeps a payload, a float multiplies its
    values (0.0 zeroes it). `names` restricts the result to those tensors.
    """
    _check_rule(rule, n_participants, len(payloads))
    scales = [None] * len(payloads) if scales is None else list(scales)
    sums: dict[str, Tensor] = {}
    counts: dict[str, Tensor] = {}
    for p, scale in zip(payloads, scales, strict=True):
        for e in p.entries:
            if names is not None and e.name not in names:
                continue
            shape = tuple(e.shape)
            if e.name not in sums:
                sums[e.name] = torch.zeros(shape, dtype=torch.float32)
                if rule == "mean-over-contributors":
                    counts[e.name] = torch.zeros(shape, dtype=torch.float32)
            if tuple(sums[e.name].shape) != shape:
                raise _shape_mismatch(e.name, tuple(sums[e.name].shape), shape)
            pos, vals = entry_values(e, p.chunk, p.topk)
            if scale is not None:
                vals = vals * np.float32(scale)  # float32 × float32, as `t * scale` in clip_to_median
            acc = sums[e.name].view(-1).numpy()
            if pos is None:
                acc += vals
            else:
                acc[pos] += vals  # positions are distinct within a payload
            if rule == "mean-over-contributors":
                cnt = counts[e.name].view(-1).numpy()
                if pos is None:
                    cnt += vals != 0
                else:
                    cnt[pos] += vals != 0
    return _finish(sums, counts, n_participants, rule)


def clip_and_aggregate(
    payloads: Sequence[Payload], factor: float, rule: str = "mean-over-all", names: Collection[str] | None = None
) -> tuple[dict[str, Tensor], ClipStats]:
    """aggregate(clip_to_median([decompress(p) for p in payloads], factor), len(payloads), rule), fused.

    The same bits, with norms read off the payloads and one accumulator per tensor (see
    `aggregate_payloads`); `names` restricts the aggregate (not the norms) to those tensors.
    """
    plan, stats = clip_plan([payload_norm(p) for p in payloads], factor)
    return aggregate_payloads(payloads, len(payloads), rule, plan, names), stats


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

"""Aligned support: one index set per tile per round, derived alike by every holder; values-only sends.

Every holder derives the same support, so a contribution is values only (no indices) and the sum
over contributions stays exactly k′-sparse:

    S_t[tile]  = top-(k′ − x) positions of |Δ̄_{t−1}| in the tile (non-zero ones only)
                 ∪ seeded exploration: the rest of the k′, drawn uniformly from the tile's other
                   positions with a generator seeded by (run seed, t, stage, tensor) — row i of the
                   draw is tile i, so each tile's draw is a function of (seed, t, stage, tile)
    e_m        = β·e_m + Δ_m                                      SparseLoCo's error feedback
    v_m        = Q(e_m[S_t])                                      values only, no indices
    e_m       ← e_m − v_m  on S_t                                 e keeps everything off S_t
    Δ̄_t       = Σ_m v_m / M  scattered on S_t                     exact: no re-sparsification

k′ is the committed entries per tile (`swarm.shard_topk`, 0: `sparseloco.topk`), x = ⌊k′/4⌋
(`EXPLORE_SHARE`): with no previous aggregate (round 0) or fewer non-zero entries than k′ − x in a
tile, exploration fills the rest. Tensors of at most one dimension go through the codec as
SparseLoCo sends them (`dense_1d`: all of it, 8-bit); a tile with fewer real entries than k′ takes
all of them. Q is the codec's sign-true quantizer per tensor (`codec.encode.quantize`; quant_bits 0:
float32 values).

**Voted** support (`peer.core.sparseloco.ranges.voted`): a first phase where each sender publishes only
the index set of its own top-k per tile (no values), and S_t = the k′ positions per tile with the most
votes; then the values phase above (`send_at`, `aligned_sum`). It costs the index bytes the aligned
support saves, and follows this round's errors instead of last round's sum.
`requantized` lets the owner publish the mean at quant_bits instead of float32, the rounding kept in
an agreed residual that the next round's mean carries (as the residual shards of issue 37 do).

Why: all-to-all commits the union of M senders' top-k (up to M·k per tile) and downloads M − 1
payloads; a range shard re-sparsifies the mean to k per tile and loses half of ‖Δ̄‖². With one agreed
support the mean needs no re-sparsification and a contribution needs no index bytes (at 2-bit values
a 64×64 tile's 32 indices cost ~34 bytes, its values 8), at the price of a support chosen from last
round's aggregate rather than from this round's errors.

Invariants: `agreed_support` is a function of (previous aggregate, shape, settings, seed key) alone,
ascending flat positions, at most k′ per tile and inside the tensor; `aligned_values` returns exactly
the values a receiver decodes, and e_new = e − v̂ on S (bit for bit), e elsewhere; `aligned_sum`'s
result is zero off S. Pure torch/numpy: no networking.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.codec.encode import quantize
from peer.core.sparseloco.codec.format import HEADER_NBYTES, SPARSE, dequantize, entry_nbytes, index_nbytes, tile_dims

__all__ = [
    "EXPLORE_SHARE",
    "agreed_support",
    "aligned_sum",
    "aligned_values",
    "sparse_names",
    "fed_back",
    "indices_nbytes",
    "requantized",
    "send_at",
    "support_seed",
    "values_nbytes",
]

EXPLORE_SHARE = 0.25  # x = ⌊k′ · share⌋ of a tile's k′ agreed positions are drawn by seed, not by |Δ̄_{t−1}|


def sparse_names(shapes: Mapping[str, Sequence[int]], dense_1d: bool) -> list[str]:
    """The tensors that take an agreed support (the others go through the codec whole)."""
    return [n for n, s in shapes.items() if not (len(s) <= 1 and dense_1d)]


def support_seed(seed: int, t: int, stage: int, name: str) -> int:
    """The exploration generator's seed for one tensor of round (t, stage): sha256 of the key, 63 bits."""
    digest = hashlib.sha256(f"aligned/{seed}/{t}/{stage}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _tiled(x: Tensor, chunk: int, fill: float) -> Tensor:
    """x laid out one tile per row, padding = `fill`. (n_tiles, th·tw), a fresh tensor."""
    rows, cols, th, tw = tile_dims(tuple(x.shape), chunk)
    n_r, n_c = -(-rows // th), -(-cols // tw)
    padded = torch.full((n_r * th, n_c * tw), fill, dtype=x.dtype)
    padded[:rows, :cols] = x.reshape(rows, cols)
    return padded.view(n_r, th, n_c, tw).permute(0, 2, 1, 3).reshape(n_r * n_c, th * tw)  # (n_tiles, th·tw)


def agreed_support(prev: Tensor | None, shape: Sequence[int], chunk: int, keep: int, seed: int) -> Tensor:
    """Ascending flat positions (int64) of the round's agreed support of one tensor (module docstring).

    `prev` is the last committed aggregate Δ̄_{t−1} of the tensor (None: the first round), `keep` = k′,
    `seed` = `support_seed` of the tensor's round."""
    shape = tuple(shape)
    numel = int(np.prod(shape)) if shape else 1
    flat = torch.arange(numel, dtype=torch.float64).view(shape)  # exact up to 2^53 entries
    pos = _tiled(flat, chunk, -1.0).to(torch.int64)  # (n_tiles, cc), −1 = padding
    cc = pos.shape[1]
    k = min(keep, cc)
    gen = torch.Generator().manual_seed(seed)
    key = torch.rand(pos.shape, generator=gen, dtype=torch.float64)  # exploration order, in [0, 1)
    key[pos < 0] = -1.0  # padding last
    n_top = k - int(k * EXPLORE_SHARE)
    if prev is not None and n_top > 0:
        mag = _tiled(prev.detach().to("cpu", torch.float64).abs(), chunk, -1.0)
        top_val, top_idx = mag.topk(n_top, dim=1)  # (n_tiles, n_top)
        key.scatter_(1, top_idx, torch.where(top_val > 0, 2.0, key.gather(1, top_idx)))  # above any draw
    chosen = pos.gather(1, key.topk(k, dim=1).indices)  # (n_tiles, k)
    return torch.sort(chosen[chosen >= 0]).values


def fed_back(delta: Tensor, prev_error: Tensor | None, beta: float) -> Tensor:
    """e = β·e_prev + Δ, a fresh float32 CPU tensor (two float32 roundings, as the codec computes it)."""
    d = delta.detach().to("cpu", torch.float32)
    return d.clone() if prev_error is None else prev_error.detach().to("cpu", torch.float32).mul(beta).add_(d)


def aligned_values(
    delta: Tensor, prev_error: Tensor | None, support: Tensor, beta: float, quant_bits: int
) -> tuple[Tensor, Tensor]:
    """One contribution of one tensor: (v̂ at `support`, float32, as a receiver decodes it; e_new).

    e = β·e_prev + Δ (`fed_back`), v = Q(e[S]); e_new = e − v̂ on S."""
    return send_at(fed_back(delta, prev_error, beta), support, quant_bits)


def send_at(e: Tensor, support: Tensor, quant_bits: int) -> tuple[Tensor, Tensor]:
    """(v̂ = Q(e[S]) as a receiver decodes it, e with v̂ subtracted on S); e is written in place."""
    flat = e.view(-1)
    v = flat[support].contiguous()
    if quant_bits:
        codes, codebook = quantize(v.numpy(), quant_bits)
        v = torch.from_numpy(dequantize(codes, codebook, quant_bits))
    flat[support] = flat[support] - v
    return v, e


def aligned_sum(values: Sequence[Tensor], support: Tensor, shape: Sequence[int], n_participants: int) -> Tensor:
    """Δ̄ of one tensor: Σ v̂_m in the given order, / n_participants, scattered on S (zero elsewhere)."""
    total = torch.zeros(int(support.numel()), dtype=torch.float32)
    for v in values:
        total += v
    out = torch.zeros(int(np.prod(tuple(shape))) if len(shape) else 1, dtype=torch.float32)
    out[support] = total / n_participants
    return out.view(tuple(shape))


def values_nbytes(
    shapes: Mapping[str, Sequence[int]], chunk: int, keep: int, quant_bits: int, names: Sequence[str]
) -> int:
    """Wire bytes of the values-only form of a contribution's `names`: a payload header plus, per
    tensor, the codec's sparse entry of k′ per tile without its index bytes (name, shape, codebook,
    packed codes; float32 values with quant_bits 0)."""
    total = HEADER_NBYTES
    for name in names:
        shape = tuple(shapes[name])
        total += entry_nbytes(name, SPARSE, shape, chunk, keep, quant_bits) - index_nbytes(shape, chunk, keep)
    return total


def indices_nbytes(shapes: Mapping[str, Sequence[int]], chunk: int, k: int, names: Sequence[str]) -> int:
    """Wire bytes of an index set of k per tile of `names` alone (a vote, or a published support): a
    payload header plus, per tensor, its entry header (name, shape) and the codec's index bytes."""
    total = HEADER_NBYTES
    for name in names:
        shape = tuple(shapes[name])
        total += 2 + len(name.encode("utf-8")) + 2 + 4 * len(shape) + index_nbytes(shape, chunk, k)
    return total


def requantized(mean: Tensor, residual: Tensor | None, support: Tensor, quant_bits: int) -> tuple[Tensor, Tensor]:
    """(C, R) of an owner that publishes its mean at `quant_bits` and keeps the rest in an agreed
    residual: A = Δ̄ + R_prev, C = Q(A[S]) scattered on S (zero elsewhere), R = A − C (exactly A off S)."""
    a = mean.detach().to("cpu", torch.float32).clone() if residual is None else mean + residual
    v, rest = send_at(a.contiguous(), support, quant_bits)
    committed = torch.zeros(a.numel(), dtype=torch.float32)
    committed[support] = v
    return committed.view(a.shape), rest

"""The voted support (issue 37): senders vote their top-k per tile, the k′ most-voted positions are agreed.

A voted round (docs/protocol.md, VOTED) commits, per tile, the exact mean of every sender's error
buffer at k′ agreed positions:

    vote_m     = TOP-k per tile(|e_m|)                       e_m = β·e_m + Δ_m (`aligned.fed_back`)
    c[p]       = #{m : p ∈ vote_m}, over the valid votes     a vote counts once per position
    S[tile]    = the k′ positions of the tile with the largest key (c[p], draw[p], −local p)
    v̂_m        = Q(e_m[S]); e_m ← e_m − v̂_m on S             `aligned.send_at`
    Δ̄         = Σ_m v̂_m / n, scattered on S                  `aligned.aligned_sum`: roster order

k = `sparseloco.topk`, k′ = `voted_keep` (`swarm.shard_topk`, 0: 2·k). `draw` is a uint64 stream of
numpy's PCG64 seeded by `support_seed(run seed, t, stage, tensor)`, element j·cc + i for position i
of tile j (cc = chunk², tiles in the codec's order), so every owner and backup of a band computes its
tiles' draws alone (`PCG64.advance`) and gets the same support; PCG64's raw stream and SeedSequence
are stable across numpy versions and machines.

Stuffing defence (`check_vote`): a vote is refused whole, and its sender left out of the round's
tally, if it names a position twice, one outside the tensor, or more than k positions of one tile.
So f dishonest identities add at most f to any position's count: they can take a support slot only
where fewer than f honest senders voted past it, and what they win is a slot (each sender's own
values are sent there), never a value.

Invariants: `select_support` is a function of (counts, shape, chunk, keep, seed, first tile) alone,
ascending flat positions, exactly min(k′, real entries) per tile; the key is unique inside a tile,
so no sort order or kernel choice can change it. Pure torch/numpy: no networking.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.codec.format import PayloadError, tile_dims

__all__ = [
    "VoteError",
    "check_vote",
    "select_support",
    "tally",
    "tile_of",
    "tile_topk",
    "voted_keep",
    "voted_support",
]

COUNT_BITS = 20  # a key's count field: up to 2^20 − 1 votes on one position (senders of one round)


class VoteError(PayloadError):
    """A vote is malformed or stuffed (module docstring): refused whole, its sender left out."""


def voted_keep(shard_topk: int, topk: int) -> int:
    """k′, the agreed positions per tile: `swarm.shard_topk`, 0 meaning 2·k (the measured setting:
    docs/results.md, "Rounds for any number of holders", voted k′ = 64 at tiny's k = 32)."""
    return shard_topk or 2 * topk


def _layout(shape: Sequence[int], chunk: int) -> tuple[int, int, int, int, int]:
    """(rows, cols, tile height, tile width, tiles per tile row) of a tensor's tile grid."""
    rows, cols, th, tw = tile_dims(tuple(shape), chunk)
    return rows, cols, th, tw, -(-cols // tw)


def tile_of(pos: Tensor, shape: Sequence[int], chunk: int) -> Tensor:
    """The tile index (the codec's order: tile rows, then tiles along a row) of flat positions `pos`."""
    _, cols, th, tw, n_c = _layout(shape, chunk)
    return (pos // cols // th) * n_c + (pos % cols) // tw


def _tiled(x: Tensor, shape: Sequence[int], chunk: int, fill: int | float) -> Tensor:
    """x (flat or shaped) laid out one tile per row, padding = `fill`: (n_tiles, th·tw), a fresh tensor."""
    rows, cols, th, tw, n_c = _layout(shape, chunk)
    n_r = -(-rows // th)
    padded = torch.full((n_r * th, n_c * tw), fill, dtype=x.dtype)
    padded[:rows, :cols] = x.reshape(rows, cols)
    return padded.view(n_r, th, n_c, tw).permute(0, 2, 1, 3).reshape(n_r * n_c, th * tw)  # (n_tiles, th·tw)


def _positions(shape: Sequence[int], chunk: int) -> Tensor:
    """Flat positions in the tile layout, −1 = padding: (n_tiles, th·tw) int64."""
    numel = int(np.prod(tuple(shape))) if len(shape) else 1
    return _tiled(torch.arange(numel, dtype=torch.int64), shape, chunk, -1)


def tile_topk(e: Tensor, chunk: int, k: int) -> Tensor:
    """A sender's vote: ascending flat positions (int64) of the top-k |e| of every tile (all of a
    tile's real entries when it has fewer), the set SparseLoCo's top-k sends."""
    pos = _positions(tuple(e.shape), chunk)
    mag = _tiled(e.detach().to("cpu", torch.float32).abs(), tuple(e.shape), chunk, -1.0)  # padding below any |e|
    chosen = pos.gather(1, mag.topk(min(k, pos.shape[1]), dim=1).indices)  # (n_tiles, k)
    return torch.sort(chosen[chosen >= 0]).values


def check_vote(vote: Tensor, shape: Sequence[int], chunk: int, k: int) -> Tensor:
    """The vote as ascending int64 positions if it is well formed: integers inside the tensor, no
    position twice, at most k in any tile. Raises VoteError (module docstring) otherwise."""
    if not isinstance(vote, Tensor) or vote.dim() != 1 or vote.dtype not in (torch.int64, torch.int32):
        raise VoteError("a vote must be a 1-D integer tensor of flat positions")
    numel = int(np.prod(tuple(shape))) if len(shape) else 1
    v = torch.sort(vote.to(torch.int64)).values
    if len(v) and (int(v[0]) < 0 or int(v[-1]) >= numel):
        raise VoteError(f"a vote names a position outside the tensor's {numel} entries")
    if bool((v[1:] == v[:-1]).any()):
        raise VoteError("a vote names a position twice")
    per_tile = torch.bincount(tile_of(v, shape, chunk))
    if len(per_tile) and int(per_tile.max()) > k:
        raise VoteError(f"a vote names {int(per_tile.max())} positions of one tile, more than k = {k}")
    return v


def tally(votes: Sequence[Tensor | None], shape: Sequence[int], chunk: int, k: int) -> tuple[Tensor, list[int]]:
    """(c: votes per flat position, int64 (numel,); the indices of the votes refused) over `votes` in
    roster order (None: no vote arrived, neither counted nor refused)."""
    numel = int(np.prod(tuple(shape))) if len(shape) else 1
    count = torch.zeros(numel, dtype=torch.int64)
    refused = []
    for i, vote in enumerate(votes):
        if vote is None:
            continue
        try:
            count[check_vote(vote, shape, chunk, k)] += 1  # distinct positions: += counts each once
        except VoteError:
            refused.append(i)
    return count, refused


def _draw_bits(chunk: int) -> tuple[int, int]:
    """(bits of a tile-local position, bits of the draw) in a 63-bit key."""
    local_bits = max(1, (chunk * chunk - 1).bit_length())
    return local_bits, 63 - COUNT_BITS - local_bits


def _draws(seed: int, first_tile: int, n_tiles: int, cc: int, bits: int) -> Tensor:
    """The top `bits` of the PCG64 stream's elements first_tile·cc … (first_tile + n_tiles)·cc − 1."""
    gen = np.random.PCG64(seed)
    gen.advance(first_tile * cc)
    raw = gen.random_raw(n_tiles * cc) >> np.uint64(64 - bits)
    return torch.from_numpy(raw.astype(np.int64)).view(n_tiles, cc)


def select_support(
    counts: Tensor, shape: Sequence[int], chunk: int, keep: int, seed: int, first_tile: int = 0
) -> Tensor:
    """Ascending flat positions (int64) of the k′ = `keep` positions per tile with the largest
    (count, draw, −local position) (module docstring). `counts` covers a tensor, or a band of whole
    tile rows whose first tile is the tensor's tile `first_tile`, of shape `shape`."""
    pos = _positions(shape, chunk)
    n_tiles, cc = pos.shape
    local_bits, draw_bits = _draw_bits(chunk)
    c = counts.reshape(-1).to(torch.int64)
    if len(c) and int(c.max()) >= 1 << COUNT_BITS:
        raise ValueError(f"{int(c.max())} votes on one position exceed the key's {COUNT_BITS} bits")
    key = _tiled(c, shape, chunk, -1) << (draw_bits + local_bits)  # (n_tiles, cc): counts first, padding < 0
    key |= _draws(seed, first_tile, n_tiles, cc, draw_bits) << local_bits
    key |= (cc - 1) - torch.arange(cc, dtype=torch.int64)  # last: the lower local position first
    key[pos < 0] = -1
    chosen = pos.gather(1, key.topk(min(keep, cc), dim=1).indices)  # (n_tiles, k′): unique keys per tile
    return torch.sort(chosen[chosen >= 0]).values


def voted_support(
    votes: Sequence[Tensor | None], shape: Sequence[int], chunk: int, k: int, keep: int, seed: int
) -> tuple[Tensor, list[int]]:
    """(S of a whole tensor from its senders' votes, the votes refused): `tally` then `select_support`."""
    counts, refused = tally(votes, shape, chunk, k)
    return select_support(counts, shape, chunk, keep, seed), refused

"""A keyed pseudo-random permutation of [0, n), computed on the fly: the order a shard is read in.

`permute(r, n, keys)` is π(r) for a numpy array of positions r in [0, n): a balanced Feistel
network of `ROUNDS` rounds on the smallest domain of 2^(2h) ≥ n values (two halves of h bits),
with cycle walking (an output ≥ n is encrypted again until it lands in [0, n)). Each round is
(L, R) → (R, L ⊕ F(R ⊕ k_i)), F the splitmix64 finaliser truncated to h bits; `keys(...)` derives
the round keys from any tuple of integers (the loader uses seed, n_shards, shard, epoch) with
BLAKE2b, so different epochs give unrelated orders.

Invariants:
- For every n ≥ 1 and keys, r ↦ permute(r, n, keys) is a bijection of [0, n) (a Feistel network
  permutes its domain whatever F is; cycle walking restricts a permutation to a subset it maps
  back into itself by following each cycle) — tested for several n, powers of two or not.
- A pure function of (r, n, keys): no state, memory O(len(r)), the same bits on every machine
  (uint64 arithmetic, wrapping explicitly on multiplication, no floating point).
- The domain is < 4n, so a position walks fewer than 4 steps on average.
"""

from __future__ import annotations

import hashlib

import numpy as np

__all__ = ["ROUNDS", "keys", "permute"]

ROUNDS = 6
_U64 = np.uint64
_M1, _M2 = _U64(0xBF58476D1CE4E5B9), _U64(0x94D049BB133111EB)  # splitmix64's finaliser
_S30, _S27, _S31 = _U64(30), _U64(27), _U64(31)


def keys(*parts: int) -> np.ndarray:
    """`ROUNDS` round keys (uint64) named by a tuple of integers (any sign, any size)."""
    text = "permutation-v1|" + "|".join(str(int(p)) for p in parts)
    raw = hashlib.blake2b(text.encode(), digest_size=8 * ROUNDS).digest()
    return np.frombuffer(raw, dtype="<u8").astype(_U64)


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 (wraps modulo 2^64, as intended)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    out: np.ndarray = z ^ (z >> _S31)
    return out


def _feistel(x: np.ndarray, half: int, round_keys: np.ndarray) -> np.ndarray:
    shift, mask = _U64(half), _U64((1 << half) - 1)
    left, right = x >> shift, x & mask
    for k in round_keys:
        left, right = right, left ^ (_mix(right ^ k) & mask)
    out: np.ndarray = (left << shift) | right
    return out


def permute(r: np.ndarray, n: int, round_keys: np.ndarray) -> np.ndarray:
    """π(r) (int64, the shape of r) for positions r in [0, n); ValueError outside it."""
    pos = np.asarray(r, dtype=np.int64)
    if n < 1 or (pos.size and (int(pos.min()) < 0 or int(pos.max()) >= n)):
        raise ValueError(f"positions must lie in [0, {n})")
    if n == 1:
        return np.zeros_like(pos)
    half = ((n - 1).bit_length() + 1) // 2  # domain 2^(2·half) ≥ n, < 4n
    out = _feistel(pos.astype(_U64), half, round_keys)
    limit = _U64(n)
    walk = np.flatnonzero(out >= limit)
    while walk.size:  # cycle walking: re-encrypt until inside [0, n)
        again = _feistel(out[walk], half, round_keys)
        out[walk] = again
        walk = walk[again >= limit]
    return out.astype(np.int64)

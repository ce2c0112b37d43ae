"""Numba/numpy kernels of the SparseLoCo payload: binomial tables and enumerative index coding.

Index coding (the entropy limit of a k-subset): the k_c sorted positions q_0 < … < q_{k_c−1} a
chunk sends among its n_c real entries are one integer, their rank in the combinatorial number
system, rank = Σ_j C(q_{j−1}, j) for j = 1 … k_c, with 0 <= rank < C(n_c, k_c). It is written in
ceil(log2 C(n_c, k_c) / 8) bytes: 34 bytes for 32 of 4096 (266.2 bits), where 12-bit indices
take 48. Ranks are held as little-endian 32-bit limbs (in int64/uint32 arrays), so every step is
exact integer arithmetic: the same bytes and the same positions on every machine.

Each kernel has a numba version (compiled with cache=True and nogil into a writable directory,
used for large inputs) and a numpy one (small inputs, or when numba is missing or fails); both
give the same results bit for bit, which tests check. `compiled` also compiles the fused
whole-tensor kernels of `peer.core.sparseloco.codec.fused` (top-k, ranks, unrank-and-scatter) and the
quantizer (`_quantize_jit`, the twin of `peer.core.sparseloco.codec.encode.quantize`). This module imports
no other part of the codec but `fused`: the encoder and the index coding call it, never back.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import threading
import types
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from peer.core.sparseloco.codec import fused as pf

log = logging.getLogger(__name__)

ENUM_MAX_K = 64  # enumerative coding up to this topk; larger topk packs fixed-width indices
NUMBA_MIN_WORK = 1 << 12  # work below which the numpy versions run (tiny tests never JIT-compile)

_state: dict[str, Any] = {"enabled": True, "kernels": None}
_functions: dict[str, Any] = {}  # `compiled_function`'s: qualified name -> dispatcher, or False (unavailable)
_lock = threading.Lock()  # held while the kernels load


def _fresh_lock() -> None:  # a forked child has no thread that could release the parent's lock
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_fresh_lock)


def set_numba(enabled: bool) -> None:
    """Use (True, the default) or bypass the numba kernels; tests compare both paths."""
    _state["enabled"] = enabled


def numba_enabled() -> bool:
    """Whether numba kernels may be used (`set_numba`)."""
    return bool(_state["enabled"])


def cache_dir() -> str:
    """A writable directory for numba's on-disk cache: $NUMBA_CACHE_DIR, ~/.cache/peer/numba, or tmp."""
    for cand in (os.environ.get("NUMBA_CACHE_DIR"), Path.home() / ".cache" / "peer" / "numba"):
        if cand:
            try:
                Path(cand).mkdir(parents=True, exist_ok=True)
                if os.access(cand, os.W_OK):
                    return str(cand)
            except OSError:
                continue
    path = Path(tempfile.gettempdir()) / f"peer-numba-{os.getuid()}"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def compiled(work: int) -> Any:
    """The compiled kernels, or None: disabled, numba missing or broken, or small work before any
    large work has loaded them (so tiny unit tests never wait for a JIT compilation)."""
    if not _state["enabled"]:
        return None
    if _state["kernels"] is None and work >= NUMBA_MIN_WORK:
        with _lock:  # codec threads may ask at once: load the kernels once
            _load()
    return _state["kernels"] or None


def compiled_function(fn: Callable[..., Any], *helpers: Callable[..., Any]) -> Any:
    """One plain function `fn` compiled by numba on first use (cached on disk, nogil, no fastmath:
    LLVM never contracts a multiply and an add into an FMA), or None when numba is disabled
    (`set_numba`), missing or broken, for kernels that live outside the codec (the commit's:
    `peer.core.sparseloco.portable`, `.consensus`, `codec.exact`); the caller then runs its numpy twin.

    `helpers` are plain functions of fn's own module that fn calls: each is compiled too and fn sees
    the compiled one under its name. They must live in fn's module: numba's disk cache is keyed by the
    source file of the function it caches, so a helper elsewhere could change under a stale cache."""
    if not _state["enabled"]:
        return None
    key = f"{fn.__module__}.{fn.__qualname__}"
    with _lock:
        if _functions.get(key) is None:
            try:
                if any(h.__module__ != fn.__module__ for h in helpers):
                    raise ValueError(f"helpers of {key} must be defined in {fn.__module__}")
                os.environ.setdefault("NUMBA_CACHE_DIR", cache_dir())
                import numba

                njit = numba.njit(cache=True, nogil=True)
                target = fn
                if helpers:  # fn's code with the helpers' compiled twins in its globals
                    inline = numba.njit(cache=True, nogil=True, inline="always")
                    scope = {**fn.__globals__, **{h.__name__: inline(h) for h in helpers}}
                    target = types.FunctionType(fn.__code__, scope, fn.__name__, fn.__defaults__, fn.__closure__)
                    target.__qualname__, target.__module__ = fn.__qualname__, fn.__module__
                _functions[key] = njit(target)
            except Exception as exc:  # noqa: BLE001  # any import/compile failure means: use numpy
                log.warning("numba kernel %s unavailable (%s: %s); using numpy", key, type(exc).__name__, exc)
                _functions[key] = False
    return _functions[key] or None


def _load() -> None:
    if _state["kernels"] is None:
        try:
            os.environ.setdefault("NUMBA_CACHE_DIR", cache_dir())  # read when numba is imported
            import numba

            _state["kernels"] = _compile(numba.njit(cache=True, nogil=True))
        except Exception as exc:  # noqa: BLE001  # any import/compile failure means: use numpy
            log.warning("numba kernels unavailable (%s: %s); using numpy", type(exc).__name__, exc)
            _state["kernels"] = False


# ------------------------------------------------------------------------------------------
# Binomial table
# ------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def binomial_table(n_max: int, k_max: int) -> np.ndarray:
    """T[j, p] = C(p, j) for j in 0..k_max, p in 0..n_max as uint32 limbs, LSB first. (k_max+1, n_max+1, L)."""
    row = [1] + [0] * k_max  # C(0, j)
    rows = [row]
    for _ in range(n_max):
        row = [1] + [row[j - 1] + row[j] for j in range(1, k_max + 1)]
        rows.append(row)
    n_limbs = max(1, -(-max(v.bit_length() for v in rows[-1]) // 32))
    raw = b"".join(v.to_bytes(4 * n_limbs, "little") for r in rows for v in r)
    table = np.frombuffer(raw, dtype="<u4").reshape(n_max + 1, k_max + 1, n_limbs)
    out = np.ascontiguousarray(table.transpose(1, 0, 2))
    out.flags.writeable = False
    return out


def rank_nbytes(n: np.ndarray, k: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Bytes of the rank of a k-subset of n: ceil(bits(C(n, k) − 1) / 8), 0 when C(n, k) == 1."""
    top = table[k, n].astype(np.int64)  # (m, L) limbs of C(n, k)
    top[:, 0] -= 1  # C(n, k) − 1 >= 0; borrow needs care only when the low limb was 0
    for limb in range(top.shape[1] - 1):
        neg = top[:, limb] < 0
        top[neg, limb] += 1 << 32
        top[neg, limb + 1] -= 1
    nz = top != 0
    hi = np.where(nz.any(axis=1), top.shape[1] - 1 - np.argmax(nz[:, ::-1], axis=1), -1)
    hi_val = top[np.arange(len(top)), np.maximum(hi, 0)]
    bits = np.where(hi >= 0, 32 * hi + np.floor(np.log2(np.maximum(hi_val, 1))).astype(np.int64) + 1, 0)
    return ((bits + 7) // 8).astype(np.int64)


# ------------------------------------------------------------------------------------------
# numpy versions
# ------------------------------------------------------------------------------------------


def _carry(acc: np.ndarray) -> np.ndarray:
    """Normalize int64 limb sums (m, L) to 32-bit limbs, in place."""
    for limb in range(acc.shape[1] - 1):
        acc[:, limb + 1] += acc[:, limb] >> 32
        acc[:, limb] &= 0xFFFFFFFF
    return acc


def _rank_np(q: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Ranks of the subsets q (m, k) int64, ascending per row, unused slots 0 at the end. (m, L) int64."""
    j = np.arange(1, q.shape[1] + 1)
    return _carry(table[j[None, :], q].sum(axis=1, dtype=np.int64))


def less_equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise a <= b for limb arrays (m, L), most significant limb last."""
    out = np.ones(len(a), dtype=bool)
    decided = np.zeros(len(a), dtype=bool)
    for limb in range(a.shape[1] - 1, -1, -1):
        diff = a[:, limb] != b[:, limb]
        new = diff & ~decided
        out[new] = a[new, limb] < b[new, limb]
        decided |= diff
    return out


@functools.lru_cache(maxsize=4)
def float_table(n_max: int, k_max: int) -> np.ndarray:
    """binomial_table as float64 (relative error < 2^-50), to guess positions before exact checks."""
    table = binomial_table(n_max, k_max)
    weights = np.ldexp(1.0, 32 * np.arange(table.shape[2]))  # (L,)
    out = table.astype(np.float64) @ weights  # (k_max+1, n_max+1)
    out.flags.writeable = False
    return out


def _unrank_np(ranks: np.ndarray, kc: np.ndarray, nc: np.ndarray, table: np.ndarray, k: int) -> tuple[np.ndarray, int]:
    """Inverse of _rank_np: (q (m, k) int64 with unused slots 0, index of the first rank >= C(n, k) or −1).

    Per step j the largest p with C(p, j) <= r is guessed from float64 values (consecutive C(p, j)
    differ by a factor >= 1 + 1/n, far above the rounding error, so the guess is off by at most
    one) and then fixed with exact limb comparisons.
    """
    m = len(ranks)
    r = ranks.astype(np.int64)
    top = table[kc, nc].astype(np.int64)
    bad = less_equal(top, r)  # rank >= C(n, k)
    if bad.any():
        return np.zeros((m, k), np.int64), int(np.argmax(bad))
    ftab = float_table(table.shape[1] - 1, table.shape[0] - 1)
    weights = np.ldexp(1.0, 32 * np.arange(r.shape[1]))
    q = np.zeros((m, k), dtype=np.int64)
    hi = nc.astype(np.int64).copy()  # exclusive upper bound of the next position
    for j in range(k, 0, -1):
        act = kc >= j
        lo = np.full(m, j - 1, dtype=np.int64)
        up = np.maximum(hi - 1, lo)
        guess = np.searchsorted(ftab[j], r.astype(np.float64) @ weights, side="right") - 1
        p = np.clip(guess, lo, up)
        step_up = (p < up) & less_equal(table[j, np.minimum(p + 1, up)].astype(np.int64), r)
        p = np.where(step_up, p + 1, p)
        step_down = (p > lo) & ~less_equal(table[j, p].astype(np.int64), r)
        p = np.where(act, np.where(step_down, p - 1, p), 0)
        q[:, j - 1] = p
        r -= table[j, p].astype(np.int64)  # C(0, j) = 0 for the inactive rows
        for limb in range(r.shape[1] - 1):  # borrow
            neg = r[:, limb] < 0
            r[neg, limb] += 1 << 32
            r[neg, limb + 1] -= 1
        hi = np.where(act, p, hi)
    return q, -1


# ------------------------------------------------------------------------------------------
# Public entry points (numba when the work is large enough, else numpy)
# ------------------------------------------------------------------------------------------


def rank_subsets(q: np.ndarray, table: np.ndarray) -> np.ndarray:
    """Ranks (m, L) int64 of the ascending subsets q (m, k) int64 (unused slots 0, at the end)."""
    kern = compiled(q.size)
    if kern is None:
        return _rank_np(q, table)
    out = np.empty((len(q), table.shape[2]), dtype=np.int64)
    kern.rank(q, table, out)
    return out


def unrank_subsets(
    ranks: np.ndarray, kc: np.ndarray, nc: np.ndarray, table: np.ndarray, k: int
) -> tuple[np.ndarray, int]:
    """(q (m, k) int64, −1) from ranks (m, L); or (_, i) when rank i is not below C(nc[i], kc[i])."""
    kern = compiled(len(ranks) * k)
    if kern is None:
        return _unrank_np(ranks, kc, nc, table, k)
    q = np.zeros((len(ranks), k), dtype=np.int64)
    bad = kern.unrank(np.ascontiguousarray(ranks, dtype=np.int64), kc, nc, table, q)
    return q, int(bad)


def _compile(njit: Callable[[Any], Any]) -> Any:
    """The numba kernels: the plain functions below, compiled (their source is the one truth)."""
    return SimpleNamespace(
        quantize=njit(_quantize_jit),
        rank=njit(_rank_jit),
        unrank=njit(_unrank_jit),
        encode=njit(pf._encode_jit),
        subtract=njit(pf._subtract_jit),
        tiles=njit(pf._tiles_jit),
        walk=njit(pf._walk_jit),
    )


# ------------------------------------------------------------------------------------------
# numba kernels (plain Python here; compiled by _compile). Loops per chunk, limbs as int64.
# ------------------------------------------------------------------------------------------


def _rank_jit(q: np.ndarray, table: np.ndarray, out: np.ndarray) -> None:
    m, k = q.shape
    n_limbs = out.shape[1]
    for c in range(m):
        for limb in range(n_limbs):
            out[c, limb] = 0
        for i in range(k):
            p = q[c, i]
            for limb in range(n_limbs):
                out[c, limb] += np.int64(table[i + 1, p, limb])
        carry = np.int64(0)
        for limb in range(n_limbs):
            v = out[c, limb] + carry
            out[c, limb] = v & 0xFFFFFFFF
            carry = v >> 32


def _unrank_jit(ranks: np.ndarray, kc: np.ndarray, nc: np.ndarray, table: np.ndarray, q: np.ndarray) -> int:
    m, n_limbs = ranks.shape
    r = np.zeros(n_limbs, dtype=np.int64)
    for c in range(m):
        for limb in range(n_limbs):
            r[limb] = ranks[c, limb]
        k, n = kc[c], nc[c]
        below = False  # rank < C(n, k)?
        for limb in range(n_limbs - 1, -1, -1):
            t = np.int64(table[k, n, limb])
            if r[limb] != t:
                below = r[limb] < t
                break
        if not below:
            return c
        hi = n
        for j in range(k, 0, -1):
            lo, up = j - 1, hi - 1
            while lo < up:  # largest p in [lo, up] with C(p, j) <= r
                mid = (lo + up + 1) >> 1
                le = True
                for limb in range(n_limbs - 1, -1, -1):
                    t = np.int64(table[j, mid, limb])
                    if t != r[limb]:
                        le = t < r[limb]
                        break
                if le:
                    lo = mid
                else:
                    up = mid - 1
            q[c, j - 1] = lo
            borrow = np.int64(0)
            for limb in range(n_limbs):
                v = r[limb] - np.int64(table[j, lo, limb]) - borrow
                borrow = np.int64(1) if v < 0 else np.int64(0)
                r[limb] = v + (borrow << 32)
            hi = lo
    return -1


def _quantize_jit(
    v: np.ndarray, sorted_abs: np.ndarray, bits: int, rounds: int, codes: np.ndarray, codebook: np.ndarray
) -> None:
    # `peer.core.sparseloco.codec.encode.quantize` after its sort as one numba kernel (compiled by `_compile`),
    # the same float64 operations in the same order: cumsum is sequential, bins are counted with the
    # same searchsorted, an empty bin is merged away as `encode._merge_empty` does. Tests compare
    # the bits.
    n, n_bins = v.size, 1 << (bits - 1)
    a = np.abs(v)
    s = sorted_abs.astype(np.float64)
    csum = np.empty(n + 1)
    csum[0] = 0.0
    for i in range(n):
        csum[i + 1] = csum[i] + s[i]
    cur = np.empty(n_bins)  # edges to try: the equal-count start, then midpoints of the means
    n_c = 0
    for b in range(1, n_bins):  # ties merged (np.unique of the sorted picks)
        x = s[(b * n) // n_bins]
        if n_c == 0 or cur[n_c - 1] != x:
            cur[n_c] = x
            n_c += 1
    edges = np.empty(n_bins)  # the edges in use, edges[:n_e]
    means = np.empty(n_bins)
    n_e, r = -1, 0
    while True:
        while True:  # means of cur's bins; the first empty bin merged into a neighbour, again
            empty, lo = -1, 0
            for b in range(n_c + 1):
                hi = np.searchsorted(s, cur[b]) if b < n_c else n
                if hi == lo:
                    empty = b
                    break
                means[b] = (csum[hi] - csum[lo]) / np.float64(hi - lo)
                lo = hi
            if empty < 0:
                break
            for b in range(min(empty, n_c - 1), n_c - 1):
                cur[b] = cur[b + 1]
            n_c -= 1
        same = n_c == n_e
        for b in range(max(0, min(n_c, n_e))):
            same = same and cur[b] == edges[b]
        if same:  # a fixed point
            break
        edges[:n_c] = cur[:n_c]
        n_e = n_c
        if r == rounds:
            break
        r += 1
        for b in range(n_e):  # a Lloyd step: edges at the midpoints of neighbouring means
            cur[b] = (means[b] + means[b + 1]) / 2
    sign = np.uint8(1 << (bits - 1))
    for i in range(n):
        x, m = np.float64(a[i]), 0
        while m < n_e and edges[m] <= x:  # searchsorted(edges, x, side="right")
            m += 1
        codes[i] = np.uint8(m) | (sign if v[i] < 0 else np.uint8(0))
    for b in range(n_bins):
        codebook[b] = np.float32(means[min(b, n_e)])

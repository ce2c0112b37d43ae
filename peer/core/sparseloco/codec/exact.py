"""Exactly rounded sums of products of float32 values, in integer limbs: split any way, the same bits.

A product a·b of two float32 values is exact in float64 (at most 48 significant bits) and an
integer multiple of 2^−298 below 2^256 in magnitude (float32 values lie in [2^−149, 2^128)): the
kernels take it apart in integers (a float32 is ±m·2^e, m < 2^24), never in floats. An
accumulator of LIMBS signed 32-bit digits (int64 each, carries settled at the end) whose digit 0
weighs 2^−OFFSET therefore holds any sum of such products exactly, and `to_float` rounds it once to
float64, to nearest with ties to even: the value `math.fsum` returns for the same terms. Integer
addition is associative, so the terms may be cut into pieces over threads, slices and tiles and
the pieces' accumulators added in any order: the rounded sum never changes. This is what lets the
commit's exactly rounded sums (the clip's norms, `peer.core.sparseloco.codec.clip`; the screening's
scores, `peer.core.sparseloco.consensus`) run in compiled kernels on every core and keep their bits.

A term that is not finite is never added: the kernels count it and the caller takes the
`math.fsum` path, which gives inf or nan (or raises) as it always has. Every kernel has a numpy or
`math.fsum` twin that tests compare bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from peer.core.sparseloco.codec import kernels as pk
from peer.core.sparseloco.codec.fused import run_split

OFFSET = 352  # digit 0 weighs 2^−352: a multiple of 32 below the 2^−298 of the smallest product
LIMBS = 20  # 640 bits: every product (< 2^256) and sums of 2^60 of them, over their sign
BLOCK = 1 << 16  # values per piece of `square_sum`'s split
MIN_WORK = 1 << 14  # values below which `square_sum` leaves the sum to math.fsum (tiny tests never JIT)
SETTLE = 1 << 20  # terms between carry settlements in a kernel (a digit's int64 never overflows)
_WEIGHTS = np.array([1 << (32 * i) for i in range(LIMBS)], dtype=object)


def to_float(limbs: np.ndarray) -> np.ndarray:
    """The float64 values of accumulators (..., LIMBS), each rounded once to nearest (ties to even).

    Python's int → float conversion is correctly rounded, and the scaling by 2^−OFFSET is exact: a
    non-zero sum of products is at least 2^−298 in magnitude, far above float64's subnormals."""
    totals = (limbs.astype(object) * _WEIGHTS).sum(axis=-1)  # (...,) exact Python ints
    flat = [math.ldexp(float(t), -OFFSET) if t else 0.0 for t in np.ravel(totals)]
    return np.array(flat, dtype=np.float64).reshape(np.shape(totals))


def _squares_jit(bits: np.ndarray, block: int, b0: int, b1: int) -> np.ndarray:
    # Σ v² of the float32 values whose bits are bits[b0·block : b1·block] into a fresh accumulator,
    # carries settled (digits 0 … LIMBS−2 in [0, 2^32)); its last entry counts the non-finite values
    # (never added). A float32 is ±m·2^e (m < 2^24 an integer, e >= −149), so v² = m²·2^(2e) with
    # m² < 2^48 exact in int64: no float arithmetic at all.
    acc = np.zeros(LIMBS + 1, dtype=np.int64)
    hi = min(bits.size, b1 * block)
    for c0 in range(b0 * block, hi, SETTLE):
        for i in range(c0, min(hi, c0 + SETTLE)):
            w = np.int64(bits[i])
            ef = (w >> 23) & 0xFF  # biased exponent; 0: subnormal, m·2^−149
            if ef == 0xFF:
                acc[LIMBS] += 1
                continue
            m = (w & 0x7FFFFF) | (0x800000 if ef else 0)
            if m == 0:
                continue
            big = m * m  # < 2^48
            bit = 2 * (ef + (ef == 0) - 150) + OFFSET  # >= 54
            li, sh = bit >> 5, bit & 31
            lo = (big & 0xFFFFFFFF) << sh  # < 2^63
            up = (big >> 32) << sh  # < 2^47
            acc[li] += lo & 0xFFFFFFFF  # each digit takes < 2^33 per term
            acc[li + 1] += (lo >> 32) + (up & 0xFFFFFFFF)
            acc[li + 2] += up >> 32
        for d in range(LIMBS - 1):  # carry each digit's excess up: no digit ever overflows
            c = acc[d] >> 32
            acc[d] -= c << 32
            acc[d + 1] += c
    return acc


def square_sum(arrays: Sequence[np.ndarray]) -> float | None:
    """Σ v² over the float32 values of `arrays`, exactly rounded (math.fsum of the float64 squares),
    from the compiled kernel split over the cores; None when numba is not in use, the values are
    few (math.fsum is quicker than a JIT), or a square is not finite (the caller's fsum decides)."""
    n = sum(a.size for a in arrays)
    kern = pk.compiled_function(_squares_jit) if n >= MIN_WORK else None
    if kern is None:
        return None
    total = np.zeros(LIMBS + 1, dtype=np.int64)
    for a in arrays:
        v = np.ascontiguousarray(a, dtype=np.float32).view(np.int32)
        if v.size:
            for part in run_split(kern, -(-v.size // BLOCK), v.size, v, BLOCK):
                total += part
    if total[LIMBS]:
        return None
    return float(to_float(total[:LIMBS]))

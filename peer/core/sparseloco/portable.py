"""Portable arithmetic: the values every holder of a stage must agree on, the same bits on any machine.

A swarm is mixed hardware (x86 with or without FMA, ARM, CUDA, 1 or 64 threads), and the same
float32 program gives other bits on other kernels: BLAS blocks and vectorises its sums by the
machine, torch's vectorised `a + α·b` is one fused multiply-add with AVX2 and two roundings
without, `torch.randn` draws its normals through vectorised log/sin/cos. What every holder must
agree on — the initial state and each committed round (docs/protocol.md) — is therefore computed
here from IEEE-754 basic operations only (+, −, ×, ÷, √, each correctly rounded, so the same on
every conforming machine) in an order fixed by the code, or from integers:

- `canonical_normal`: initial weights from integers alone. Element i of a tensor is the sum of
  eight uniform 16-bit integers taken from two words of splitmix64 (a counter-based integer hash
  of the tensor's key), centred and scaled by one float64 multiply, then rounded to float32: an
  Irwin–Hall(8) variate, normal to within a kurtosis of −0.15 and truncated at ±4.9σ (torchtitan
  initialises with a normal truncated at ±2σ–3σ).
- `orthonormal_basis`: U (d, k) by modified Gram–Schmidt in float64, every dot product and norm an
  exactly rounded sum (`math.fsum`) of exactly rounded products; diag(R) > 0 by construction.
- `project64`: Π(X) = X·U·Uᵀ (V, d) in float64, each output a sum in ascending index order, a
  product rounded before it is added (`_project_jit` or its numpy twin, the same bits; the numba
  kernel is compiled without fastmath, so LLVM never contracts a multiply and an add into an FMA).
  `split64` is the commit's use of it, T_S + Π(u) and T⊥ + (u − Π(u)) rounded once, fused into the
  kernel row by row (rows are independent: split over the cores, the bits never depend on it).
- `portable_cos`: the cosine of the learning-rate schedule as a Taylor series in float64 basic
  operations (libm's cos differs between C libraries and between its FMA and non-FMA builds).
- `check_denormals`: a process whose floating-point unit flushes subnormals to zero (a library
  built with -ffast-math can switch that on) would round differently; it is refused loudly.

Zero terms are skipped in the projection's sums: a sum that starts at +0.0 is never −0.0 under
round-to-nearest (x + (−x) = +0.0), so adding ±0.0 never changes it and skipping is exact.
Pure numpy/numba/torch: no networking imports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import overload

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.codec import kernels as codec_kernels
from peer.core.sparseloco.codec.fused import run_split
from peer.core.sparseloco.codec.scratch import fresh

__all__ = [
    "arithmetic_fingerprint",
    "canonical_normal",
    "check_denormals",
    "orthonormal_basis",
    "portable_cos",
    "as_float64",
    "project64",
    "round_like",
    "split64",
]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # splitmix64's increment
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31, _S16 = np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(16)
_MASK16 = np.uint64(0xFFFF)
TERMS = 8  # 16-bit uniforms summed per normal variate (two 64-bit words)
_MEAN = TERMS * 0xFFFF // 2  # 262140: the centre of the integer sum, exactly
SIGMA = math.sqrt(TERMS * (65536**2 - 1) / 12)  # std of that sum (one correctly rounded sqrt)
_CHUNK = 1 << 22  # elements generated at a time (bounded temporaries)
NUMBA_MIN_ROWS = 256  # rows of a projection below which the numpy twin runs (tiny tests never JIT)
NUMBA_MIN_ELEMENTS = 1 << 20  # elements of an initial tensor below which the numpy twin runs
ROWS = 8  # rows `_project_jit` projects together (it fixes no bit: each row's sums are its own)


# ------------------------------------------------------------------------------------------
# Initial values from integers
# ------------------------------------------------------------------------------------------


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on uint64 words (multiplications wrap modulo 2^64: exact)."""
    z = (z ^ (z >> _S30)) * _M1
    z = (z ^ (z >> _S27)) * _M2
    out: np.ndarray = z ^ (z >> _S31)
    return out


def _integer_sums(key: int, start: int, stop: int) -> np.ndarray:
    """Σ of the eight 16-bit fields of words 2i+1 and 2i+2 of stream `key`, for i in [start, stop): int64."""
    base = np.uint64(key & 0xFFFFFFFFFFFFFFFF)
    i = np.arange(start, stop, dtype=np.uint64)
    total = np.zeros(stop - start, dtype=np.uint64)
    for word in (np.uint64(1), np.uint64(2)):
        z = _mix(base + (np.uint64(2) * i + word) * _GOLDEN)
        for _ in range(4):
            total += z & _MASK16
            z >>= _S16
    return total.astype(np.int64)


def canonical_gaussian64(key: int, n: int) -> np.ndarray:
    """n standard-normal-like float64 values of stream `key`: (Σ − mean) / σ, one division each."""
    out = np.empty(n, dtype=np.float64)
    for lo in range(0, n, _CHUNK):
        hi = min(n, lo + _CHUNK)
        out[lo:hi] = (_integer_sums(key, lo, hi) - _MEAN).astype(np.float64) / SIGMA
    return out


def _normal_jit(key: np.uint64, scale: float, out: np.ndarray, lo: int, hi: int) -> None:
    """out[i] = fl32((Σ_i − mean)·scale) for i in [lo, hi): `canonical_normal`'s kernel (integer
    hashing, one float64 multiply, one rounding to float32), the bits of the numpy path."""
    for i in range(lo, hi):
        total = np.int64(0)
        for word in range(1, 3):
            z = key + (np.uint64(2) * np.uint64(i) + np.uint64(word)) * _GOLDEN
            z = (z ^ (z >> _S30)) * _M1
            z = (z ^ (z >> _S27)) * _M2
            z = z ^ (z >> _S31)
            for _ in range(4):
                total += np.int64(z & _MASK16)
                z = z >> _S16
        out[i] = np.float32(np.float64(total - _MEAN) * scale)


def canonical_normal(key: int, shape: Sequence[int], std: float) -> Tensor:
    """A float32 tensor of `shape` whose values have standard deviation `std`, defined by integers:
    fl32((Σ − mean) · fl64(std / σ)) for the Irwin–Hall(8) sum Σ of each element (module docstring).
    The same bits on every machine; `key` is a 64-bit stream id (a parameter's `param_seed`)."""
    n = math.prod(shape)
    scale = float(std) / SIGMA  # one correctly rounded division
    out = np.empty(n, dtype=np.float32)
    kernel = codec_kernels.compiled_function(_normal_jit) if n >= NUMBA_MIN_ELEMENTS else None
    if kernel is not None:
        run_split(kernel, n, n, np.uint64(key & 0xFFFFFFFFFFFFFFFF), scale, out)  # elements are independent
    else:
        for lo in range(0, n, _CHUNK):
            hi = min(n, lo + _CHUNK)
            centred = (_integer_sums(key, lo, hi) - _MEAN).astype(np.float64)  # exact: |Σ − mean| < 2^20
            out[lo:hi] = (centred * scale).astype(np.float32)
    return torch.from_numpy(out).view(*shape) if len(shape) else torch.from_numpy(out).reshape(())


# ------------------------------------------------------------------------------------------
# The subspace basis
# ------------------------------------------------------------------------------------------


def _exact_dot(a: np.ndarray, b: np.ndarray) -> float:
    """Σ a·b: each product rounded once (float64), the sum exactly rounded (math.fsum)."""
    return math.fsum(np.multiply(a, b).tolist())


def orthonormal_basis(d: int, k: int, key: int) -> np.ndarray:
    """U (d, k) float64 with orthonormal columns: modified Gram–Schmidt of a canonical Gaussian
    matrix, in column order, every dot product and norm exactly rounded; diag(R) > 0 (each column
    is divided by its positive norm), which is the sign convention of a sign-fixed QR."""
    G = canonical_gaussian64(key, d * k).reshape(d, k)  # (d, k), row-major
    Q = np.empty((d, k), dtype=np.float64)
    for j in range(k):
        v = np.ascontiguousarray(G[:, j])
        for i in range(j):
            q = Q[:, i]
            r = _exact_dot(q, v)
            v = v - r * q  # r·q rounded, then the difference rounded: no fused multiply-add
        norm = math.sqrt(math.fsum(np.multiply(v, v).tolist()))
        if not norm > 0:
            raise ValueError(f"column {j} of the basis is linearly dependent (d={d}, k={k})")
        Q[:, j] = v / norm
    return Q


# ------------------------------------------------------------------------------------------
# Π(X) = X·U·Uᵀ in a fixed order
# ------------------------------------------------------------------------------------------


def _project_jit(
    X: np.ndarray,
    U: np.ndarray,
    Ut: np.ndarray,
    out: np.ndarray,
    W: np.ndarray,
    P: np.ndarray,
    w_out: np.ndarray,
    p_out: np.ndarray,
    r0: int,
    r1: int,
) -> None:
    """Rows [r0, r1) of p = (X·U)·Uᵀ; X (V, d) float32, U (d, k) and Ut (k, d) float64. Every sum in
    ascending index order from +0.0, zero terms skipped (exact, see above). What is made of p: out
    = p (float64, when `out` has rows), w_out = fl32(W + p) when W has rows, p_out = fl32(P + (X − p))
    when P has rows (float32 W, P: the commit's T_S/T⊥ split, `split64`), each element in float64
    and rounded once; a row of p never leaves the kernel then. Rows are taken ROWS at a time, each
    row of Uᵀ read once for all of them (Uᵀ is larger than a core's L2: read once per row, it made
    the kernel wait on the shared cache); every element still adds its terms alone, in order."""
    d, k = U.shape
    p = np.empty((ROWS, k), dtype=np.float64)
    rows = np.empty((ROWS, d), dtype=np.float64)
    keep, to_w, to_p = out.shape[0] > 0, W.shape[0] > 0, P.shape[0] > 0
    for i0 in range(r0, r1, ROWS):
        n = min(ROWS, r1 - i0)
        for r in range(n):
            for c in range(k):
                p[r, c] = 0.0
            for j in range(d):
                a = np.float64(X[i0 + r, j])
                if a != 0.0:
                    for c in range(k):
                        p[r, c] = p[r, c] + a * U[j, c]
            for j in range(d):
                rows[r, j] = 0.0
        for c in range(k):
            for r in range(n):
                b = p[r, c]
                if b != 0.0:
                    for j in range(d):
                        rows[r, j] = rows[r, j] + b * Ut[c, j]
        for r in range(n):
            i = i0 + r
            if keep:
                for j in range(d):
                    out[i, j] = rows[r, j]
            if to_w:
                for j in range(d):
                    w_out[i, j] = np.float32(np.float64(W[i, j]) + rows[r, j])
            if to_p:
                for j in range(d):
                    p_out[i, j] = np.float32(np.float64(P[i, j]) + (np.float64(X[i, j]) - rows[r, j]))


def _project_np(X: np.ndarray, U: np.ndarray, Ut: np.ndarray) -> np.ndarray:
    """`_project_jit`'s twin for small inputs: the same sums in the same order (a zero term adds
    ±0.0, which never changes a sum that starts at +0.0), the same bits."""
    P = np.zeros((X.shape[0], U.shape[1]), dtype=np.float64)  # (V, k)
    X64 = X.astype(np.float64)
    for j in range(U.shape[0]):
        P += X64[:, j : j + 1] * U[j]  # (V, 1)·(k,): products rounded, then added
    out = np.zeros((X.shape[0], U.shape[0]), dtype=np.float64)  # (V, d)
    for c in range(U.shape[1]):
        out += P[:, c : c + 1] * Ut[c]
    return out


def _stored(t: Tensor) -> np.ndarray:
    """t on the CPU as float32 (its dtype in a run), or float64 when it is float64."""
    t = t.detach().to("cpu")
    out: np.ndarray = (t if t.dtype == torch.float64 else t.to(torch.float32)).numpy()
    return out


def project64(X: Tensor, U: Tensor) -> np.ndarray:
    """Π(X) = X·U·Uᵀ of a (V, d) tensor as float64 (V, d), the same bits on every machine.

    X and U (d, k) are read as float32 (their stored dtype in a run; float64 stays float64): the
    products of two float32 values are exact in float64."""
    x, u, ut = _operands(X, U)
    kernel = codec_kernels.compiled_function(_project_jit) if x.shape[0] >= NUMBA_MIN_ROWS else None
    if kernel is None:
        return _project_np(x, u, ut)
    out = np.empty((x.shape[0], u.shape[0]), dtype=np.float64)
    none = np.empty((0, u.shape[0]), dtype=np.float32)
    run_split(kernel, x.shape[0], x.size * u.shape[1] // 8, x, u, ut, out, none, none, none, none)  # rows apart
    return out


@overload
def split64(X: Tensor, U: Tensor, W: Tensor, P: Tensor) -> tuple[Tensor, Tensor]: ...
@overload
def split64(X: Tensor, U: Tensor, W: None, P: Tensor) -> tuple[None, Tensor]: ...
def split64(X: Tensor, U: Tensor, W: Tensor | None, P: Tensor) -> tuple[Tensor | None, Tensor]:
    """(fl(W + Π(X)), fl(P + (X − Π(X)))) with Π(X) = `project64`(X, U): each element in float64,
    rounded once to W's and P's dtype (float32, or float64 kept); W None: only the second. The commit's
    T_S/T⊥ split of the embedding's change X. With float32 operands the compiled kernel forms Π a row
    at a time, on every core, and never stores it; otherwise numpy (the same bits)."""
    x, u, ut = _operands(X, U)
    operands = (X, P) if W is None else (X, P, W)
    fused = all(t.dtype == torch.float32 for t in operands) and x.shape[0] >= NUMBA_MIN_ROWS
    kernel = codec_kernels.compiled_function(_project_jit) if fused else None
    if kernel is None:
        p = project64(X, U)
        w = None if W is None else round_like(as_float64(W) + p, W)
        return w, round_like(as_float64(P) + (as_float64(X) - p), P)
    none = np.empty((0, x.shape[1]), dtype=np.float32)
    w_in = none if W is None else np.ascontiguousarray(_stored(W))
    p_in = np.ascontiguousarray(_stored(P))
    w_out = none if W is None else fresh(w_in.size, w_in.dtype).reshape(w_in.shape)  # recycled pages: the state's
    p_out = fresh(p_in.size, p_in.dtype).reshape(p_in.shape)
    no_out = np.empty((0, x.shape[1]), dtype=np.float64)
    run_split(kernel, x.shape[0], x.size * u.shape[1] // 8, x, u, ut, no_out, w_in, p_in, w_out, p_out)
    return (None if W is None else torch.from_numpy(w_out)), torch.from_numpy(p_out)


def _operands(X: Tensor, U: Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """X (V, d) as stored, U (d, k) and Uᵀ as float64 (exact), contiguous; checks the shapes."""
    if X.dim() != 2 or U.dim() != 2 or X.shape[1] != U.shape[0]:
        raise ValueError(f"cannot project {tuple(X.shape)} onto a basis of shape {tuple(U.shape)}")
    u = _stored(U).astype(np.float64)  # (d, k), exact
    return np.ascontiguousarray(_stored(X)), u, np.ascontiguousarray(u.T)


def as_float64(t: Tensor) -> np.ndarray:
    """t on the CPU as float64 (exact for float32 and float64 values)."""
    return _stored(t).astype(np.float64)


def round_like(values: np.ndarray, like: Tensor) -> Tensor:
    """float64 values rounded once to `like`'s dtype (float32, or float64 kept), on the CPU."""
    return torch.from_numpy(values).to(torch.float64 if like.dtype == torch.float64 else torch.float32)


# ------------------------------------------------------------------------------------------
# Scalars
# ------------------------------------------------------------------------------------------


def portable_cos(x: float) -> float:
    """cos(x) for 0 <= x <= π from float64 basic operations in a fixed order (a Taylor series of 20
    terms, summed from the smallest; |error| < 1e-15): the same float on every machine."""
    if not 0.0 <= x <= math.pi:
        raise ValueError(f"portable_cos is defined on [0, π], got {x}")
    sq = x * x
    terms = [1.0]
    for n in range(1, 20):
        terms.append(terms[-1] * -sq / ((2 * n - 1) * (2 * n)))
    total = 0.0
    for term in reversed(terms):
        total += term
    return total


def check_denormals() -> None:
    """RuntimeError if this thread's floating-point unit flushes subnormal numbers to zero: the
    portable arithmetic needs IEEE-754's gradual underflow (torch.set_flush_denormal(True), or a
    library built with -ffast-math, turns it off for the whole process)."""
    smallest = np.float32(1.4e-45)
    if not (smallest * np.float32(1.0) > 0 and np.float32(1e-38) * np.float32(1e-3) > 0):
        raise RuntimeError(
            "this process flushes subnormal floats to zero (torch.set_flush_denormal(True) or a library "
            "built with -ffast-math); committed states would differ from other peers'. Turn it off."
        )


def arithmetic_fingerprint() -> str:
    """sha256 (16 hex chars) of a few values of every portable function, computed here: equal on
    two peers whose builds compute the initial state and commits alike (the manifest carries the
    bootstrap's; a joiner whose build differs refuses to join rather than fork the model)."""
    import hashlib

    U = orthonormal_basis(17, 5, key=1)
    X = canonical_normal(2, (9, 17), 1.0)
    X[X.abs() < 0.5] = 0.0
    parts = [
        canonical_normal(3, (257,), 0.02).numpy().tobytes(),
        U.tobytes(),
        project64(X, torch.from_numpy(U).float()).tobytes(),
        np.array([portable_cos(i * math.pi / 7) for i in range(8)]).tobytes(),
    ]
    return hashlib.sha256(b"".join(parts)).hexdigest()[:16]

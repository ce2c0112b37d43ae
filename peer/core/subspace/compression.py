"""Subspace Networks boundary compression (arXiv 2601.02360, DESIGN.md §2).

A compressed pipeline sends only k of the d activation channels between stages. With an
orthonormal basis U (d, k) and the projector Π(T) = T·U·Uᵀ:

- Token embedding: TE = T_S + T⊥ with T_S = Π(TE) (trainable, stage 0) and T⊥ = TE − T_S (a
  buffer every stage of the pipeline holds).
- Forward across a boundary:  X̃ = (X − T⊥[x])·U  (b, L, k), sent with the token ids x;
  the receiver rebuilds  X̂ = X̃·Uᵀ + T⊥[x]  (b, L, d).
- Backward across a boundary: the gradient is sent as ∇X̂·U (b, L, k) and expanded with Uᵀ.
- Outer step: the committed embedding change `update` splits into its in-subspace part Π(update),
  added to T_S, and the residual r = update − Π(update), added to T⊥. TE moves by exactly
  `update`; T_S stays in Col(U).

Invariants:
- `make_basis` is a pure function of (d, k, seed), the same bits on every machine: a canonical
  Gaussian from integers, float64 Gram–Schmidt with exactly rounded sums (diag(R) > 0), then
  cast (`peer.core.sparseloco.portable`). `basis_hash` identifies it.
- The boundary is exact for activations of the form T⊥[x] + Z·Uᵀ and loses precisely the part of
  X − T⊥[x] outside Col(U) otherwise.
- The initial split and the outer-step split are portable (float64, fixed order:
  `peer.core.sparseloco.portable.project64`), so every peer that applies the same committed update holds a
  bit-identical T⊥ on any hardware. Boundary compression and the in-step projection of T_S are
  training, and stay device-native (`project`).
- Token ids cross the wire as int32 and are never mixed into a float channel.

Pure torch: no networking imports.
"""

from __future__ import annotations

import hashlib
import logging
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor

from peer.core.sparseloco.portable import as_float64, orthonormal_basis, project64, round_like, split64
from peer.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = [
    "basis_hash",
    "compress_activations",
    "compress_grad",
    "compressed_boundary",
    "distinct_ks",
    "embedding_outer_update",
    "expand_activations",
    "expand_grad",
    "k_from_ratio",
    "make_basis",
    "perp_outer_update",
    "project",
    "project_",
    "split_embedding",
]


# ---------------------------------------------------------------------------------------------
# The basis
# ---------------------------------------------------------------------------------------------


def make_basis(d: int, k: int, seed: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Orthonormal U (d, k) drawn from `seed`: the same bits on every machine.

    A canonical Gaussian (d, k) matrix (integer arithmetic), orthonormalised by modified
    Gram–Schmidt in float64 with exactly rounded sums (`peer.core.sparseloco.portable.orthonormal_basis`;
    diag(R) > 0), then cast to `dtype`.
    """
    if isinstance(d, bool) or isinstance(k, bool) or not isinstance(d, int) or not isinstance(k, int):
        raise ConfigError(f"subspace width k={k!r} and model width d={d!r} must be integers")
    if not 0 < k <= d:
        raise ConfigError(f"subspace width k={k} must satisfy 0 < k <= d_model={d}; pick a smaller ratio")
    u: Tensor = torch.from_numpy(orthonormal_basis(d, k, basis_key(d, k, seed))).to(dtype).contiguous()  # (d, k)
    log.debug("subspace basis d=%d k=%d seed=%d hash=%s", d, k, seed, basis_hash(u))
    return u


def basis_key(d: int, k: int, seed: int) -> int:
    """The integer stream `make_basis` draws its Gaussian matrix from."""
    return int.from_bytes(hashlib.sha256(f"{int(seed)}/subspace.U/{d}x{k}".encode()).digest()[:8], "little")


def basis_hash(U: Tensor) -> str:
    """First 16 hex chars of the sha256 of U's float32 bytes (row-major)."""
    data = U.detach().to(device="cpu", dtype=torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]


def k_from_ratio(d: int, ratio: float | str) -> int:
    """Subspace width for a compression ratio k/d, e.g. "1/8" or 0.125 -> round(d * ratio) >= 1."""
    if isinstance(d, bool) or not isinstance(d, int) or d <= 0:
        raise ConfigError(f"d_model={d!r} must be a positive integer")
    try:
        if isinstance(ratio, bool):
            raise TypeError
        if isinstance(ratio, str):
            frac = Fraction(ratio.strip())
        elif isinstance(ratio, (int, float)):
            if not math.isfinite(ratio):
                raise ValueError
            frac = Fraction(ratio)
        else:
            raise TypeError
    except (ValueError, TypeError, ZeroDivisionError):
        raise ConfigError(
            f'subspace ratio {ratio!r} is not a number; use a fraction like "1/8" or a float like 0.125'
        ) from None
    if not 0 < frac <= 1:
        raise ConfigError(f'subspace ratio {ratio!r} must be in (0, 1]; e.g. "1/8" keeps d/8 channels')
    k = math.floor(frac * d + Fraction(1, 2))  # round half up, exact
    if k < 1:
        raise ConfigError(
            f"subspace ratio {ratio} gives k = round({d} × {frac}) = 0 channels at d_model={d}; "
            f"the smallest valid ratio for this width is 1/{d}"
        )
    return min(d, k)


def distinct_ks(d: int, ratios: Sequence[str]) -> list[int]:
    """k for each ratio of a sweep; two ratios that round to the same k are a ConfigError.

    A sweep's rows must be different experiments: "1/96" and "1/128" at d = 64 would both run
    as k = 1 under different labels.
    """
    seen: dict[int, str] = {}
    out = []
    for ratio in ratios:
        k = k_from_ratio(d, ratio)
        if k in seen:
            raise ConfigError(
                f"subspace ratios {seen[k]} and {ratio} both give k = {k} at d_model={d}; drop one "
                f"(distinct ratios are multiples of 1/{d}; the smallest valid ratio is 1/{d})"
            )
        seen[k] = ratio
        out.append(k)
    return out


# ---------------------------------------------------------------------------------------------
# Projection and the embedding split
# ---------------------------------------------------------------------------------------------


def _as(U: Tensor, like: Tensor) -> Tensor:
    return U.to(device=like.device, dtype=like.dtype)


def project(T: Tensor, U: Tensor) -> Tensor:
    """Π(T) = T·U·Uᵀ on the last dimension of T (…, d)."""
    u = _as(U, T)
    return (T @ u) @ u.T  # (…, d)


@torch.no_grad()
def project_(param: Tensor, U: Tensor) -> Tensor:
    """In-place Π(param); run after each inner step to keep T_S in Col(U). Returns `param`."""
    param.copy_(project(param, U))
    return param


def split_embedding(TE: Tensor, U: Tensor) -> tuple[Tensor, Tensor]:
    """TE (V, d) -> (w, perp): w = Π(TE) in Col(U), perp = TE − w (on CPU, in TE's dtype).

    Portable (the initial state every holder computes alike): Π in float64 by `project64`,
    w = round(Π), perp = round(TE − Π)."""
    _check_basis(U, TE.shape[-1])
    p = project64(TE, U)  # (V, d) float64
    return round_like(p, TE), round_like(as_float64(TE) - p, TE)


# ---------------------------------------------------------------------------------------------
# Activations and gradients at a stage boundary
# ---------------------------------------------------------------------------------------------


def _check_basis(U: Tensor, d: int) -> None:
    if U.dim() != 2 or U.shape[0] != d:
        raise ValueError(f"basis of shape {tuple(U.shape)} does not match width d={d}")


def _lookup(perp: Tensor, tokens: Tensor, like: Tensor) -> Tensor:
    if tokens.is_floating_point() or tokens.is_complex() or tokens.dtype == torch.bool:
        raise TypeError(f"token ids must be an integer tensor (int32 on the wire), got {tokens.dtype}")
    return perp[tokens.to(torch.long)].to(dtype=like.dtype, device=like.device)  # (b, L, d)


def compress_activations(X: Tensor, tokens: Tensor, perp: Tensor, U: Tensor) -> Tensor:
    """X̃ = (X − T⊥[x])·U : X (b, L, d), tokens (b, L) -> (b, L, k)."""
    _check_basis(U, X.shape[-1])
    if tokens.shape != X.shape[:-1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match activations {tuple(X.shape)}")
    return (X - _lookup(perp, tokens, X)) @ _as(U, X)  # (b, L, k)


def expand_activations(Xt: Tensor, tokens: Tensor, perp: Tensor, U: Tensor) -> Tensor:
    """X̂ = X̃·Uᵀ + T⊥[x] : X̃ (b, L, k), tokens (b, L) -> (b, L, d)."""
    if U.dim() != 2 or Xt.shape[-1] != U.shape[1]:
        raise ValueError(f"compressed width {Xt.shape[-1]} does not match basis {tuple(U.shape)}")
    if tokens.shape != Xt.shape[:-1]:
        raise ValueError(f"tokens {tuple(tokens.shape)} do not match activations {tuple(Xt.shape)}")
    return Xt @ _as(U, Xt).T + _lookup(perp, tokens, Xt)  # (b, L, d)


def compress_grad(G: Tensor, U: Tensor) -> Tensor:
    """∇X̂ (…, d) -> ∇X̂·U (…, k), what the receiver of activations sends back."""
    _check_basis(U, G.shape[-1])
    return G @ _as(U, G)  # (…, k)


def expand_grad(Gt: Tensor, U: Tensor) -> Tensor:
    """(…, k) -> (…, d): the sender's gradient w.r.t. X, Gt·Uᵀ."""
    if U.dim() != 2 or Gt.shape[-1] != U.shape[1]:
        raise ValueError(f"compressed gradient width {Gt.shape[-1]} does not match basis {tuple(U.shape)}")
    return Gt @ _as(U, Gt).T  # (…, d)


def _on_wire(t: Tensor, wire: torch.dtype) -> Tensor:
    """What the wire does to a float32 boundary tensor: rounded to `wire`, read back as float32."""
    return t if wire == torch.float32 else t.to(wire).float()


class _CompressedBoundary(torch.autograd.Function):
    """expand(compress(X)) forward, expand_grad(compress_grad(∇)) backward, both rounded to the
    wire dtype in their compressed (b, L, k) form; no grad to T⊥ or ids."""

    @staticmethod
    def forward(ctx: Any, X: Tensor, tokens: Tensor, perp: Tensor, U: Tensor, wire: torch.dtype) -> Tensor:
        ctx.save_for_backward(U)
        ctx.wire = wire
        Xt = _on_wire(compress_activations(X, tokens, perp, U), wire)  # (b, L, k)
        return expand_activations(Xt, tokens, perp, U)  # (b, L, d)

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor, None, None, None, None]:
        # ctx is Any: torch's stubs give no public context type with `saved_tensors`.
        (U,) = ctx.saved_tensors
        grad_x = expand_grad(_on_wire(compress_grad(grad_out, U), ctx.wire), U)  # (b, L, d)
        return grad_x, None, None, None, None


def compressed_boundary(
    X: Tensor, tokens: Tensor, perp: Tensor, U: Tensor, wire: torch.dtype = torch.float32
) -> Tensor:
    """In-process stage boundary: exactly what crossing the wire (`subspace.wire_dtype`) does to X
    and to its gradient."""
    out: Tensor = _CompressedBoundary.apply(X, tokens, perp, U, wire)  # type: ignore[no-untyped-call]  # torch leaves apply unannotated
    return out


# ---------------------------------------------------------------------------------------------
# Outer step re-projection
# ---------------------------------------------------------------------------------------------


@torch.no_grad()
def perp_outer_update(perp: Tensor, update: Tensor, U: Tensor) -> Tensor:
    """T⊥_new = round(T⊥ + (update − Π(update))), float64 inside, on CPU; the single definition
    every peer applies (stage 0 through `embedding_outer_update`, the same bits)."""
    _check_basis(U, update.shape[-1])
    return split64(update, U, None, perp)[1]


@torch.no_grad()
def embedding_outer_update(w_start: Tensor, perp: Tensor, update: Tensor, U: Tensor) -> tuple[Tensor, Tensor]:
    """Apply the committed change `update` of embed.weight to (T_S, T⊥), portably (on CPU).

    With p = Π(update) in float64 (`project64`, fused: `split64`): T_S_new = round(T_S + p) and
    T⊥_new = round(T⊥ + (update − p)), rounded once to the stored dtype. TE = T_S + T⊥ moves by
    `update` (to that rounding) and T_S stays in Col(U) when it started there.
    """
    if not (w_start.shape == perp.shape == update.shape):
        raise ValueError(
            f"embedding shapes differ: weight {tuple(w_start.shape)}, perp {tuple(perp.shape)}, "
            f"update {tuple(update.shape)}"
        )
    _check_basis(U, update.shape[-1])
    return split64(update, U, w_start, perp)  # Π(update) in float64, never stored whole

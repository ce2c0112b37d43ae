"""Table 5c and 5d of arXiv 2601.02360: a trainable subspace basis U and AdamW in subspace coordinates.

The paper's text was not at hand; these are the interpretations implemented (docs/configuration.md
says the same):

- Grassmann updates (Table 5c). U gets a gradient only at the stage boundaries: the compressed
  boundary X̂ = ((X − T⊥[x])·U)·Uᵀ + T⊥[x] is differentiated with respect to U
  (`boundary_with_basis_grad`; T_S and T⊥ are held fixed). The coordinator averages the compressed
  replicas' dL/dU over an outer round and takes one Riemannian step on the Grassmann manifold
  (`grassmann_step`): G = g − U·(Uᵀ·g), U' = QR-retraction of U − η·G with diag(R) > 0, in float64.
  Every holder then re-splits its embedding on U' (`resplit`): TE = T_S + T⊥ is unchanged,
  T_S ← Π'(TE), T⊥ ← TE − T_S.
- Modified AdamW (Table 5d). T_S steps in subspace coordinates: Z = T_S·U (V, k) with
  ∇Z = ∇T_S·U, AdamW on Z, then T_S ← Z·Uᵀ (`to_coordinates` / `from_coordinates`), so the step
  stays in Col(U) by construction and Adam's per-coordinate scaling acts on the k coordinates.

Pure math: no networking, no research code. The swarm keeps a fixed U (its hash is in the manifest):
both are simulator-only.
"""

from __future__ import annotations

import torch
from torch import Tensor

from peer.core.subspace.compression import compressed_boundary, split_embedding

__all__ = [
    "boundary_with_basis_grad",
    "from_coordinates",
    "grassmann_step",
    "resplit",
    "to_coordinates",
]


def boundary_with_basis_grad(
    X: Tensor, tokens: Tensor, perp: Tensor, U: Tensor, wire: torch.dtype = torch.float32
) -> Tensor:
    """The compressed boundary's value and X-gradient exactly (`compressed_boundary`, wire rounding
    included), plus dL/dU into `U` (a leaf that requires grad) through ((X − T⊥[x])·U)·Uᵀ + T⊥[x]
    with X held fixed. The U-gradient sees no wire rounding."""
    exact = compressed_boundary(X, tokens, perp, U.detach(), wire)
    base = X.detach() - perp[tokens].to(device=X.device, dtype=X.dtype)  # (b, L, d)
    u = U.to(dtype=X.dtype)
    smooth = (base @ u) @ u.T  # (b, L, d): value equal to `exact` up to the wire; only its U-gradient is used
    return exact + (smooth - smooth.detach())


@torch.no_grad()
def grassmann_step(U: Tensor, grad: Tensor, lr: float) -> Tensor:
    """One Riemannian gradient step of U (d, k) on the Grassmann manifold, in float64.

    G = grad − U·(Uᵀ·grad) (the tangent part), then the QR retraction of U − lr·G with the column
    signs fixed so that diag(R) > 0 (as `make_basis`). Returns U' in U's dtype and device.
    """
    if grad.shape != U.shape:
        raise ValueError(f"gradient of shape {tuple(grad.shape)} does not match the basis {tuple(U.shape)}")
    u, g = U.double(), grad.double()
    tangent = g - u @ (u.T @ g)
    q, r = torch.linalg.qr(u - lr * tangent)
    signs = torch.sign(torch.diagonal(r))
    signs[signs == 0] = 1.0
    out: Tensor = (q * signs).to(dtype=U.dtype, device=U.device).contiguous()
    return out


@torch.no_grad()
def resplit(ts: Tensor, perp: Tensor, U_new: Tensor) -> tuple[Tensor, Tensor]:
    """(T_S, T⊥) on the new basis: TE = T_S + T⊥ kept, T_S ← Π'(TE), T⊥ ← TE − T_S (float64 Π).

    Returns tensors in the inputs' dtype and device."""
    te = (ts.double() + perp.to(device=ts.device).double()).to(ts.dtype).cpu()
    w, rest = split_embedding(te, U_new.cpu())
    return w.to(ts.device), rest.to(perp.device)


def to_coordinates(ts: Tensor, U: Tensor) -> Tensor:
    """Z = T_S·U (V, k): T_S's coordinates in the basis U."""
    return ts @ U.to(device=ts.device, dtype=ts.dtype)


def from_coordinates(z: Tensor, U: Tensor) -> Tensor:
    """T_S = Z·Uᵀ (V, d): in Col(U) by construction."""
    return z @ U.to(device=z.device, dtype=z.dtype).T

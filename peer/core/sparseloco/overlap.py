"""Overlapped outer steps: the rebase that applies a committed round to a replica that trained on.

With overlap, the round of outer step t runs while the inner steps of t + 1 do: the replica keeps
training on the parameters it had at the boundary of t (θ_b), and when the round commits
θ_c = θ_start(t + 1) it moves onto the committed state keeping the inner progress made meanwhile:

    θ ← θ_c + (θ_now − θ_b)                                        rebase

The next pseudo-gradient is still Δ = θ_start(t + 1) − θ at the end of t + 1's inner steps, so it
holds the progress made during the overlap once and nothing twice. The committed state stays a
function of the round's bytes (θ_c does not depend on when or how far a replica trained on). This is
the one-step-delay / eager family (Streaming DiLoCo arXiv 2501.18512's overlapping, DiLoCoX arXiv
2506.21263's one-step delay, eager updates arXiv 2502.12996), written as a delayed application of
the outer update to the local parameters.

Invariants: `rebase` of a tensor that did not move (θ_now = θ_b, e.g. T⊥, which only commits move)
gives θ_c to the bit; θ − θ_c = θ_now − θ_b up to one rounding of each subtraction and addition.
Pure torch: no networking imports.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor


@torch.no_grad()
def rebase(
    committed: Mapping[str, Tensor], now: Mapping[str, Tensor], boundary: Mapping[str, Tensor]
) -> dict[str, Tensor]:
    """θ_c + (θ_now − θ_b) for every tensor of `now` (new tensors; the three must name the same ones)."""
    if set(committed) != set(now) or set(boundary) != set(now):
        missing = sorted((set(committed) ^ set(now)) | (set(boundary) ^ set(now)))
        raise ValueError(f"rebase needs the same tensors in all three states, not {missing[:3]}")
    return {name: committed[name] + (value - boundary[name]) for name, value in now.items()}

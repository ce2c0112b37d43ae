"""The whole model as a chain of stage views: one forward, one loss and one gradient norm.

    logits = s_{S−1}(… b(s_1(b(s_0(x)))) …)   loss = CE(logits, y)   ‖g‖ = √(Σ_s Σ‖g_s‖²)

Every caller that runs stages in one process (a full replica, the simulator's replicas) chains
them with `chain_forward`; a pipeline runs the same stages apart and meets the same `token_loss`
on its last stage. A boundary `b` maps the activations leaving one stage to the next stage's
input (the simulator's compressed boundary); none passes them as they are.

The gradient norm of a model split over stages is `global_grad_norm` of each stage's Σ‖g‖²
(`peer.core.model.optim.grad_sq_norm`), wherever the stages are. Each share is a whole number of units
of one fixed grid (`SQ_NORM_GRID`), so the shares add up exactly (`math.fsum`): the norm depends
neither on the order the stages report in nor on where the model is split — it is the whole
model's float — and every stage clips by it (`peer.core.model.optim.clip_grads_to`). Without the grid a
stage's share is rounded to 53 bits before the shares are added, and a split model's norm could
miss the whole model's by an ulp (issue 34: seen on one host's kernels, not on another's).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from peer.core.model.decoder import Decoder

# (activations (b, L, d) leaving a stage, the next stage) -> that stage's input (b, L, d)
Boundary = Callable[[torch.Tensor, Decoder], torch.Tensor]


def chain_forward(stages: Sequence[Decoder], inputs: torch.Tensor, boundary: Boundary | None = None) -> torch.Tensor:
    """Logits (b, L, V) of token ids (b, L) through every stage in order, across `boundary`."""
    hidden: torch.Tensor = stages[0](inputs)  # (b, L, d)
    for stage in stages[1:]:
        if boundary is not None:
            hidden = boundary(hidden, stage)
        hidden = stage(hidden)
    return hidden


def token_loss(logits: torch.Tensor, targets: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of logits (b, L, V) against target ids (b, L), computed in float32
    (reduction "none": one loss per token, (b·L,))."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.long().flatten(), reduction=reduction)


def global_grad_norm(sq_norms: Iterable[float]) -> float:
    """‖g‖ of the whole model from each stage's Σ‖g‖² (`grad_sq_norm`: exact sums, so any order and
    any split into stages give the same float)."""
    return math.sqrt(math.fsum(sq_norms))

"""The inner step of paper Alg. 1 for one stage: accumulate micro-batch gradients, clip, AdamW.

`accumulate` + `adamw_step` are the one inner step (simulator replicas, full replicas, stage
peers): micro-batch gradients of loss / n_micro add up, the stage's gradient norm is clipped to
`train.grad_clip`, AdamW steps at the learning rate of the GLOBAL step t·H + h, and a compressed
pipeline's stage 0 projects T_S back onto Col(U) (arXiv 2601.02360 §3.2). Training is
device-native: what every holder must agree on — the initial state and each committed round — is
`peer.core.sparseloco.commit` (portable, on the CPU).

Invariants: the same batch, parameters and optimizer state give the same inner step on every
caller.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from peer.core.model.decoder import Decoder
from peer.core.model.optim import TrainConfig, clip_grads, clip_grads_to, lr_at, set_lr
from peer.core.subspace.compression import project_

# (inputs (b, L), targets (b, L)) of one micro-batch -> (its mean loss, values counted on the way)
MicroForward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]


def accumulate(
    forward: MicroForward, inputs: torch.Tensor, targets: torch.Tensor, n_micro: int, scale: float = 1.0
) -> tuple[float, int]:
    """Forward + backward of `n_micro` micro-batches; gradients add up as ∇(scale · loss / n_micro).

    Returns (the batch's mean loss, the sum of the counts `forward` reported).
    """
    total_loss, counted = 0.0, 0
    for mb_in, mb_tgt in zip(inputs.chunk(n_micro), targets.chunk(n_micro), strict=True):
        loss, n = forward(mb_in, mb_tgt)
        weighted = loss / n_micro
        torch.autograd.backward(weighted if scale == 1.0 else weighted * scale)
        total_loss += loss.item() / n_micro
        counted += n
    return total_loss, counted


def adamw_step(
    stage: Decoder,
    optimizer: torch.optim.Optimizer,
    global_step: int,
    train: TrainConfig,
    keep_in_subspace: torch.Tensor | None = None,
    total_norm: float | None = None,
) -> None:
    """Clip the gradients, step AdamW at lr(global_step); with a basis U, T_S ← Π(T_S).

    `total_norm` is the gradient norm over every stage of the model (`grad_sq_norm` of each stage,
    summed, square-rooted): the stage clips by it, as the whole model would. None clips by this
    stage's own norm.
    """
    if total_norm is None:
        clip_grads(stage.parameters(), train.grad_clip)
    else:
        clip_grads_to(stage.parameters(), train.grad_clip, total_norm)
    set_lr(optimizer, lr_at(global_step, train))
    optimizer.step()
    if keep_in_subspace is not None:
        if stage.embed is None:
            raise ValueError("only the stage that holds the embedding keeps T_S in Col(U)")
        with torch.no_grad():
            project_(stage.embed.weight, keep_in_subspace)

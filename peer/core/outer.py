"""The inner step of paper Alg. 1 for one stage, and the stage helpers around it (eqs. 3–4).

`accumulate` + `adamw_step` are the one inner step (simulator replicas, full replicas, stage
peers): micro-batch gradients of loss / n_micro add up, the stage's gradient norm is clipped to
`train.grad_clip`, AdamW steps at the learning rate of the GLOBAL step t·H + h, and a compressed
pipeline's stage 0 projects T_S back onto Col(U) (arXiv 2601.02360 §3.2). Training is
device-native: what every holder must agree on — the initial state and each committed round — is
`peer.core.commit` (portable, on the CPU).

Stage helpers: a stage's parameters by global name (`stage_state`), the initial T_S/T⊥ split of
the seed's embedding (`initial_split`, portable), T⊥ as a stage holds it (`perp_of`, `set_perp`)
and the checks a state to adopt must pass (`check_stage_state`).

Invariants: the same batch, parameters and optimizer state give the same inner step on every
caller; every holder of a compressed run keeps T⊥ as a buffer.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from peer.config import RunConfig, TrainConfig
from peer.core.model import Decoder
from peer.core.optim import clip_grads, clip_grads_to, lr_at, set_lr
from peer.core.subspace import project_, split_embedding

EMBED = "embed.weight"

# (inputs (b, L), targets (b, L)) of one micro-batch -> (its mean loss, values counted on the way)
MicroForward = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, int]]


def stage_state(stage: Decoder) -> dict[str, torch.Tensor]:
    """Trainable parameters of a stage by global name (detached clones)."""
    return {name: p.detach().clone() for name, p in stage.named_parameters()}


def initial_split(cfg: RunConfig, U: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T_S, T⊥) of the seed's initial embedding; every peer computes the same split alone."""
    embed_only = Decoder(cfg.model, layers=range(0), has_embed=True, has_head=False, seed=cfg.seed)
    assert embed_only.embed is not None  # built with has_embed=True
    with torch.no_grad():
        return split_embedding(embed_only.embed.weight, U)


def attach_subspace(stage: Decoder, w: torch.Tensor, perp: torch.Tensor) -> None:
    """Give a stage its T⊥ (stages > 0 need it to expand boundaries); stage 0 also gets T_S = w."""
    if stage.embed is not None:
        with torch.no_grad():
            stage.embed.weight.copy_(w)
        stage.embed.enable_subspace(perp.clone())
    else:
        stage.register_buffer("perp", perp.clone(), persistent=True)


def init_subspace(stages: list[Decoder], cfg: RunConfig, U: torch.Tensor) -> None:
    """Split the initial embedding TE into T_S = Π(TE) (trainable) and T⊥ (buffer) on every stage."""
    w, perp = initial_split(cfg, U)
    for stage in stages:
        attach_subspace(stage, w, perp)


def perp_of(stage: Decoder) -> torch.Tensor:
    """T⊥ as held by a stage (the embedding's buffer on stage 0, a plain buffer elsewhere)."""
    held = stage.embed.perp if stage.embed is not None else stage.get_buffer("perp")
    if held is None:
        raise ValueError("this stage holds no T⊥ (the run uses no subspace)")
    return held


def set_perp(stage: Decoder, perp: torch.Tensor) -> None:
    """Overwrite the stage's T⊥ in place (same shape, its own device)."""
    with torch.no_grad():
        perp_of(stage).copy_(perp)


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


def check_stage_state(
    module: Decoder,
    stage: int,
    start: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    perp: torch.Tensor,
) -> None:
    """ValueError unless `start` and `params` name exactly `module`'s parameters with their shapes
    and `perp` has T⊥'s shape (a state to adopt, checked before anything changes)."""
    own = dict(module.named_parameters())
    for what, tensors in (("state", start), ("parameters", params)):
        if set(tensors) != set(own):
            missing, extra = set(own) - set(tensors), set(tensors) - set(own)
            raise ValueError(
                f"{what} for stage {stage} does not match: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(extra)[:3]}"
            )
        for name, value in tensors.items():
            if own[name].shape != value.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(own[name].shape)}")
    if perp.shape != perp_of(module).shape:
        raise ValueError(f"T⊥: shape {tuple(perp.shape)} != {tuple(perp_of(module).shape)}")

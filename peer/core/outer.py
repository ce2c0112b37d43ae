"""The two steps of paper Alg. 1 for one stage — the inner step and committing an outer round —
and the stage helpers around them (eqs. 3–4).

`accumulate` + `adamw_step` are the one inner step (simulator replicas, full replicas, stage
peers): micro-batch gradients of loss / n_micro add up, the stage's gradient norm is clipped to
`train.grad_clip`, AdamW steps at the learning rate of the GLOBAL step t·H + h, and a compressed
pipeline's stage 0 projects T_S back onto Col(U) (arXiv 2601.02360 §3.2).

`commit_round` is the one place a committed round is applied — by the simulator (M replicas in one
process) and by every peer of the swarm (full replicas, heads, stage peers, spares):
decoded contributions Δ̂ → median norm clip → drop outliers (`peer.core.robust.screen`) →
Δ̄ = aggregate over the kept ones → θ ← θ_start − η·Δ̄ → the embedding's
change split into its Col(U) part (kept in T_S) and the rest (moved into T⊥), so TE = T_S + T⊥
moves by exactly −η·Δ̄. Every holder of a stage keeps T⊥ as a buffer when the run uses a subspace;
stages without the embedding move their T⊥ by stage 0's committed change (`embedding_update`).

Invariants: the same committed list in the same order gives the same bits on every holder
(clipping, screening, aggregation and the outer step are deterministic); a round that drops nothing
gives exactly the bits it gave before screening existed; an empty round leaves θ = θ_start;
the same batch, parameters and optimizer state give the same inner step on every caller.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from peer.config import RunConfig, TrainConfig
from peer.core.model import Decoder
from peer.core.optim import clip_grads, clip_grads_to, decoupled_decay, lr_at, set_lr
from peer.core.robust import DEFAULT as ROBUST
from peer.core.robust import RobustConfig, Screen, screen
from peer.core.sparseloco import ClipStats, SparseLoCoConfig, aggregate, clip_to_median, outer_step
from peer.core.subspace import (
    embedding_outer_update,
    perp_outer_update,
    project_,
    split_embedding,
)

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


def perp_decay(train: TrainConfig, outer_step: int) -> float:
    """The weight-decay factor of T⊥ for outer step t: Π_h (1 − lr(t·H + h)·wd), applied at commit.

    T⊥ is part of the embedding but no optimizer's parameter, so it decays here, once per round,
    by what AdamW's decoupled decay did to T_S (and to a full model's embedding) in that round.
    Every holder computes the same float from (train, t) alone.
    """
    H = train.inner_steps
    return decoupled_decay(range(outer_step * H, (outer_step + 1) * H), train)


def _decay_perp(stage: Decoder, factor: float) -> None:
    if factor != 1.0:
        with torch.no_grad():
            perp_of(stage).mul_(factor)


def apply_outer_update(
    stage: Decoder,
    start: Mapping[str, torch.Tensor],
    aggregate: Mapping[str, torch.Tensor],
    outer_lr: float,
    U: torch.Tensor | None,
    embed_update: torch.Tensor | None = None,
    perp_factor: float = 1.0,
) -> None:
    """Set the stage's parameters to θ_start − η·Δ̄ (in place).

    `embed_update` is the committed change of `embed.weight` (−η·Δ̄ of stage 0); stages that hold
    only T⊥ pass it so their T⊥ moves exactly as stage 0's does. `perp_factor` (`perp_decay`)
    scales T⊥ before the update, on every holder of T⊥ alike.
    """
    new = outer_step({k: v for k, v in start.items() if k != EMBED}, aggregate, outer_lr)
    if U is not None:
        _decay_perp(stage, perp_factor)
    with torch.no_grad():
        params = dict(stage.named_parameters())
        for name, value in new.items():
            params[name].copy_(value)
        if EMBED in start:
            update = -outer_lr * aggregate[EMBED]
            if U is None:
                params[EMBED].copy_(start[EMBED] + update)
            else:
                w, perp = embedding_outer_update(start[EMBED], perp_of(stage), update, U)
                params[EMBED].copy_(w)
                set_perp(stage, perp)
        elif U is not None and embed_update is not None:
            set_perp(stage, perp_outer_update(perp_of(stage), embed_update, U))


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


@dataclass(frozen=True)
class RoundCommit:
    """What committing one stage's round did: the clip stats, the outliers dropped (positions in
    the committed list, `screen.dropped`) and, when the stage holds the embedding, its committed
    change −η·Δ̄[embed.weight] (the T⊥ update of every other stage)."""

    clip: ClipStats
    embed_update: torch.Tensor | None = None
    screen: Screen = Screen()

    @property
    def dropped(self) -> tuple[int, ...]:
        return self.screen.dropped


def robust_aggregate(
    decoded: Sequence[Mapping[str, torch.Tensor]],
    cfg: SparseLoCoConfig,
    robust: RobustConfig = ROBUST,
    keys: Sequence[str] | None = None,
) -> tuple[dict[str, torch.Tensor], ClipStats, Screen]:
    """Δ̄ of a committed list: median clip → drop outliers → aggregate the kept ones (in order).

    With nothing dropped this is aggregate(clip_to_median(decoded), len(decoded)), bit for bit.
    """
    clipped, clip = clip_to_median(decoded, cfg.clip_median_factor)
    screened = screen(clipped, clip.norms, robust, keys)
    if screened.dropped:
        gone = set(screened.dropped)
        clipped = [d for i, d in enumerate(clipped) if i not in gone]
    return aggregate(clipped, len(clipped), cfg.aggregation), clip, screened


NO_CLIP = ClipStats(0, (), 0.0, 0.0)


def commit_round(
    views: Sequence[Decoder],
    start: Mapping[str, torch.Tensor],
    decoded: Sequence[Mapping[str, torch.Tensor]],
    cfg: SparseLoCoConfig,
    U: torch.Tensor | None,
    embed_update: torch.Tensor | None = None,
    perp_factor: float = 1.0,
    robust: RobustConfig = ROBUST,
    keys: Sequence[str] | None = None,
) -> RoundCommit:
    """Apply one committed round to every view of a stage: θ ← θ_start − η·mean(clip(Δ̂) kept).

    `decoded` are the committed contributions Δ̂ in commit order; `views` are this process's
    holders of the stage (one for a peer, M for the simulator); `embed_update` is stage 0's
    committed change, which moves T⊥ of a stage without the embedding; `perp_factor` is the
    round's T⊥ weight decay (`perp_decay`); `robust` the outlier rule and `keys` the
    contributions' replica ids (its tie-break). No contribution: θ = θ_start (T⊥ still decays).
    """
    if not decoded:
        for view in views:
            with torch.no_grad():
                for name, p in view.named_parameters():
                    p.copy_(start[name])
            if U is not None:
                _decay_perp(view, perp_factor)
        return RoundCommit(NO_CLIP)
    summed, clip, screened = robust_aggregate(decoded, cfg, robust, keys)
    device = next(iter(start.values())).device
    agg = {k: v.to(device) for k, v in summed.items()}
    if embed_update is not None:
        embed_update = embed_update.to(device)
    for view in views:
        apply_outer_update(view, start, agg, cfg.outer_lr, U, embed_update=embed_update, perp_factor=perp_factor)
    own_update = -cfg.outer_lr * agg[EMBED] if EMBED in start and EMBED in agg else None
    return RoundCommit(clip, own_update, screened)


def embedding_update(
    decoded: Sequence[Mapping[str, torch.Tensor]],
    cfg: SparseLoCoConfig,
    robust: RobustConfig = ROBUST,
    keys: Sequence[str] | None = None,
) -> torch.Tensor:
    """Stage 0's committed change of embed.weight (−η·Δ̄) for a holder that only observes stage 0.

    Clipped and screened exactly as `commit_round` treats stage 0 (norms and scores over the whole
    contribution), so T⊥ moves by the same bits on every stage.
    """
    clipped, clip = clip_to_median(decoded, cfg.clip_median_factor)
    dropped = set(screen(clipped, clip.norms, robust, keys).dropped)
    embed_only = [{EMBED: d[EMBED]} for i, d in enumerate(clipped) if i not in dropped]
    return -cfg.outer_lr * aggregate(embed_only, len(embed_only), cfg.aggregation)[EMBED]


def state_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: equal iff bit-identical."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


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

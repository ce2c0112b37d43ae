"""Inner optimizer of every replica: AdamW with warmup + cosine decay and gradient clipping.

The learning rate is a function of the GLOBAL step `t * H + inner_step` (DESIGN §3 "Clock"), never
of a local counter alone, so a late joiner or a resumed peer uses the same schedule as everyone.
AdamW settings follow the paper: β = (0.9, 0.95), weight decay 0.1, clip 1.0. Norm gains and
other 1-D parameters get no weight decay. A model split over stages clips by the norm over all
its stages (`grad_sq_norm` per stage, summed, then `clip_grads_to`), as a whole model would.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from peer.core.sparseloco.portable import portable_cos


@dataclass(frozen=True)
class TrainConfig:
    """Inner optimizer (AdamW, warmup + cosine) and the outer-step clock: the `[train]` section of a
    run, assembled and cross-checked by `peer.config`."""

    inner_steps: int = field(default=20, metadata={"help": "H: inner steps per outer step."})  # between two rounds
    # T: outer rounds in the run (sets the cosine horizon)
    outer_steps: int = field(default=10, metadata={"help": "T: outer steps (rounds) of the run."})
    batch_size: int = field(default=8, metadata={"help": "Sequences per inner step per replica."})
    microbatches: int = 2  # pipeline micro-batches per inner step (divides batch_size)
    in_flight: int = field(  # micro-batches in the pipeline at once (1F1B); a head's own choice, not fingerprinted
        default=0,
        metadata={"help": "Head: micro-batches in the pipeline at once (1 = sequential; 0 = auto from S and RTT)."},
    )
    seq_len: int = field(default=64, metadata={"help": "Tokens per sequence."})
    # rounds in flight while the next inner steps run (docs/protocol.md, "Overlapped outer steps")
    overlap: int = field(
        default=0,
        metadata={"help": "Rounds run in the background while the next outer step trains (0 = synchronous, 1)."},
    )
    lr: float = field(default=3e-3, metadata={"help": "Peak inner learning rate."})
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0


def lr_at(global_step: int, train: TrainConfig) -> float:
    """Linear warmup to `train.lr`, then cosine down to `min_lr_ratio * lr` at the run's end.

    The same float on every machine (`portable_cos`): the T⊥ decay of a commit depends on it."""
    total = max(1, train.inner_steps * train.outer_steps)
    if global_step < train.warmup_steps:
        return train.lr * (global_step + 1) / train.warmup_steps
    span = max(1, total - train.warmup_steps)
    progress = min(1.0, (global_step - train.warmup_steps) / span)
    floor = train.min_lr_ratio * train.lr
    return floor + (train.lr - floor) * 0.5 * (1.0 + portable_cos(math.pi * progress))


def build_adamw(named_params: Iterable[tuple[str, torch.nn.Parameter]], train: TrainConfig) -> torch.optim.AdamW:
    """AdamW over the given parameters; 1-D tensors (norm gains) are not decayed."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in named_params:
        if not p.requires_grad:
            continue
        (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": train.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        [g for g in groups if g["params"]], lr=train.lr, betas=(train.beta1, train.beta2), foreach=False
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_grads(params: Iterable[torch.nn.Parameter], max_norm: float) -> float:
    """Clip in place; returns the pre-clip global norm."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))


# A stage's Σ‖g‖² travels as one float64 and the global norm sums one per stage. Rounding each
# stage's sum to 53 bits and then adding them rounds twice, so the norm would depend on where the
# stages split the model (and on the kernels that make the last bits). Each tensor's Σg² is put on
# one fixed grid first: sums of grid values below 2⁵³ grid units are exact in float64, so any
# grouping into stages gives the same float as the whole model. The grid bounds the exact range:
# totals below SQ_NORM_EXACT_BELOW (a norm below ~1448; clipping is at 1.0) are split-free; a
# tensor's Σg² is kept to ±SQ_NORM_GRID / 2, far below what clipping at 1.0 can resolve.
SQ_NORM_GRID = 2.0**-32
SQ_NORM_EXACT_BELOW = SQ_NORM_GRID * 2.0**53  # 2²¹


def _on_grid(sq: float) -> float:
    """sq rounded to the nearest multiple of SQ_NORM_GRID (inf, NaN and sq from 2²¹ up, whose ulp
    is already a multiple of the grid, as they are)."""
    if not math.isfinite(sq) or sq >= SQ_NORM_EXACT_BELOW:
        return sq
    return round(sq / SQ_NORM_GRID) * SQ_NORM_GRID  # an int, times a power of two: exact below 2⁵³ units


def grad_sq_norm(params: Iterable[torch.nn.Parameter], unscale: float = 1.0) -> float:
    """Σ‖g‖² over the parameters that have a gradient: one stage's share of a global norm.

    Each tensor's Σg² (float64) is divided by `unscale` (a loss scale squared: a power of two) and
    put on the fixed grid SQ_NORM_GRID, then summed exactly: the shares of any split of a model into
    stages add up (`peer.core.model.chain.global_grad_norm`) to the whole model's float while the total
    is below SQ_NORM_EXACT_BELOW."""
    per_tensor = (float(p.grad.detach().double().square().sum()) for p in params if p.grad is not None)
    return sq_norm(per_tensor, unscale)


def sq_norm(per_tensor: Iterable[float], unscale: float = 1.0) -> float:
    """`grad_sq_norm` of each tensor's Σg² given (float64; a sharded tensor's: the sum of its shards')."""
    return math.fsum(_on_grid(sq / unscale) for sq in per_tensor)


def clip_grads_to(params: Iterable[torch.nn.Parameter], max_norm: float, total_norm: float) -> None:
    """Scale gradients by min(1, max_norm / (total_norm + 1e-6)), where total_norm is the norm over
    every stage of the model (gradient clipping by the global norm, split across stages)."""
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1.0:
        for p in params:
            if p.grad is not None:
                p.grad.mul_(coef)


def decoupled_decay(global_steps: Iterable[int], train: TrainConfig) -> float:
    """Π (1 − lr(s)·weight_decay) over the given global steps: what AdamW's decoupled weight decay
    does to a parameter in those steps, for a tensor that is not a parameter (T⊥)."""
    factor = 1.0
    for step in global_steps:
        factor *= 1.0 - lr_at(step, train) * train.weight_decay
    return factor

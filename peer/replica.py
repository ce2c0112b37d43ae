"""A replica's stages and their local training, plus the outer update of one stage.

Used by the simulator (M replicas in one process) and by the swarm's full replicas and stage peers.
A replica is S stage views of one decoder (`peer.model.build_stage`). A *compressed* replica passes
activations between its stages through the subspace boundary (X̃ = (X − T⊥[x])·U, expanded with
Uᵀ) and keeps T_S in Col(U) after every inner step; an *uncompressed* one (a full replica) passes
them as they are and trains its embedding freely. Both hold T⊥ as a buffer when the run uses a
subspace, so one outer rule updates every holder of the embedding identically
(`peer.subspace.embedding_outer_update`).

Outer step for stage s (paper Alg. 1, SparseLoCo):  θ ← θ_start − η·Δ̄, with the embedding's change
split into its Col(U) part (kept in T_S) and the rest (moved into T⊥), so TE = T_S + T⊥ moves by
exactly −η·Δ̄ and T⊥ stays bit-identical on every peer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.nn.functional as F

from peer.config import RunConfig
from peer.model import Decoder, build_stage
from peer.optim import build_adamw, clip_grads, lr_at, set_lr
from peer.sparseloco import outer_step
from peer.subspace import (
    compressed_boundary,
    embedding_outer_update,
    perp_outer_update,
    project_,
    split_embedding,
)

EMBED = "embed.weight"


def stage_state(stage: Decoder) -> dict[str, torch.Tensor]:
    """Trainable parameters of a stage by global name (detached clones)."""
    return {name: p.detach().clone() for name, p in stage.named_parameters()}


def initial_split(cfg: RunConfig, U: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(T_S, T⊥) of the seed's initial embedding; every peer computes the same split alone."""
    embed_only = Decoder(cfg.model, layers=range(0), has_embed=True, has_head=False, seed=cfg.seed)
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
    if stage.embed is not None:
        return stage.embed.perp
    return stage.perp


def set_perp(stage: Decoder, perp: torch.Tensor) -> None:
    if stage.embed is not None:
        stage.embed.perp.copy_(perp)
    else:
        stage.perp.copy_(perp)


def apply_outer_update(
    stage: Decoder,
    start: Mapping[str, torch.Tensor],
    aggregate: Mapping[str, torch.Tensor],
    outer_lr: float,
    U: torch.Tensor | None,
    embed_update: torch.Tensor | None = None,
) -> None:
    """Set the stage's parameters to θ_start − η·Δ̄ (in place).

    `embed_update` is the committed change of `embed.weight` (−η·Δ̄ of stage 0); stages that hold
    only T⊥ pass it so their T⊥ moves exactly as stage 0's does.
    """
    new = outer_step({k: v for k, v in start.items() if k != EMBED}, aggregate, outer_lr)
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


@dataclass
class StepStats:
    loss: float
    tokens: int
    boundary_values: int = 0  # activation + gradient values that crossed stage boundaries


@dataclass
class LocalReplica:
    """S stages of one replica, trained together in this process."""

    cfg: RunConfig
    compressed: bool
    U: torch.Tensor | None = None
    stages: list[Decoder] = field(default_factory=list)
    optimizers: list[torch.optim.Optimizer] = field(default_factory=list)

    @classmethod
    def build(cls, cfg: RunConfig, compressed: bool, U: torch.Tensor | None) -> "LocalReplica":
        if compressed and U is None:
            raise ValueError("a compressed replica needs the subspace basis U")
        stages = [build_stage(cfg.model, s, cfg.stages, cfg.seed) for s in range(cfg.stages)]
        if U is not None:
            init_subspace(stages, cfg, U)
        optimizers = [build_adamw(st.named_parameters(), cfg.train) for st in stages]
        return cls(cfg=cfg, compressed=compressed, U=U, stages=stages, optimizers=optimizers)

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Run the stages with boundary compression if compressed; returns (loss, boundary values)."""
        h = self.stages[0](inputs)
        crossed = 0
        for stage in self.stages[1:]:
            if self.compressed:
                h = compressed_boundary(h, inputs, perp_of(stage), self.U)
                crossed += 2 * h.shape[0] * h.shape[1] * self.U.shape[1]  # (b, L, k) forward + backward
            else:
                crossed += 2 * h.numel()
            h = stage(h)
        loss = F.cross_entropy(h.flatten(0, 1).float(), targets.flatten())
        return loss, crossed

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def accumulate(self, inputs: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> StepStats:
        """Forward + backward of `microbatches` micro-batches; gradients add up (times `scale`)."""
        n_micro = self.cfg.train.microbatches
        total_loss, crossed = 0.0, 0
        for mb_in, mb_tgt in zip(inputs.chunk(n_micro), targets.chunk(n_micro)):
            loss, c = self.forward_loss(mb_in, mb_tgt)
            (loss * (scale / n_micro)).backward()
            total_loss += loss.item() / n_micro
            crossed += c
        return StepStats(loss=total_loss, tokens=inputs.numel(), boundary_values=crossed)

    def apply_step(self, global_step: int) -> None:
        """Clip per stage (as a real pipeline does), AdamW step, keep T_S in Col(U)."""
        lr = lr_at(global_step, self.cfg.train)
        for stage, opt in zip(self.stages, self.optimizers):
            clip_grads(stage.parameters(), self.cfg.train.grad_clip)
            set_lr(opt, lr)
            opt.step()
        if self.compressed:
            with torch.no_grad():
                project_(self.stages[0].embed.weight, self.U)

    def inner_step(self, inputs: torch.Tensor, targets: torch.Tensor, global_step: int) -> StepStats:
        """One inner AdamW step on a (b, L) batch split into micro-batches."""
        self.zero_grad()
        stats = self.accumulate(inputs, targets)
        self.apply_step(global_step)
        return stats

    @torch.no_grad()
    def eval_loss(self, batches: list[tuple[torch.Tensor, torch.Tensor]], compressed: bool | None = None) -> float:
        """Mean loss over batches; compressed=None uses this replica's own boundary mode."""
        saved = self.compressed
        if compressed is not None:
            self.compressed = compressed and self.U is not None
        try:
            losses = [float(self.forward_loss(x, y)[0]) for x, y in batches]
        finally:
            self.compressed = saved
        return sum(losses) / max(1, len(losses))

    def full_state(self) -> dict[str, torch.Tensor]:
        """The whole model's weights by global name, with TE = T_S + T⊥ merged into embed.weight."""
        out: dict[str, torch.Tensor] = {}
        for stage in self.stages:
            for name, p in stage.named_parameters():
                out[name] = p.detach().clone()
        head = self.stages[0]
        if head.embed.perp is not None:
            out[EMBED] = out[EMBED] + head.embed.perp
        return out


def state_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: equal iff bit-identical."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]

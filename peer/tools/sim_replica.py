"""One replica of the simulator: S stages trained together in one process.

A *compressed* replica passes activations between its stages through the subspace boundary
(X̃ = (X − T⊥[x])·U, expanded with Uᵀ) and keeps T_S in Col(U) after every inner step; an
*uncompressed* one (a full replica) passes them as they are and trains its embedding freely.
The stages are chained as a full replica chains them (`peer.core.chain.chain_forward`, with the
compressed boundary between stages), and the inner step is the peers' own (`peer.core.inner`:
micro-batch accumulation, clipped AdamW); gradients are clipped by the norm over ALL stages
(`peer.core.chain.global_grad_norm`), so a pipeline clips as a whole model does.

Switches of the paper's ablations (Table 5): `weight_projection` keeps the outputs of every
W_o and W_2 in Col(U) (W ← U·Uᵀ·W after each step), so the residual stream stays in
T⊥[x] + Col(U) and boundaries lose nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from peer.config import WIRE_DTYPES, RunConfig
from peer.core.chain import Boundary, chain_forward, global_grad_norm, token_loss
from peer.core.inner import accumulate, adamw_step
from peer.core.model import Decoder, build_stage
from peer.core.optim import build_adamw, grad_sq_norm, lr_at
from peer.core.subspace import compressed_boundary
from peer.core.subspace_state import EMBED, init_subspace, perp_of


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
    weight_projection: bool = False

    @classmethod
    def build(
        cls, cfg: RunConfig, compressed: bool, U: torch.Tensor | None, weight_projection: bool = False
    ) -> LocalReplica:
        if compressed and U is None:
            raise ValueError("a compressed replica needs the subspace basis U")
        if weight_projection and U is None:
            raise ValueError("weight projection needs the subspace basis U")
        stages = [build_stage(cfg.model, s, cfg.stages, cfg.seed) for s in range(cfg.stages)]
        if U is not None:
            init_subspace(stages, cfg, U)
        rep = cls(cfg=cfg, compressed=compressed, U=U, stages=stages, weight_projection=weight_projection)
        rep.project_outputs()
        rep.optimizers = [build_adamw(st.named_parameters(), cfg.train) for st in stages]
        return rep

    @torch.no_grad()
    def project_outputs(self) -> None:
        """With `weight_projection`: W ← U·(Uᵀ·W) for every W_o and W_2, rows = output channels."""
        if not self.weight_projection or self.U is None:
            return
        for stage in self.stages:
            for name, p in stage.named_parameters():
                if name.endswith(("attn.wo.weight", "ffn.w2.weight")):
                    p.copy_(self.U @ (self.U.T @ p))

    def logits(self, inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Run the stages with boundary compression if compressed; returns (logits, boundary values)."""
        boundary: Boundary | None = None
        width = self.cfg.model.d_model  # values of one token crossing a boundary: (b, L, d) ...
        if self.compressed and self.U is not None:
            U, wire = self.U, WIRE_DTYPES[self.cfg.subspace.wire_dtype]
            width = U.shape[1]  # ... or (b, L, k) compressed

            def boundary(h: torch.Tensor, stage: Decoder) -> torch.Tensor:
                return compressed_boundary(h, inputs, perp_of(stage), U, wire)

        crossed = (len(self.stages) - 1) * 2 * inputs.shape[0] * inputs.shape[1] * width  # forward + backward
        return chain_forward(self.stages, inputs, boundary), crossed

    def forward_loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Mean cross-entropy of a (b, L) batch on this replica's path; (loss, boundary values)."""
        h, crossed = self.logits(inputs)
        return token_loss(h, targets), crossed

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def accumulate(self, inputs: torch.Tensor, targets: torch.Tensor, scale: float = 1.0) -> StepStats:
        """Forward + backward of `microbatches` micro-batches; gradients add up (times `scale`)."""
        loss, crossed = accumulate(self.forward_loss, inputs, targets, self.cfg.train.microbatches, scale)
        return StepStats(loss=loss, tokens=inputs.numel(), boundary_values=crossed)

    def apply_step(self, global_step: int, keep_in_subspace: bool | None = None, decay_perp: bool = False) -> None:
        """Clip by the norm over all stages, AdamW step, keep T_S in Col(U) (compressed replicas,
        or as `keep_in_subspace` says); `decay_perp` decays T⊥ as AdamW decays the embedding
        (for a model that steps without outer rounds; SparseLoCo decays T⊥ at each commit)."""
        total = global_grad_norm(grad_sq_norm(st.parameters()) for st in self.stages)
        keep = self.compressed if keep_in_subspace is None else keep_in_subspace
        for s, (stage, opt) in enumerate(zip(self.stages, self.optimizers, strict=True)):
            keep_in = self.U if keep and s == 0 else None
            adamw_step(stage, opt, global_step, self.cfg.train, keep_in, total_norm=total)
        if decay_perp and self.U is not None:
            factor = 1.0 - lr_at(global_step, self.cfg.train) * self.cfg.train.weight_decay
            with torch.no_grad():
                for stage in self.stages:
                    perp_of(stage).mul_(factor)
        self.project_outputs()

    def inner_step(self, inputs: torch.Tensor, targets: torch.Tensor, global_step: int) -> StepStats:
        """One inner AdamW step on a (b, L) batch split into micro-batches."""
        self.zero_grad()
        stats = self.accumulate(inputs, targets)
        self.apply_step(global_step)
        return stats

    @torch.no_grad()
    def sequence_losses(self, batches: list[tuple[torch.Tensor, torch.Tensor]], compressed: bool) -> torch.Tensor:
        """Mean loss of every held-out sequence on the given path, (n_seq,) float64."""
        saved = self.compressed
        self.compressed = compressed and self.U is not None
        try:
            out = []
            for x, y in batches:
                h, _ = self.logits(x)
                per_token = token_loss(h, y, reduction="none")
                out.append(per_token.view(y.shape).double().mean(dim=1))
        finally:
            self.compressed = saved
        return torch.cat(out)

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
        head = self.stages[0].embed
        if head is not None and head.perp is not None:
            out[EMBED] = out[EMBED] + head.perp
        return out

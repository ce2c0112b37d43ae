"""One replica of the simulator: S stages trained together in one process.

A *compressed* replica passes activations between its stages through the subspace boundary
(X̃ = (X − T⊥[x])·U, expanded with Uᵀ) and keeps T_S in Col(U) after every inner step; an
*uncompressed* one (a full replica) passes them as they are and trains its embedding freely.
The stages are chained as a full replica chains them (`peer.core.model.chain.chain_forward`, with the
compressed boundary between stages), and the inner step is the peers' own (`peer.core.model.inner`:
micro-batch accumulation, clipped AdamW); gradients are clipped by the norm over ALL stages
(`peer.core.model.chain.global_grad_norm`), so a pipeline clips as a whole model does.

Switches of the paper's ablations (Table 5): `weight_projection` keeps the outputs of every
W_o and W_2 in Col(U) (W ← U·Uᵀ·W after each step), so the residual stream stays in
T⊥[x] + Col(U) and boundaries lose nothing. `enable_ablations` turns on Table 5c (`grassmann`:
dL/dU accumulates in `u_leaf` through the boundaries; `rebase` moves the replica onto a new U),
Table 5d (`modified_adamw`: T_S steps in subspace coordinates through the proxy `z`) and the eq. 5
bias record (`delta_star`: the round's embedding change before any projection, `delta_sent`: after);
`peer.core.subspace.grassmann` holds their math, `peer.research.simulate.ablations` the coordinator's side.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from peer.config import WIRE_DTYPES, RunConfig
from peer.core.model.chain import Boundary, chain_forward, global_grad_norm, token_loss
from peer.core.model.decoder import Decoder, build_stage
from peer.core.model.inner import accumulate, adamw_step
from peer.core.model.optim import build_adamw, grad_sq_norm, lr_at, set_lr
from peer.core.subspace import grassmann as gm
from peer.core.subspace.compression import compressed_boundary, project, project_
from peer.core.subspace.state import EMBED, init_subspace, perp_of, set_perp


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
    grassmann: bool = False  # Table 5c: U trainable at the boundaries (`enable_ablations`)
    u_leaf: torch.Tensor | None = None  # Table 5c: U as a leaf; its .grad sums dL/dU over the round
    z: torch.nn.Parameter | None = None  # Table 5d: T_S's coordinates Z = T_S·U, stepped by `z_opt`
    z_opt: torch.optim.Optimizer | None = None
    delta_star: torch.Tensor | None = None  # eq. 5: this round's unprojected embedding steps, summed
    delta_sent: torch.Tensor | None = None  # eq. 5: this round's embedding change as kept (projected)

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

    def enable_ablations(self, grassmann: bool = False, modified_adamw: bool = False, track_bias: bool = False) -> None:
        """Table 5c / 5d / the eq. 5 record on a freshly built replica (before its first step).

        `grassmann` and `modified_adamw` act on compressed replicas only (an uncompressed one trains
        TE freely and sends no U-gradient); `track_bias` records on every replica with a subspace."""
        if self.U is None:
            return
        if grassmann and self.compressed:
            self.grassmann = True
            self.u_leaf = self.U.detach().clone().requires_grad_(True)
        if modified_adamw and self.compressed:
            head = self.embed_weight()
            self.z = torch.nn.Parameter(gm.to_coordinates(head.detach(), self.U))
            self.z_opt = build_adamw([("z", self.z)], self.cfg.train)
            named = [(n, p) for n, p in self.stages[0].named_parameters() if n != EMBED]
            self.optimizers[0] = build_adamw(named, self.cfg.train)  # T_S steps through z instead
        if track_bias:
            self.delta_star = torch.zeros_like(self.embed_weight().detach())
            self.delta_sent = torch.zeros_like(self.delta_star)

    def embed_weight(self) -> torch.nn.Parameter:
        """T_S (or TE without a subspace): stage 0's embedding weight."""
        head = self.stages[0].embed
        if head is None:
            raise ValueError("stage 0 holds no embedding")
        return head.weight

    @torch.no_grad()
    def rebase(self, U_new: torch.Tensor) -> None:
        """Table 5c: move onto the basis U' keeping TE: T_S ← Π'(TE), T⊥ ← TE − T_S on every stage,
        W_o / W_2 re-projected (with weight projection); the U-gradient starts again from zero."""
        ts = self.embed_weight()
        w, perp = gm.resplit(ts, perp_of(self.stages[0]), U_new)
        ts.copy_(w)
        for stage in self.stages:
            set_perp(stage, perp)
        self.U = U_new
        if self.grassmann:
            self.u_leaf = U_new.detach().clone().requires_grad_(True)
        self.project_outputs()

    def logits(self, inputs: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Run the stages with boundary compression if compressed; returns (logits, boundary values)."""
        boundary: Boundary | None = None
        width = self.cfg.model.d_model  # values of one token crossing a boundary: (b, L, d) ...
        if self.compressed and self.U is not None:
            U, wire = self.U, WIRE_DTYPES[self.cfg.subspace.wire_dtype]
            width = U.shape[1]  # ... or (b, L, k) compressed

            def boundary(h: torch.Tensor, stage: Decoder) -> torch.Tensor:
                if self.u_leaf is not None and torch.is_grad_enabled():  # Table 5c: dL/dU into u_leaf
                    return gm.boundary_with_basis_grad(h, inputs, perp_of(stage), self.u_leaf, wire)
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

    def apply_step(
        self,
        global_step: int,
        keep_in_subspace: bool | None = None,
        decay_perp: bool = False,
        residual_to_perp: bool = False,
    ) -> None:
        """Clip by the norm over all stages, AdamW step, keep T_S in Col(U) (compressed replicas,
        or as `keep_in_subspace` says); `decay_perp` decays T⊥ as AdamW decays the embedding
        (for a model that steps without outer rounds; SparseLoCo decays T⊥ at each commit).

        `residual_to_perp` (heterogeneous AdamW, §2.4): instead of discarding the step's residual
        outside Col(U), move it into T⊥ (T⊥ += T_S − Π(T_S); T_S ← Π(T_S)), so TE = T_S + T⊥
        changes by the full step while the compressed forward stays exact. With `z` (Table 5d) T_S
        steps in subspace coordinates and needs no projection."""
        total = global_grad_norm(grad_sq_norm(st.parameters()) for st in self.stages)
        keep = self.compressed if keep_in_subspace is None else keep_in_subspace
        ts = self.embed_weight() if self.U is not None else None
        before = ts.detach().clone() if ts is not None and self.delta_star is not None else None
        for stage, opt in zip(self.stages, self.optimizers, strict=True):
            adamw_step(stage, opt, global_step, self.cfg.train, None, total_norm=total)
        if self.z is not None:
            self._step_coordinates(global_step)
        with torch.no_grad():
            if ts is not None and before is not None and self.delta_star is not None:
                self.delta_star += ts - before
            if decay_perp and self.U is not None:
                factor = 1.0 - lr_at(global_step, self.cfg.train) * self.cfg.train.weight_decay
                for stage in self.stages:
                    perp_of(stage).mul_(factor)
            if ts is not None and self.U is not None and keep and self.z is None:
                if residual_to_perp:
                    self._residual_to_perp(ts)
                else:
                    project_(ts, self.U)
            if ts is not None and before is not None and self.delta_sent is not None:
                self.delta_sent += ts - before
        self.project_outputs()

    @torch.no_grad()
    def _residual_to_perp(self, ts: torch.Tensor) -> None:
        assert self.U is not None
        kept = project(ts, self.U)
        residual = ts - kept
        ts.copy_(kept)
        for stage in self.stages:
            perp_of(stage).add_(residual.to(perp_of(stage).device))

    def _step_coordinates(self, global_step: int) -> None:
        """Table 5d: Z ← T_S·U, ∇Z = ∇T_S·U (clipped as T_S's was), AdamW on Z, T_S ← Z·Uᵀ."""
        assert self.z is not None and self.z_opt is not None and self.U is not None
        ts = self.embed_weight()
        with torch.no_grad():
            self.z.copy_(gm.to_coordinates(ts, self.U))  # T_S may have moved (commit, rebase)
            self.z.grad = None if ts.grad is None else gm.to_coordinates(ts.grad, self.U)
        set_lr(self.z_opt, lr_at(global_step, self.cfg.train))
        self.z_opt.step()
        with torch.no_grad():
            ts.copy_(gm.from_coordinates(self.z, self.U))

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

"""The compute side of one pipeline stage held by a peer (no networking here).

A stage peer receives compressed activations X̃ (b, L, k) and token ids, expands them
(X̂ = X̃·Uᵀ + T⊥[x]), runs its layers and sends on X̃' = (X' − T⊥[x])·U; on the way back it expands
∇X̃' with Uᵀ, backpropagates, and returns ∇X̂·U. The last stage computes the loss and its backward
in the same call. Gradients accumulate over micro-batches until the head says `step`.

Each call says its mode (`compressed`, the head's choice for the outer step; None: the worker's
`boundary_compressed`): an uncompressed call takes and returns the full (b, L, d) boundary and its
gradient, no projection, as a full replica chains its stages. Stage 0 keeps T_S in Col(U) through
its inner steps only while its outer step is compressed (`boundary_compressed`, read by `step`).

The committed state and the outer rounds are `peer.node.stage.state.StageState`, which this class
extends; the inner step is its `StageOptimizer` (`peer.core.model.inner.adamw_step`). Every method is
synchronous and thread-safe (one lock), so the gRPC handler can call it from any worker thread.

Micro-batches in flight (`epoch` given): several forwards and backwards of one inner step may be
in progress at once; `peer.node.stage.epoch_gate.EpochGate` admits each in the order that keeps the
gradient sum the sequential schedule's, bit for bit (1F1B window, replays, the step of the last
inner step), waiting at most `swarm.rpc_timeout_s`. Without an epoch nothing waits.

Precision (`peer.core.model.precision`): the stage's forward runs under autocast in its own precision,
whatever the other stages of the pipeline use; parameters and `.grad` stay float32 and the
boundary tensors it sends are float32 (the wire's dtype is chosen by the transport). With fp16 the
stage multiplies the gradient it backpropagates (the loss on the last stage, the root gradient
elsewhere) by its loss scale S, so `.grad` is S times the gradient for the whole inner step; the
input gradient it sends is divided by S first and `grad_sq_norm` reports the unscaled Σ‖g‖², so
no other stage sees S. A non-finite Σ‖g‖² (an overflow) makes the global norm non-finite, and
every stage given that norm skips the step (`step`): the whole inner step is skipped on every
stage together, and each fp16 stage halves its S. An input gradient that overflowed goes out as
zeros (the wire carries finite values only) and this stage reports Σ‖g‖² = inf.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from peer.config import RunConfig
from peer.core.model.chain import token_loss
from peer.core.model.optim import grad_sq_norm
from peer.core.model.precision import CastWeights, LossScaler, autocast, resolve_precision
from peer.core.model.split_backward import input_grad_first
from peer.core.subspace.compression import (
    compress_activations,
    compress_grad,
    expand_activations,
    expand_grad,
)
from peer.core.subspace.state import perp_of
from peer.node.stage.epoch_gate import EpochGate
from peer.node.stage.state import StageState

log = logging.getLogger(__name__)


@dataclass
class ForwardOut:
    hidden: torch.Tensor | None = None  # (b, L, k) compressed output ((b, L, d) not), for stages before the last
    loss: float | None = None  # last stage only
    grad: torch.Tensor | None = None  # last stage only: (b, L, k or d) gradient wrt its input


class StageWorker(StageState):
    """One stage's pipeline compute (forward, backward, step) on top of its committed state."""

    def __init__(
        self,
        cfg: RunConfig,
        stage: int,
        compressed: bool = True,
        device: str = "cpu",
        precision: str = "fp32",
        activation_checkpointing: bool = False,
    ) -> None:
        """compressed=False: a full replica's stage (T_S trained freely, no boundary compression).
        precision: bf16, fp16, fp32 or auto (`resolve_precision` on `device`); activation_checkpointing:
        `Decoder.activation_checkpointing` of the stage's module."""
        super().__init__(cfg, stage, compressed, device)
        self.precision = resolve_precision(precision, self.device)
        self.module.activation_checkpointing = activation_checkpointing
        self.scaler = LossScaler.for_precision(self.precision)
        self.casts = CastWeights(self.module, self.precision)  # the weights in the compute dtype, once per step
        self._overflow = False  # an input gradient of this inner step was not finite (sent as zeros)
        # micro-batch -> (input X̂ or None on stage 0, output, compressed): awaiting its backward
        self.pending: dict[tuple[str, int], tuple[torch.Tensor | None, torch.Tensor, bool]] = {}
        self.microbatches_seen = 0
        self.seen: set[tuple[str, int]] = set()  # micro-batches of the current inner step
        swarm = cfg.swarm
        self.gate = EpochGate(self.lock, stage, cfg.train.microbatches, swarm.rpc_timeout_s, self._reset_step)
        self.busy_s = 0.0  # seconds spent computing forward/backward (benchmarks: busy fraction)
        self._weights_due: Callable[[], None] | None = None  # deferred weight gradients (`defer`)
        self.skipped_steps = 0  # optimizer steps skipped for a non-finite gradient norm (`step`)
        # this outer step's boundary mode: a head sets it per outer step (`peer.node.pipeline.mode`);
        # `compressed` stays the role (a pipeline's stage or a full replica's: checkpoints record it)
        self.boundary_compressed = compressed

    # ---------------------------------------------------------------- pipeline compute
    def forward(
        self,
        key: tuple[str, int],
        tokens: torch.Tensor,
        hidden: torch.Tensor | None,
        targets: torch.Tensor | None,
        epoch: tuple[int, int] | None = None,
        window: int = 0,
        defer: bool = False,
        compressed: bool | None = None,
    ) -> ForwardOut:
        """Run this stage on one micro-batch. tokens (b, L) int; hidden (b, L, k) for stages > 0,
        (b, L, d) when not `compressed` (None: `boundary_compressed`). `epoch` (inner step, attempt):
        micro-batches in flight (see the module docstring). `defer` (last stage): the input gradient
        first, weight gradients at the next use (`split_backward`)."""
        mode = self.boundary_compressed if compressed is None else compressed
        tokens = tokens.long().to(self.device)
        hidden = hidden.to(self.device) if hidden is not None else None
        targets = targets.to(self.device) if targets is not None else None
        with self.lock:
            self._admit(key[1], epoch, window, turn=self.is_last)
            started = time.perf_counter()
            try:
                return self._forward_locked(key, tokens, hidden, targets, defer, mode)
            finally:
                self.busy_s += time.perf_counter() - started

    def _forward_locked(
        self,
        key: tuple[str, int],
        tokens: torch.Tensor,
        hidden: torch.Tensor | None,
        targets: torch.Tensor | None,
        defer: bool,
        compressed: bool,
    ) -> ForwardOut:
        if key in self.seen:  # the head replays the inner step (a stage peer failed): start it over
            log.info(
                "stage %d: replay of inner step detected (micro-batch %s); dropping its gradients",
                self.stage,
                key[1],
            )
            self._reset_step()
        self.seen.add(key)
        x_in = None
        if self.is_first:
            out = self.run(tokens)  # (b, L, d)
        else:
            if hidden is None:
                raise ValueError(f"stage {self.stage} needs activations from stage {self.stage - 1}")
            x_in = self._expand(hidden, tokens, compressed).detach().requires_grad_(True)  # (b, L, d)
            out = self.run(x_in)
        if self.is_last:
            if targets is None:
                raise ValueError("the last stage needs targets")
            loss = token_loss(out, targets)
            if not torch.isfinite(loss):  # refused before backward: nothing non-finite reaches a gradient
                self.seen.discard(key)
                raise ValueError(
                    f"the loss of micro-batch {key[1]} is {loss.item()}, refused before backward "
                    "(out-of-range activations or diverged parameters; lower the learning rate)"
                )
            root = self._scaled(loss / self.cfg.train.microbatches)
            grad = self._backward(root, None, x_in, defer, compressed)  # (b, L, k or d)
            return ForwardOut(loss=loss.item(), grad=grad)
        self.pending[key] = (x_in, out, compressed)
        return ForwardOut(hidden=self._boundary(out.detach(), tokens, compressed))

    def _expand(self, hidden: torch.Tensor, tokens: torch.Tensor, compressed: bool) -> torch.Tensor:
        """The input X̂ (b, L, d) of a received boundary: X̃·Uᵀ + T⊥[x], or X itself uncompressed."""
        if not compressed:
            return hidden.float()
        return expand_activations(hidden.float(), tokens, perp_of(self.module), self.U)

    def _boundary(self, out: torch.Tensor, tokens: torch.Tensor, compressed: bool) -> torch.Tensor:
        """The output sent on (CPU): X̃' = (X' − T⊥[x])·U (b, L, k), or X' (b, L, d) uncompressed."""
        if not compressed:
            return out.cpu()
        return compress_activations(out, tokens, perp_of(self.module), self.U).cpu()

    def run(self, x: torch.Tensor) -> torch.Tensor:
        """The stage's module on its input under autocast in this stage's precision, its matmul
        weights cast once per inner step (`CastWeights`); float32 out (logits (b, L, V) or hidden
        (b, L, d)): the loss and the boundary are computed in float32."""
        with autocast(self.device, self.precision):
            out = self.casts.forward(x)
        return out.float()

    def _scaled(self, root_or_grad: torch.Tensor) -> torch.Tensor:
        """× S, the loss scale (fp16); as it is when the scaler is off (bf16, fp32)."""
        return root_or_grad * self.scaler.scale if self.scaler.enabled else root_or_grad

    @torch.no_grad()
    def evaluate(
        self,
        tokens: torch.Tensor,
        hidden: torch.Tensor | None,
        targets: torch.Tensor | None,
        compressed: bool | None = None,
    ) -> ForwardOut:
        """Forward without keeping anything for backward (validation loss through the pipeline)."""
        mode = self.boundary_compressed if compressed is None else compressed
        tokens = tokens.long().to(self.device)
        with self.lock:
            if self.is_first:
                out = self.run(tokens)
            else:
                if hidden is None:
                    raise ValueError(f"stage {self.stage} needs activations from stage {self.stage - 1}")
                out = self.run(self._expand(hidden.to(self.device), tokens, mode))
            if self.is_last:
                if targets is None:
                    raise ValueError("the last stage needs targets")
                loss = token_loss(out, targets.to(self.device))
                return ForwardOut(loss=loss.item())
            return ForwardOut(hidden=self._boundary(out, tokens, mode))

    def backward(
        self,
        key: tuple[str, int],
        grad: torch.Tensor,
        epoch: tuple[int, int] | None = None,
        defer: bool = False,
        compressed: bool | None = None,
    ) -> torch.Tensor | None:
        """Backpropagate an output gradient (b, L, k), or (b, L, d) when the forward pass was
        uncompressed; returns ∇ of the input in the same mode. `compressed`, when given, must be
        the forward pass's. With `epoch`, waits until earlier micro-batches are accumulated; `defer`
        as in `forward`."""
        with self.lock:
            self._admit(key[1], epoch, 0, turn=True)
            if key not in self.pending:
                raise KeyError(f"no forward pass {key} pending on stage {self.stage}")
            if compressed is not None and self.pending[key][2] != compressed:
                raise ValueError(
                    f"micro-batch {key[1]} ran its forward pass {'' if self.pending[key][2] else 'un'}compressed "
                    f"on stage {self.stage}; its gradient must come in the same mode"
                )
            started = time.perf_counter()
            x_in, out, mode = self.pending.pop(key)
            try:  # the gradient is already scaled by 1/n_micro; × S here (fp16)
                root_grad = grad.to(self.device).float()
                root_grad = self._scaled(expand_grad(root_grad, self.U) if mode else root_grad)
                return self._backward(out, root_grad, x_in, defer, mode)
            finally:
                self.busy_s += time.perf_counter() - started
                self.settled.notify_all()

    def _backward(
        self,
        root: torch.Tensor,
        root_grad: torch.Tensor | None,
        x_in: torch.Tensor | None,
        defer: bool,
        compressed: bool,
    ) -> torch.Tensor | None:
        """Accumulate one micro-batch's gradients; ∇ of the input, compressed (b, L, k) or not
        (b, L, d), or None on stage 0. defer: the weights' part waits for `_weights` (the step or Σ‖g‖² asks for it).
        `root`/`root_grad` carry the loss scale S; the input gradient goes out divided by it."""
        grad_in: torch.Tensor | None
        if defer and x_in is not None:
            grad_in, self._weights_due = input_grad_first(root, root_grad, x_in, self.module.parameters())
        else:
            root.backward(root_grad)
            grad_in = None if x_in is None else x_in.grad
        self.microbatches_seen += 1
        self.gate.accumulated()
        if grad_in is None:
            return None
        if self.scaler.enabled:
            grad_in = grad_in / self.scaler.scale  # exact: S is a power of two
        if not bool(torch.isfinite(grad_in).all()):  # an overflow: the step is skipped everywhere (`step`)
            self._overflow = True
            grad_in = torch.zeros_like(grad_in)
        return compress_grad(grad_in, self.U).cpu() if compressed else grad_in.cpu()

    def _weights(self) -> None:  # the deferred weight gradients, if any (under the lock)
        due, self._weights_due = self._weights_due, None
        if due is not None:
            started = time.perf_counter()
            due()
            self.busy_s += time.perf_counter() - started

    def _admit(self, mb: int, epoch: tuple[int, int] | None, window: int, turn: bool) -> None:
        """`EpochGate.admit` of micro-batch `mb` in (outer step, *epoch); nothing waits without an epoch."""
        if epoch is not None:
            self.gate.admit(mb, (self.train_step, epoch[0], epoch[1]), window, turn)

    def drop_pending(self, pipeline_id: str | None = None) -> None:
        """Forget activations of failed micro-batches (all, or one pipeline's)."""
        with self.lock:
            for key in [k for k in self.pending if pipeline_id is None or k[0] == pipeline_id]:
                del self.pending[key]
            self.settled.notify_all()

    def step(self, outer_step: int, inner_step: int, total_norm: float | None = None) -> None:
        """Optimizer step of the accumulated gradients at the global step t·H + inner_step.

        `total_norm`: the gradient norm over all stages of the model (global clipping, as a whole
        model clips); None clips by this stage's own norm. A non-finite norm (an overflow on any
        stage: every stage gets the same norm) skips the step: the gradients are dropped and the
        loss scale halves. Otherwise `.grad` is unscaled (÷ S) before clipping and AdamW."""
        with self.lock:
            self._weights()
            norm = total_norm if total_norm is not None else math.sqrt(self._sq_norm())
            if not math.isfinite(norm):
                self._skip(outer_step, inner_step, norm)
                return
            if self.scaler.enabled:
                for p in self.module.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.scaler.scale)  # exact: S is a power of two
            global_step = outer_step * self.cfg.train.inner_steps + inner_step
            keep_in = self.U if self.is_first and self.boundary_compressed else None  # keep T_S in Col(U)
            self.optim.step(global_step, keep_in, total_norm)
            self.casts.clear()  # stale now; not kept through a round (the next forward casts again)
            self.scaler.update(finite=True)
            self._reset_step()

    def _graphs_alive(self) -> bool:
        return bool(self.pending) or self._weights_due is not None

    def _written(self) -> None:
        self.casts.clear()

    def _skip(self, outer_step: int, inner_step: int, norm: float) -> None:
        """Skip this inner step's optimizer step: its gradients overflowed somewhere in the model."""
        self.scaler.update(finite=False)
        log.info(
            "stage %d: the gradient norm of inner step %d of outer step %d is %s; step skipped%s",
            self.stage,
            inner_step,
            outer_step,
            norm,
            f", fp16 loss scale now {self.scaler.scale:g}" if self.scaler.enabled else "",
        )
        self.skipped_steps += 1
        self._reset_step()

    def grad_sq_norm(self, generation: int | None = None) -> float:
        """Σ‖g‖² of this stage's accumulated gradients, unscaled (÷ S²): its share of the global
        gradient norm; inf after an overflow, so the global norm is inf and every stage skips.
        ValueError when they were reset (a replay) since `generation` (`self.gate.generation` earlier)."""
        with self.lock:
            if generation not in (None, self.gate.generation):
                raise ValueError(f"stage {self.stage}: a replay reset the gradients before their Σ‖g‖² was sent")
            self._weights()
            return self._sq_norm()

    def _sq_norm(self) -> float:
        """The unscaled Σ‖g‖² (÷ S²); inf when anything overflowed (never NaN: the head sums it)."""
        sq = grad_sq_norm(self.module.parameters(), unscale=self.scaler.scale**2 if self.scaler.enabled else 1.0)
        return sq if math.isfinite(sq) and not self._overflow else math.inf

    def zero_grad(self) -> None:
        with self.lock:
            self._reset_step()

    def restart_outer_step(self) -> None:
        """A head paused mid outer step and starts it over at inner step 0 with a new attempt: forget
        the step's gradients and the epoch, which its own restarted micro-batches would find stale."""
        with self.lock:
            self._reset_step()
            self.gate.forget()

    def _reset_step(self) -> None:
        """Forget the current inner step's gradients and pending activations."""
        self._weights_due = None
        self._overflow = False
        self.optim.zero_grad()
        self.pending.clear()
        self.seen.clear()
        self.microbatches_seen = 0
        self.gate.reset()
        self.settled.notify_all()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """`StageState.load_state_dict`; the outer step may have gone back, so no epoch of it is stale."""
        with self.lock:
            super().load_state_dict(state)
            self.gate.forget()

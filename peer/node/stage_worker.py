"""The compute side of one pipeline stage held by a peer (no networking here).

A stage peer receives compressed activations X̃ (b, L, k) and token ids, expands them
(X̂ = X̃·Uᵀ + T⊥[x]), runs its layers and sends on X̃' = (X' − T⊥[x])·U; on the way back it expands
∇X̃' with Uᵀ, backpropagates, and returns ∇X̂·U. The last stage computes the loss and its backward
in the same call. Gradients accumulate over micro-batches until the head says `step`.

The committed state and the outer rounds are `peer.node.stage_state.StageState`, which this class
extends; the inner step is `peer.core.outer.adamw_step`. Every method is synchronous and
thread-safe (one lock), so the gRPC handler can call it from any worker thread.

Micro-batches in flight (`epoch` given): several forwards and backwards of one inner step may be
in progress at once, but the gradients of micro-batch i are accumulated only after those of
i − 1 (a backward waits for its turn, releasing the lock), so the sum is the sequential schedule's
bit for bit whatever the network does. A forward of micro-batch i waits until at most
`window − stage` micro-batches are stashed (1F1B). The epoch (inner step, attempt) orders
replays: a higher one drops the step's gradients and wakes every waiter of the old one (which
fails), a lower one is stale and refused. The next inner step's micro-batches wait for the step of
a complete one (the head does not wait for its answer); one that does not come within
`swarm.rpc_timeout_s` is dropped with its gradients. Without an epoch nothing waits.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from peer.config import RunConfig
from peer.core.optim import grad_sq_norm
from peer.core.outer import (
    adamw_step,
    perp_of,
)
from peer.core.split_backward import input_grad_first
from peer.core.subspace import (
    compress_activations,
    compress_grad,
    expand_activations,
    expand_grad,
)
from peer.errors import PeerError
from peer.node.stage_state import StageState

log = logging.getLogger(__name__)


@dataclass
class ForwardOut:
    hidden: torch.Tensor | None = None  # (b, L, k) compressed output, for stages before the last
    loss: float | None = None  # last stage only
    grad: torch.Tensor | None = None  # last stage only: (b, L, k) gradient wrt its compressed input


class StaleMicrobatch(PeerError):
    """A micro-batch of an older (outer step, inner step, attempt) than the stage runs (`epoch`):
    refused, never run (the service answers it as a typed STALE refusal)."""

    def __init__(self, stage: int, epoch: tuple[int, int, int], message: str) -> None:
        super().__init__(message)
        self.stage, self.epoch = stage, epoch


class StageWorker(StageState):
    """One stage's pipeline compute (forward, backward, step) on top of its committed state."""

    def __init__(self, cfg: RunConfig, stage: int, compressed: bool = True, device: str = "cpu") -> None:
        """compressed=False: a full replica's stage (T_S trained freely, no boundary compression)."""
        super().__init__(cfg, stage, compressed, device)
        self.pending: dict[tuple[str, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self.microbatches_seen = 0
        self.seen: set[tuple[str, int]] = set()  # micro-batches of the current inner step
        self._turn = threading.Condition(self.lock)  # micro-batch order of gradient accumulation
        self._epoch: tuple[int, int, int] | None = None  # (outer step, inner step, attempt) in progress
        self._applied = 0  # micro-batches whose gradients are accumulated (in order) in this epoch
        self.generation = 0  # bumped by every reset: waiters of an older one give up
        self.busy_s = 0.0  # seconds spent computing forward/backward (benchmarks: busy fraction)
        self._weights_due: Callable[[], None] | None = None  # deferred weight gradients (`defer`)

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
    ) -> ForwardOut:
        """Run this stage on one micro-batch. tokens (b, L) int; hidden (b, L, k) for stages > 0.
        `epoch` (inner step, attempt): micro-batches in flight (see the module docstring). `defer`
        (last stage): the input gradient first, weight gradients at the next use (`split_backward`)."""
        tokens = tokens.long().to(self.device)
        hidden = hidden.to(self.device) if hidden is not None else None
        targets = targets.to(self.device) if targets is not None else None
        with self.lock:
            self._admit(key[1], epoch, window, turn=self.is_last)
            started = time.perf_counter()
            try:
                return self._forward_locked(key, tokens, hidden, targets, defer)
            finally:
                self.busy_s += time.perf_counter() - started

    def _forward_locked(
        self,
        key: tuple[str, int],
        tokens: torch.Tensor,
        hidden: torch.Tensor | None,
        targets: torch.Tensor | None,
        defer: bool = False,
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
            out = self.module(tokens)  # (b, L, d)
        else:
            if hidden is None:
                raise ValueError(f"stage {self.stage} needs activations from stage {self.stage - 1}")
            x_in = expand_activations(hidden.float(), tokens, perp_of(self.module), self.U)  # (b, L, d)
            x_in.requires_grad_(True)
            out = self.module(x_in)
        if self.is_last:
            if targets is None:
                raise ValueError("the last stage needs targets")
            loss = F.cross_entropy(out.flatten(0, 1).float(), targets.long().flatten())
            if not torch.isfinite(loss):  # refused before backward: nothing non-finite reaches a gradient
                self.seen.discard(key)
                raise ValueError(
                    f"the loss of micro-batch {key[1]} is {loss.item()}, refused before backward "
                    "(out-of-range activations or diverged parameters; lower the learning rate)"
                )
            grad = self._backward(loss / self.cfg.train.microbatches, None, x_in, defer)  # (b, L, k)
            return ForwardOut(loss=loss.item(), grad=grad)
        self.pending[key] = (x_in, out)
        return ForwardOut(hidden=compress_activations(out.detach(), tokens, perp_of(self.module), self.U).cpu())

    @torch.no_grad()
    def evaluate(self, tokens: torch.Tensor, hidden: torch.Tensor | None, targets: torch.Tensor | None) -> ForwardOut:
        """Forward without keeping anything for backward (validation loss through the pipeline)."""
        tokens = tokens.long().to(self.device)
        with self.lock:
            if self.is_first:
                out = self.module(tokens)
            else:
                if hidden is None:
                    raise ValueError(f"stage {self.stage} needs activations from stage {self.stage - 1}")
                out = self.module(
                    expand_activations(hidden.to(self.device).float(), tokens, perp_of(self.module), self.U)
                )
            if self.is_last:
                if targets is None:
                    raise ValueError("the last stage needs targets")
                loss = F.cross_entropy(out.flatten(0, 1).float(), targets.long().to(self.device).flatten())
                return ForwardOut(loss=loss.item())
            return ForwardOut(hidden=compress_activations(out, tokens, perp_of(self.module), self.U).cpu())

    def backward(
        self, key: tuple[str, int], grad: torch.Tensor, epoch: tuple[int, int] | None = None, defer: bool = False
    ) -> torch.Tensor | None:
        """Backpropagate a compressed output gradient (b, L, k); returns ∇ of the input, compressed.
        With `epoch`, waits until earlier micro-batches are accumulated; `defer` as in `forward`."""
        with self.lock:
            self._admit(key[1], epoch, 0, turn=True)
            if key not in self.pending:
                raise KeyError(f"no forward pass {key} pending on stage {self.stage}")
            started = time.perf_counter()
            x_in, out = self.pending.pop(key)
            try:  # the gradient is already scaled by 1/n_micro
                return self._backward(out, expand_grad(grad.to(self.device).float(), self.U), x_in, defer)
            finally:
                self.busy_s += time.perf_counter() - started

    def _backward(
        self, root: torch.Tensor, root_grad: torch.Tensor | None, x_in: torch.Tensor | None, defer: bool
    ) -> torch.Tensor | None:
        """Accumulate one micro-batch's gradients; ∇ of the input, compressed (b, L, k), or None on
        stage 0. defer: the weights' part waits for `_weights` (the step or Σ‖g‖² asks for it)."""
        grad_in: torch.Tensor | None
        if defer and x_in is not None:
            grad_in, self._weights_due = input_grad_first(root, root_grad, x_in, self.module.parameters())
        else:
            root.backward(root_grad)
            grad_in = None if x_in is None else x_in.grad
        self.microbatches_seen += 1
        self._accumulated()
        return None if grad_in is None else compress_grad(grad_in, self.U).cpu()

    def _weights(self) -> None:  # the deferred weight gradients, if any (under the lock)
        due, self._weights_due = self._weights_due, None
        if due is not None:
            started = time.perf_counter()
            due()
            self.busy_s += time.perf_counter() - started

    def _admit(self, mb: int, epoch: tuple[int, int] | None, window: int, turn: bool) -> None:
        """Enter `epoch` and wait (lock released) until micro-batch `mb` may run here.

        turn: its gradients are next in micro-batch order; window: fewer than window − stage
        micro-batches are stashed. StaleMicrobatch when the epoch is stale; ValueError when a
        replay superseded the wait or `swarm.rpc_timeout_s` passed."""
        if epoch is None:
            return
        full = (self.outer_step, epoch[0], epoch[1])
        if self._unstepped(full) and not self._turn.wait_for(  # only a later epoch waits, so check stale after
            lambda: not self._unstepped(full), timeout=self.cfg.swarm.rpc_timeout_s
        ):
            self._reset_step()  # the step is lost (as with a replaced peer); a replay starts clean
            raise ValueError(f"stage {self.stage}: inner step {epoch[0] - 1} was never stepped before {full}")
        if self._epoch is not None and full < self._epoch:
            raise StaleMicrobatch(
                self.stage, self._epoch, f"micro-batch {mb} of {full} is stale: stage {self.stage} runs {self._epoch}"
            )
        if self._epoch is None or full > self._epoch:
            self._reset_step()
            self._epoch = full
        generation = self.generation
        limit = max(1, window - self.stage)

        def ready() -> bool:
            if generation != self.generation:
                return True
            return (not turn or self._applied == mb) and (window <= 0 or mb - self._applied < limit)

        if not self._turn.wait_for(ready, timeout=self.cfg.swarm.rpc_timeout_s):
            raise ValueError(f"stage {self.stage}: micro-batch {mb} waited too long for micro-batch {self._applied}")
        if generation != self.generation:
            raise ValueError(f"stage {self.stage}: micro-batch {mb} was superseded by a replay")

    def _unstepped(self, full: tuple[int, int, int]) -> bool:
        """The inner step before `full` is complete but its `step` (sent unwaited) has not arrived."""
        cur = self._epoch
        return cur is not None and cur[:2] == (full[0], full[1] - 1) and self._applied >= self.cfg.train.microbatches

    def _accumulated(self) -> None:
        """One more micro-batch's gradients are in: wake the next one."""
        self._applied += 1
        self._turn.notify_all()

    def drop_pending(self, pipeline_id: str | None = None) -> None:
        """Forget activations of failed micro-batches (all, or one pipeline's)."""
        with self.lock:
            for key in [k for k in self.pending if pipeline_id is None or k[0] == pipeline_id]:
                del self.pending[key]

    def step(self, outer_step: int, inner_step: int, total_norm: float | None = None) -> None:
        """Optimizer step of the accumulated gradients at the global step t·H + inner_step.

        `total_norm`: the gradient norm over all stages of the model (global clipping, as a whole
        model clips); None clips by this stage's own norm."""
        with self.lock:
            self._weights()
            global_step = outer_step * self.cfg.train.inner_steps + inner_step
            keep_in = self.U if self.is_first and self.compressed else None  # keep T_S in Col(U)
            adamw_step(self.module, self.optimizer, global_step, self.cfg.train, keep_in, total_norm)
            self._reset_step()

    def grad_sq_norm(self, generation: int | None = None) -> float:
        """Σ‖g‖² of this stage's accumulated gradients: its share of the global gradient norm.
        ValueError when they were reset (a replay) since `generation` (`self.generation` earlier)."""
        with self.lock:
            if generation not in (None, self.generation):
                raise ValueError(f"stage {self.stage}: a replay reset the gradients before their Σ‖g‖² was sent")
            self._weights()
            return grad_sq_norm(self.module.parameters())

    def zero_grad(self) -> None:
        with self.lock:
            self._reset_step()

    def _reset_step(self) -> None:
        """Forget the current inner step's gradients and pending activations."""
        self._weights_due = None
        self.optimizer.zero_grad(set_to_none=True)
        self.pending.clear()
        self.seen.clear()
        self.microbatches_seen = 0
        self._applied = 0
        self.generation += 1
        self._turn.notify_all()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """`StageState.load_state_dict`; the outer step may have gone back, so no epoch of it is stale."""
        with self.lock:
            super().load_state_dict(state)
            self._epoch = None

"""The inner step of a full replica's chain of stages, on one rank or data-parallel over N ranks.

One inner step (paper Alg. 1, every stage at once): the (b, L) batch in `train.microbatches`
micro-batches through the chain (`peer.core.model.inner.accumulate`), the gradient norm over all stages
(`peer.core.model.chain.global_grad_norm`), each stage's clipped AdamW step (`StageWorker.step`).

Over N ranks (`DataParallel`, torch's DistributedDataParallel around a module that holds every
stage): each rank draws its own batch of the replica's shard (`rank_batch_index`), its micro-
batches accumulate locally (`no_sync`) and the last one's backward averages the gradients over the
ranks, bucket by bucket while backward still runs, in rank order (`peer.node.replica.reduce`). Every
rank then holds the same averaged gradients, the same norm and takes the same AdamW step: one replica
with an N × b batch.

Invariants: with one rank the step is `accumulate` + norm + step, nothing else; with N ranks every
rank's parameters and optimizer state stay bit-identical as long as they start so.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from peer.core.model.chain import global_grad_norm, token_loss
from peer.core.model.inner import MicroForward, accumulate
from peer.node.replica.reduce import rank_order_mean
from peer.node.stage.worker import StageWorker

Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (inputs (b, L), targets (b, L)) -> mean loss

BUCKET_CAP_MB = 25.0  # DDP's default: gradients all-reduced in buckets of this size during backward


def rank_batch_index(t: int, h: int, inner_steps: int, ranks: int, rank: int) -> int:
    """The batch of the replica's shard that rank `rank` of `ranks` trains on at inner step h of
    outer step t: the ranks take consecutive batches, so together they read the shard in order."""
    return (t * inner_steps + h) * ranks + rank


def chain_step(
    chain: Sequence[StageWorker], forward: MicroForward, t: int, h: int, x: torch.Tensor, y: torch.Tensor
) -> float:
    """Micro-batches through every stage, then each stage's step, clipped by the gradient norm
    over all stages (as the whole model and a pipeline clip); the batch's mean loss."""
    loss, _ = accumulate(forward, x, y, chain[0].cfg.train.microbatches, loss_scale(chain))
    total_norm = global_grad_norm(w.grad_sq_norm() for w in chain)
    for w in chain:
        w.step(t, h, total_norm)
    return loss


def chain_loss(chain: Sequence[StageWorker], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a (b, L) batch through every stage of a full replica, uncompressed, each
    under autocast in its precision with its weights cast once per inner step (`StageWorker.run`;
    the loss itself in float32)."""
    device = chain[0].device
    hidden = x.to(device)  # (b, L)
    for w in chain:
        hidden = w.run(hidden)  # (b, L, d), the last: (b, L, V)
    return token_loss(hidden, y.to(device))


def loss_scale(chain: Sequence[StageWorker]) -> float:
    """The loss scale of a full replica's one backward through every stage: its stages' scalers
    agree, because each step gives all of them the same total norm (`StageWorker.step`)."""
    scales = {w.scaler.scale for w in chain}
    if len(scales) != 1:
        raise RuntimeError(f"the full replica's stages disagree on the loss scale: {sorted(scales)}")
    return scales.pop()


class _Chain(nn.Module):
    """Every stage's module in one module (what DDP wraps); its forward is the chain's loss."""

    def __init__(self, stages: Sequence[nn.Module], loss: Loss) -> None:
        super().__init__()
        self.stages = nn.ModuleList(stages)
        self._loss = loss

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self._loss(x, y)


class DataParallel:
    """A chain of stages under DDP. Building it is a collective: every rank builds it at the same
    point, and rank 0's parameters are copied to the others."""

    def __init__(
        self,
        chain: Sequence[StageWorker],
        loss: Loss,
        bucket_cap_mb: float = BUCKET_CAP_MB,
        device_ids: list[int] | None = None,
    ) -> None:
        self.n_micro = chain[0].cfg.train.microbatches
        # buffers (T⊥) change only with the state rank 0 shares: copied at init, never per forward
        self.ddp = DistributedDataParallel(
            _Chain([w.module for w in chain], loss),
            device_ids=device_ids,
            forward_sync_buffers=False,
            bucket_cap_mb=bucket_cap_mb,
        )
        self.ddp.register_comm_hook(None, rank_order_mean)

    def forward(self) -> MicroForward:
        """One inner step's micro-batch forward for `accumulate`: the gradients of every micro-batch
        but the last stay local; the last one's backward all-reduces them (averaged over ranks)."""
        seen = 0

        def micro(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, int]:
            nonlocal seen
            seen += 1
            local = self.ddp.no_sync() if seen < self.n_micro else contextlib.nullcontext()
            with local:  # DDP decides at forward time whether this micro-batch's backward syncs
                return self.ddp(x, y), 0

        return micro

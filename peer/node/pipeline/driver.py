"""The head's side of a pipeline: its inner steps, validation and what it reports.

The head (stage 0) runs its own layers and drives stages 1 … S−1 on the peers it claims
(`peer.node.pipeline.routing`): each inner step runs with K micro-batches in flight
(`peer.node.pipeline.schedule` picks K from the measured links before every inner step; K = 1 is
the sequential schedule) through the one step executor (`peer.node.pipeline.step`), which replays
the inner step after a failed stage peer. Every wait is bounded by `swarm.claim_timeout_s` /
`swarm.rpc_timeout_s`. Known limit: a replacement peer starts from θ_start of the outer step, so
the inner steps its predecessor took before failing are lost for that stage.

Each outer step runs compressed or uncompressed, chosen at its first inner step from the measured
links (`peer.node.pipeline.mode`, `policy` "auto") or forced ("always", "never"), and kept through
it: stage 0's `boundary_compressed` and every call's flag follow `decision`.

The driver receives what it uses: the run's config, this pipeline's id, stage 0's worker, the
stage records to claim peers from, the client pool, and two callbacks (publish a new binding,
show the chosen schedule).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch

from peer.config import RunConfig
from peer.net.pool import ClientPool
from peer.node.pipeline.accounting import EquivalentBytes
from peer.node.pipeline.failures import Action, StageFailed
from peer.node.pipeline.mode import LinkFigures, ModeDecision, check_policy, choose_mode, message_bytes
from peer.node.pipeline.routing import Routing, StageRecords
from peer.node.pipeline.schedule import LinkEstimator
from peer.node.pipeline.step import StepExecutor
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

EVAL_MICROBATCH = 10_000  # validation batch i travels as micro-batch 10 000 + i (never a training one)


class PipelineDriver:
    """Drives one pipeline: stage 0 here, stages 1 … S−1 on claimed peers."""

    def __init__(
        self,
        cfg: RunConfig,
        pipeline_id: str,
        worker: StageWorker,
        records: StageRecords,
        clients: ClientPool,
        stop: threading.Event,
        on_bind: Callable[[], None] = lambda: None,
        on_schedule: Callable[[dict[str, Any]], None] | None = None,
        policy: str = "auto",
        on_mode: Callable[[int, ModeDecision, LinkFigures | None], None] | None = None,
    ) -> None:
        """on_bind: publish the stage peers just bound (the head's record); on_schedule: the K,
        round trip and serialization time chosen, to show (`PeerService.schedule`); policy: the
        boundary mode, "auto" (by the links), "always" or "never" compressed; on_mode: each outer
        step's mode and the figures it was chosen from, to record."""
        self.cfg, self.pipeline_id, self.worker, self.clients = cfg, pipeline_id, worker, clients
        self.routing = Routing(cfg, pipeline_id, records, clients, stop, on_bind)
        self.links = LinkEstimator(cfg, clients, lambda: worker.busy_s, on_schedule)
        self.equiv = EquivalentBytes(cfg)
        self.executor = StepExecutor(cfg, pipeline_id, worker, self.routing, self.links, self.equiv, stop)
        self.last_loss: float | None = None
        self.tokens = 0
        self.started = time.monotonic()
        self.in_flight = 1  # micro-batches in flight in the last inner step (1: the sequential schedule)
        self.policy, self.on_mode = check_policy(policy), on_mode
        self.decision: ModeDecision | None = None  # this outer step's mode (None: no step begun yet)
        self._decided_at: int | None = None  # the outer step it was chosen for

    @property
    def peers(self) -> dict[int, tuple[str, str]]:
        """stage -> (peer id, address) of the peers bound now."""
        return self.routing.bound()

    def inner_step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """One inner step over `train.microbatches` micro-batches; replays after replacing a failed
        stage peer (NetworkError when it cannot go on, PipelineBehind when the head missed a round)."""
        if t != self._decided_at:
            self.choose_mode(t)
        self.in_flight = self.links.in_flight(lambda: self.routing.route(t)) if self.cfg.stages > 1 else 1
        loss = self.executor.run(t, h, x, y, self.in_flight)
        self.last_loss = loss
        self.tokens += x.numel()
        return loss

    def choose_mode(self, t: int) -> None:
        """Outer step t's boundary mode, from the links measured so far (`peer.node.pipeline.mode`);
        called at the outer step's first inner step (and by `peer bench pipeline` after its warm-up)."""
        cfg = self.cfg
        measured = cfg.stages > 1 and self.policy == "auto"  # a forced mode asks nothing of the links
        figures = self.links.figures(lambda: self.routing.route(t)) if measured else None
        target = cfg.subspace.uncompressed_min_util
        decision = choose_mode(self.policy, figures, message_bytes(cfg, cfg.model.d_model), target)
        log.info(
            "outer step %d runs %s: %s%s",
            t,
            decision.mode,
            decision.reason,
            "" if figures is None else f" ({figures.describe()})",
        )
        self.worker.boundary_compressed = decision.compressed
        self.links.set_compressed(decision.compressed)
        self.decision, self._decided_at = decision, t
        if self.on_mode is not None:
            self.on_mode(t, decision, figures)

    @property
    def mode(self) -> str:
        """This outer step's mode, "compressed" or "uncompressed" (before the first: the worker's)."""
        return "compressed" if self.worker.boundary_compressed else "uncompressed"

    def release(self) -> None:
        """End of the outer step: claims end with the round; keep the same peers as first choice."""
        self.routing.release()
        self.executor.settle_steps()

    def settle_steps(self) -> None:
        """Collect the later stages' step answers not waited for (`StepExecutor.settle_steps`)."""
        self.executor.settle_steps()

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """Validation loss through the pipeline (no backward kept anywhere); None when a stage
        failed (its peer is dropped where the failure says so)."""
        t = self.worker.train_step  # the outer step the pipeline's peers serve now (ahead: overlap)
        mode = self.worker.boundary_compressed  # read once: with overlap the next outer step may choose anew
        losses: list[float] = []
        for i, (x, y) in enumerate(batches):
            hidden = self.worker.evaluate(x, None, None, mode).hidden
            try:
                reply = self.executor.forward_chain(
                    t, 0, EVAL_MICROBATCH + i, x.to(torch.int32), hidden, y.to(torch.int32), False, mode
                )
            except StageFailed as exc:
                if exc.failure.action is not Action.WAIT:
                    self.routing.on_failure(exc.failure, t)  # PipelineBehind for BEHIND
                log.warning("validation skipped: %s", exc)
                return None
            assert reply.loss is not None  # forward_chain checked it
            losses.append(reply.loss)
            self.equiv.add(x.shape[0], x.shape[1], train=False)
        return sum(losses) / max(1, len(losses))

    @property
    def act_bytes(self) -> tuple[int, int]:
        """(bytes actually moved for activations and their gradients, uncompressed equivalent)."""
        sent, received = self.clients.bytes_sent(), self.clients.bytes_received()
        moved = sum(sent.get(m, 0) + received.get(m, 0) for m in ("forward", "backward"))
        return moved, self.equiv.total

    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-9, time.monotonic() - self.started)

"""The gRPC handler of a training peer: maps data-plane requests onto its StageWorkers.

A stage peer serves `forward`/`backward`/`step` for the pipeline that claimed it this outer step
(the first head whose forward arrives; others are told the peer is busy), `get_payload` for its
round payloads, and `get_state` for late joiners. Heads and full replicas serve only payloads and
state. The service never trains on its own: requests drive it, and `on_last_step` tells the
owner (the trainer) that the H-th inner step is done so it can run the outer round.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

import torch

from peer.config import RunConfig
from peer.errors import PeerError
from peer.rounds import PayloadStore
from peer.stage_worker import StageWorker
from peer.transport.errors import NotFoundError
from peer.transport.messages import (
    ArtifactRequest,
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    PayloadRequest,
    StateReply,
    StateRequest,
    StepReply,
    StepRequest,
)

log = logging.getLogger(__name__)


class Busy(PeerError):
    """The stage peer serves another pipeline or is between rounds; the head should retry or pick another."""


class PeerService:
    """Handler for `peer.transport.PeerServer` over this process's stage workers."""

    def __init__(self, cfg: RunConfig, workers: dict[int, StageWorker], store: PayloadStore, peer_id: str,
                 role: str, on_last_step: Callable[[str, int], None] | None = None,
                 artifacts: dict[str, bytes] | None = None) -> None:
        self.cfg, self.workers, self.store = cfg, workers, store
        self.peer_id, self.role = peer_id, role
        self.on_last_step = on_last_step
        self.artifacts = artifacts or {}
        self.claimed_by: str | None = None  # pipeline id (head's peer id) for the current outer step
        self.in_round = False  # between the last inner step and the committed round
        self.tokens = 0
        self.started = time.monotonic()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ pipeline
    def _worker_for(self, stage: int, outer_step: int, pipeline_id: str) -> StageWorker:
        worker = self.workers.get(stage)
        if worker is None or self.role != "stage":
            raise NotFoundError(f"peer {self.peer_id[:12]} does not serve stage {stage} to pipelines")
        with self._lock:
            if self.in_round:
                raise Busy(f"stage {stage} is finishing outer round {worker.outer_step}; retry shortly")
            if outer_step != worker.outer_step:
                raise Busy(f"stage {stage} is at outer step {worker.outer_step}, request is for {outer_step}")
            if self.claimed_by not in (None, pipeline_id):
                raise Busy(f"stage {stage} peer is claimed by pipeline {self.claimed_by[:12]} this round")
            self.claimed_by = pipeline_id
        return worker

    def release(self, pipeline_id: str | None = None) -> None:
        """Forget a claim (the head gave up on this peer, or the round ended)."""
        with self._lock:
            if pipeline_id is None or self.claimed_by == pipeline_id:
                self.claimed_by = None
        for worker in self.workers.values():
            worker.drop_pending(pipeline_id)

    def forward(self, request: ForwardRequest) -> ForwardReply:
        worker = self._worker_for(request.stage, request.outer_step, request.pipeline_id)
        key = (request.pipeline_id, request.microbatch)
        if not request.train:
            with torch.no_grad():
                out = worker.evaluate(request.tokens, request.hidden, request.targets)
            return ForwardReply(hidden=out.hidden, loss=out.loss)
        out = worker.forward(key, request.tokens, request.hidden, request.targets)
        return ForwardReply(hidden=out.hidden, loss=out.loss, grad=out.grad)

    def backward(self, request: BackwardRequest) -> BackwardReply:
        worker = self._worker_for(request.stage, request.outer_step, request.pipeline_id)
        try:
            grad = worker.backward((request.pipeline_id, request.microbatch), request.grad)
        except KeyError as exc:
            raise PeerError(str(exc).strip("'\"")) from None
        return BackwardReply(grad=grad)

    def step(self, request: StepRequest) -> StepReply:
        worker = None
        for stage, w in self.workers.items():
            worker = self._worker_for(stage, request.outer_step, request.pipeline_id)
        if worker is None:
            raise NotFoundError("this peer holds no stage")
        worker.step(request.outer_step, request.inner_step)
        self.tokens += request.tokens
        if request.inner_step == self.cfg.train.inner_steps - 1:
            with self._lock:
                self.in_round = True
            if self.on_last_step is not None:
                self.on_last_step(request.pipeline_id, request.outer_step)
        return StepReply(ok=True, message="")

    def begin_observing(self) -> bool:
        """A hot spare enters a round it did not train in; False if a head claimed it first."""
        with self._lock:
            if self.claimed_by is not None:
                return False
            self.in_round = True
            return True

    def round_done(self) -> None:
        with self._lock:
            self.in_round = False
            self.claimed_by = None

    # ------------------------------------------------------------------ rounds and state
    def get_payload(self, request: PayloadRequest) -> bytes:
        data = self.store.get(request.outer_step, request.stage)
        if data is None:
            raise NotFoundError(f"no payload for round {request.outer_step} stage {request.stage} here")
        return data

    def get_state(self, request: StateRequest) -> StateReply:
        worker = self.workers.get(request.stage)
        if worker is None:
            raise NotFoundError(f"peer {self.peer_id[:12]} does not hold stage {request.stage}")
        with worker.lock:
            tensors = worker.snapshot()
            meta = {"param_hash": worker.param_hash(), "perp_hash": worker.perp_hash(), "stage": request.stage}
            return StateReply(outer_step=worker.outer_step, meta=meta, tensors=tensors)

    def get_artifact(self, request: ArtifactRequest) -> bytes:
        if request.name not in self.artifacts:
            raise NotFoundError(f"no artefact named {request.name!r} here")
        return self.artifacts[request.name]

    def info(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "role": self.role, "stages": sorted(self.workers),
                "outer_step": min((w.outer_step for w in self.workers.values()), default=0),
                "claimed_by": self.claimed_by, "in_round": self.in_round}

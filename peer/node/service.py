"""The gRPC handler of a training peer: maps data-plane requests onto its StageWorkers.

A stage peer serves `forward`/`backward`/`step` for the pipeline that claimed it this outer step
(the first head whose forward arrives; others are told the peer is busy), `get_payload` for its
round payloads, and `get_state` for late joiners. Heads and full replicas serve only payloads and
state, and the run's prepared dataset once they hold it (`get_artifact`, peer.node.data.serve).
The service never trains on its own: requests drive it, and `on_last_step` tells the owner (the
trainer) that the H-th inner step is done so it can run the outer round.

Hostile input: every pipeline request is checked against this stage before it touches a worker
(token range, (b, L) within train.batch_size x model.max_seq_len, boundary (b, L, k) with finite
values of magnitude <= MAX_BOUNDARY_ABS, targets only on the last stage, backward grads shaped
like the pending forward's output). Only a valid forward claims the peer; backward and step need
the claim. Rejections are TransportError (INVALID_ARGUMENT) or PeerError (FAILED_PRECONDITION),
so a bad request never leaves pending state or gradients behind. A refusal the head decides on
(busy, claimed, lost, stale, a failed hop) carries a typed `Refusal` (`peer.net.transport.errors`).

Micro-batches in flight (`window` > 0, `peer.node.pipeline.step`): the worker orders gradient
accumulation by micro-batch (`StageWorker._admit`). With a `route` the stage streams: it sends its
output straight to `route[0]` (the next stage, same pipeline claim), backpropagates the gradient
that comes back and answers with the loss and its own input gradient, so only the first boundary
crosses the head's link. Each hop has its own deadline (`swarm.rpc_timeout_s` per remaining stage);
a failed hop is answered as `HopError` whose refusal names the failed stage, which the head replaces.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from peer.config import RunConfig
from peer.errors import NetworkError, PeerError
from peer.net.transport.client import PeerClient
from peer.net.transport.dialer import Outbound
from peer.net.transport.errors import (
    HopError,
    NotFoundError,
    Refusal,
    RefusalKind,
    Refused,
    RemoteError,
    TransportError,
)
from peer.net.transport.messages import (
    ArtifactRequest,
    BackwardReply,
    BackwardRequest,
    FileSlice,
    ForwardReply,
    ForwardRequest,
    PayloadKind,
    PayloadRequest,
    RangeBlob,
    RangesReply,
    StateReply,
    StateRequest,
    StepReply,
    StepRequest,
)
from peer.node.data.serve import DatasetServer, is_dataset_artifact
from peer.node.round.payloads import PayloadStore
from peer.node.stage.epoch_gate import StaleMicrobatch
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

# |X̃| or |∇X̃| above this means a diverged or hostile sender: expanding ~3e38 overflows float32
# and turns this stage's gradients into NaN while the loss still looks finite.
MAX_BOUNDARY_ABS = 1e6


class PeerService:
    """Handler for `peer.net.transport.PeerServer` over this process's stage workers."""

    def __init__(
        self,
        cfg: RunConfig,
        workers: dict[int, StageWorker],
        store: PayloadStore,
        peer_id: str,
        role: str,
        on_last_step: Callable[[str, int], None] | None = None,
        artifacts: dict[str, bytes] | None = None,
        outbound: Outbound | None = None,
        dataset: DatasetServer | None = None,
    ) -> None:
        """`outbound`: the proof and link of the calls this peer makes to the next stages;
        `dataset`: the prepared dataset this peer serves once it holds it (heads, full replicas)."""
        self.cfg, self.workers, self.store = cfg, workers, store
        self.peer_id, self.role = peer_id, role
        self.on_last_step = on_last_step
        self.artifacts = artifacts or {}
        self.dataset = dataset or DatasetServer()
        self.outbound = outbound
        self.claimed_by: str | None = None  # pipeline id (head's peer id) for the current outer step
        self.in_round = False  # between the last inner step and the committed round
        self.leaving = False  # stopped: serves payloads a little longer, no pipeline work (Session.hand_off)
        self.tokens = 0
        self.started = time.monotonic()
        self.last_request = self.started
        self._lock = threading.Lock()
        self._next: dict[str, PeerClient] = {}  # clients of the next stages' peers (streaming)
        self.schedule: dict[str, Any] = {}  # the head's pipeline schedule (in flight, RTT), shown in info()

    # ------------------------------------------------------------------ pipeline
    def _stage_worker(self, stage: int) -> StageWorker:
        worker = self.workers.get(stage)
        if worker is None or self.role != "stage":
            raise NotFoundError(
                f"peer {self.peer_id[:12]} does not serve stage {stage} to pipelines",
                refusal=Refusal(RefusalKind.LOST, stage),
            )
        return worker

    def _worker_for(self, stage: int, outer_step: int, pipeline_id: str, claim: bool = True) -> StageWorker:
        """The worker for a pipeline request; `claim=False`: the pipeline must already hold the claim."""
        worker = self._stage_worker(stage)
        with self._lock:
            if self.leaving:
                raise NotFoundError(
                    f"peer {self.peer_id[:12]} is leaving the run; use another stage {stage} peer",
                    refusal=Refusal(RefusalKind.LOST, stage),
                )
            trains = worker.train_step  # the outer step it trains (t + 1 while round t is in flight: overlap)
            busy = Refusal(RefusalKind.BUSY, stage, outer_step=trains)
            if self.in_round:
                raise Refused(busy, f"stage {stage} is finishing outer round {worker.outer_step}; retry shortly")
            if outer_step != trains:
                raise Refused(busy, f"stage {stage} is at outer step {trains}, request is for {outer_step}")
            if self.claimed_by not in (None, pipeline_id):
                raise Refused(
                    Refusal(RefusalKind.CLAIMED, stage),
                    f"stage {stage} peer is claimed by pipeline {self.claimed_by[:12]} this round",
                )
            if not claim and self.claimed_by != pipeline_id:
                raise PeerError(
                    f"pipeline {pipeline_id[:12]!r} sent no forward pass to stage {stage} in outer step "
                    f"{outer_step}; start the inner step with its forward passes"
                )
            if self.claimed_by is None:
                worker.zero_grad()  # nothing of a previous (dead) pipeline may leak into this one
            self.claimed_by = pipeline_id
            self.last_request = time.monotonic()
        return worker

    def release(self, pipeline_id: str | None = None) -> None:
        """Forget a claim (the head gave up on this peer, or the round ended)."""
        with self._lock:
            if pipeline_id is None or self.claimed_by == pipeline_id:
                self.claimed_by = None
        for worker in self.workers.values():
            worker.drop_pending(pipeline_id)

    def _width(self, compressed: bool) -> int:
        """The boundary's last dimension in a call of this mode: k compressed, d not."""
        return self.cfg.k if compressed else self.cfg.model.d_model

    def _check_forward(self, worker: StageWorker, request: ForwardRequest) -> None:
        """Reject a micro-batch that does not fit this stage (raises before any state changes)."""
        model, train, s = self.cfg.model, self.cfg.train, worker.stage
        tokens = request.tokens
        if tokens.dim() != 2 or tokens.is_floating_point() or tokens.dtype == torch.bool:
            raise TransportError(f"stage {s}: tokens must be integer (b, L), got {tokens.dtype} {list(tokens.shape)}")
        b, L = tokens.shape
        if not (0 < b <= train.batch_size and 0 < L <= model.max_seq_len):
            raise TransportError(
                f"stage {s}: micro-batch (b, L) = ({b}, {L}) is outside 1..{train.batch_size} x "
                f"1..{model.max_seq_len} (train.batch_size x model.max_seq_len); the head runs "
                "another config"
            )
        _check_ids(tokens, model.vocab_size, f"stage {s} tokens")
        if request.train and not (request.inner_step < train.inner_steps and request.microbatch < train.microbatches):
            raise TransportError(
                f"stage {s}: inner step {request.inner_step} / micro-batch {request.microbatch} "
                f"out of range ({train.inner_steps} inner steps of {train.microbatches} "
                "micro-batches)"
            )
        if not worker.is_first:
            _check_boundary(request.hidden, (b, L, self._width(request.compressed)), f"stage {s} hidden")
        if request.route and (not request.train or request.window < 1 or len(request.route) != self.cfg.stages - 1 - s):
            raise TransportError(
                f"stage {s}: a streamed training request names the {self.cfg.stages - 1 - s} later stages and a "
                f"window, got {len(request.route)} and {request.window}"
            )
        if (worker.is_last or bool(request.route)) != (request.targets is not None):
            raise TransportError(
                f"stage {s}: targets go with (and only with) the last stage, {self.cfg.stages - 1}, "
                "or a streamed request"
            )
        if request.targets is not None:
            if tuple(request.targets.shape) != (b, L):
                raise TransportError(f"stage {s}: targets {list(request.targets.shape)} differ from tokens [{b}, {L}]")
            _check_ids(request.targets, model.vocab_size, f"stage {s} targets")

    def forward(self, request: ForwardRequest) -> ForwardReply:
        started = time.monotonic()
        reply = self._forward(request)
        return dataclasses.replace(reply, served_s=time.monotonic() - started)  # the caller's hop time less this

    def _forward(self, request: ForwardRequest) -> ForwardReply:
        self._check_forward(self._stage_worker(request.stage), request)
        worker = self._worker_for(request.stage, request.outer_step, request.pipeline_id)
        key = (request.pipeline_id, request.microbatch)
        try:
            if not request.train:
                with torch.no_grad():
                    out = worker.evaluate(request.tokens, request.hidden, request.targets, request.compressed)
                return ForwardReply(hidden=out.hidden, loss=out.loss)
            epoch = (request.inner_step, request.attempt) if request.window > 0 else None
            if request.route:
                return self._stream(worker, request, epoch)
            defer = self._defers(request, epoch)
            out = worker.forward(
                key, request.tokens, request.hidden, request.targets, epoch, request.window, defer, request.compressed
            )
        except StaleMicrobatch as exc:
            t, h, attempt = exc.epoch
            raise TransportError(
                f"stage {worker.stage} cannot run this micro-batch: {exc}",
                refusal=Refusal(RefusalKind.STALE, exc.stage, outer_step=t, inner_step=h, attempt=attempt),
            ) from None
        except (KeyError, ValueError) as exc:
            raise TransportError(f"stage {worker.stage} cannot run this micro-batch: {exc}") from None
        if out.loss is None or not self._last_microbatch(request.microbatch):
            return ForwardReply(hidden=out.hidden, loss=out.loss, grad=out.grad)
        if defer:  # the gradient goes now, Σ‖g‖² once the weight gradients are done
            generation = worker.gate.generation
            return ForwardReply(loss=out.loss, grad=out.grad, late=lambda: (_late_sq_norm(worker, generation),))
        return ForwardReply(loss=out.loss, grad=out.grad, grad_sq_norm=worker.grad_sq_norm())

    def _defers(self, request: ForwardRequest, epoch: tuple[int, int] | None) -> bool:
        """The head asked for Σ‖g‖² after the answer on the last micro-batch of a pipelined step."""
        return request.defer_norms and epoch is not None and self._last_microbatch(request.microbatch)

    def _stream(self, worker: StageWorker, request: ForwardRequest, epoch: tuple[int, int] | None) -> ForwardReply:
        """Forward here, on to the next stage, backward here with the gradient it answers."""
        key = (request.pipeline_id, request.microbatch)
        mode = request.compressed
        out = worker.forward(key, request.tokens, request.hidden, None, epoch, request.window, False, mode)
        if out.hidden is None:
            raise TransportError(f"stage {worker.stage} produced no activations to stream on")
        onward = ForwardRequest(
            request.pipeline_id,
            request.microbatch,
            request.outer_step,
            request.inner_step,
            worker.stage + 1,
            request.tokens,
            out.hidden,
            targets=request.targets,
            attempt=request.attempt,
            route=request.route[1:],
            window=request.window,
            defer_norms=request.defer_norms,
            compressed=request.compressed,
        )
        reply = self._hop(request.route[0], onward, len(request.route))
        if reply.grad is None or reply.loss is None:
            raise HopError(Refusal(RefusalKind.REMOTE, worker.stage + 1), "the reply carries no loss and gradient")
        defer = self._defers(request, epoch)
        grad = worker.backward(key, reply.grad, epoch, defer, request.compressed)
        if not self._last_microbatch(request.microbatch):
            return ForwardReply(loss=reply.loss, grad=grad)
        generation = worker.gate.generation

        def norms() -> tuple[float, ...]:  # Σ‖g‖² of stages S-1 .. this one
            later = _later_norms(reply, worker.stage + 1)
            return (*later, _late_sq_norm(worker, generation))

        if defer:
            return ForwardReply(loss=reply.loss, grad=grad, late=norms)
        return ForwardReply(loss=reply.loss, grad=grad, sq_norms=norms())

    def _hop(self, address: str, request: ForwardRequest, depth: int) -> ForwardReply:
        """One stage-to-stage call; any failure becomes a HopError naming the stage that failed."""
        with self._lock:
            client = self._next.get(address)
            if client is None:
                for old in list(self._next)[: max(0, len(self._next) - 7)]:  # a few peers at most
                    self._next.pop(old).close()
                client = self._next[address] = PeerClient(
                    address,
                    timeout_s=self.cfg.swarm.rpc_timeout_s,
                    wire_dtype=self.cfg.subspace.wire_dtype,
                    vocab_size=self.cfg.model.vocab_size,
                    outbound=self.outbound,
                )
        try:
            return client.forward(request, timeout_s=self.cfg.swarm.rpc_timeout_s * depth)
        except PeerError as exc:
            if isinstance(exc, NetworkError):
                with self._lock:
                    if self._next.get(address) is client:
                        self._next.pop(address).close()
            raise hop_error(exc, request.stage) from None

    def _stream_bytes(self) -> int:
        """Bytes this stage sent to and received from the next stage's peers (streaming)."""
        with self._lock:
            stats = [c.stats() for c in self._next.values()]
        return sum(st[kind].get("forward", 0) for st in stats for kind in ("bytes_sent", "bytes_received"))

    def _last_microbatch(self, microbatch: int) -> bool:
        """After the inner step's last micro-batch a stage's gradients are complete (global clipping)."""
        return microbatch == self.cfg.train.microbatches - 1

    def backward(self, request: BackwardRequest) -> BackwardReply:
        worker = self._worker_for(request.stage, request.outer_step, request.pipeline_id, claim=False)
        key = (request.pipeline_id, request.microbatch)
        with worker.lock:  # the pending entry cannot vanish between the check and its use
            pending = worker.pending.get(key)
            if pending is None:
                raise PeerError(
                    f"no forward pass of micro-batch {request.microbatch} is pending on stage "
                    f"{worker.stage}; replay the micro-batch from its forward pass"
                )
            b, L = pending[1].shape[:2]
            _check_boundary(request.grad, (b, L, self._width(request.compressed)), f"stage {worker.stage} grad")
            try:
                grad = worker.backward(key, request.grad, compressed=request.compressed)
            except (KeyError, ValueError) as exc:
                raise PeerError(str(exc).strip("'\"")) from None
            sq = worker.grad_sq_norm() if self._last_microbatch(request.microbatch) else None
        return BackwardReply(grad=grad, grad_sq_norm=sq)

    def step(self, request: StepRequest) -> StepReply:
        if not self.workers:
            raise NotFoundError("this peer holds no stage")
        if request.inner_step >= self.cfg.train.inner_steps:
            raise TransportError(
                f"inner step {request.inner_step} out of range: the run has "
                f"{self.cfg.train.inner_steps} inner steps per outer step"
            )
        workers = [self._worker_for(s, request.outer_step, request.pipeline_id, claim=False) for s in self.workers]
        for worker in workers:
            worker.step(request.outer_step, request.inner_step, request.grad_norm)
        self.tokens += request.tokens
        if request.inner_step == self.cfg.train.inner_steps - 1:
            with self._lock:
                self.in_round = True
            if self.on_last_step is not None:
                self.on_last_step(request.pipeline_id, request.outer_step)
        return StepReply(ok=True, message="")

    def release_if_idle(self, idle_s: float) -> str | None:
        """Free a claim whose pipeline sent nothing for `idle_s` (its head died or stalled).

        Returns the released pipeline id. The accumulated gradients of its unfinished inner step
        are dropped; the peer becomes a hot spare again.
        """
        with self._lock:
            if self.claimed_by is None or self.in_round or time.monotonic() - self.last_request < idle_s:
                return None
            released, self.claimed_by = self.claimed_by, None
        for worker in self.workers.values():
            worker.zero_grad()
        log.warning("pipeline %s sent nothing for %.0fs: released its claim on this peer", released[:12], idle_s)
        return released

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
    def get_payload(self, request: PayloadRequest) -> bytes | RangesReply:
        """Our payload of the round, or (another sender named) one we fetched in it (a second source),
        whole or (kind EMBED) as its embedding view; in a ranges round the parts (ours or a sender's we
        fetched, with their merkle proofs) or the shards of the ranges asked for that we hold
        (`peer.node.round.ranges.exchange`)."""
        sender = None if request.sender in ("", self.peer_id) else request.sender  # SHARD: the sha256 wanted
        t, stage = request.outer_step, request.stage
        if request.kind is PayloadKind.EMBED:
            data = self.store.view(t, stage, sender)
            if data is None:
                raise NotFoundError(f"no payload for round {t} stage {stage} here")
            return data
        if request.kind is not PayloadKind.PAYLOAD:
            if request.kind is PayloadKind.PART:
                items = [RangeBlob(*held) for held in self.store.parts(t, stage, sender, request.ranges)]
            else:
                items = [RangeBlob(r, data) for r, data in self.store.shards(t, stage, request.ranges, request.sender)]
            if not items:
                raise NotFoundError(f"none of the {request.kind.name.lower()}s asked of round {t} stage {stage} here")
            return RangesReply(tuple(items))
        data = self.store.get(request.outer_step, request.stage, sender)
        if data is None:
            raise NotFoundError(f"no payload for round {request.outer_step} stage {request.stage} here")
        return data

    def get_state(self, request: StateRequest) -> StateReply:
        worker = self.workers.get(request.stage)
        if worker is None:
            raise NotFoundError(f"peer {self.peer_id[:12]} does not hold stage {request.stage}")
        return worker.reply()

    def get_artifact(self, request: ArtifactRequest) -> bytes | FileSlice:
        """The tokenizer, or the dataset's index and shards (peer.node.data.serve), from the offset on."""
        if is_dataset_artifact(request.name):
            return self.dataset.answer(request)
        if request.name not in self.artifacts:
            raise NotFoundError(f"no artefact named {request.name!r} here")
        data = self.artifacts[request.name]
        if request.offset > len(data):
            raise TransportError(f"offset {request.offset} is past the end of {request.name} ({len(data)} bytes)")
        return data[request.offset :]

    def info(self) -> dict[str, Any]:
        return {
            "peer_id": self.peer_id,
            "role": self.role,
            "stages": sorted(self.workers),
            "outer_step": min((w.outer_step for w in self.workers.values()), default=0),
            "claimed_by": self.claimed_by,
            "in_round": self.in_round,
            "busy_s": {str(s): round(w.busy_s, 4) for s, w in self.workers.items()},
            "precision": {str(s): w.precision for s, w in self.workers.items()},
            "skipped_steps": {str(s): w.skipped_steps for s, w in self.workers.items()},
            "stream_bytes": self._stream_bytes(),
            "dataset": self.dataset.info(),
            **self.schedule,
        }


def _check_ids(ids: torch.Tensor, vocab_size: int, what: str) -> None:
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi >= vocab_size:
        raise TransportError(
            f"{what}: ids span [{lo}, {hi}], outside [0, {vocab_size}); the sender uses "
            "another tokenizer than this run's manifest"
        )


def _check_boundary(t: torch.Tensor | None, shape: tuple[int, int, int], what: str) -> None:
    """A boundary tensor X̃ or ∇X̃ of exactly `shape` (b, L, k), finite and |x| <= MAX_BOUNDARY_ABS."""
    if t is None or not t.is_floating_point() or tuple(t.shape) != shape:
        got = "nothing" if t is None else f"{t.dtype} {list(t.shape)}"
        raise TransportError(f"{what}: expected float {list(shape)}, got {got}; the sender runs another config")
    peak = float(t.float().abs().amax())
    if not peak <= MAX_BOUNDARY_ABS:  # also catches NaN
        raise TransportError(
            f"{what}: values up to {peak:.3g} (limit {MAX_BOUNDARY_ABS:.0e}); the sending stage "
            "diverged (lower the learning rate) or is faulty"
        )


def _late_sq_norm(worker: StageWorker, generation: int) -> float:
    """The stage's Σ‖g‖² for an answer already sent; PeerError if a replay reset them since."""
    try:
        return worker.grad_sq_norm(generation)
    except ValueError as exc:
        raise PeerError(str(exc)) from None


def _later_norms(reply: ForwardReply, stage: int) -> tuple[float, ...]:
    """Σ‖g‖² of the later stages from their reply (`ForwardReply.norms`); a failure to send them
    after the answer is a failed hop into `stage`."""
    try:
        return reply.norms()
    except PeerError as exc:
        raise hop_error(exc, stage) from None


def hop_error(exc: PeerError, stage: int) -> HopError:
    """The HopError for a failed call into `stage`: the refusal that peer sent passes through (a
    deeper stage's own hop failure names that stage; one naming an earlier stage is not believed);
    without one, the kind follows the error (an untyped FAILED_PRECONDITION is an older peer's busy)."""
    if isinstance(exc, RemoteError) and exc.refusal is not None and exc.refusal.stage >= stage:
        return HopError(exc.refusal, str(exc))
    if isinstance(exc, NotFoundError):
        return HopError(Refusal(RefusalKind.LOST, stage), str(exc))
    if isinstance(exc, NetworkError):
        return HopError(Refusal(RefusalKind.NETWORK, stage), str(exc))
    if isinstance(exc, RemoteError) and exc.code == "FAILED_PRECONDITION":  # an older peer's busy, untyped
        return HopError(Refusal(RefusalKind.BUSY, stage), str(exc))
    return HopError(Refusal(RefusalKind.REMOTE, stage), str(exc))

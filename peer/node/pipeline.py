"""The head's side of a compressed pipeline: claim stage peers, stream micro-batches, step.

The head (stage 0) runs its own layers, then calls each later stage's peer in turn (petals-style
orchestration): forward carries X̃ (b, L, k) and the int32 token ids, the last stage answers with
the loss and ∇X̃ of its input, and backward walks the stages in reverse. After the micro-batches
of an inner step the head tells every stage to take its optimizer step, with the gradient norm
over all stages (each later stage reports its Σ‖g‖² with its last micro-batch), so a pipeline
clips its gradients as a whole model does. With micro-batches in flight the head does not wait
for that step's answer before its own step and the next inner step (a stage holds the next inner
step's micro-batches until the step has arrived, `StageWorker._admit`), except after the outer
step's last inner step, so the step costs no round trip; a step that failed shows up as the next
inner step's failure of that stage, which replaces the peer as any failed hop does.

Claims: the first forward of an outer step claims a ready peer for this pipeline until the round
(`PeerService`). Every newly chosen peer is published at once in the head's replica record
("pipeline_peers"), which is what lets that peer's round payload speak for this pipeline. A peer
that is busy with another pipeline is skipped; one that is still finishing its round is retried
with backoff. On a network error or timeout the head drops the peer, claims
another ready peer of that stage and replays the whole inner step (stage peers notice a repeated
micro-batch and drop that step's gradients); every wait is bounded by `swarm.claim_timeout_s` /
`swarm.rpc_timeout_s`. Known limit: a replacement peer starts from θ_start of the outer step, so
the inner steps its predecessor took before failing are lost for that stage.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from peer.config import WIRE_DTYPES
from peer.errors import NetworkError, PeerError
from peer.net.transport.client import PeerClient
from peer.net.transport.codec import encoded_size
from peer.net.transport.errors import NotFoundError, RemoteError
from peer.net.transport.framing import framed_size
from peer.net.transport.messages import BackwardReply, BackwardRequest, ForwardReply, ForwardRequest, StepRequest
from peer.node.schedule import PipelineBehind, PipelinedStep, past_step
from peer.node.stage_worker import StageWorker

if TYPE_CHECKING:
    from peer.node.session import Session

log = logging.getLogger(__name__)

R = TypeVar("R")


class StageUnavailable(PeerError):
    def __init__(self, stage: int, message: str):
        super().__init__(message)
        self.stage = stage


class PipelineDriver:
    def __init__(self, session: Session, worker: StageWorker, stop: threading.Event) -> None:
        self.session, self.worker, self.stop = session, worker, stop
        self.cfg = session.cfg
        self.pipeline_id = session.peer_id
        self.peers: dict[int, tuple[str, str]] = {}  # stage -> (peer id, address)
        self.excluded: set[str] = set()
        self.last_loss: float | None = None
        self.tokens = 0
        self.started = time.monotonic()
        self._equiv_cache: dict[tuple[int, int, bool, bool], int] = {}
        self.act_equiv = 0
        self._pool = ThreadPoolExecutor(max_workers=max(1, self.cfg.stages - 1), thread_name_prefix="peer-step")
        self._pipelined = PipelinedStep(self)
        self.in_flight = 1  # micro-batches in flight in the last inner step (1: the sequential schedule)
        self._unacked: list[Future[Any]] = []  # the later stages' step calls of the last inner step, not waited for

    # ------------------------------------------------------------------ claims
    def _candidates(self, stage: int, t: int) -> list[tuple[str, str]]:
        peers = self.session.dht.get_stage_peers(stage)
        ready = [
            (pid, rec.address)
            for pid, rec in peers.items()
            if rec.role in ("spare", "trainer")
            and rec.outer_step == t
            and rec.address
            and pid not in self.excluded
            and (rec.pipeline in (None, self.pipeline_id))
        ]
        return sorted(ready, key=lambda p: (p[0] != self.peers.get(stage, ("",))[0], p[0]))

    def _ahead(self, stage: int, t: int) -> bool:
        return any(
            rec.outer_step is not None and rec.outer_step > t and rec.role in ("spare", "trainer")
            for rec in self.session.dht.get_stage_peers(stage).values()
        )

    def _ensure_peer(self, stage: int, t: int) -> tuple[str, str]:
        if stage in self.peers:
            return self.peers[stage]
        deadline = time.monotonic() + self.cfg.swarm.claim_timeout_s
        while time.monotonic() < deadline and not self.stop.is_set():
            found = self._candidates(stage, t)
            if not found and self._ahead(stage, t):
                raise PipelineBehind(f"stage {stage} peers are past outer step {t}: this head missed a round")
            if found:
                self.peers[stage] = found[0]
                log.info(
                    "pipeline %s: stage %d -> %s at %s", self.pipeline_id[:8], stage, found[0][0][:12], found[0][1]
                )
                # publish the new binding ("pipeline_peers" of the replica record) before that peer can
                # announce a payload for this pipeline (peer.node.round.agreement.binding)
                self.session.records.refresh()
                return found[0]
            self.stop.wait(0.5)
        if self.stop.is_set():
            raise PeerError("stopped")
        raise NetworkError(
            f"stage {stage} has no ready peer at outer step {t} after "
            f"{self.cfg.swarm.claim_timeout_s:.0f}s; start one with `peer join --stage {stage} ...`"
        )

    def release(self) -> None:
        """End of the outer step: claims end with the round; keep the same peers as first choice."""
        self.excluded.clear()
        self.settle_steps()

    def _drop(self, stage: int, why: str) -> None:
        pid, address = self.peers.pop(stage, ("", ""))
        if pid:
            log.warning("pipeline %s: dropping stage %d peer %s (%s)", self.pipeline_id[:8], stage, pid[:12], why)
            self.excluded.add(pid)
            self.session.clients.drop(address)

    # ------------------------------------------------------------------ calls with retry
    def _call(self, stage: int, t: int, fn: Callable[[PeerClient], R]) -> R:
        """Call `fn(client)` on this stage's peer; retry a busy peer, replace a claimed/dead one."""
        deadline = time.monotonic() + self.cfg.swarm.claim_timeout_s
        while True:
            pid, address = self._ensure_peer(stage, t)
            try:
                return fn(self.session.clients.get(address))
            except NotFoundError as exc:
                self._drop(stage, str(exc))
            except RemoteError as exc:
                if "claimed by pipeline" in str(exc):
                    self._drop(stage, "claimed by another pipeline")
                elif exc.code != "FAILED_PRECONDITION":
                    raise StageUnavailable(stage, str(exc)) from None
                elif past_step(str(exc), t):  # the peer committed round t without us: we missed it
                    self._drop(stage, "past this outer step")
                    raise PipelineBehind(f"stage {stage} peer is past outer step {t}: {exc}") from None
                elif time.monotonic() > deadline:
                    raise StageUnavailable(stage, f"stage {stage} stayed busy: {exc}") from None
                else:
                    self.stop.wait(0.2)  # finishing its round; retry the same peer
            except NetworkError as exc:
                self._drop(stage, str(exc))
                raise StageUnavailable(stage, str(exc)) from None
            if self.stop.is_set():
                raise PeerError("stopped")

    # ------------------------------------------------------------------ training
    def inner_step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """One inner step over `microbatches` micro-batches; replays after replacing a failed stage peer.

        More than one micro-batch in flight: the pipelined schedule (`peer.node.schedule`)."""
        self.in_flight = self._pipelined.in_flight(t) if self.cfg.stages > 1 else 1
        if self.in_flight == 1:
            self.settle_steps()  # the sequential schedule's micro-batches do not wait for a step
        attempts = 0
        while True:
            try:
                loss = self._run_pipelined(t, h, x, y) if self.in_flight > 1 else self._run_inner_step(t, h, x, y)
                break
            except StageUnavailable as exc:
                attempts += 1
                self.worker.zero_grad()
                if attempts > 3:
                    raise NetworkError(f"inner step {h} of outer step {t} failed {attempts} times: {exc}") from None
                log.warning("replaying inner step %d of outer step %d after: %s", h, t, exc)
        self.last_loss = loss
        self.tokens += x.numel()
        return loss

    def _run_pipelined(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """Micro-batches in flight (the schedule replays its own failed hops), then every stage's
        step; a stage peer lost at the step is replaced and the whole inner step replayed."""
        loss, sq_norms = self._pipelined.run(t, h, x, y, self.in_flight)
        self._step(t, h, x.numel(), sq_norms, wait=h == self.cfg.train.inner_steps - 1)
        return loss

    def _run_inner_step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        S, n_micro = self.cfg.stages, self.cfg.train.microbatches
        total = 0.0
        sq_norms: list[float | None] = []  # Σ‖g‖² of stages S−1 … 1 after the last micro-batch
        for mb, (mb_x, mb_y) in enumerate(zip(x.chunk(n_micro), y.chunk(n_micro), strict=True)):
            key = (self.pipeline_id, mb)
            tokens = mb_x.to(torch.int32)
            hidden = self.worker.forward(key, mb_x, None, None).hidden  # (b, L, k)
            reply: ForwardReply | None = None
            for s in range(1, S):
                req = ForwardRequest(
                    self.pipeline_id,
                    mb,
                    t,
                    h,
                    s,
                    tokens,
                    _required(hidden, f"stage {s - 1} activations"),
                    targets=mb_y.to(torch.int32) if s == S - 1 else None,
                )
                reply = self._call(s, t, _forward(req))
                hidden = reply.hidden
            if reply is None or reply.loss is None:
                raise StageUnavailable(S - 1, f"stage {S - 1} returned no loss")
            loss, grad = reply.loss, reply.grad
            sq_norms = [reply.grad_sq_norm]
            for s in range(S - 2, 0, -1):
                back = BackwardRequest(self.pipeline_id, mb, t, h, s, _required(grad, f"stage {s + 1} gradient"))
                back_reply = self._call(s, t, _backward(back))
                grad = back_reply.grad
                sq_norms.append(back_reply.grad_sq_norm)
            self.worker.backward(key, _required(grad, "stage 1 gradient"))
            total += loss / n_micro
            self.act_equiv += self._equiv_bytes(mb_x.shape[0], mb_x.shape[1])
        self._step(t, h, x.numel(), sq_norms)
        return total

    def _step(self, t: int, h: int, tokens: int, sq_norms: list[float | None], wait: bool = True) -> None:
        """Every stage's optimizer step, clipped by the global norm: each later stage reported its
        Σ‖g‖² with the last micro-batch (stages S−1 … 1).

        wait: the later stages' answers come before the head's own step (a failed one replays the
        inner step); otherwise the head steps at once and looks at the answers after the next inner
        step (`settle_steps`)."""
        self.settle_steps()
        norm = None
        if all(sq is not None for sq in sq_norms):
            norm = math.sqrt(math.fsum([self.worker.grad_sq_norm(), *(sq for sq in sq_norms if sq is not None)]))
        step = StepRequest(self.pipeline_id, t, h, self.cfg.train.microbatches, tokens, grad_norm=norm)
        futures = [self._pool.submit(self._call, s, t, lambda c: c.step(step)) for s in range(1, self.cfg.stages)]
        if wait:
            for f in futures:
                f.result()
        else:
            self._unacked = futures
        self.worker.step(t, h, norm)

    def settle_steps(self) -> None:
        """Collect the step calls not waited for. One that failed has already cost its stage's peer
        the next inner step (the peer holds that step's micro-batches until the step arrives, then
        refuses them) and the head has replaced it, so it is only logged."""
        unacked, self._unacked = self._unacked, []
        for f in unacked:
            try:
                f.result(timeout=self.cfg.swarm.rpc_timeout_s)
            except Exception as exc:  # noqa: BLE001 - every outcome of a finished call is only logged here
                log.warning("pipeline %s: a stage's optimizer step failed: %s", self.pipeline_id[:8], exc)

    @torch.no_grad()
    def evaluate(self, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """Validation loss through the pipeline (no backward kept anywhere)."""
        t = self.worker.outer_step
        losses: list[float] = []
        for i, (x, y) in enumerate(batches):
            tokens = x.to(torch.int32)
            hidden = self.worker.evaluate(x, None, None).hidden
            reply: ForwardReply | None = None
            try:
                for s in range(1, self.cfg.stages):
                    req = ForwardRequest(
                        self.pipeline_id,
                        10_000 + i,
                        t,
                        0,
                        s,
                        tokens,
                        _required(hidden, f"stage {s - 1} activations"),
                        targets=y.to(torch.int32) if s == self.cfg.stages - 1 else None,
                        train=False,
                    )
                    reply = self._call(s, t, _forward(req))
                    hidden = reply.hidden
            except StageUnavailable as exc:
                log.warning("validation skipped: %s", exc)
                return None
            if reply is None or reply.loss is None:
                log.warning("validation skipped: the last stage returned no loss")
                return None
            losses.append(reply.loss)
            self.act_equiv += self._equiv_bytes(x.shape[0], x.shape[1], train=False)
        return sum(losses) / max(1, len(losses))

    # ------------------------------------------------------------------ accounting
    def _equiv_bytes(self, b: int, L: int, train: bool = True, streamed: bool = False) -> int:
        """Bytes the same micro-batch would take on the head's link with uncompressed (b, L, d)
        boundaries (streamed: only stage 1's call crosses it)."""
        key = (b, L, train, streamed)
        if key not in self._equiv_cache:
            d, S = self.cfg.model.d_model, self.cfg.stages
            dtype = WIRE_DTYPES[self.cfg.subspace.wire_dtype]
            tok = torch.zeros(b, L, dtype=torch.int32)
            full = torch.zeros(b, L, d, dtype=dtype)  # (b, L, d)
            total = 0
            if streamed:  # only stage 1's call crosses the head's link
                route = tuple(self.peers[s][1] for s in range(2, S) if s in self.peers)
                head: list[Any] = [
                    ForwardRequest("p", 0, 0, 0, 1, tok, full, targets=tok, route=route, window=S),
                    ForwardReply(loss=0.0, grad=full),
                ]
                total = sum(framed_size(encoded_size(m, self.cfg.subspace.wire_dtype)) for m in head)
            for s in range(1, 1 if streamed else S):
                last = s == S - 1
                wire = self.cfg.subspace.wire_dtype
                msgs: list[Any] = [
                    ForwardRequest("p", 0, 0, 0, s, tok, full, targets=tok if last else None, train=train)
                ]
                if last:
                    msgs.append(ForwardReply(loss=0.0, grad=full) if train else ForwardReply(loss=0.0))
                else:
                    msgs.append(ForwardReply(hidden=full))
                if train and not last:
                    msgs += [BackwardRequest("p", 0, 0, 0, s, full), BackwardReply(grad=full)]
                total += sum(framed_size(encoded_size(m, wire)) for m in msgs)
            self._equiv_cache[key] = total
        return self._equiv_cache[key]

    @property
    def act_bytes(self) -> tuple[int, int]:
        """(bytes actually moved for activations and their gradients, uncompressed equivalent)."""
        sent = self.session.clients.bytes_sent()
        received = self.session.clients.bytes_received()
        moved = sum(sent.get(m, 0) + received.get(m, 0) for m in ("forward", "backward"))
        return moved, self.act_equiv

    def tokens_per_s(self) -> float:
        return self.tokens / max(1e-9, time.monotonic() - self.started)


def _required(tensor: torch.Tensor | None, what: str) -> torch.Tensor:
    """A tensor a stage must have sent; a reply without it makes that stage unusable for this step."""
    if tensor is None:
        raise PeerError(f"the pipeline got no {what}")
    return tensor


def _forward(request: ForwardRequest) -> Callable[[PeerClient], ForwardReply]:
    return lambda client: client.forward(request)


def _backward(request: BackwardRequest) -> Callable[[PeerClient], BackwardReply]:
    return lambda client: client.backward(request)

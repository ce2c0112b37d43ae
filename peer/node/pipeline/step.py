"""One inner step of the head's pipeline: K micro-batches in flight, one replay loop.

For each micro-batch the head runs stage 0's forward, sends the boundary X̃ (b, L, k) on, gets back
the loss and ∇X̃ and runs stage 0's backward (in an uncompressed outer step X and ∇X (b, L, d),
every call flagged so: `StageWorker.boundary_compressed`, chosen by `peer.node.pipeline.mode`);
after the micro-batches it tells every stage to take its optimizer step with the gradient norm
over all stages (each later stage reports its Σ‖g‖² with the last micro-batch), so a pipeline
clips as a whole model does.

- K = 1, the sequential schedule: the head relays the chain itself (`forward_chain`: stage s's
  output comes back to the head and goes to s + 1; the gradients walk back the same way, one
  `backward` call per stage), one micro-batch at a time, and waits for every stage's step.
- K > 1: K micro-batch threads; stage 1 gets the route of the later stages' addresses and streams
  (stage s forwards to s + 1 itself and backpropagates what s + 1 answers, `PeerService._stream`),
  so the head's link carries one boundary each way per micro-batch whatever S is. Every stage
  orders gradient accumulation by micro-batch (`StageWorker._admit`) and stashes at most K − s
  micro-batches, so the result is the sequential schedule's bit for bit; the loss is summed in
  micro-batch order. The head does not wait for the step's answers before its own step and the
  next inner step (a stage holds the next inner step's micro-batches until the step has arrived),
  except after the outer step's last inner step: the step costs no round trip, and a step that
  failed shows up as the next inner step's failure of that stage.

Failures: every call goes through `call`, which retries a busy peer in place (`BUSY_RETRY_S`, up to
`swarm.claim_timeout_s`) and turns anything else into a decision (`failures.classify`). The one
replay loop (`run`) applies it: the routing drops the peer where the decision says so, and the
whole inner step is replayed with a new attempt number (they grow from the clock and never
repeat), at most `swarm.inner_step_replays` times. A stage that sees a higher attempt drops the
step's gradients first, a lower one is refused as stale, so a replay never counts a gradient twice.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

import torch

from peer.config import RunConfig
from peer.core.model.chain import global_grad_norm
from peer.errors import NetworkError, PeerError
from peer.net.transport.client import PeerClient
from peer.net.transport.messages import BackwardReply, BackwardRequest, ForwardReply, ForwardRequest, StepRequest
from peer.node.pipeline.accounting import EquivalentBytes
from peer.node.pipeline.failures import Action, Failure, StageFailed, classify
from peer.node.pipeline.routing import BUSY_RETRY_S, Routing
from peer.node.pipeline.schedule import LinkEstimator
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

R = TypeVar("R")
Norms = list[float | None]  # Σ‖g‖² of stages S−1 … 1 after the last micro-batch (None: not sent)


class _Aborted(PeerError):
    """Another micro-batch of this attempt failed first."""


class StepExecutor:
    """Runs the inner steps of one pipeline: stage 0 here (`worker`), stages 1 … S−1 through `routing`."""

    def __init__(
        self,
        cfg: RunConfig,
        pipeline_id: str,
        worker: StageWorker,
        routing: Routing,
        links: LinkEstimator,
        equiv: EquivalentBytes,
        stop: threading.Event,
    ) -> None:
        self.cfg, self.pipeline_id, self.worker, self.routing = cfg, pipeline_id, worker, routing
        self.links, self.equiv, self.stop = links, equiv, stop
        self._steps = ThreadPoolExecutor(max_workers=max(1, cfg.stages - 1), thread_name_prefix="peer-step")
        self._unacked: list[Future[object]] = []  # the later stages' step calls of the last inner step, not waited for
        self._pool: ThreadPoolExecutor | None = None  # K workers, kept while K stays and no attempt fails
        self._pool_k = 0
        # attempt numbers never repeat: they grow across replays, inner steps and paused retries,
        # and start from the clock (ms), so a restarted head (same pipeline id) outnumbers its
        # earlier process; restarting at 0 left stages refusing every replay as stale
        self._attempts = itertools.count(time.time_ns() // 1_000_000)

    # ------------------------------------------------------------------ the replay loop
    def run(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor, k: int) -> float:
        """The mean loss of inner step h with K = k in flight, every stage stepped; replayed after a
        failed stage as the decision says (`failures`), NetworkError once it cannot go on."""
        if k == 1:
            self.settle_steps()  # the sequential schedule's micro-batches do not wait for a step
        failures = 0
        busy_until = time.monotonic() + self.routing.claim_timeout_s
        while True:
            attempt = next(self._attempts)
            try:
                return self._attempt(t, h, x, y, k, attempt)
            except StageFailed as exc:
                failure = exc.failure
            self.routing.on_failure(failure, t)  # PipelineBehind for BEHIND
            if failure.action is Action.WAIT:
                if time.monotonic() > busy_until:
                    raise NetworkError(f"inner step {h} of outer step {t}: {failure.reason}") from None
                self.stop.wait(BUSY_RETRY_S)
            else:
                failures += 1
                if failures > self.routing.replays:
                    raise NetworkError(
                        f"inner step {h} of outer step {t} failed {failures} times: {failure.reason}"
                    ) from None
                log.warning("replaying inner step %d of outer step %d after: %s", h, t, failure.reason)
            if self.stop.is_set():
                raise PeerError("stopped")
            self.worker.zero_grad()

    def _attempt(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor, k: int, attempt: int) -> float:
        n = self.cfg.train.microbatches
        batches = list(enumerate(zip(x.chunk(n), y.chunk(n), strict=True)))
        if k == 1:
            results = [self._guarded(self._relayed, t, h, mb, mb_x, mb_y) for mb, (mb_x, mb_y) in batches]
        else:
            results = self._in_flight(t, h, batches, k, attempt)
        total = 0.0
        for loss, _ in results:
            total += loss / n  # in micro-batch order
        self._step(t, h, x.numel(), results[-1][1], wait=k == 1 or h == self.cfg.train.inner_steps - 1)
        return total

    def _guarded(self, fn: Callable[..., R], t: int, h: int, *args: object) -> R:
        """`fn(t, h, *args)`; a failure raised as StageFailed with its decision (a bug re-raised)."""
        try:
            return fn(t, h, *args)
        except Exception as exc:
            failure = classify(exc, 1, self.cfg.stages, t, h)
            if failure is None:
                raise
            raise StageFailed(failure) from None

    # ------------------------------------------------------------------ calls
    def call(
        self, stage: int, t: int, h: int, fn: Callable[[PeerClient], R], abort: threading.Event | None = None
    ) -> R:
        """`fn(client)` on this stage's peer in inner step h of outer step t. A busy peer is asked
        again in place (nothing ran there); any other failure is raised as StageFailed with its
        decision. `abort`: another micro-batch of the attempt failed (_Aborted)."""
        deadline = time.monotonic() + self.routing.claim_timeout_s
        while True:
            _, address = self.routing.peer(stage, t)
            try:
                return fn(self.routing.client(address))
            except PeerError as exc:
                failure = classify(exc, stage, self.cfg.stages, t, h)
                if failure is None:
                    raise
                if failure.action is not Action.WAIT or failure.stage != stage or time.monotonic() > deadline:
                    raise StageFailed(failure) from None
            if self.stop.is_set():
                raise PeerError("stopped")
            if (self.stop if abort is None else abort).wait(BUSY_RETRY_S):
                raise PeerError("stopped") if abort is None else _Aborted("aborted")

    def forward_chain(
        self,
        t: int,
        h: int,
        mb: int,
        tokens: torch.Tensor,
        hidden: torch.Tensor | None,
        targets: torch.Tensor,
        train: bool,
        compressed: bool | None = None,
    ) -> ForwardReply:
        """Stage 0's output `hidden` (b, L, k), or (b, L, d) not `compressed` (None: stage 0's mode),
        through stages 1 … S−1, each called by the head in turn: the last stage's reply (the loss; ∇
        of its input when training)."""
        S, reply = self.cfg.stages, None
        mode = self.worker.boundary_compressed if compressed is None else compressed
        for s in range(1, S):
            request = ForwardRequest(
                self.pipeline_id,
                mb,
                t,
                h,
                s,
                tokens,
                _required(hidden, f"stage {s - 1} activations"),
                targets=targets if s == S - 1 else None,
                train=train,
                compressed=mode,
            )
            reply = self.call(s, t, h, self._timed(request) if s == 1 and train else _forward(request))
            hidden = reply.hidden
        if reply is None or reply.loss is None:
            raise StageFailed(Failure(Action.REPLAY, S - 1, f"stage {S - 1} returned no loss"))
        return reply

    # ------------------------------------------------------------------ one micro-batch
    def _relayed(self, t: int, h: int, mb: int, mb_x: torch.Tensor, mb_y: torch.Tensor) -> tuple[float, Norms]:
        """One micro-batch of the sequential schedule: the head relays every hop both ways."""
        key = (self.pipeline_id, mb)
        hidden = self.worker.forward(key, mb_x, None, None).hidden  # (b, L, k)
        reply = self.forward_chain(t, h, mb, mb_x.to(torch.int32), hidden, mb_y.to(torch.int32), train=True)
        grad, norms = reply.grad, [reply.grad_sq_norm]
        for s in range(self.cfg.stages - 2, 0, -1):
            grad = _required(grad, f"stage {s + 1} gradient")
            back = BackwardRequest(self.pipeline_id, mb, t, h, s, grad, self.worker.boundary_compressed)
            back_reply = self.call(s, t, h, _backward(back))
            grad = back_reply.grad
            norms.append(back_reply.grad_sq_norm)
        self.worker.backward(key, _required(grad, "stage 1 gradient"))
        self.equiv.add(mb_x.shape[0], mb_x.shape[1])
        assert reply.loss is not None  # forward_chain checked it
        return reply.loss, norms

    def _in_flight(
        self, t: int, h: int, batches: list[tuple[int, tuple[torch.Tensor, torch.Tensor]]], k: int, attempt: int
    ) -> list[tuple[float, Norms]]:
        """The micro-batches of one attempt on K threads, streamed through stage 1."""
        route = self.routing.route(t)
        abort = threading.Event()
        turns = _ForwardTurns(abort)
        pool = self._workers(k)
        futures = [
            pool.submit(self._streamed, t, h, mb, mb_x, mb_y, attempt, route, k, turns) for mb, (mb_x, mb_y) in batches
        ]
        ok = False
        try:
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = [e for f in futures if f.done() and (e := f.exception()) is not None]
            if failed:
                abort.set()
                first = next((e for e in failed if not isinstance(e, _Aborted)), failed[0])
                failure = classify(first, 1, self.cfg.stages, t, h)
                if failure is None:
                    raise first
                raise StageFailed(failure)
            results = [f.result() for f in futures]
            ok = True
        finally:
            abort.set()
            if not ok:
                self._discard_pool()
        return results

    def _streamed(
        self,
        t: int,
        h: int,
        mb: int,
        mb_x: torch.Tensor,
        mb_y: torch.Tensor,
        attempt: int,
        route: tuple[str, ...],
        k: int,
        turns: _ForwardTurns,
    ) -> tuple[float, Norms]:
        key, epoch, abort = (self.pipeline_id, mb), (h, attempt), turns.abort
        turns.wait(mb)
        try:
            hidden = self.worker.forward(key, mb_x, None, None, epoch, k).hidden  # (b, L, k)
        finally:
            turns.done(mb)
        request = ForwardRequest(
            self.pipeline_id,
            mb,
            t,
            h,
            1,
            mb_x.to(torch.int32),
            _required(hidden, "stage 0 activations"),
            targets=mb_y.to(torch.int32),
            attempt=attempt,
            route=route[1:],
            window=k,
            defer_norms=mb == self.cfg.train.microbatches - 1,  # the flush: Σ‖g‖² come after the gradient
            compressed=self.worker.boundary_compressed,
        )
        reply = self.call(1, t, h, self._send(request), abort)
        if reply.grad is None or reply.loss is None:
            raise StageFailed(
                Failure(Action.REPLAY, 1, "stage 1 answered a streamed micro-batch without loss and gradient")
            )
        if abort.is_set():
            raise _Aborted("aborted")
        self.worker.backward(key, reply.grad, epoch)  # while the stages after compute their weight gradients
        norms: Norms = [*reply.norms()] or [None]
        return reply.loss, norms

    def _timed(self, request: ForwardRequest) -> Callable[[PeerClient], ForwardReply]:
        """A relayed call into stage 1, its network time measured (`LinkEstimator.record_call`)."""

        def send(client: PeerClient) -> ForwardReply:
            started = time.monotonic()
            reply = client.forward(request)
            if reply.served_s is not None:
                self.links.record_call(time.monotonic() - started - reply.served_s)
            return reply

        return send

    def _send(self, request: ForwardRequest) -> Callable[[PeerClient], ForwardReply]:
        """The streamed call into stage 1, measured: every try counts its uncompressed equivalent
        (like for like with the bytes moved) and its network time (`LinkEstimator.record_call`)."""
        timeout = self.cfg.swarm.rpc_timeout_s * max(1, self.cfg.stages - 1)
        b, L = request.tokens.shape[0], request.tokens.shape[1]

        def send(client: PeerClient) -> ForwardReply:
            self.equiv.add(b, L, route=request.route)
            started = time.monotonic()
            reply = client.forward(request, timeout_s=timeout)
            if reply.served_s is not None:  # the network part of the call (an older peer: not known)
                self.links.record_call(time.monotonic() - started - reply.served_s)
            return reply

        return send

    # ------------------------------------------------------------------ the optimizer step
    def _step(self, t: int, h: int, tokens: int, sq_norms: Norms, wait: bool) -> None:
        """Every stage's optimizer step, clipped by the global norm (each later stage reported its
        Σ‖g‖² with the last micro-batch). wait: the later stages' answers come before the head's own
        step; otherwise they are looked at after the next inner step (`settle_steps`)."""
        self.settle_steps()
        norm = None
        if all(sq is not None for sq in sq_norms):
            norm = global_grad_norm([self.worker.grad_sq_norm(), *(sq for sq in sq_norms if sq is not None)])
        step = StepRequest(self.pipeline_id, t, h, self.cfg.train.microbatches, tokens, grad_norm=norm)
        futures: list[Future[object]] = [
            self._steps.submit(self.call, s, t, h, lambda c: c.step(step)) for s in range(1, self.cfg.stages)
        ]
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

    # ------------------------------------------------------------------ the micro-batch threads
    def _workers(self, k: int) -> ThreadPoolExecutor:
        """The K micro-batch threads (the head's window). They live across inner steps: fresh
        threads every step cost stage 0 ~10 % of its compute on a CPU (new allocator arenas and
        caches; measured in docs/pipeline.md)."""
        if self._pool is None or self._pool_k != k:
            self._discard_pool()
            self._pool, self._pool_k = ThreadPoolExecutor(max_workers=k, thread_name_prefix="peer-mb"), k
        return self._pool

    def _discard_pool(self) -> None:
        """Give up the micro-batch threads (after a failed attempt some may still wait on a call)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
        self._pool = None


class _ForwardTurns:
    """Stage 0's forwards of one attempt run in micro-batch order.

    The K micro-batch threads race for the worker's lock; when a later micro-batch won, stage 1
    (which runs micro-batches in order) waited for micro-batch 0 and the head then sat idle until
    its answer came back: 54–61 ms of a ~520 ms inner step, measured on `peer bench pipeline`."""

    def __init__(self, abort: threading.Event) -> None:
        self.abort = abort
        self._cond = threading.Condition()
        self._next = 0

    def wait(self, mb: int) -> None:
        """Until every earlier micro-batch has run its forward (_Aborted if the attempt failed)."""
        with self._cond:
            while self._next < mb:
                if self.abort.is_set():
                    raise _Aborted("aborted")
                self._cond.wait(0.05)
        if self.abort.is_set():
            raise _Aborted("aborted")

    def done(self, mb: int) -> None:
        with self._cond:
            self._next = max(self._next, mb + 1)
            self._cond.notify_all()


def _required(tensor: torch.Tensor | None, what: str) -> torch.Tensor:
    """A tensor a stage must have sent; a reply without it makes that stage unusable for this step."""
    if tensor is None:
        raise PeerError(f"the pipeline got no {what}")
    return tensor


def _forward(request: ForwardRequest) -> Callable[[PeerClient], ForwardReply]:
    return lambda client: client.forward(request)


def _backward(request: BackwardRequest) -> Callable[[PeerClient], BackwardReply]:
    return lambda client: client.backward(request)

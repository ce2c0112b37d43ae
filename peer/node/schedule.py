"""The head's pipelined inner step: micro-batches in flight (1F1B) with stage-to-stage streaming.

The head keeps up to K micro-batches in the pipeline (`train.in_flight`; 0 picks K from the
number of stages S and the measured round trip, `choose_in_flight`). For each micro-batch it runs
stage 0's forward, sends the boundary X̃ and the targets to stage 1 with the route of the later
stages' addresses, and gets back the loss and ∇X̃ of stage 1's input: stage s forwards to s + 1
itself and backpropagates what s + 1 answers (`PeerService._stream`), so the head's link carries
one boundary each way per micro-batch whatever S is. Every stage orders gradient accumulation by
micro-batch (`StageWorker._admit`) and stashes at most K − s micro-batches, so the result is the
sequential schedule's bit for bit, independent of network timing; the loss is summed in
micro-batch order and the optimizer step stays synchronous at the end of the inner step.

Failures: every request carries the attempt number of this inner step. A failed hop names its
stage (`HopError`); the head drops that peer (`PipelineDriver._drop`), claims another and replays
the whole inner step with attempt + 1. A stage that sees a higher attempt drops the step's
gradients first, a lower one is refused as stale, so a replay never counts a gradient twice.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from peer.errors import NetworkError, PeerError
from peer.net.transport.errors import HopError, NotFoundError, RemoteError, TransportError
from peer.net.transport.messages import ForwardReply, ForwardRequest

if TYPE_CHECKING:
    from peer.node.pipeline import PipelineDriver

log = logging.getLogger(__name__)

IN_FLIGHT_ENV = "PEER_TRAIN__IN_FLIGHT"  # a head's local choice (also set by `peer join --in-flight`)
RTT_PER_EXTRA_S = 0.025  # auto: one more micro-batch in flight per 25 ms of round trip per link


def choose_in_flight(configured: int, stages: int, microbatches: int, rtt_s: float) -> int:
    """K: `configured` when > 0, else S plus one per 25 ms of round trip on each of the S − 1
    links (enough to cover the latency of the chain); never more than the micro-batches."""
    if configured > 0:
        return max(1, min(configured, microbatches))
    extra = round(max(0.0, rtt_s) * max(0, stages - 1) / RTT_PER_EXTRA_S)
    return max(1, min(microbatches, stages + extra))


def configured_in_flight(default: int) -> int:
    """The local override (`PEER_TRAIN__IN_FLIGHT`, set by `peer join --in-flight`) or the config's."""
    raw = os.environ.get(IN_FLIGHT_ENV, "").strip()
    if not raw:
        return default
    try:
        return max(0, int(raw))
    except ValueError:
        log.warning("%s=%r is not an integer; using train.in_flight=%d", IN_FLIGHT_ENV, raw, default)
        return default


class PipelineBehind(NetworkError):
    """The stage peers moved on to a later outer step: the head must re-sync before training."""


_PEER_STEP = re.compile(r"(?:is at outer step|finishing outer round) (\d+)")


def past_step(message: str, t: int) -> bool:
    """A stage peer's busy reply says it is already past outer step `t`."""
    found = _PEER_STEP.search(message)
    return found is not None and int(found.group(1)) > t


class StageBusy(PeerError):
    """A stage is between rounds: wait and replay without counting a failure."""


class _Aborted(PeerError):
    """Another micro-batch of this attempt failed first."""


class PipelinedStep:
    """Runs one inner step for a `PipelineDriver` with K micro-batches in flight."""

    def __init__(self, driver: PipelineDriver) -> None:
        self.driver = driver
        self._rtt: dict[str, float] = {}
        self._equiv_lock = threading.Lock()

    # ------------------------------------------------------------------ schedule choice
    def in_flight(self, t: int) -> int:
        cfg = self.driver.cfg
        configured = configured_in_flight(cfg.train.in_flight)
        rtt = 0.0
        if configured == 0 and cfg.stages > 1:
            rtt = self.rtt(self.driver._ensure_peer(1, t)[1])
        k = choose_in_flight(configured, cfg.stages, cfg.train.microbatches, rtt)
        service = getattr(self.driver.session, "service", None)
        if service is not None:
            service.schedule = {"in_flight": k, "rtt_ms": round(rtt * 1e3, 2)}
        return k

    def rtt(self, address: str) -> float:
        """Smallest of three `info` round trips to `address` (seconds), measured once per peer."""
        if address not in self._rtt:
            client = self.driver.session.clients.get(address)
            times = []
            for _ in range(3):
                started = time.monotonic()
                try:
                    client.info(timeout_s=self.driver.cfg.swarm.rpc_timeout_s)
                except PeerError:
                    return 0.0
                times.append(time.monotonic() - started)
            self._rtt[address] = min(times)
            log.info("round trip to %s: %.1f ms", address, self._rtt[address] * 1e3)
        return self._rtt[address]

    # ------------------------------------------------------------------ the inner step
    def run(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor, k: int) -> tuple[float, list[float | None]]:
        """(mean loss, Σ‖g‖² of stages S−1 … 1) of inner step h; replays after a failed stage."""
        failures, attempt = 0, 0
        busy_until = time.monotonic() + self.driver.cfg.swarm.claim_timeout_s
        while True:
            try:
                return self._attempt(t, h, x, y, k, attempt)
            except StageBusy as exc:
                if time.monotonic() > busy_until:
                    raise NetworkError(f"inner step {h} of outer step {t}: {exc}") from None
                self.driver.stop.wait(0.2)
            except _StageFailed as exc:
                failures += 1
                if failures > 3:
                    raise NetworkError(f"inner step {h} of outer step {t} failed {failures} times: {exc}") from None
                log.warning("replaying inner step %d of outer step %d (attempt %d) after: %s", h, t, attempt + 1, exc)
            if self.driver.stop.is_set():
                raise PeerError("stopped")
            attempt += 1
            self.driver.worker.zero_grad()

    def _attempt(
        self, t: int, h: int, x: torch.Tensor, y: torch.Tensor, k: int, attempt: int
    ) -> tuple[float, list[float | None]]:
        d = self.driver
        n = d.cfg.train.microbatches
        route = tuple(d._ensure_peer(s, t)[1] for s in range(1, d.cfg.stages))
        abort = threading.Event()
        pool = ThreadPoolExecutor(max_workers=k, thread_name_prefix="peer-mb")
        futures: list[Future[tuple[float, list[float | None]]]] = []
        try:
            for mb, (mb_x, mb_y) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
                futures.append(pool.submit(self._microbatch, t, h, mb, mb_x, mb_y, attempt, route, k, abort))
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = [e for f in futures if f.done() and (e := f.exception()) is not None]
            if failed:
                abort.set()
                first = next((e for e in failed if not isinstance(e, _Aborted)), failed[0])
                raise self._classify(first, t) from None
            results = [f.result() for f in futures]
        finally:
            abort.set()
            pool.shutdown(wait=False, cancel_futures=True)
        total = 0.0
        for loss, _ in results:
            total += loss / n  # in micro-batch order, as the sequential schedule sums
        return total, results[-1][1]

    def _microbatch(
        self,
        t: int,
        h: int,
        mb: int,
        mb_x: torch.Tensor,
        mb_y: torch.Tensor,
        attempt: int,
        route: tuple[str, ...],
        k: int,
        abort: threading.Event,
    ) -> tuple[float, list[float | None]]:
        d = self.driver
        key, epoch = (d.pipeline_id, mb), (h, attempt)
        if abort.is_set():
            raise _Aborted("aborted")
        hidden = d.worker.forward(key, mb_x, None, None, epoch, k).hidden  # (b, L, k)
        if hidden is None:
            raise PeerError("stage 0 produced no activations")
        request = ForwardRequest(
            d.pipeline_id,
            mb,
            t,
            h,
            1,
            mb_x.to(torch.int32),
            hidden,
            targets=mb_y.to(torch.int32),
            attempt=attempt,
            route=route[1:],
            window=k,
        )
        reply = self._send(route[0], request, t, abort)
        if reply.grad is None or reply.loss is None:
            raise TransportError("stage 1 answered a streamed micro-batch without loss and gradient")
        if abort.is_set():
            raise _Aborted("aborted")
        d.worker.backward(key, reply.grad, epoch)
        norms: list[float | None] = list(reply.sq_norms) or [reply.grad_sq_norm]
        return reply.loss, norms

    def _send(self, address: str, request: ForwardRequest, t: int, abort: threading.Event) -> ForwardReply:
        """The streamed call into stage 1; a busy stage 1 (nothing done there yet) is retried."""
        d = self.driver
        deadline = time.monotonic() + d.cfg.swarm.claim_timeout_s
        timeout = d.cfg.swarm.rpc_timeout_s * max(1, d.cfg.stages - 1)
        b, L = request.tokens.shape[0], request.tokens.shape[1]
        while True:
            with self._equiv_lock:  # every send, retries and replays included: like for like with `moved`
                d.act_equiv += d._equiv_bytes(b, L, streamed=True)
            try:
                return d.session.clients.get(address).forward(request, timeout_s=timeout)
            except RemoteError as exc:
                direct_busy = exc.code == "FAILED_PRECONDITION" and "claimed by pipeline" not in str(exc)
                if not direct_busy or past_step(str(exc), t) or time.monotonic() > deadline:
                    raise
            if abort.wait(0.2):
                raise _Aborted("aborted")

    def _classify(self, exc: BaseException, t: int) -> Exception:
        """The exception that ends this attempt: replay after dropping a peer, wait, or give up."""
        d = self.driver
        if isinstance(exc, NotFoundError):
            d._drop(1, str(exc))
            return _StageFailed(str(exc))
        if isinstance(exc, RemoteError):
            hop = HopError.parse(str(exc)) if exc.code == "ABORTED" else None
            stage, kind = hop if hop is not None else (1, _direct_kind(exc))
            if kind == "busy" and past_step(str(exc), t):
                d._drop(stage, "past this outer step")
                return PipelineBehind(f"stage {stage} peer is past outer step {t}: {exc}")
            if kind == "busy":
                return StageBusy(str(exc))
            if kind in ("network", "lost", "claimed"):
                d._drop(stage, str(exc))
            return _StageFailed(str(exc))
        if isinstance(exc, NetworkError):
            d._drop(1, str(exc))
            return _StageFailed(str(exc))
        if isinstance(exc, (TransportError, _Aborted, KeyError, ValueError)):
            return _StageFailed(str(exc))
        return exc if isinstance(exc, Exception) else PeerError(str(exc))


class _StageFailed(PeerError):
    """This attempt of the inner step failed; replay it."""


def _direct_kind(exc: RemoteError) -> str:
    if "claimed by pipeline" in str(exc):
        return "claimed"
    return "busy" if exc.code == "FAILED_PRECONDITION" else "remote"

"""The head's pipelined inner step: micro-batches in flight (1F1B) with stage-to-stage streaming.

The head keeps up to K micro-batches in the pipeline (`train.in_flight`; 0 picks K from the
number of stages S, the measured round trip, the time one boundary message takes through the
slowest bandwidth cap of the chain and the measured compute time per micro-batch,
`choose_in_flight`; re-evaluated before every inner step). For each micro-batch it runs
stage 0's forward, sends the boundary X̃ and the targets to stage 1 with the route of the later
stages' addresses, and gets back the loss and ∇X̃ of stage 1's input: stage s forwards to s + 1
itself and backpropagates what s + 1 answers (`PeerService._stream`), so the head's link carries
one boundary each way per micro-batch whatever S is. Every stage orders gradient accumulation by
micro-batch (`StageWorker._admit`) and stashes at most K − s micro-batches, so the result is the
sequential schedule's bit for bit, independent of network timing; the loss is summed in
micro-batch order and the optimizer step stays synchronous at the end of the inner step.

Failures: every request carries the attempt number of this inner step. A failed hop names its
stage (`HopError`); the head drops that peer (`PipelineDriver._drop`), claims another and replays
the whole inner step with a new attempt (numbers grow from the clock and never repeat). A stage
that sees a higher attempt drops the step's gradients first, a lower one is refused as stale, so a
replay never counts a gradient twice.
"""

from __future__ import annotations

import itertools
import logging
import os
import re
import statistics
import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING

import torch

from peer.config import WIRE_DTYPES, RunConfig
from peer.errors import NetworkError, PeerError
from peer.net import ratelimit
from peer.net.transport.errors import HopError, NotFoundError, RemoteError, TransportError
from peer.net.transport.messages import ForwardReply, ForwardRequest

if TYPE_CHECKING:
    from peer.node.pipeline import PipelineDriver

log = logging.getLogger(__name__)

IN_FLIGHT_ENV = "PEER_TRAIN__IN_FLIGHT"  # a head's local choice (also set by `peer join --in-flight`)
RTT_PER_EXTRA_S = 0.025  # auto, before any compute is measured: one more micro-batch per 25 ms of hop time
SLACK = 2  # auto: micro-batches beyond the latency bound, for the messaging each stage's core does (docs/pipeline.md)
MIN_COMPUTE_S = 0.005  # a measured compute time per micro-batch below this counts as this (bounds K)
MAX_STASH = 32  # a stage never stashes more micro-batches than this (their activations wait for backward)
RTT_SAMPLES = 5  # the round trip: the smallest of the last probes (three at first, then one per step, unwaited)


def choose_in_flight(
    configured: int,
    stages: int,
    microbatches: int,
    rtt_s: float,
    serialize_s: float = 0.0,
    compute_s: float = RTT_PER_EXTRA_S,
    stash_limit: int = MAX_STASH,
) -> int:
    """K: `configured` when > 0, else S plus enough micro-batches to cover the chain's latency while
    each stage computes, plus SLACK: hop = round trip + `serialize_s` (a boundary message and its
    gradient at the slowest cap, `serialization_s`), K = S + SLACK + round((S − 1) · hop / compute
    per micro-batch); never more than the micro-batches nor `stash_limit`; 1 for one stage."""
    if configured > 0:
        return max(1, min(configured, microbatches))
    hop_s = max(0.0, rtt_s) + max(0.0, serialize_s)
    extra = round(hop_s * max(0, stages - 1) / max(compute_s, MIN_COMPUTE_S))
    slack = SLACK if stages > 1 else 0
    return max(1, min(microbatches, stash_limit, stages + slack + extra))


def serialization_s(hop_bytes: int, caps_mbps: Iterable[float | None]) -> float:
    """Seconds `hop_bytes` (one hop's boundary message and its gradient) take at the slowest of
    `caps_mbps` (the head's and its stage peers' upload and download caps); 0 when none is capped."""
    rates = [float(c) * ratelimit.MBIT for c in caps_mbps if c is not None and c > 0]
    return hop_bytes / min(rates) if rates else 0.0


def hop_bytes(cfg: RunConfig) -> int:
    """Bytes of one hop of one micro-batch: the compressed boundary (b, L, k) with its int32 tokens
    and targets forward, its gradient back (framing left out)."""
    b, L = cfg.train.batch_size // cfg.train.microbatches, cfg.train.seq_len
    boundary = b * L * cfg.k * WIRE_DTYPES[cfg.subspace.wire_dtype].itemsize
    return 2 * boundary + 2 * b * L * 4


def network_per_hop(network_s: Sequence[float]) -> float:
    """One hop's network seconds (both ways, framing and codec included) from the network part of an
    inner step's calls into stage 1: their median, so a token bucket's free burst or one slow
    message does not decide K."""
    return float(statistics.median(network_s))


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


_STALE = re.compile(r"is stale: stage (\d+) runs \((\d+), (\d+), \d+\)")  # StageWorker._admit's refusal


class StageBusy(PeerError):
    """A stage is between rounds: wait and replay without counting a failure."""


class _Aborted(PeerError):
    """Another micro-batch of this attempt failed first."""


class PipelinedStep:
    """Runs one inner step for a `PipelineDriver` with K micro-batches in flight."""

    def __init__(self, driver: PipelineDriver) -> None:
        self.driver = driver
        self._rtt: dict[str, deque[float]] = {}
        self._rtt_lock = threading.Lock()
        self._probing: set[str] = set()  # addresses with a background round-trip probe under way
        self._caps: dict[str, tuple[float | None, float | None]] = {}  # address -> its (upload, download) caps
        self._busy = driver.worker.busy_s  # stage 0's compute seconds at the last choice
        self._compute_s: float | None = None
        self._calls: list[float] = []  # network seconds of each streamed call into stage 1 in this inner step
        self._network_s: float | None = None  # measured network time of one hop (smoothed)
        self.k = 0
        self._equiv_lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None  # K workers, kept while K stays and no attempt fails
        self._pool_k = 0
        # attempt numbers never repeat: they grow across replays, inner steps and paused retries,
        # and start from the clock (ms), so a restarted head (same pipeline id) outnumbers its
        # earlier process; restarting at 0 left stages refusing every replay as stale
        self._attempts = itertools.count(time.time_ns() // 1_000_000)

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

    # ------------------------------------------------------------------ schedule choice
    def in_flight(self, t: int) -> int:
        """K for the next inner step, re-evaluated each time from the latest measurements."""
        cfg = self.driver.cfg
        configured = configured_in_flight(cfg.train.in_flight)
        rtt = ser = 0.0
        compute = self._measured_compute()
        if configured == 0 and cfg.stages > 1:
            route = [self.driver._ensure_peer(s, t)[1] for s in range(1, cfg.stages)]
            rtt = self.rtt(route[0])
            link = self.driver.session.clients.outbound.link.caps  # this peer's own caps
            caps = [link.upload_mbps, link.download_mbps, *(c for a in route for c in self.caps(a))]
            ser = serialization_s(hop_bytes(cfg), caps)
            network = self._measured_network()
            if network is not None and network > rtt + ser:  # the link is slower than probes and caps say
                rtt, ser = network, 0.0
        k = choose_in_flight(configured, cfg.stages, cfg.train.microbatches, rtt, ser, compute or RTT_PER_EXTRA_S)
        if k != self.k:
            log.info(
                "micro-batches in flight: %d (hop %.1f ms + serialization %.1f ms, compute %s per micro-batch)",
                k,
                rtt * 1e3,
                ser * 1e3,
                "not measured yet" if compute is None else f"{compute * 1e3:.1f} ms",
            )
        self.k = k
        service = getattr(self.driver.session, "service", None)
        if service is not None:
            service.schedule = {"in_flight": k, "rtt_ms": round(rtt * 1e3, 2), "serialize_ms": round(ser * 1e3, 2)}
        return k

    def _measured_compute(self) -> float | None:
        """Stage 0's compute seconds per micro-batch in the inner step(s) since the last call
        (smoothed); None before any was measured."""
        busy, last = self.driver.worker.busy_s, self._busy
        self._busy = busy
        if busy > last:
            per_mb = (busy - last) / max(1, self.driver.cfg.train.microbatches)
            self._compute_s = per_mb if self._compute_s is None else 0.5 * (self._compute_s + per_mb)
        return self._compute_s

    def _measured_network(self) -> float | None:
        """Network seconds of one hop, measured on the last inner step's streamed calls (each call's
        time less the time stage 1 held it, `ForwardReply.served_s`); smoothed, None until measured."""
        calls, self._calls = self._calls, []
        if calls:
            hop = network_per_hop(calls)
            self._network_s = hop if self._network_s is None else 0.5 * (self._network_s + hop)
        return self._network_s

    def rtt(self, address: str) -> float:
        """Round trip to `address` (seconds): the smallest of its last `RTT_SAMPLES` `info` probes;
        three at first sight (waited for), then one per call in the background (a daemon thread:
        waiting for it would cost the inner step a round trip), so K follows a link whose latency
        changes."""
        with self._rtt_lock:
            samples = self._rtt.setdefault(address, deque(maxlen=RTT_SAMPLES))
            first = not samples
            probing = address in self._probing
            if not first and not probing:
                self._probing.add(address)
        if first:
            for _ in range(3):
                if not self._probe(address):
                    break
        elif not probing:
            threading.Thread(target=self._probe, args=(address, True), daemon=True, name="peer-rtt").start()
        with self._rtt_lock:
            return min(samples) if samples else 0.0

    def _probe(self, address: str, background: bool = False) -> bool:
        """One `info` round trip to `address`, added to its samples (and its caps remembered)."""
        info = None
        try:
            started = time.monotonic()
            info = self.driver.session.clients.get(address).info(timeout_s=self.driver.cfg.swarm.rpc_timeout_s)
            elapsed = time.monotonic() - started
        except PeerError:
            pass
        finally:
            with self._rtt_lock:  # the sample lands before the probe counts as done
                if info is not None:
                    self._rtt.setdefault(address, deque(maxlen=RTT_SAMPLES)).append(elapsed)
                if background:
                    self._probing.discard(address)
        if info is None:
            return False
        self._remember_caps(address, info)
        return True

    def caps(self, address: str) -> tuple[float | None, float | None]:
        """A stage peer's (upload, download) caps in Mbit/s from its `info` (asked once per address)."""
        if address not in self._caps:
            try:
                info = self.driver.session.clients.get(address).info(timeout_s=self.driver.cfg.swarm.rpc_timeout_s)
            except PeerError:
                return (None, None)  # asked again next inner step
            self._remember_caps(address, info)
        return self._caps[address]

    def _remember_caps(self, address: str, info: dict) -> None:
        net = info.get("net")
        net = net if isinstance(net, dict) else {}
        up, down = (net.get(k) for k in ("max_upload_mbps", "max_download_mbps"))
        self._caps[address] = (_cap(up), _cap(down))

    # ------------------------------------------------------------------ the inner step
    def run(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor, k: int) -> tuple[float, list[float | None]]:
        """(mean loss, Σ‖g‖² of stages S−1 … 1) of inner step h; replays after a failed stage."""
        failures, attempt = 0, next(self._attempts)
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
            attempt = next(self._attempts)
            self.driver.worker.zero_grad()

    def _attempt(
        self, t: int, h: int, x: torch.Tensor, y: torch.Tensor, k: int, attempt: int
    ) -> tuple[float, list[float | None]]:
        d = self.driver
        n = d.cfg.train.microbatches
        route = tuple(d._ensure_peer(s, t)[1] for s in range(1, d.cfg.stages))
        abort = threading.Event()
        turns = _ForwardTurns(abort)
        pool = self._workers(k)
        futures: list[Future[tuple[float, list[float | None]]]] = []
        ok = False
        try:
            for mb, (mb_x, mb_y) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
                futures.append(pool.submit(self._microbatch, t, h, mb, mb_x, mb_y, attempt, route, k, turns))
            wait(futures, return_when=FIRST_EXCEPTION)
            failed = [e for f in futures if f.done() and (e := f.exception()) is not None]
            if failed:
                abort.set()
                first = next((e for e in failed if not isinstance(e, _Aborted)), failed[0])
                raise self._classify(first, t, h) from None
            results = [f.result() for f in futures]
            ok = True
        finally:
            abort.set()
            if not ok:
                self._discard_pool()
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
        turns: _ForwardTurns,
    ) -> tuple[float, list[float | None]]:
        d = self.driver
        key, epoch, abort = (d.pipeline_id, mb), (h, attempt), turns.abort
        turns.wait(mb)
        try:
            hidden = d.worker.forward(key, mb_x, None, None, epoch, k).hidden  # (b, L, k)
        finally:
            turns.done(mb)
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
            defer_norms=mb == d.cfg.train.microbatches - 1,  # the flush: Σ‖g‖² come after the gradient
        )
        reply = self._send(route[0], request, t, abort)
        if reply.grad is None or reply.loss is None:
            raise TransportError("stage 1 answered a streamed micro-batch without loss and gradient")
        if abort.is_set():
            raise _Aborted("aborted")
        d.worker.backward(key, reply.grad, epoch)  # while the stages after compute their weight gradients
        norms: list[float | None] = [*reply.norms()] or [None]
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
                started = time.monotonic()
                reply = d.session.clients.get(address).forward(request, timeout_s=timeout)
                if reply.served_s is not None:  # the network part of the call (an older peer: not known)
                    self._calls.append(max(0.0, time.monotonic() - started - reply.served_s))
                return reply
            except RemoteError as exc:
                direct_busy = exc.code == "FAILED_PRECONDITION" and "claimed by pipeline" not in str(exc)
                if not direct_busy or past_step(str(exc), t) or time.monotonic() > deadline:
                    raise
            if abort.wait(0.2):
                raise _Aborted("aborted")

    def _classify(self, exc: BaseException, t: int, h: int) -> Exception:
        """The exception that ends this attempt: replay after dropping a peer, wait, or give up."""
        d = self.driver
        ahead = _STALE.search(str(exc))
        if ahead is not None and int(ahead.group(1)) > 0 and (int(ahead.group(2)), int(ahead.group(3))) > (t, h):
            # the peer ran later inner steps of this outer step, for an earlier process of this
            # pipeline (a restarted head): its weights moved on, it cannot serve this one again
            d._drop(int(ahead.group(1)), "it ran later inner steps of this outer step for an earlier process")
            return _StageFailed(str(exc))
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


def _cap(value: object) -> float | None:
    """A cap field of a peer's info: Mbit/s, or None for no cap (missing, 0, junk)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return float(value)


class _StageFailed(PeerError):
    """This attempt of the inner step failed; replay it."""


def _direct_kind(exc: RemoteError) -> str:
    if "claimed by pipeline" in str(exc):
        return "claimed"
    return "busy" if exc.code == "FAILED_PRECONDITION" else "remote"

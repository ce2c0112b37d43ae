"""How many micro-batches the head keeps in flight (K), from the measured links and compute.

The head keeps up to K micro-batches in the pipeline (`train.in_flight`; 0 picks K from the
number of stages S, the measured round trip, the time one boundary message takes through the
slowest bandwidth cap of the chain and the measured compute time per micro-batch,
`choose_in_flight`; re-evaluated before every inner step by `LinkEstimator.in_flight`). K = 1 is
the sequential schedule. docs/pipeline.md has the rule and the measurements behind SLACK.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from peer.config import WIRE_DTYPES, RunConfig
from peer.errors import PeerError
from peer.net import ratelimit
from peer.net.pool import ClientPool
from peer.node.pipeline.mode import MIN_WIRE_S, HeldBandwidth, LinkFigures, held_bandwidth, measured_bandwidth

log = logging.getLogger(__name__)

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


def hop_bytes(cfg: RunConfig, compressed: bool = True) -> int:
    """Bytes of one hop of one micro-batch: the boundary (b, L, k), or (b, L, d) uncompressed, with
    its int32 tokens and targets forward, its gradient back (framing left out)."""
    b, L = cfg.train.batch_size // cfg.train.microbatches, cfg.train.seq_len
    width = cfg.k if compressed else cfg.model.d_model
    boundary = b * L * width * WIRE_DTYPES[cfg.subspace.wire_dtype].itemsize
    return 2 * boundary + 2 * b * L * 4


def network_per_hop(network_s: Sequence[float]) -> float:
    """One hop's network seconds (both ways, framing and codec included) from the network part of an
    inner step's calls into stage 1: their median, so a token bucket's free burst or one slow
    message does not decide K."""
    return float(statistics.median(network_s))


def with_in_flight(cfg: RunConfig, in_flight: int | None) -> RunConfig:
    """The run's config with this peer's own window K (`peer join --in-flight`, `SessionOptions.in_flight`;
    None: the run's `train.in_flight`). `train.in_flight` is left out of the run's fingerprint, so a head
    chooses its own; only the pipeline and the memory check see this copy, never a checkpoint."""
    if in_flight is None:
        return cfg
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, in_flight=max(0, in_flight)))


class LinkEstimator:
    """The measurements behind K: round trips and caps of the stage peers (their `info`), stage 0's
    compute per micro-batch and the network part of the streamed calls into stage 1."""

    def __init__(
        self,
        cfg: RunConfig,
        clients: ClientPool,
        busy_s: Callable[[], float],
        on_schedule: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """busy_s: stage 0's compute seconds so far; on_schedule: shown K, round trip and serialization."""
        self.cfg, self.clients, self.busy_s, self.on_schedule = cfg, clients, busy_s, on_schedule
        self._rtt: dict[str, deque[float]] = {}
        self._rtt_lock = threading.Lock()
        self._probing: set[str] = set()  # addresses with a background round-trip probe under way
        self._caps: dict[str, tuple[float | None, float | None]] = {}  # address -> its (upload, download) caps
        self._busy = busy_s()  # stage 0's compute seconds at the last choice
        self._compute_s: float | None = None
        self._calls: list[float] = []  # network seconds of each streamed call into stage 1 in this inner step
        self._calls_lock = threading.Lock()
        self._network_s: float | None = None  # measured network time of one hop (smoothed)
        self.k = 0
        self._compressed = True  # the boundary mode of the calls measured (`set_compressed`)
        self._fastest: float | None = None  # the fastest call's network seconds since the last `figures`
        self._held: HeldBandwidth | None = None  # the last bandwidth a hop bounded (`held_bandwidth`)

    def in_flight(self, route: Callable[[], Sequence[str]]) -> int:
        """K for the next inner step, re-evaluated each time from the latest measurements; `route`
        gives the addresses of stages 1 … S−1 (asked only when K is chosen automatically)."""
        cfg = self.cfg
        configured = cfg.train.in_flight
        rtt = ser = 0.0
        compute = self._measured_compute()
        if configured == 0 and cfg.stages > 1:
            addresses = route()
            rtt = self.rtt(addresses[0])
            ser = serialization_s(hop_bytes(cfg, self._compressed), self._chain_caps(addresses))
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
        if self.on_schedule is not None:
            self.on_schedule({"in_flight": k, "rtt_ms": round(rtt * 1e3, 2), "serialize_ms": round(ser * 1e3, 2)})
        return k

    def set_compressed(self, compressed: bool) -> None:
        """The mode of the calls to come: a hop measured in the other mode moved other bytes, so the
        measured network time starts over, and the bandwidth held is let go (a single uncompressed
        hop misread on a busy core must not hold the compressed steps that follow)."""
        if compressed != self._compressed:  # a bandwidth read off the other mode's hops is not held
            self._compressed, self._network_s, self._held = compressed, None, None
            with self._calls_lock:
                self._calls, self._fastest = [], None

    def figures(self, route: Callable[[], Sequence[str]]) -> LinkFigures:
        """What the mode is chosen from (`peer.node.pipeline.mode`): stage 0's compute per
        micro-batch, the round trip to stage 1 and the slowest bandwidth of the chain, the lower of
        the stated caps and of the hops measured since the last call (`route`: stages 1 … S−1). A hop
        is measured by its fastest call: every call pays the link's serialization, while a busy core
        (or K calls queued on the link) only ever adds to some; a hop too fast to tell holds the last
        bandwidth measured for a while (`peer.node.pipeline.mode.held_bandwidth`)."""
        addresses = route()
        with self._rtt_lock:  # the probes so far (`rtt` probes on when K is chosen): 0 before any
            rtt = min(self._rtt.get(addresses[0]) or [0.0])
        with self._calls_lock:
            fastest, self._fastest = self._fastest, None
        rates = {"caps": min((c * ratelimit.MBIT for c in self._chain_caps(addresses) if c), default=None)}
        hop = hop_bytes(self.cfg, self._compressed)
        floor = None if fastest is None else hop / MIN_WIRE_S
        self._held = held_bandwidth(measured_bandwidth(hop, fastest, rtt), floor, self._held)
        rates["measured"] = None if self._held is None else self._held.bps
        known = {k: v for k, v in rates.items() if v is not None}
        source = min(known, key=lambda k: known[k]) if known else "none"
        return LinkFigures(self._compute_s, known.get(source), rtt, source)

    def _chain_caps(self, addresses: Sequence[str]) -> list[float | None]:
        """This peer's own (upload, download) caps and those of the stage peers at `addresses`."""
        link = self.clients.outbound.link.caps
        return [link.upload_mbps, link.download_mbps, *(c for a in addresses for c in self.caps(a))]

    def record_call(self, network_s: float) -> None:
        """The network part of one call into stage 1 (its time less the time stage 1 held it)."""
        with self._calls_lock:
            self._calls.append(max(0.0, network_s))
            self._fastest = network_s if self._fastest is None else min(self._fastest, network_s)

    def _measured_compute(self) -> float | None:
        """Stage 0's compute seconds per micro-batch in the inner step(s) since the last call
        (smoothed); None before any was measured."""
        busy, last = self.busy_s(), self._busy
        self._busy = busy
        if busy > last:
            per_mb = (busy - last) / max(1, self.cfg.train.microbatches)
            self._compute_s = per_mb if self._compute_s is None else 0.5 * (self._compute_s + per_mb)
        return self._compute_s

    def _measured_network(self) -> float | None:
        """Network seconds of one hop, measured on the last inner step's streamed calls (each call's
        time less the time stage 1 held it, `ForwardReply.served_s`); smoothed, None until measured."""
        with self._calls_lock:
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
            info = self.clients.get(address).info(timeout_s=self.cfg.swarm.rpc_timeout_s)
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
                info = self.clients.get(address).info(timeout_s=self.cfg.swarm.rpc_timeout_s)
            except PeerError:
                return (None, None)  # asked again next inner step
            self._remember_caps(address, info)
        return self._caps[address]

    def _remember_caps(self, address: str, info: dict[str, Any]) -> None:
        net = info.get("net")
        net = net if isinstance(net, dict) else {}
        up, down = (net.get(k) for k in ("max_upload_mbps", "max_download_mbps"))
        self._caps[address] = (_cap(up), _cap(down))


def _cap(value: object) -> float | None:
    """A cap field of a peer's info: Mbit/s, or None for no cap (missing, 0, junk)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        return None
    return float(value)

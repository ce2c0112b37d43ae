"""The links of `peer bench swarm`: per-peer bandwidth and latency draws, and a flow-level transfer model.

Where this sits: `peer.research.swarm.sim` runs one stage's outer rounds as a simpy discrete-event
simulation; every byte a simulated peer fetches goes through `Network.fetch` here.

Links (`LinkMix`, `draw_links`): a peer is a *home* link with probability 1 − `dc_fraction`, else a
*datacenter* link. Upload and download rates are the class's nominal Mbit/s times a log-normal factor
(σ = `spread`, median 1: some homes get less than their plan, some more); the round-trip time is uniform
in the class's [min, max] ms. A peer's one-way latency is half its RTT, and a request between peers a and
b costs (RTT_a + RTT_b) / 2 before its first byte, plus `rpc_s` of CPU at the server (gRPC, checks).
Every draw comes from one `random.Random(seed)`, so a seed gives the same swarm.

Transfers (`PSLink`, `Network`): every peer's upload and every peer's download is a processor-sharing
link: its capacity is divided equally among the transfers it carries at that moment, and the shares are
re-divided whenever a transfer starts or ends (fair sharing, as TCP flows sharing one bottleneck get).
A transfer from s to r runs on s's upload and r's download at once and ends when both have carried its
bytes: its time is the larger of the two links' processor-sharing times. When one end is the bottleneck
all along this is exactly a rate of min(s's upload share, r's download share); when the bottleneck moves
between the two ends mid-transfer it is a little optimistic (each link stays work-conserving: a share a
slow receiver cannot use goes to the sender's other transfers, as TCP's max-min fairness would give).
Each link is O(log n) per start/end (virtual time: a link with n transfers advances every transfer's
progress at capacity / n), which is what lets a 1,000-peer round with ~2 M requests run in seconds.
"""

from __future__ import annotations

import heapq
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import simpy

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class LinkClass:
    """Nominal rates and RTT range of one kind of link."""

    up_mbps: float
    down_mbps: float
    rtt_min_ms: float
    rtt_max_ms: float


@dataclass(frozen=True)
class LinkMix:
    """The swarm's links: home links, datacenter links, the share of the latter and the rates' spread."""

    home: LinkClass = LinkClass(20.0, 100.0, 20.0, 200.0)
    dc: LinkClass = LinkClass(1000.0, 1000.0, 5.0, 50.0)
    dc_fraction: float = 0.0  # share of datacenter peers (the target: all home links)
    spread: float = 0.0  # σ of the log-normal factor on a peer's rates (0: every peer gets its plan)
    rpc_s: float = 0.0  # CPU per request at the server


@dataclass(frozen=True)
class Link:
    """One peer's drawn link: bytes per second each way, its RTT in seconds, and its class."""

    up_Bps: float
    down_Bps: float
    rtt_s: float
    dc: bool


def draw_link(rng: random.Random, mix: LinkMix) -> Link:
    """One peer's link from `mix` (module docstring)."""
    dc = rng.random() < mix.dc_fraction
    cls = mix.dc if dc else mix.home
    factor = math.exp(rng.gauss(0.0, mix.spread)) if mix.spread > 0 else 1.0
    rtt_ms = rng.uniform(cls.rtt_min_ms, cls.rtt_max_ms)
    return Link(cls.up_mbps * MBIT * factor, cls.down_mbps * MBIT * factor, rtt_ms / 1e3, dc)


class PSLink:
    """One direction of one peer's link as a processor-sharing server (virtual time, one heap).

    V, the virtual time, grows at capacity / n while n transfers are active; a transfer of b bytes that
    starts at virtual time V0 ends when V reaches V0 + b. The next end is rescheduled at every start/end;
    a timeout of an older schedule finds its version stale and does nothing."""

    def __init__(self, env: simpy.Environment, Bps: float) -> None:
        self.env, self.Bps = env, Bps
        self.V, self.t = 0.0, 0.0
        self.jobs: list[tuple[float, int, Callable[[], None]]] = []  # (finish V, seq, done callback)
        self.seq = 0
        self.version = 0
        self.pending = False  # a wake-up of the current version is scheduled

    def _advance(self) -> None:
        now = self.env.now
        if self.jobs:
            self.V += (now - self.t) * self.Bps / len(self.jobs)
        self.t = now

    def add(self, nbytes: float, done: Callable[[], None]) -> None:
        """Start carrying `nbytes`; `done()` is called when they are carried."""
        self._advance()
        self.seq += 1
        heapq.heappush(self.jobs, (self.V + nbytes, self.seq, done))
        if self.pending and self.jobs[0][2] is not done:
            return  # the pending wake-up now comes early (n grew): it finds nothing done and reschedules
        self._schedule()

    def _schedule(self) -> None:
        self.version += 1
        self.pending = bool(self.jobs)
        if not self.jobs:
            return
        dt = max(0.0, (self.jobs[0][0] - self.V) * len(self.jobs) / self.Bps)
        version = self.version
        ev = self.env.timeout(dt)
        ev.callbacks.append(lambda _e: self._fire(version))

    def _fire(self, version: int) -> None:
        if version != self.version:
            return
        self.pending = False
        self._advance()
        finished = []
        eps = 1e-9 * max(1.0, self.V)
        while self.jobs and self.jobs[0][0] <= self.V + eps:
            finished.append(heapq.heappop(self.jobs)[2])
        self._schedule()
        for done in finished:
            done()


class Network:
    """Every peer's upload and download links, the requests between them and the bytes each carried.

    `up[t][p]` / `down[t][p]`: the bytes peer p sent / received for round t (a transfer's `tag`)."""

    def __init__(self, env: simpy.Environment, rpc_s: float = 0.0) -> None:
        self.env, self.rpc_s = env, rpc_s
        self.links: dict[str, Link] = {}
        self.up: dict[str, PSLink] = {}
        self.down: dict[str, PSLink] = {}
        self.sent: dict[int, dict[str, float]] = {}
        self.received: dict[int, dict[str, float]] = {}

    def add_peer(self, pid: str, link: Link) -> None:
        self.links[pid] = link
        self.up[pid] = PSLink(self.env, link.up_Bps)
        self.down[pid] = PSLink(self.env, link.down_Bps)

    def latency_s(self, a: str, b: str) -> float:
        """Time before a request's first byte arrives: one round trip between a and b, and the server's CPU."""
        return (self.links[a].rtt_s + self.links[b].rtt_s) / 2 + self.rpc_s

    def transfer(self, src: str, dst: str, nbytes: float, tag: int) -> simpy.Event:
        """An event that fires when `nbytes` went from src to dst after one request's latency (counted
        under round `tag`)."""
        env = self.env
        out = env.event()
        left = [2]

        def one_end_done() -> None:
            left[0] -= 1
            if left[0] == 0:
                sent, received = self.sent.setdefault(tag, {}), self.received.setdefault(tag, {})
                sent[src] = sent.get(src, 0.0) + nbytes
                received[dst] = received.get(dst, 0.0) + nbytes
                out.succeed()

        def start(_e: Any) -> None:
            if nbytes <= 0:
                left[0] = 1
                one_end_done()
                return
            self.up[src].add(nbytes, one_end_done)
            self.down[dst].add(nbytes, one_end_done)

        env.timeout(self.latency_s(src, dst)).callbacks.append(start)
        return out

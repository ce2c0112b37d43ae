"""`peer bench swarm`'s engine: one stage's outer rounds with N peers, as a simpy discrete-event simulation.

Where this sits: `peer.research.bench.swarm` builds a `SimConfig` per M and reads `simulate`'s rows; links
and transfers are `peer.research.swarm.net`, byte counts and compute times `peer.research.swarm.sizes`, the
three rules' gathers `peer.research.swarm.gather` ("all", "ranges") and
`peer.research.swarm.voted`. Every protocol decision is the swarm's own function, called,
never re-written: `ownership.round_rule` (which rule), `agreement.round_view` on real `peer.net.records`
(who is expected), `agreement.close_decision` on a `Poll` built from the simulated state (when a gather
or the roster closes), `ownership.coordinator_order` (who publishes the roster), `ownership.owners`
(who aggregates a range). `Protocol` holds them; a test passes a recording one.

A peer: computes H inner steps (the planner's time for its link, ±`jitter`), announces (visible to the
others `dht_s` later), gathers round t by its rule, commits, starts round t + 1. Churn: each live peer
leaves at rate `churn_per_h` (a Poisson process: sessions exponential with mean 1 / rate) at any moment,
its transfers failing and its DHT records expiring `record_ttl_s` later; new peers arrive at the same
total rate (M stays about constant) and contribute from the next round they reach.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any

import simpy

from peer.config import SwarmConfig
from peer.core.sparseloco.ranges.plan import n_ranges_for
from peer.node.round import agreement
from peer.node.round.ranges import ownership
from peer.node.round.ranges.fetch import MAX_FETCHERS
from peer.node.round.timings import RoundTimings
from peer.research.swarm.net import LinkMix, Network, draw_link
from peer.research.swarm.sizes import Sizes, compute_s, stage_sizes

SWARM = SwarmConfig()


@dataclass(frozen=True)
class Protocol:
    """The swarm's decision functions the simulator calls (the real ones by default)."""

    round_rule: Callable[[SwarmConfig, int], str] = ownership.round_rule
    owners: Callable[[int, int, int, Collection[str], int], list[str]] = ownership.owners
    coordinator_order: Callable[[int, int, Collection[str]], list[str]] = ownership.coordinator_order
    round_view: Callable[..., agreement.RoundView] = agreement.round_view
    close_decision: Callable[[agreement.Poll], agreement.Close] = agreement.close_decision


@dataclass
class RuleHooks:
    """How a peer runs its rounds (`run_peer(sim, peer)`, a simpy process) and how a range is checked
    when an owner's records expire (`check_range(sim, ranges, r)`), and each rule's gather: those of
    `peer.research.swarm.gather` and `.voted`, passed in by `peer.research.swarm.run.simulate`, so the
    engine never imports the gathers that read it."""

    run_peer: Callable[..., Any] = field(default=lambda sim, peer: iter(()))
    check_range: Callable[..., None] = field(default=lambda sim, ranges, r: None)
    gathers: dict[str, Callable[..., Any]] = field(default_factory=dict)  # rule -> its gather (run_peer calls)


@dataclass(frozen=True)
class SimConfig:
    """One simulation: the swarm, its links, the model and the protocol's clocks (units in names)."""

    peers: int = 8
    rule: str = "ranges"  # swarm.round_rule: "all", "ranges", "voted" or "auto"
    rounds: int = 3
    seed: int = 0
    preset: str = "1B"
    stages: int = 4
    stage: int = 0
    inner_steps: int = 50
    flops: float = 400e12  # one device's sustained FLOP/s (`peer plan --flops`)
    mix: LinkMix = LinkMix()
    churn_per_h: float = 0.0  # leaves per peer per hour (and as many joins)
    deadline_s: float = SWARM.round_timeout_s
    record_ttl_s: float = SWARM.record_ttl_s
    poll_s: float = RoundTimings(0.0).poll_s
    dht_s: float = 0.5  # from a DHT store's start until every reader sees it
    dht_store_s: float = 0.3  # a DHT store's call (the announcer waits for it)
    dht_read_s: float = 0.1  # one DHT read of a round's records
    fetch_parallel: int = MAX_FETCHERS  # requests in flight per peer in a "ranges" round ("all": 1, as gather_round)
    range_backups: int = SWARM.range_backups
    shard_topk: int = SWARM.shard_topk
    shard: str = SWARM.shard  # swarm.shard: "topk" or "exact"
    mean_bits: int = SWARM.mean_bits  # the voted round's mean shards (`swarm.mean_bits`; 0: float32)
    support_topk: int = 64  # k′: positions per tile of the voted rule's agreed support (docs/results.md: 64)
    owner_grace_s: float = SWARM.owner_grace_s  # a range's co-owners are waited for this long after its first
    roster_quiet_s: float = SWARM.roster_quiet_s  # the roster closes this long after the last announcement ...
    roster_quorum: float = SWARM.roster_quorum  # ... once this share of the expected contributors announced
    roster_wait_s: float = 5.0  # the next publisher in coordinator_order waits this long for the roster
    jitter: float = 0.05  # compute time × U(1 − jitter, 1 + jitter) per peer and round
    compute_s: float | tuple[float, ...] | None = None  # H inner steps' wall time (per peer: cycled; None: planner)
    sizes: Sizes | None = None  # byte counts (None: `stage_sizes` of the preset)

    def swarm(self) -> SwarmConfig:
        return SwarmConfig(
            round_rule=self.rule, range_backups=self.range_backups, shard_topk=self.shard_topk, shard=self.shard
        )


@dataclass
class PeerRound:
    """What one peer did in one round."""

    pid: str
    t: int
    rule: str
    compute_s: float
    round_s: float = 0.0
    outcome: str = ""  # the close decision ("complete", "deadline") or "ranges", "voted", "timeout", "left"
    counted: int = 0  # contributions in the set it committed
    start_s: float = 0.0  # simulated time of its announce (round_s counts from it)


@dataclass
class Peer:
    pid: str
    alive: bool = True
    step: int = 0  # the outer step its records publish
    joined_at: int = 0
    records_until: float = float("inf")  # when its DHT records expire (it left at that minus the TTL)
    poll_phase: float = 0.0


@dataclass
class RoundBoard:
    """The DHT's view of one round, as every reader sees it (visible times)."""

    announced: dict[str, float] = field(default_factory=dict)  # sender -> when its announcement is visible
    roster: tuple[str, ...] | None = None
    roster_at: float = float("inf")
    roster_pending: bool = False
    holders_of: dict[str, set[str]] = field(default_factory=dict)  # payload sender -> peers that hold it
    R: int = 1
    sizes: Sizes | None = None
    ranges: Any = None  # swarm_gather.Ranges once the roster is read
    phases: list[Any] = field(default_factory=list)  # every Ranges whose readiness waits on its owners' records
    voted: Any = None  # swarm_voted.Voted once a voted round's roster is out


class Sim:
    """The simulated swarm: peers, network, DHT boards, and the records `round_view` reads."""

    def __init__(self, cfg: SimConfig, protocol: Protocol | None = None, rules: RuleHooks | None = None) -> None:
        """`rules`: the two rules' gathers (`peer.research.swarm.run` passes `peer.research.swarm.gather`'s)."""
        self.cfg, self.proto = cfg, protocol or Protocol()
        self.rules = rules or RuleHooks()
        self.env = simpy.Environment()
        self.rng = random.Random(cfg.seed)
        self.net = Network(self.env, cfg.mix.rpc_s)
        self.peers: dict[str, Peer] = {}
        self.boards: dict[int, RoundBoard] = {}
        self.log: list[PeerRound] = []
        self.version = 0  # bumped whenever a record any reader sees changes
        self.n_prev: dict[int, int] = {}  # round -> contributions committed (the first committer's set)
        self.next_id = 0
        self.max_compute_s = 0.0
        self.pools: dict[str, Any] = {}  # pid -> its swarm_gather.Pool
        self.left: list[str] = []  # every peer that left, in order
        self._views: dict[tuple[int, str], tuple[int, agreement.RoundView]] = {}
        self._order: dict[int, tuple[int, list[str]]] = {}

    # ------------------------------------------------------------------------------------ peers

    def add_peer(self, first_round: int) -> None:
        pid = f"peer{self.next_id:05d}"
        self.next_id += 1
        link = draw_link(self.rng, self.cfg.mix)
        self.net.add_peer(pid, link)
        peer = Peer(pid, step=first_round, joined_at=first_round, poll_phase=self.rng.uniform(0, self.cfg.poll_s))
        self.peers[pid] = peer
        self.version += 1
        self.env.process(self.rules.run_peer(self, peer))

    def leave(self, peer: Peer) -> None:
        peer.alive = False
        peer.records_until = self.env.now + self.cfg.record_ttl_s
        self.left.append(peer.pid)
        self.version += 1
        self.env.timeout(self.cfg.record_ttl_s).callbacks.append(lambda _e: self._expired(peer.pid))

    def _expired(self, pid: str) -> None:
        """`pid`'s records expired: ranges it owned may be ready now (its backups', or the fallback)."""
        self.version += 1
        for board in self.boards.values():
            for phase in board.phases:
                for r in phase.mine.get(pid, ()):
                    self.rules.check_range(self, phase, r)

    def recorded(self, pid: str) -> bool:
        """Its DHT records are still there (alive, or left less than the TTL ago)."""
        return self.peers[pid].records_until > self.env.now

    def compute_time(self, peer: Peer) -> float:
        cfg = self.cfg
        if isinstance(cfg.compute_s, tuple):  # measured, per peer
            base = cfg.compute_s[int(peer.pid[4:]) % len(cfg.compute_s)]
            self.max_compute_s = max(self.max_compute_s, base)
            return base
        if cfg.compute_s is not None:
            base = cfg.compute_s
        else:
            link = self.net.links[peer.pid]
            base = compute_s(cfg.preset, cfg.stages, cfg.inner_steps, cfg.flops, 8 * link.up_Bps / 1e6)
        out = base * self.rng.uniform(1 - cfg.jitter, 1 + cfg.jitter)
        self.max_compute_s = max(self.max_compute_s, out)
        return out

    def board(self, t: int) -> RoundBoard:
        board = self.boards.get(t)
        if board is None:
            board = self.boards[t] = RoundBoard()
            n_prev = self.n_prev.get(t - 1, self.cfg.peers)  # round 0: a swarm already running at M
            board.sizes = self.cfg.sizes or stage_sizes(
                self.cfg.preset, self.cfg.stages, self.cfg.stage, n_prev, self.cfg.shard_topk, self.cfg.shard
            )
            board.R = board.sizes.n if self.cfg.sizes is None else n_ranges_for(n_prev, board.sizes.n)
        return board

    def rule(self, t: int) -> str:
        return self.proto.round_rule(self.cfg.swarm(), self.n_prev.get(t - 1, self.cfg.peers))

    # ------------------------------------------------------------------------------------ the real view

    def view(self, t: int, me: str) -> agreement.RoundView:
        """`agreement.round_view` of round t for `me` on typed records of the simulated DHT (cached while
        no record changed: the function is pure)."""
        key = (t, me)
        hit = self._views.get(key)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        from peer.net.records import Announcement, ReplicaRecord, StageRecord

        now = self.env.now
        live = [p for p in self.peers.values() if p.records_until > now]
        replicas = {p.pid: ReplicaRecord(kind="full", outer_step=p.step, joined_at=p.joined_at, inc="1") for p in live}
        holders = {p.pid: StageRecord(role="full", state="busy", outer_step=p.step, inc="1") for p in live}
        board = self.board(t)
        anns = {s: Announcement(sha256=s, size=1, inc="1") for s, at in board.announced.items() if at <= now}
        view = self.proto.round_view(t, 0, anns, {}, replicas, holders, me, "1")
        self._views[key] = (self.version, view)
        return view

    def publishers(self, t: int, first: int = 3) -> list[str]:
        """The first `first` of `ownership.coordinator_order` over the live holders gathering round t
        (at outer step t − 1 or t), cached while no record changed."""
        hit = self._order.get(t)
        if hit is not None and hit[0] == self.version:
            return hit[1]
        now = self.env.now
        gathering = [p.pid for p in self.peers.values() if p.records_until > now and p.step in (t - 1, t)]
        order = self.proto.coordinator_order(t, self.cfg.stage, gathering)[:first]
        self._order[t] = (self.version, order)
        return order

    # ------------------------------------------------------------------------------------ churn

    def churn(self) -> Any:
        """Leaves and joins at the configured rate, until a peer finished the last round (or, with churn
        so fast that none does, twice the time the rounds would take at the slowest compute)."""
        rate_s, cfg = self.cfg.churn_per_h / 3600.0, self.cfg
        while rate_s > 0:
            live = [p for p in self.peers.values() if p.alive]
            yield self.env.timeout(self.rng.expovariate(rate_s * max(1, len(live))))
            live = [p for p in self.peers.values() if p.alive]
            horizon = 2 * cfg.rounds * (self.max_compute_s + cfg.deadline_s + cfg.record_ttl_s)
            if not live or any(p.step >= cfg.rounds for p in live) or self.env.now > horizon:
                return
            self.leave(self.rng.choice(live))
            clock = max(p.step for p in live)
            if clock + 1 < cfg.rounds:
                self.add_peer(clock + 1)


def summarize(sim: Sim) -> list[dict[str, Any]]:
    """One row per round: bytes per peer up/down (mean, max; payload units too), round time, utilisation,
    the set's size and whether the round was lost (fewer than half its holders committed it in time)."""
    rows = []
    for t in sorted(sim.boards):
        done = [r for r in sim.log if r.t == t and r.outcome != "left"]
        if not done:
            continue
        board = sim.boards[t]
        payload = board.sizes.payload if board.sizes else 1
        up = list(sim.net.sent.get(t, {}).values()) or [0.0]
        holders = [r.pid for r in done]
        down = [sim.net.received.get(t, {}).get(p, 0.0) for p in holders]
        ok = [r for r in done if r.outcome != "timeout"]
        rows.append(
            {
                "t": t,
                "rule": done[0].rule,
                "holders": len(done),
                "R": 1 if done[0].rule == "all" else board.R,
                "payload_bytes": payload,
                "down_mean": statistics.fmean(down),
                "down_max": max(down),
                "up_mean": sum(up) / len(done),
                "up_max": max(up),
                "round_s": statistics.fmean(r.round_s for r in done),
                "round_max_s": max(r.round_s for r in done),
                "compute_s": statistics.fmean(r.compute_s for r in done),
                "util": statistics.fmean(r.compute_s / (r.compute_s + r.round_s) for r in done),
                "counted": statistics.fmean(r.counted for r in ok) if ok else 0.0,
                "timeouts": len(done) - len(ok),
                "lost": len(ok) * 2 < len(done),
            }
        )
    return rows

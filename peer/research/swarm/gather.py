"""The two gathers of a simulated round: today's all-to-all and the range-sharded round (simpy processes).

Where this sits: `peer.research.swarm.sim.Sim` starts `run_peer` for every peer; each round it calls
`gather_all`, `gather_ranges` or (`peer.research.swarm.voted`) `gather_voted` as `ownership.round_rule`
says (`RuleHooks.gathers`, wired by `peer.research.swarm.run`). The roster, the owners' deal, a range's
readiness and a peer's request pool are shared with the voted round.

"all" (`peer.node.round.gather.gather_round`): poll the DHT every `poll_s`; each poll reads the round
(`dht_read_s`), takes `agreement.round_view` of it, fetches every bound payload not held yet one after
the other in sender order (as `_fetch_bound` does: one request at a time), a payload whose sender left
from another holder that has it (second sources), then asks `agreement.close_decision` whether the set
is closed. Bytes: each holder fetches M − 1 payloads.

"ranges" (docs/protocol.md, RANGES): announce; the first live holder in `ownership.coordinator_order`
whose `close_decision` over the announcements (held = announced; complete also by `ownership.quiet_close`)
says COMPLETE or DEADLINE publishes the roster (the next in order `roster_wait_s` later if none appeared);
each range's owners (`ownership.owners`, 1 + `range_backups`) fetch part r of every roster member (one
request per member for all their ranges, `fetch_parallel` in flight, starting after their own roster
position: `rotated`) and publish their shard; a range is ready when every owner published, or those that
did plus the others' records expired, or `owner_grace_s` after its first owner published; every holder
fetches each ready shard
from its first live publisher; a range whose owners are all gone is computed by every holder from the
members' parts (the fallback). Not done by its deadline: the holder gives the round up ("timeout").
Aggregation and decoding CPU time are not modelled (`peer bench commit` measures them).
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Callable, Generator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import simpy

from peer.node.round.agreement import Close, Poll
from peer.node.round.ranges.ownership import quiet_close
from peer.node.round.timings import FRESH_S

if TYPE_CHECKING:
    from peer.research.swarm.sim import Peer, RoundBoard, Sim

Proc = Generator[simpy.Event, Any, Any]
Publish = Callable[["Sim", int, "RoundBoard", tuple[str, ...]], None]
CLOSED = (Close.COMPLETE, Close.DEADLINE)


def run_peer(sim: Sim, peer: Peer) -> Proc:
    """Compute, announce, gather, commit — round after round, until the last one or it leaves."""
    from peer.research.swarm.sim import PeerRound

    env, cfg = sim.env, sim.cfg
    pool = Pool(sim, peer.pid, cfg.fetch_parallel)
    for t in range(peer.joined_at, cfg.rounds):
        peer.step = t
        sim.version += 1
        rec = PeerRound(peer.pid, t, sim.rule(t), sim.compute_time(peer))
        yield env.timeout(rec.compute_s)
        if not peer.alive:
            return
        start = rec.start_s = env.now
        board = sim.board(t)
        later(env, cfg.dht_s, _announcer(sim, board, peer.pid))
        board.holders_of.setdefault(peer.pid, set()).add(peer.pid)
        yield env.timeout(cfg.dht_store_s)  # the announcement's DHT store returns
        gather = sim.rules.gathers[rec.rule]
        rec.outcome, rec.counted = yield from gather(sim, peer, t, start, pool)
        rec.round_s = env.now - start
        sim.log.append(rec)
        if not peer.alive:
            rec.outcome = "left"
            return
        if rec.outcome != "timeout":
            sim.n_prev.setdefault(t, rec.counted)
    peer.step = cfg.rounds
    sim.version += 1


def later(env: simpy.Environment, delay_s: float, fn: Callable[[], None]) -> None:
    """Call `fn()` `delay_s` from now (a DHT store becoming visible)."""
    env.timeout(delay_s).callbacks.append(lambda _e: fn())


def _announcer(sim: Sim, board: RoundBoard, pid: str) -> Callable[[], None]:
    """`pid`'s announcement of the round becomes visible."""

    def visible() -> None:
        board.announced[pid] = sim.env.now
        sim.version += 1

    return visible


def gather_all(sim: Sim, peer: Peer, t: int, start: float, pool: Pool) -> Proc:
    """Today's gather (module docstring); (outcome, payloads committed)."""
    env, cfg, me = sim.env, sim.cfg, peer.pid
    deadline = start + cfg.deadline_s
    board = sim.board(t)
    held, rejected, retry_at = {me}, set(), dict[str, float]()
    while True:
        read_at = env.now
        yield env.timeout(cfg.dht_read_s)
        view = sim.view(t, me)  # announcements as of the read's end: `read_round` gets them last
        for sender in sorted(view.bound):
            if sender in held or sender in rejected or retry_at.get(sender, 0.0) > env.now or env.now >= deadline:
                continue
            src = _source(sim, board, sender)
            if src is None:
                if sim.recorded(sender):
                    retry_at[sender] = env.now + 2.0  # unreachable yet: retried with backoff
                else:
                    rejected.add(sender)
                continue
            # the request's timeout is what is left of the deadline (at least 0.5 s), as `_fetch` sets it;
            # a transfer cut by it keeps running in this model (its bytes still count: conservative)
            got = sim.net.transfer(src, me, board.sizes.payload if board.sizes else 0, t)
            yield env.any_of([got, env.timeout(max(0.5, deadline - env.now))])
            if not peer.alive:
                return "left", 0
            if got.triggered and sim.peers[src].alive:
                held.add(sender)
                board.holders_of.setdefault(sender, set()).add(me)
        poll = Poll(
            fresh=env.now - read_at <= FRESH_S,
            past_deadline=env.now >= deadline,
            complete=view.expected <= held | rejected | view.dropped,
            lone=held == {me} and bool(view.gathering),
        )
        decision = sim.proto.close_decision(poll)
        if decision in CLOSED or decision in (Close.FOLLOWED, Close.BEHIND):
            return decision.value, len(held)
        if decision is Close.WAIT:
            yield env.timeout(cfg.poll_s)


def _source(sim: Sim, board: RoundBoard, sender: str) -> str | None:
    """Who serves `sender`'s payload: the sender while it lives, else a live holder that fetched it."""
    if sim.peers[sender].alive:
        return sender
    return next((p for p in sorted(board.holders_of.get(sender, ())) if sim.peers[p].alive), None)


# ---------------------------------------------------------------------------------------------- ranges


@dataclass
class Ranges:
    """Round t's ranges once the roster is out: owners, published shards, and when each range is ready."""

    members: tuple[str, ...]
    owners: list[list[str]]
    mine: dict[str, list[int]]
    published: list[set[str]]
    ready_log: list[tuple[float, int, str]] = field(default_factory=list)  # (time, r, "shard" | "fallback")
    is_ready: set[int] = field(default_factory=set)
    waiting: set[int] = field(default_factory=set)  # ranges one owner published: ready `owner_grace_s` later


def deal_ranges(sim: Sim, t: int, board: RoundBoard, members: tuple[str, ...]) -> Ranges:
    k = 1 + sim.cfg.range_backups
    owners = [sim.proto.owners(t, sim.cfg.stage, r, members, k) for r in range(board.R)]
    mine: dict[str, list[int]] = {}
    for r, ow in enumerate(owners):
        for o in ow:
            mine.setdefault(o, []).append(r)
    return Ranges(members, owners, mine, [set() for _ in range(board.R)])


def check_range(sim: Sim, rg: Ranges, r: int, waited: bool = False) -> None:
    """Range r is ready once every owner published or is gone (records expired), or `owner_grace_s` after
    its first owner published (`waited`: `ownership.range_step`'s grace); none published and all gone:
    the fallback."""
    if r in rg.is_ready:
        return
    pub, ow = rg.published[r], rg.owners[r]
    gone = [o for o in ow if o not in pub and not sim.recorded(o)]
    if len(pub) + len(gone) < len(ow) and not (waited and pub):
        if pub and r not in rg.waiting and sim.cfg.owner_grace_s > 0:
            rg.waiting.add(r)
            later(sim.env, sim.cfg.owner_grace_s, lambda: check_range(sim, rg, r, waited=True))
        return
    rg.is_ready.add(r)
    rg.ready_log.append((sim.env.now, r, "shard" if pub else "fallback"))


def wait_roster(sim: Sim, peer: Peer, t: int, start: float, publish: Publish | None = None) -> Proc:
    """Wait for round t's roster; publish it when this peer's turn in coordinator_order comes (`publish`:
    what the roster starts, the ranges round's owners by default); True once it is out."""
    env, cfg, me = sim.env, sim.cfg, peer.pid
    board = sim.board(t)
    closed_at: float | None = None
    while True:
        read_at = env.now
        yield env.timeout(cfg.dht_read_s)
        if not peer.alive:
            return False
        if board.roster_at <= read_at:
            return True
        order = sim.publishers(t)
        pos = order.index(me) if me in order else -1
        if pos >= 0 and not board.roster_pending:
            view = sim.view(t, me)
            announced = {s for s, at in board.announced.items() if at <= read_at}
            last = max((at for at in board.announced.values() if at <= read_at), default=read_at)
            poll = Poll(
                fresh=True,
                past_deadline=env.now >= start + cfg.deadline_s,
                complete=view.expected <= announced | view.dropped
                or quiet(len(announced), len(view.expected | announced), read_at - last, cfg),
                lone=announced == {me} and bool(view.gathering),
            )
            if sim.proto.close_decision(poll) in CLOSED:
                closed_at = env.now if closed_at is None else closed_at
                if env.now >= closed_at + pos * cfg.roster_wait_s:
                    board.roster_pending = True
                    roster = tuple(sorted(announced))
                    fn = publish or _publish_roster
                    later(env, cfg.dht_s, lambda roster=roster, fn=fn: fn(sim, t, board, roster))  # type: ignore[misc]
        if env.now >= start + cfg.deadline_s and board.roster_at == float("inf") and not board.roster_pending:
            return False
        yield env.timeout(cfg.poll_s)


def quiet(announced: int, expected: int, quiet_s: float, cfg: Any) -> bool:
    """`ownership.quiet_close` with the simulation's settings."""
    return quiet_close(announced, expected, quiet_s, cfg.roster_quiet_s, cfg.roster_quorum)


def _publish_roster(sim: Sim, t: int, board: RoundBoard, members: tuple[str, ...]) -> None:
    board.roster, board.roster_at = members, sim.env.now
    board.ranges = rg = deal_ranges(sim, t, board, members)
    board.phases.append(rg)
    for owner, mine in rg.mine.items():
        if sim.peers[owner].alive:
            sim.env.process(_own(sim, t, board, rg, owner, mine))
    for r, ow in enumerate(rg.owners):  # owners whose records already expired (the others: `Sim.leave`)
        if any(not sim.recorded(o) for o in ow):
            check_range(sim, rg, r)


def _own(sim: Sim, t: int, board: RoundBoard, rg: Ranges, me: str, mine: list[int]) -> Proc:
    """An owner: part r of every member for each of its ranges (one request per member), then its shards."""
    sizes = board.sizes
    assert sizes is not None
    nbytes = sum(sizes.parts[r] + sizes.proof for r in mine)
    pool: Pool = sim.pools[me]
    done = sim.env.event()
    left = [len(rg.members) - 1]
    if left[0] == 0:
        done.succeed()

    def one(_ok: bool) -> None:
        left[0] -= 1
        if left[0] == 0:
            done.succeed()

    for m in rotated(rg.members, me):
        pool.add(t, nbytes, while_alive(sim, m), one)
    yield done
    if not sim.peers[me].alive:
        return
    yield sim.env.timeout(sim.cfg.dht_s)
    for r in mine:
        rg.published[r].add(me)
        check_range(sim, rg, r)
    if not sim.peers[me].alive:  # it left right after publishing: its records still say so for the TTL
        return


def gather_ranges(sim: Sim, peer: Peer, t: int, start: float, pool: Pool) -> Proc:
    """The range-sharded round (module docstring); (outcome, contributions in the roster)."""
    env, cfg, me = sim.env, sim.cfg, peer.pid
    board = sim.board(t)
    got = yield from wait_roster(sim, peer, t, start)
    if not got:
        return ("left", 0) if not peer.alive else ("timeout", 0)
    rg: Ranges = board.ranges
    sizes = board.sizes
    assert sizes is not None
    need = set(range(board.R)) - set(rg.mine.get(me, ()))
    mine_done = [r for r in rg.mine.get(me, ())]
    left = [len(need)]
    all_done = env.event()
    if left[0] == 0:
        all_done.succeed()
    seen = 0
    deadline = start + cfg.deadline_s

    def finished(_ok: bool) -> None:
        left[0] -= 1
        if left[0] == 0 and not all_done.triggered:
            all_done.succeed()

    while not all_done.triggered and env.now < deadline and peer.alive:
        read_at = env.now
        yield env.timeout(cfg.dht_read_s)
        new = [e for e in rg.ready_log[seen:] if e[0] <= read_at]
        seen += len(new)
        for _, r, kind in new:
            if r not in need:
                continue
            if kind == "shard":
                nbytes = sizes.shard(r, len(rg.members))
                pool.add(t, nbytes, shard_source(sim, rg, r, me), finished)
            else:
                fetch_from_members(sim, pool, t, rg, sizes.parts[r] + sizes.proof, finished)
        if not all_done.triggered:
            yield env.any_of([all_done, env.timeout(cfg.poll_s)])
    own_published = all(me in rg.published[r] for r in mine_done)
    if not peer.alive:
        return "left", 0
    if all_done.triggered and own_published:
        return "ranges", len(rg.members)
    while not own_published and env.now < deadline:  # our own shards still being computed
        yield env.timeout(cfg.poll_s)
        own_published = all(me in rg.published[r] for r in mine_done)
    return ("ranges", len(rg.members)) if all_done.triggered and own_published else ("timeout", 0)


def rotated(members: tuple[str, ...], me: str) -> list[str]:
    """The members but `me`, starting after `me` (as `RangeFetcher.parts` asks them): owners that start
    at once spread their first requests over every member instead of queueing on the roster's first."""
    i = members.index(me) + 1 if me in members else 0
    return [m for m in members[i:] + members[:i] if m != me]


def while_alive(sim: Sim, pid: str) -> Callable[[], str | None]:
    """A request's source: `pid` while it lives (a member's part is nowhere else)."""
    return lambda: pid if sim.peers[pid].alive else None


def shard_source(sim: Sim, rg: Ranges, r: int, me: str) -> Callable[[], str | None]:
    """Who serves range r's shard to `me`: a live owner that published it, in `me`'s own order of them
    (`Resolver._spread`: sha256 of the two ids), so a range's holders share its owners' uploads."""

    def source() -> str | None:
        live = [o for o in rg.owners[r] if o in rg.published[r] and sim.peers[o].alive]
        return min(live, key=lambda o: hashlib.sha256(f"{me}|{o}".encode()).digest(), default=None)

    return source


def fetch_from_members(sim: Sim, pool: Pool, t: int, rg: Ranges, nbytes: int, finished: Callable[[bool], None]) -> None:
    """Every owner of a range is gone: fetch its part from every live member and aggregate it here."""
    others = rotated(rg.members, pool.me)
    left = [len(others)]
    if not others:
        finished(True)
        return

    def one(_ok: bool) -> None:
        left[0] -= 1
        if left[0] == 0:
            finished(True)

    for m in others:
        pool.add(t, nbytes, while_alive(sim, m), one)


class Pool:
    """A peer's requests: a FIFO queue served `size` at a time (the peer's requests in flight)."""

    def __init__(self, sim: Sim, me: str, size: int, register: bool = True) -> None:
        """`register`: the peer's own pool (`Sim.pools[me]`); False: one more, for a role apart."""
        self.sim, self.me = sim, me
        self.queue: deque[tuple[int, float, Callable[[], str | None], Callable[[bool], None]]] = deque()
        self.wake = sim.env.event()
        if register:
            sim.pools[me] = self
        for _ in range(max(1, size)):
            sim.env.process(self._worker())

    def add(self, t: int, nbytes: float, source: Callable[[], str | None], done: Callable[[bool], None]) -> None:
        self.queue.append((t, nbytes, source, done))
        if not self.wake.triggered:
            self.wake.succeed()

    def _worker(self) -> Proc:
        sim = self.sim
        peer = sim.peers[self.me]
        while peer.alive:
            if not self.queue:
                if self.wake.triggered:
                    self.wake = sim.env.event()
                yield self.wake
                continue
            t, nbytes, source, done = self.queue.popleft()
            src = source()
            if src is None:
                done(False)
                continue
            yield sim.net.transfer(src, self.me, nbytes, t)
            done(peer.alive and sim.peers[src].alive)

"""The voted round in `peer bench swarm` (issue 37): votes, an agreed support, values there, the exact mean.

Where this sits: `peer.research.swarm.gather.run_peer` calls `gather_voted` for a round whose rule is
"voted"; the roster, the owners' deal (`ownership.owners` over the roster, primary + `range_backups`), a
range's readiness (`check_range`: every owner published, or those that did and the others' records
expired) and the request pools are `peer.research.swarm.gather`'s; the byte counts are
`peer.research.swarm.sizes.voted_sizes` (the codec's sizes on each range's bands). The design and its
measured loss: `peer simulate --round voted` (`peer.research.simulate.round_designs`, docs/results.md).

Per round, after the announcements and the roster (as "ranges"), per range r with owners O_r:
1. votes: each owner fetches from every other member its vote of all the owner's ranges (k indices per
   tile, no values; one request per member, a part's merkle proof with it), as a ranges owner its parts,
   `fetch_parallel` in flight in a pool of its owner role apart from its requests as a holder (phases 1
   and 3 of its ranges overlap phase 2 of the others');
2. support: when every member's vote is in (or the member is gone), the owner publishes the k′ most voted
   positions per tile of its ranges (DHT visible `dht_s` later); range r's support is ready when every
   owner of r published it or is gone (`check_range`); every holder fetches every other range's support
   from its first live publisher;
3. values: once a member holds the supports of every range owner o owns, o fetches the member's values
   there (k′ codes per tile, no indices; one request per member for all o's ranges);
4. mean: when every member's values are in (or the member is gone: its records expired), or by the quiet
   close (`ownership.quiet_close` over the values that came), the owner publishes the mean shard (values
   at `mean_bits`); every holder fetches every other range's mean, as in phase 2.
A range whose owners are all gone (the fallback) is computed by every holder: its support from every
member's vote of r, its mean from every member's values at it. A member that left fails its requests at
once (as a ranges part does); an owner stops waiting for values at the roster's time + the deadline.
A holder commits when it holds every range's mean (its own ranges' published) by its deadline, else it
gives the round up ("timeout"); counted = the members whose values are in every range's mean (the first
publisher's; "ranges" counts the roster).
Not modelled, as for "ranges": the CPU of tallying votes and averaging, DHT bytes, vote stuffing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import simpy

from peer.node.round.ranges.ownership import quiet_close
from peer.research.swarm.gather import (
    Pool,
    Proc,
    Ranges,
    check_range,
    deal_ranges,
    fetch_from_members,
    shard_source,
    wait_roster,
    while_alive,
)
from peer.research.swarm.sizes import VotedSizes, voted_sizes

if TYPE_CHECKING:
    from peer.research.swarm.sim import Peer, RoundBoard, Sim


@dataclass
class Voted:
    """Round t's voted phases once the roster is out (the owners are the same for both)."""

    support: Ranges  # phase 2: who published range r's support, and when each range was ready
    mean: Ranges  # phase 4: the same for the means
    sizes: VotedSizes
    deadline: float  # owners stop waiting for values then
    member_set: frozenset[str] = frozenset()
    held: dict[str, bytearray] = field(default_factory=dict)  # member -> 1 per range whose support it holds
    got: dict[str, set[str]] = field(default_factory=dict)  # owner -> members whose values came (or failed)
    ok: dict[str, set[str]] = field(default_factory=dict)  # owner -> members whose values came
    in_mean: dict[int, frozenset[str]] = field(default_factory=dict)  # r -> members its first mean holds
    counted: int | None = None  # members in every range's mean, once all are published
    pools: dict[str, Pool] = field(default_factory=dict)  # owner -> the requests of its owner role


def _publish_voted(sim: Sim, t: int, board: RoundBoard, members: tuple[str, ...]) -> None:
    """The roster is out: deal the owners, start every live owner's phases."""
    board.roster, board.roster_at = members, sim.env.now
    support = deal_ranges(sim, t, board, members)
    mean = Ranges(members, support.owners, support.mine, [set() for _ in range(board.R)])
    cfg = sim.cfg
    sizes = voted_sizes(
        cfg.preset, cfg.stages, cfg.stage, board.R, cfg.support_topk, cfg.mean_bits
    )  # R ranges, as the board's
    assert sizes.n == board.R, (sizes.n, board.R)
    board.ranges, board.phases = support, [support, mean]
    board.voted = vt = Voted(support, mean, sizes, sim.env.now + cfg.deadline_s, frozenset(members))
    vt.got = {owner: set() for owner in support.mine}
    vt.ok = {owner: {owner} for owner in support.mine}
    for owner, mine in support.mine.items():
        if sim.peers[owner].alive:
            vt.pools[owner] = Pool(sim, owner, cfg.fetch_parallel, register=False)
            sim.env.process(_own(sim, t, vt, owner, mine))
    for m in members:
        if sim.peers[m].alive:
            sim.env.process(_send(sim, t, vt, m))
    for r, ow in enumerate(support.owners):  # owners whose records already expired (the others: `Sim.leave`)
        if any(not sim.recorded(o) for o in ow):
            check_range(sim, support, r)
            check_range(sim, mean, r)


def _own(sim: Sim, t: int, vt: Voted, me: str, mine: list[int]) -> Proc:
    """An owner: every member's votes of its ranges, their supports, every member's values, their means."""
    env, sizes = sim.env, vt.sizes
    pool = vt.pools[me]
    votes = env.event()
    nbytes = sum(sizes.votes[r] + sizes.proof for r in mine)
    fetch_from_members(sim, pool, t, vt.support, nbytes, lambda _ok: _succeed(votes))
    yield votes
    if not sim.peers[me].alive:
        return
    yield env.timeout(sim.cfg.dht_s)
    if not sim.peers[me].alive:
        return
    for r in mine:
        vt.support.published[r].add(me)
        check_range(sim, vt.support, r)
        hold(sim, t, vt, me, r)
    grew_at, n_ok, cfg = env.now, len(vt.ok[me]), sim.cfg
    while not _values_in(sim, vt, me) and env.now < vt.deadline:
        yield env.timeout(cfg.poll_s)
        if not sim.peers[me].alive:
            return
        if len(vt.ok[me]) > n_ok:
            grew_at, n_ok = env.now, len(vt.ok[me])
        if quiet_close(n_ok, len(vt.member_set), env.now - grew_at, cfg.roster_quiet_s, cfg.roster_quorum):
            break  # `_values_roster`'s quiet close: the rest are gone or late
    if not _values_in(sim, vt, me) and env.now >= vt.deadline:
        return
    yield env.timeout(sim.cfg.dht_s)
    if not sim.peers[me].alive:
        return
    for r in mine:
        vt.in_mean.setdefault(r, frozenset(vt.ok[me]))
        vt.mean.published[r].add(me)
        check_range(sim, vt.mean, r)


def _send(sim: Sim, t: int, vt: Voted, me: str) -> Proc:
    """A member as a sender: it reads the supports as their ranges get ready (a DHT read per poll) and
    fetches each from its first live publisher (`hold` then lets the owners fetch its values), until it
    holds every range's or the owners' deadline passed. It runs whether or not its own gather gave the
    round up (as a ranges member's parts are served either way)."""
    env, cfg, pool = sim.env, sim.cfg, sim.pools[me]
    held = vt.held.setdefault(me, bytearray(len(vt.support.owners)))
    seen = 0
    while sim.peers[me].alive and env.now < vt.deadline and not all(held):
        read_at = env.now
        yield env.timeout(cfg.dht_read_s)
        new = [e for e in vt.support.ready_log[seen:] if e[0] <= read_at]
        seen += len(new)
        for _, r, kind in new:
            if not held[r]:
                _fetch(sim, pool, t, vt, "support", r, kind, lambda _ok: None)
        yield env.timeout(cfg.poll_s)


def _succeed(event: simpy.Event) -> None:
    event.succeed()


def _values_in(sim: Sim, vt: Voted, owner: str) -> bool:
    """Every other member's values reached `owner`, or their requests failed, or the member left and
    its records expired (until then an owner cannot tell it from a late one)."""
    got = vt.got[owner]
    gone = {pid for pid in sim.left if pid in vt.member_set and pid != owner and not sim.recorded(pid)}
    return len(got | gone) >= len(vt.member_set) - 1


def hold(sim: Sim, t: int, vt: Voted, me: str, r: int) -> None:
    """`me` holds range r's support now: each live owner of r whose every range's support `me` holds
    fetches `me`'s values of them (one request; an owner counts values that came before it published)."""
    held = vt.held.setdefault(me, bytearray(len(vt.support.owners)))
    if held[r]:
        return
    held[r] = 1
    for o in vt.support.owners[r]:
        if o == me or o not in vt.pools or not sim.peers[o].alive:
            continue
        theirs = vt.support.mine[o]
        if all(held[x] for x in theirs):
            nbytes = sum(vt.sizes.values[x] + vt.sizes.proof for x in theirs)
            vt.pools[o].add(t, nbytes, while_alive(sim, me), _arrived(vt, o, me))


def _arrived(vt: Voted, owner: str, member: str) -> Callable[[bool], None]:
    def done(ok: bool) -> None:
        vt.got[owner].add(member)
        if ok:
            vt.ok[owner].add(member)

    return done


def _counted(vt: Voted) -> int:
    """Contributions the committed state holds: members whose values are in every range's mean (a
    range computed by the fallback holds every member: its values are fetched from each)."""
    if vt.counted is None:
        sets = list(vt.in_mean.values())
        vt.counted = len(frozenset.intersection(*sets)) if sets else len(vt.support.members)
    return vt.counted


def gather_voted(sim: Sim, peer: Peer, t: int, start: float, pool: Pool) -> Proc:
    """A holder's voted round (module docstring); (outcome, contributions in the roster)."""
    env, cfg, me = sim.env, sim.cfg, peer.pid
    board = sim.board(t)
    if not (yield from wait_roster(sim, peer, t, start, _publish_voted)):
        return ("left", 0) if not peer.alive else ("timeout", 0)
    vt: Voted = board.voted
    mine = set(vt.support.mine.get(me, ()))
    left = [board.R - len(mine)]  # means still to come
    all_done = env.event()
    if left[0] == 0:
        all_done.succeed()

    def finished(_ok: bool) -> None:
        left[0] -= 1
        if left[0] == 0 and not all_done.triggered:
            all_done.succeed()

    seen = 0  # the supports: fetched by `_send`
    deadline = start + cfg.deadline_s
    while not all_done.triggered and env.now < deadline and peer.alive:
        read_at = env.now
        yield env.timeout(cfg.dht_read_s)
        new = [e for e in vt.mean.ready_log[seen:] if e[0] <= read_at]
        seen += len(new)
        for _, r, kind in new:
            if r not in mine:
                _fetch(sim, pool, t, vt, "mean", r, kind, finished)
        if not all_done.triggered:
            yield env.any_of([all_done, env.timeout(cfg.poll_s)])
    if not peer.alive:
        return "left", 0
    while not all(me in vt.mean.published[r] for r in mine) and env.now < deadline:  # our own means
        yield env.timeout(cfg.poll_s)
    ok = all_done.triggered and all(me in vt.mean.published[r] for r in mine)
    return ("voted", _counted(vt)) if ok else ("timeout", 0)


def _fetch(
    sim: Sim, pool: Pool, t: int, vt: Voted, phase: str, r: int, kind: str, finished: Callable[[bool], None]
) -> None:
    """Range r's support or mean, from its first live publisher, or (all its owners gone) computed here
    from every member's votes or values of r."""
    sizes, me = vt.sizes, pool.me
    if phase == "support":
        done: Callable[[bool], None] = lambda _ok: hold(sim, t, vt, me, r)  # noqa: E731
        if kind == "shard":
            pool.add(t, sizes.supports[r] + sizes.head, shard_source(sim, vt.support, r, me), done)
        else:
            fetch_from_members(sim, pool, t, vt.support, sizes.votes[r] + sizes.proof, done)
    elif kind == "shard":
        pool.add(t, sizes.means[r] + sizes.head, shard_source(sim, vt.mean, r, me), finished)
    else:
        fetch_from_members(sim, pool, t, vt.mean, sizes.values[r] + sizes.proof, finished)

"""Who counts in round (t, s) and which committed state wins: the pure rules of docs/protocol.md.

Every function here reads only DHT records (typed, `peer.net.records`) and returns a decision, so every holder
that sees the same records decides the same way, and each rule is testable without a swarm.

- Incarnations: every process draws a fresh `inc` at start and puts it in all its records and
  payload announcements. An announcement whose sender now publishes another `inc` (it restarted
  with the same key) is stale: never fetched, never waited for (`fresh`).
- Binding: a stage peer's payload speaks for pipeline head h in round (t, s) only if h's own
  signed stage-0 announcement of round t lists it under "peers" (the peer that did the H-th inner
  step, a replacement included). Before h has announced, h's replica record ("pipeline_peers")
  binds provisionally. If h's announcement binds nobody for s, or a peer that died or moved on
  without announcing, h is dropped from round (t, s) by every holder.
- Following, the canonical state and re-syncs read holders' state claims: `peer.node.round.claims`.
- Deadline fence: every contributor announces when it closes the round at the latest ("closes",
  DHT time). A holder about to close within `margin` of an earlier closer's deadline (or after it)
  may hold a set that closer did not: it waits for that closer's commit (→ following) until the
  closer's deadline + margin (`fenced_by`). The earliest closer never waits, so nobody deadlocks.
- Bans: part of the committed state, recomputed by every holder that commits a set; an observer
  of a stage it does not hold skips only the replicas that every holder of that stage at t bans
  (`round_bans`: a lone holder cannot make it skip an honest replica).
- Closing a gather: after every poll, `close_decision` turns what the poll knows (`Poll`) into
  one named outcome (`Close`): keep polling, read again, or stop with a complete set, at the
  deadline, with a followed set, or behind (re-sync).
- Committing a gathered round: the late checks between the close and the commit (`Late`) turn into
  one named outcome (`Commit`, `commit_decision`): apply, apply with T⊥ unchanged, leave the round
  to the others, re-sync, or withdraw a commit the swarm overtook while it was applied.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from peer.net.records import Announcement, ReplicaRecord, StageRecord
from peer.node.round.bans import PREFIX, Bans

if TYPE_CHECKING:
    from peer.net.dht import SwarmDHT

Holders = Mapping[str, StageRecord]  # {peer id: stage record}
Replicas = Mapping[str, ReplicaRecord]  # {peer id: replica record}
Announcements = Mapping[str, Announcement]  # {sender: payload announcement}


def current_inc(sender: str, holders: Holders, replicas: Replicas) -> str | None:
    """The incarnation `sender` publishes now (stage record first, then replica record), if any."""
    for rec in (holders.get(sender), replicas.get(sender)):
        if rec is not None and rec.inc is not None:
            return rec.inc
    return None


def step_of(rec: StageRecord | ReplicaRecord | None) -> int:
    """A record's outer step; -1 for a record without one (a leave) or no record."""
    return -1 if rec is None or rec.outer_step is None else rec.outer_step


def joined_at(replicas: Replicas, pid: str) -> int:
    """The first round replica `pid` contributes to (0 without a replica record)."""
    rec = replicas.get(pid)
    return 0 if rec is None else rec.joined_at


def fresh(sender: str, ann: Announcement, holders: Holders, replicas: Replicas, me: str, my_inc: str) -> bool:
    """False for an announcement of an earlier incarnation of its sender (this peer's own included)."""
    inc = ann.inc
    if sender == me:
        return inc == my_inc
    now = current_inc(sender, holders, replicas)
    return now is None or inc is None or now == inc


IGNORED = {  # why round_view ignored an announcement (logged by gather_round)
    "unbound": "that replica's record does not list it as its stage-{stage} peer for this round",
    "stale": "it comes from an earlier incarnation of that peer",
    "banned": "that replica is banned as a repeated outlier (docs/poisoning.md)",
}


@dataclass
class RoundView:
    """One poll's reading of round (t, s); see the module docstring."""

    bound: dict[str, tuple[str, Announcement]] = field(default_factory=dict)  # sender -> (replica, announcement)
    expected: set[str] = field(default_factory=set)  # replica ids to wait for
    dropped: set[str] = field(default_factory=set)  # replicas out of (t, s) for everyone
    ignored: list[tuple[str, str, str]] = field(default_factory=list)  # (sender, claimed replica, why)
    others_gathering: bool = False  # another live holder of stage s is still at outer step t
    gathering: set[str] = field(default_factory=set)  # those holders' peer ids
    banned: set[str] = field(default_factory=set)  # banned replicas (peer.node.round.bans): out of (t, s), not fetched
    # the records this view was decided on (references, formatted only by a log line: `views.log_short_close`)
    replicas: Mapping[str, ReplicaRecord] = field(default_factory=dict)
    holders: Mapping[str, StageRecord] = field(default_factory=dict)


def _head_binding(anns0: Announcements, rid: str) -> Mapping[str, str] | None:
    """The "peers" binding of head `rid`'s own stage-0 announcement of the round, if announced."""
    ann = anns0.get(rid)
    if ann is None or ann.replica_of(rid) != rid:
        return None
    return ann.peers or {}


def binding(rid: str, anns0: Announcements, replicas: Replicas) -> Mapping[str, str]:
    """{"<stage>": peer id} that replica `rid`'s payloads of the round may come from: its own stage-0
    announcement's "peers", else (before it announced) its replica record's "pipeline_peers"."""
    announced = _head_binding(anns0, rid)
    if announced is not None:
        return announced
    head = replicas.get(rid)
    return (head.pipeline_peers if head is not None else None) or {}


def bound_to(sender: str, rid: str, stage: int, anns0: Announcements, replicas: Replicas) -> bool:
    """`sender` may speak for replica `rid` in stage `stage`: it is the replica, or its binding names it."""
    return sender == rid or binding(rid, anns0, replicas).get(str(stage)) == sender


def round_view(
    t: int,
    stage: int,
    payloads: Announcements,
    stage0: Announcements,
    replicas: Replicas,
    holders: Holders,
    me: str,
    my_inc: str,
    banned: Collection[str] = frozenset(),
) -> RoundView:
    """Read round (t, stage) from the DHT's records: `payloads` = announcements of (t, stage),
    `stage0` = announcements of (t, 0) (the heads' bindings), `replicas` = replica records,
    `holders` = stage-`stage` records, `me`/`my_inc` = this process, `banned` = replica id prefixes
    banned from round t (dropped from it, their announcements ignored, unless the set another
    holder committed holds them)."""
    view = RoundView()
    anns0 = {s: a for s, a in stage0.items() if fresh(s, a, {}, replicas, me, my_inc)}
    for sender, ann in payloads.items():
        rid = ann.replica_of(sender)
        if not fresh(sender, ann, holders, replicas, me, my_inc):
            view.ignored.append((sender, rid, "stale"))
            continue
        if rid == sender:
            view.bound[sender] = (rid, ann)
            continue
        # before the head announced, its record binds provisionally
        if bound_to(sender, rid, stage, anns0 if stage > 0 else {}, replicas):
            view.bound[sender] = (rid, ann)
        else:
            view.ignored.append((sender, rid, "unbound"))
    bound_rids = {rid for rid, _ in view.bound.values()}
    for rid, rec in replicas.items():
        if rec.joined_at > t or step_of(rec) < t - 1:
            continue
        announced = _head_binding(anns0, rid) if stage > 0 and rec.kind == "pipeline" else None
        if announced is None or rid in bound_rids:
            view.expected.add(rid)
            continue
        peer = announced.get(str(stage))
        # alive and still to announce: at t, or behind it — its head trained outer step t through it, so
        # only its record lags (overlapped rounds: still committing t - 1; a peer catching up commits the
        # rounds before t within seconds, its record a refresh behind); past t without announcing it never will
        step = step_of(holders.get(peer)) if peer is not None else -1
        if 0 <= step <= t:
            view.expected.add(rid)
        else:  # bound nobody, or a peer that died or moved on without announcing
            view.dropped.add(rid)
    view.expected |= {rid for rid in bound_rids if rid in replicas}
    others = {pid: rec for pid, rec in holders.items() if pid != me}
    # a holder at t - 1 is about to gather t (a slow commit, a record refresh that lagged): a payload
    # of ours alone must wait for it too, or the deadline, not close the round without it; a replica
    # that (re)joined after t (it re-synced past it) never sends round t and is not waited for, nor
    # is a hot spare (an unclaimed stage peer only observes; a head that claims it is expected)
    view.gathering = {
        pid
        for pid, rec in others.items()
        if rec.outer_step in (t - 1, t)
        and rec.state != "syncing"
        and rec.role != "spare"
        and joined_at(replicas, pid) <= t
    }
    view.others_gathering = bool(view.gathering)
    view.replicas, view.holders = replicas, holders
    if banned:
        _ban(view, banned)
    return view


def _ban(view: RoundView, banned: Collection[str]) -> None:
    """Banned replicas are dropped from the round and their announcements ignored (a committed set
    that holds one is still followed as it is: `peer.node.round.rounds`)."""
    rids = view.expected | view.dropped | {rid for rid, _ in view.bound.values()}
    view.banned = {rid for rid in rids if rid[:PREFIX] in banned}
    for sender, (rid, _) in sorted(view.bound.items()):
        if rid in view.banned:
            del view.bound[sender]
            view.ignored.append((sender, rid, "banned"))
    view.expected -= view.banned
    view.dropped |= view.banned


def unbound_held(view: RoundView, held: Collection[str]) -> list[str]:
    """The replicas of `held` that nothing binds any more: a stage peer's payload bound only by its
    head's replica record (provisionally), whose head left before announcing the round. No later
    replay can prove such a payload genuine (`peer.node.round.verify.resolve`), so a set that holds it
    can never be replayed past (by a joiner, or the attester): a holder closing a set of its own
    leaves it out, as every holder that reads the round after the head's record expired does."""
    bound = {rid for rid, _ in view.bound.values()}
    return sorted({rid for _, rid, why in view.ignored if why == "unbound"} & set(held) - bound)


def fenced_by(view: RoundView, me: str, my_closes: float | None, now: float, margin_s: float) -> set[str]:
    """Contributors of the round whose deadline comes before ours (ties: the smaller peer id) and is
    within `margin_s` of `now` (DHT time): at that deadline each closes with what it holds, maybe
    not our payload, so we wait for its commit instead of committing a set of our own."""
    if my_closes is None:
        return set()
    out = set()
    for sender, (_, ann) in view.bound.items():
        closes = ann.closes
        if sender == me or closes is None or (closes, sender) >= (my_closes, me):
            continue
        if closes - margin_s <= now < closes + margin_s:
            out.add(sender)
    return out


def sender_alive(sender: str, holders: Holders, replicas: Replicas) -> bool:
    """The sender still publishes a record (its announcement may still be served)."""
    return sender in holders or sender in replicas


def round_bans(holders: Holders, t: int, me: str = "") -> frozenset[str]:
    """Replica id prefixes banned from round t of a stage, for an observer that does not hold it: the
    ones every holder of the stage still at outer step t bans (none when there is none), so no
    single holder's claim makes the observer skip a replica."""
    at_t = [rec for pid, rec in holders.items() if pid != me and rec.outer_step == t]
    if not at_t:
        return frozenset()
    return frozenset.intersection(*(Bans.from_record(rec.bans).banned(t) for rec in at_t))


def expected_replicas(dht: SwarmDHT, t: int, replicas: Replicas | None = None) -> set[str]:
    """Replica ids that should contribute to round t (see the module docstring).

    `replicas` is `dht.get_replicas()` when the caller already has it.
    """
    out = set()
    for rid, rec in (dht.get_replicas() if replicas is None else replicas).items():
        if rec.joined_at <= t and step_of(rec) >= t - 1:
            out.add(rid)
    return out


class Close(enum.Enum):
    """What a gather does after one poll of round (t, s)."""

    WAIT = "wait"  # poll again after the poll interval
    REREAD = "reread"  # the view is stale (we may have been frozen): read the round again at once
    COMPLETE = "complete"  # stop: every expected payload is held, rejected or dropped
    DEADLINE = "deadline"  # stop at the deadline with what we hold
    FOLLOWED = "followed"  # stop: we hold exactly the set another holder committed from our state
    BEHIND = "behind"  # stop: the round was closed elsewhere and cannot be reproduced here: re-sync


@dataclass(frozen=True)
class Poll:
    """What one poll of a gather knows, as the close decision reads it (docs/protocol.md, GATHER).

    `fresh`: the view was read moments ago (`peer.node.round.timings.FRESH_S`); `past_deadline`: the
    round's deadline has passed; `fenced`: an earlier closer's deadline is near, so its commit
    decides (`fenced_by`). `closed_elsewhere`: the swarm's clock is two rounds past t. Following:
    `following` a claim from our state, whose set we now hold whole (`follow_held`) or have failed
    to fetch for longer than the grace (`follow_expired`). Otherwise, `complete`: every expected
    replica is held, rejected or dropped, which closes the set unless one of the holds applies:
    `lone` (only our payload, while a holder seen gathering may be frozen), `follower` (an observer
    while a contributor is around), `short` (the first round's start-up quorum), `settling` (a
    payload just lost may be in a commit about to appear)."""

    fresh: bool
    past_deadline: bool = False
    fenced: bool = False
    closed_elsewhere: bool = False
    following: bool = False
    follow_held: bool = False
    follow_expired: bool = False
    complete: bool = False
    lone: bool = False
    follower: bool = False
    short: bool = False
    settling: bool = False


def close_decision(poll: Poll) -> Close:
    """The one rule that ends a gather (tested row by row in tests/unit/test_close_decision.py)."""
    if poll.closed_elsewhere:
        return Close.BEHIND
    if poll.following:
        if poll.follow_held:
            return Close.FOLLOWED
        if poll.follow_expired:
            return Close.BEHIND
    elif (
        poll.complete and poll.fresh and not (poll.lone or poll.follower or poll.short or poll.settling or poll.fenced)
    ):
        return Close.COMPLETE
    if poll.past_deadline and not poll.fenced:
        return Close.DEADLINE if poll.fresh else Close.REREAD
    return Close.WAIT if poll.fresh else Close.REREAD


class Commit(enum.Enum):
    """What `Rounds.commit_jobs` does with the rounds it gathered (docs/protocol.md, RESYNC, RECONCILE)."""

    APPLY = "apply"  # commit every own stage's round (a later stage's T⊥ moved by stage 0's set); then publish
    APPLY_WITHOUT_EMBED = "apply_without_embed"  # stage 0's set is gone and no holder is ahead: T⊥ unchanged
    LEAVE = "leave"  # the check before applying moved a worker (a re-sync): the others apply the round
    RESYNC = "resync"  # the round cannot be reproduced here: take the majority's state, our payload back
    WITHDRAW = "withdraw"  # applied, but the swarm closed the round a round ago meanwhile: never published


@dataclass(frozen=True)
class Late:
    """What the late checks of a commit found (docs/protocol.md, RESYNC, RECONCILE).

    `moved`: the canonical-state check right before applying moved a worker to another outer step;
    `closed_elsewhere`: the swarm's clock, read right before applying, is two rounds past t (a
    freeze); `failed`: an own stage's round cannot be committed here (closed elsewhere, a ranges
    round not complete); `embed_lost`: stage 0's committed set, observed for T⊥ by a holder of other
    stages, could not be fetched; `stage_ahead`: a strict majority of a stage's holders claims a
    state past ours (read only when `embed_lost`); `frozen`: applying outlasted a fresh read and the
    swarm, read again, closed the round meanwhile (known only after applying)."""

    moved: bool = False
    closed_elsewhere: bool = False
    failed: bool = False
    embed_lost: bool = False
    stage_ahead: bool = False
    frozen: bool = False


def commit_decision(late: Late) -> Commit:
    """The one rule of the late checks (tested row by row in tests/unit/test_commit_decision.py).
    Asked before applying (`frozen` False) and again after (an APPLY may become WITHDRAW)."""
    if late.moved:
        return Commit.LEAVE
    if late.closed_elsewhere or late.failed:
        return Commit.RESYNC
    if late.frozen:
        return Commit.WITHDRAW
    if late.embed_lost:
        # stage 0's committed set cannot be fetched (its sender died): with no holder ahead to sync
        # from, commit our own stage with T⊥ unchanged rather than wait for a state nobody will ever
        # have; the canonical-state check reconciles holders that could fetch it (RECONCILE)
        return Commit.RESYNC if late.stage_ahead else Commit.APPLY_WITHOUT_EMBED
    return Commit.APPLY

"""Gathering one round (t, s): announce our payload, fetch the others', decide when the set is closed.

Round (t, s) — DESIGN §3, docs/protocol.md. A contributor keeps its encoded payload in its
`PayloadStore` (served by gRPC `get_payload`) and announces {sha256, size, address, replica, inc,
closes} under `round.{t}.{s}` (a head adds "peers", the stage peers that did its last inner step:
the round's binding); then it polls the DHT, fetching each bound announcement's payload once and
checking its sha256 and format, until the set is closed:
- every expected replica's payload is held, rejected or dropped, and neither the lone guard, the
  observer rule, the start-up quorum, the settle after a lost payload nor the deadline fence holds
  it open (`peer.node.round.agreement`);
- or another holder has committed round t FROM OUR STATE (its claim's `prev` is our state id:
  `peer.node.round.claims.followable`; an observer of a stage it does not hold takes the set most of
  that stage's holders committed: `observed`): we take exactly its set, every entry fetched by
  content and proven genuine (`peer.node.round.verify`) — a set naming payloads no replica announced
  gets its claimer refused — or, when it cannot be fetched within the grace, re-sync (`behind`);
- or the swarm's clock is two rounds past us (`peer.node.round.claims.closed_elsewhere`): the others
  closed round t a round ago, so we re-sync (`behind`) and never commit a set of our own;
- or the deadline passes.
An observer of stage 0 reading embedding views (from the relays first: `peer.node.round.fetcher`)
fetches a payload whole before it judges a claim of the round that leaves it out (`.views`).
A close is decided only on a view whose read began moments before (`peer.node.round.timings.FRESH_S`): a process frozen
mid-round (a stopped peer, a stalled machine), even inside a DHT read, wakes to a fresh read and
follows what the others committed meanwhile, or re-syncs, never a set decided on what it read before.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from peer.core.sparseloco.codec.format import Payload
from peer.errors import NetworkError, PeerError
from peer.net.dht import dht_time
from peer.net.records import Announcement, ReplicaRecord, StageRecord
from peer.node.round.agreement import (
    Close,
    Poll,
    RoundView,
    close_decision,
    fenced_by,
    round_view,
    sender_alive,
    unbound_held,
)
from peer.node.round.bans import PREFIX
from peer.node.round.censors import CensorWatch, Evidence, evidence
from peer.node.round.claims import (
    Claim,
    closed_elsewhere,
    committed_only_from_others,
    followable,
    observed,
    parse_claims,
    swarm_clock,
)
from peer.node.round.context import RoundContext
from peer.node.round.contribution import Contribution, Reading, ViewReader
from peer.node.round.fetcher import Fetcher, NotRelayed, relay_wait_s
from peer.node.round.follow import Follow, Held, omission
from peer.node.round.payloads import SETTLE_S, announce, first_payload, poll_pause, read_round
from peer.node.round.result import RoundInputs, RoundResult
from peer.node.round.timings import FRESH_S, MAX_SLOW_READS, RoundTimings
from peer.node.round.verify import SetFetcher
from peer.node.round.views import ViewChecks, log_ignored, log_short_close

log = logging.getLogger(__name__)


def gather_round(
    ctx: RoundContext,
    t: int,
    stage: int,
    timings: RoundTimings,
    inputs: RoundInputs,
    stop: threading.Event | None = None,
) -> RoundResult:
    """Contribute `inputs.own` if given, then collect the round's payloads (`RoundInputs` says what
    each input does).

    Every payload is hashed and parsed exactly once, where it is fetched (`RoundResult.contributions`).
    When the set is closed: see the module docstring and `peer.node.round.agreement.close_decision`.
    `ctx.refusals`: holders whose claims are ignored (and where a forged set's claimer goes). Our
    announcement carries `ctx.me`'s address and incarnation. A payload whose sender is gone is asked of
    the round's other contributors (for stage 0 also of the other `ctx.cfg.stages` − 1 stages' holders).
    """
    own = inputs.own and first_payload(ctx.dht, ctx.store, ctx.me, t, stage, inputs.own, ctx.cfg.train.overlap)
    if own is not None and own.replica[:16] in inputs.banned:  # a repeated outlier: not fetched by anyone
        log.warning("round %d stage %d: %s is banned as a repeated outlier; observing", t, stage, own.replica[:12])
        own = None
    gather = _Gather(ctx, t, stage, timings, own, inputs.validate, inputs.banned, inputs.prev)
    gather.established = {r[:PREFIX] for r in inputs.established}
    gather.previous = inputs.previous
    if own is not None:
        gather.contribute(own, inputs.peers, inputs.mode)
    return gather.run(stop, inputs.quorum)


@dataclass
class _Read:
    """One poll's DHT read of round (t, s), and what it says."""

    at: float  # when the read began (monotonic): its age
    replicas: Mapping[str, ReplicaRecord]
    holders: Mapping[str, StageRecord]  # live holders of the stage (graceful leaves removed)
    left: set[str]  # holders that left gracefully
    payloads: Mapping[str, Announcement]
    stage0: Mapping[str, Announcement]
    view: RoundView
    claims: Mapping[str, Claim]
    clock: int


class _Gather:
    """The state of one gather of round (t, stage) across its polls (module docstring)."""

    def __init__(
        self,
        ctx: RoundContext,
        t: int,
        stage: int,
        timings: RoundTimings,
        own: Contribution | None,
        validate: Reading | None,
        banned: Collection[str],
        prev: str | None,
    ) -> None:
        self.ctx, self.dht, self.clients, self.me = ctx, ctx.dht, ctx.clients, ctx.dht.peer_id
        self.t, self.stage, self.timings, self.own, self.prev = t, stage, timings, own, prev
        self.store, self.inc, self.n_stages, self.banned = ctx.store, ctx.me.incarnation, ctx.cfg.stages, banned
        self.refusals = ctx.refusals
        self.parse: Reading = validate if validate is not None else Payload.from_bytes
        self.started = time.monotonic()
        self.deadline = self.started + timings.deadline_s
        self.my_closes: float | None = None  # when we close the round at the latest (DHT time)
        self.held = Held()
        self.bad, self.rejected = set[str](), set[str]()  # senders whose payload failed its checks; their replicas
        self.logged: set[tuple[str, str]] = set()  # (sender, claimed replica) already logged
        self.retry_at: dict[str, float] = {}  # unreachable senders are retried with backoff, not every poll
        self.lost_at: float | None = None  # when a sender's payload was last given up as gone
        self.seen: set[str] = set()  # other holders of the stage seen gathering this round
        self.slow_reads = 0  # DHT reads in a row that took longer than FRESH_S themselves
        self.view, self.why_behind = RoundView(), ""  # the last poll's view; why a BEHIND was taken (the log)
        self.watch = CensorWatch(self.refusals, stage, timings.grace_s)
        self.evidence: Evidence | None = None  # what the last poll showed of round t (RoundResult.evidence)
        self.previous: Sequence[Evidence] = ()  # what we saw of earlier rounds: claims of them are judged too
        self.lapsed: set[str] = set()  # replicas whose sender was not alive at some poll of this gather
        self.unfetchable: set[tuple[str, str]] = set()  # claims whose set we could not fetch within the grace
        self.logged_claims: set[tuple[str, str]] = set()  # claims we logged as not followed
        self.stranded_at: float | None = None  # when an observer first saw round t committed from another state
        self.established: set[str] = set()  # replica prefixes of our last committed set: expected by all
        self.result = RoundResult(t=t, stage=stage)
        self.fetcher = Fetcher(self.dht, self.clients, self.store, self.me, timings.rpc_s, self.n_stages)
        self.fetcher.relay_until = self.started + relay_wait_s(timings.deadline_s)  # views: relays first
        self.views = ViewChecks(self.fetcher, t, stage)
        sets = SetFetcher(self.dht, self.clients, self.store, self.me, timings.rpc_s, ttl_s=timings.ttl_s)
        self.follow = Follow(sets, self.refusals, t, stage, self.n_stages)

    def contribute(self, own: Contribution, peers: Mapping[str, str] | None, mode: str | None = None) -> None:
        """Serve and announce our contribution, and hold it (the encoder's payload, never re-parsed)."""
        served = (self.store, self.ctx.me.address, self.inc, peers, self.timings.deadline_s, self.timings.ttl_s, mode)
        self.my_closes = announce(self.dht, self.t, self.stage, own, *served)
        self.held.data[own.replica] = own

    def run(self, stop: threading.Event | None, quorum: int) -> RoundResult:
        """Poll until `close_decision` stops the gather; the result in commit order."""
        while True:
            read = self._read()
            if read is None:  # a DHT read that failed once is a missed poll, until the deadline
                poll_pause(stop, self.timings.poll_s)
                continue
            decision = self._decide(read, quorum)
            if decision is Close.WAIT:
                poll_pause(stop, self.timings.poll_s)
            elif decision is not Close.REREAD:
                break
        return self._finish(decision)

    def _read(self) -> _Read | None:
        """One DHT read of the round, parsed; None when it failed (NetworkError past the deadline)."""
        t, stage, me = self.t, self.stage, self.me
        at = time.monotonic()  # a read's age counts from its start: one begun before a freeze is stale
        try:
            replicas, holders, payloads, stage0 = read_round(self.dht, t, stage)
        except NetworkError as exc:
            if time.monotonic() >= self.deadline:
                raise
            log.info("round %d stage %d: DHT read failed, polling again: %s", t, stage, exc)
            return None
        # a read that took longer than FRESH_S (the process froze while its DHT child answered, and
        # records it read then look expired now) is read again; a DHT that is this slow every time
        # is believed after MAX_SLOW_READS reads in a row, so the gather cannot spin
        self.slow_reads = self.slow_reads + 1 if time.monotonic() - at > FRESH_S else 0
        left = {pid for pid, rec in holders.items() if rec.left}  # graceful leaves
        holders = {pid: rec for pid, rec in holders.items() if pid not in left}
        view = round_view(t, stage, payloads, stage0, replicas, holders, me, self.inc, self.banned)
        # waited for: seen gathering and now gone (maybe frozen), still gathering, or past t (follow its
        # commit); not one whose live records, at most at t, say it will not send t (restarted, spare)
        self.seen = view.gathering | {p for p in self.seen if _past(holders.get(p), t)}
        mine = replicas.get(me)
        if self.own is None and (stage == 0 or (mine is not None and mine.kind == "full")):
            view.expected.discard(me)  # only we could send our replica's payload, and we observe
        log_ignored(view, self.logged, t, stage)
        refused = self.refusals.peers()
        claims = parse_claims(holders, me, refused)
        clock = swarm_clock({p: r for p, r in replicas.items() if p != me}, refused)
        self.view = view
        return _Read(at, replicas, holders, left, payloads, stage0, view, claims, clock)

    def _decide(self, read: _Read, quorum: int) -> Close:
        """Fetch what is bound and missing, then the close decision of this poll."""
        if closed_elsewhere(read.clock, self.t, self.timings.stalled(self.started), self.ctx.cfg.train.overlap):
            self.why_behind = "the swarm is rounds ahead"
            return close_decision(Poll(fresh=True, closed_elsewhere=True))
        self._fetch_bound(read)
        self._confirm_views(read)
        self.result.expected = len(read.view.expected)
        # decide on a view read moments ago, never an old one
        fresh = time.monotonic() - read.at <= FRESH_S or self.slow_reads >= MAX_SLOW_READS
        self.evidence = self._evidence(read)
        self.watch.check(read.claims.values(), (self.evidence, *self.previous), dht_time())
        targets = self._targets(read)
        if targets:  # round t is committed elsewhere, from our state: take exactly that set
            target = targets[0]
            self.result.followed = target
            taken = self.follow.take(target, self.held, read.holders, self.parse)
            expired = self.follow.expired(self.timings.grace_s)
            if expired and not taken and not _claimed_by_most(target, read, self.me, self._refused()):
                # one claim we could not check never sends us behind: it is set aside, and we close
                # our own set; after the round the canonical order decides (docs/protocol.md, FOLLOW)
                log.warning(
                    "round %d stage %d: cannot fetch the set %s claims; closing our own set instead",
                    self.t,
                    self.stage,
                    target.peer[:12],
                )
                self.unfetchable.add((target.peer, target.state))
                return Close.REREAD
            self.why_behind = "cannot fetch the set a majority of the holders committed"
            past_deadline = time.monotonic() >= self.deadline
            poll = Poll(fresh, past_deadline, following=True, follow_held=taken, follow_expired=expired)
            return close_decision(poll)
        self.follow.since, self.result.followed = None, None
        # an earlier closer at (or past) its deadline may commit without our payload: its commit
        # decides (→ FOLLOW), waited for until its deadline + the grace, even past ours
        fenced = fenced_by(read.view, self.me, self.my_closes, dht_time(), self.timings.grace_s)
        held = set(self.held.data)
        # a holder seen gathering this round whose records then expired may only be frozen (a stopped
        # process, a stalled link): a payload of ours alone waits for it (not one that left gracefully)
        seen_gathering = bool(self.seen - read.left)
        own_rid = self.own.replica if self.own is not None else None
        # a payload we lost (its sender left) may be held by a holder that committed it: its commit may
        # reach the DHT before we close without it (→ FOLLOW), bounded by the grace
        lost = self.lost_at is not None and time.monotonic() - self.lost_at < min(self.timings.grace_s, SETTLE_S)
        # an observer (no payload of its own) never decides a set while a contributor is around: it follows
        # the first commit (a frozen contributor's expired records cannot mislead it); holding nothing, it
        # closes no empty set while another replica lives, none dropped: one re-syncing shows its replay's
        # step and a join past t, yet sends t (a head catching up closed t empty: refused as a censor)
        idle = not held and not read.view.dropped and any(r != self.me for r in read.replicas)
        # ... but an observer whose state no commit of round t starts from (a T⊥ rebase of ours still to
        # come) waits for none it could follow: once such commits have settled, its set closes
        stranded = self.own is None and bool(held) and self._stranded(read)
        poll = Poll(
            fresh,
            past_deadline=time.monotonic() >= self.deadline,
            fenced=bool(fenced),
            complete=read.view.expected <= held | self.rejected | read.view.dropped,
            lone=held == {own_rid} and seen_gathering,
            follower=self.own is None and (seen_gathering or idle) and not stranded,
            short=self.t == 0 and quorum > 1 and len(held) < quorum,  # start-up: peers still appearing
            settling=lost,
        )
        return close_decision(poll)

    def _refused(self) -> frozenset[str]:
        return self.refusals.peers()

    def _stranded(self, read: _Read) -> bool:
        """Whether round t was committed by others, every commit from another state than ours (so none
        can be followed: `followable`), for `SETTLE_S` since we first saw one — time for a commit from
        our state to appear too."""
        claims = read.claims.values()
        if self.prev is None or not committed_only_from_others(claims, self.t, self.prev, self._refused()):
            self.stranded_at = None
            return False
        if self.stranded_at is None:
            self.stranded_at = time.monotonic()
        return time.monotonic() - self.stranded_at >= SETTLE_S

    def _targets(self, read: _Read) -> list[Claim]:
        """The claims of round t we may follow, best first: from our state (an observer: the set most
        holders committed), not refused, not set aside as unfetchable, leaving out no payload we
        hold or have not checked yet (`peer.node.round.follow.omission`).

        An observer of a stage it does not hold (`prev` None: stage 0 for T⊥) has no say in the set: it
        must move T⊥ by the set the stage's holders commit. A payload whose sender lapsed at some poll
        (`_evidence`: a frozen or gone head) is one an honest holder may have given up, so an
        observer follows a set that leaves it out (ci43's chaos run: a restarted observer held a frozen
        head's payload that every holder had dropped, closed its own set and moved T⊥ apart for 8
        rounds). A holder keeps the rule whole: its larger set wins the RECONCILE after the round."""
        claims = read.claims.values()
        targets = followable(claims, self.t, self.prev) if self.prev is not None else observed(claims, self.t)
        refused = self._refused()
        bound = {rid for rid, _ in read.view.bound.values()}
        given_up = self.lapsed if self.prev is None else set()
        out = []
        for claim in targets:
            key = (claim.peer, claim.state)
            named = set(claim.link.replicas) if claim.link is not None else set()
            if claim.peer in refused or key in self.unfetchable or self.views.invalid & named:
                continue
            left_out = omission(claim, bound, self.held.data, self.rejected, given_up)
            if left_out.followable:
                out.append(claim)
                continue
            if key not in self.logged_claims:
                self.logged_claims.add(key)
                log.info(
                    "round %d stage %d: not following %s: its set leaves out %s",
                    self.t,
                    self.stage,
                    claim.peer[:12],
                    ", ".join(r[:12] for r in sorted(left_out.validated | left_out.unchecked)),
                )
        return out

    def _evidence(self, read: _Read) -> Evidence | None:
        """What this poll shows of round t, to judge claims of it (`peer.node.round.censors`)."""
        bound = {rid: sender for sender, (rid, _) in read.view.bound.items()}
        own_rid = self.own.replica if self.own is not None else None
        for rid in self.held.data:
            sender = bound.get(rid)
            if rid == own_rid or sender == self.me:
                continue
            # nothing binds it now (its head left: `agreement.unbound_held`), or its sender's records lapsed
            if sender is None or not sender_alive(sender, read.holders, read.replicas):
                self.lapsed.add(rid)
        # bound and alive at every poll of this gather: a payload whose sender's records lapsed once (a
        # frozen process) or whose binding went away (its head left) may have been given up by an honest
        # holder, which is then no censor for leaving it out
        alive = {rid for rid in self.held.data if rid not in self.lapsed}
        closes = [ann.closes for _, ann in read.view.bound.values()] + [self.my_closes]
        return evidence(self.t, self.prev, self.held.data, self.established, alive, closes)

    def _fetch_bound(self, read: _Read) -> None:
        """Fetch each bound announcement's payload not held yet, once (unreachable: retried later)."""
        t, stage, held = self.t, self.stage, self.held
        for sender, (rid, rec) in sorted(read.view.bound.items()):
            if rid in held.data or sender in self.bad or self.retry_at.get(sender, 0.0) > time.monotonic():
                continue
            others = {**read.payloads, **read.stage0}
            try:
                got = self.fetcher.fetch(t, stage, sender, rec, self.parse, others, self.deadline, strict=True)
            except NotRelayed:  # the holders of the stage before ours fetch the view now: the next poll
                continue
            except NetworkError as exc:
                if not sender_alive(sender, read.holders, read.replicas):  # it died after announcing: out for us
                    if rid not in self.rejected:  # unless a holder that fetched it serves it later (retried)
                        log.warning(
                            "round %d stage %d: dropping %s: it left and its payload is gone", t, stage, rid[:12]
                        )
                        self.lost_at = time.monotonic()
                    self.rejected.add(rid)
                    self.retry_at[sender] = time.monotonic() + 1.0
                    continue
                self.retry_at[sender] = time.monotonic() + 2.0
                log.info("round %d stage %d: payload of %s not reachable yet: %s", t, stage, sender[:12], exc)
                continue
            except PeerError as exc:
                log.warning("round %d stage %d: rejecting payload of %s: %s", t, stage, sender[:12], exc)
                self.bad.add(sender)
                self.rejected.add(rid)
                continue
            held.data[rid] = got
            self.result.bytes_fetched += len(got.data)

    def _confirm_views(self, read: _Read) -> None:
        """Reading views: fetch whole each one a claim of round t leaves out (`peer.node.round.views`)."""
        if isinstance(self.parse, ViewReader):
            claims, bound, others = read.claims.values(), read.view.bound, {**read.payloads, **read.stage0}
            alive = functools.partial(sender_alive, holders=read.holders, replicas=read.replicas)
            nbytes, rejected, lost = self.views.confirm(self.held.data, claims, bound, others, self.parse, alive)
            self.result.bytes_fetched += nbytes
            for rid, sender in rejected:
                self.bad.add(sender)
                self.rejected.add(rid)
            for rid in lost:  # as `_fetch_bound` drops a payload whose sender left before we had it
                self.rejected.add(rid)
                self.lost_at = time.monotonic()

    def _finish(self, decision: Close) -> RoundResult:
        if decision in (Close.COMPLETE, Close.DEADLINE):  # a set of our own: only payloads a replay can check
            for rid in unbound_held(self.view, self.held.data):
                log.warning("round %d stage %d: left out %s: head gone, nothing binds it", self.t, self.stage, rid[:12])
                del self.held.data[rid]
                self.rejected.add(rid)
        result, held, view = self.result, self.held, self.view
        if decision is Close.COMPLETE:
            log_short_close(view, held.data, self.seen, self.t, self.stage)
        if decision is Close.BEHIND:
            result.behind = True
            log.warning("round %d stage %d: %s; re-syncing instead", self.t, self.stage, self.why_behind)
        elif decision is Close.DEADLINE:
            result.timed_out = True
            log.warning(
                "round %d stage %d: deadline after %.0fs with %d/%d payloads (missing: %s)",
                self.t,
                self.stage,
                self.timings.deadline_s,
                len(held.data),
                len(view.expected),
                ", ".join(sorted(view.expected - set(held.data) - self.rejected))[:200],
            )
        result.rejected, result.dropped = sorted(self.rejected - set(held.data)), sorted(view.dropped - set(held.data))
        result.replicas = sorted(held.data)
        result.contributions = [held.data[r] for r in result.replicas]
        result.wall_s = time.monotonic() - self.started
        result.evidence = self.evidence
        return result


def _claimed_by_most(claim: Claim, read: _Read, me: str, refused: Collection[str]) -> bool:
    """Whether a strict majority of the stage's live, unrefused holders — we count, and we do not
    claim it — claims `claim`'s set from its state: only then does a set we cannot fetch send us
    behind; one claim alone never does, even with one other holder."""
    link = claim.link
    assert link is not None
    name = (link.prev, link.entries)
    same = [c for c in read.claims.values() if c.link is not None and (c.link.prev, c.link.entries) == name]
    voters = [p for p in read.holders if p != me and p not in refused]
    return 2 * len(same) > len(voters) + 1


def _past(rec: StageRecord | None, t: int) -> bool:
    """A holder seen gathering round t is still waited for: gone, or its record is not at or before t."""
    return rec is None or rec.outer_step is None or rec.outer_step > t

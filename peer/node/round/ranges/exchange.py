"""One holder's ranges round (t, s): parts announced, a roster agreed, ranges aggregated by their owners.

docs/protocol.md, RANGES. The all-to-all gather (`peer.node.round.gather`) has every holder fetch
every payload: M − 1 payloads per holder per round. Here each contribution is cut into R parts
(`peer.core.sparseloco.ranges.plan`, R ≈ M) and a holder fetches only the parts of the few ranges it owns and
one shard per other range:
1. announce: our parts are served from the `PayloadStore`; the announcement carries their merkle
   `root`, the number of `ranges` and, as `sha256`, the hash of the parts concatenated;
2. roster: the close rule of an all-to-all gather (`peer.node.round.agreement.close_decision`) runs
   over *announcements* (held = announced, bound, fresh, planned for R ranges; complete also once
   `swarm.roster_quorum` of the expected are in and none came for `swarm.roster_quiet_s`:
   `ownership.quiet_close`, so a departed contributor's records do not hold it); then the first of
   `coordinator_order` that closed publishes the roster (`roster.{t}.{s}`: the contributions in
   replica order); every holder takes the valid roster of the best-ranked publisher, and one ranked
   i-th publishes its own after i · `rpc_s` without a better one (a vanished coordinator costs that);
3. owners (`peer.node.round.ranges.ownership.owners`, 1 + backups per range) fetch part r of every roster
   member, proven against its root (`peer.node.round.ranges.fetch`), aggregate it
   (`peer.core.sparseloco.ranges.owner.aggregate_range`: portable, the same bits on every machine), publish
   {r: sha256(shard)} (`shards.{t}.{s}`) and serve the shard;
4. every holder takes, per range, the shard its owners agree on; the one published when another
   owner vanished (`swarm.owner_grace_s` after the range's first hash, or past the shard deadline);
   on a disagreement it fetches the parts, recomputes each
   claimed shard from the contributions it lists as included, refuses an owner whose shard is not
   what it claims (`peer.node.round.refusals`) and takes the valid shard that includes the most (then the
   smallest hash); a range whose owners are all gone it computes itself.
The result (`RangesResult`) holds the roster and one checked shard per range; the caller commits
`peer.core.sparseloco.ranges.assemble` of them with `peer.core.sparseloco.commit.commit_summed`. Every wait has a
deadline: the roster by the round's deadline, the shards by `shard_wait_s` (then the survivors'
hashes count) and the round by deadline + grace after the roster (else `timed_out`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.ranges import RangePlan, merkle_root
from peer.core.sparseloco.ranges.owner import Shard, aggregate_range, roster_digest
from peer.errors import NetworkError
from peer.net.dht import RoundKind, dht_time
from peer.net.range_records import Roster, RosterEntry, RosterRecord, ShardsRecord
from peer.net.records import Announcement
from peer.node.round.agreement import Close, Poll, RoundView, close_decision, round_view
from peer.node.round.context import RoundContext
from peer.node.round.payloads import announced_before, read_round, sha256
from peer.node.round.ranges.fetch import RangeBytes, RangeFetcher, wait_until
from peer.node.round.ranges.ownership import coordinator_order, owners, quiet_close
from peer.node.round.ranges.resolve import Aggregate, Resolver
from peer.node.round.ranges.shard import RangeShard, made
from peer.node.round.timings import FRESH_S, MAX_SLOW_READS, RoundTimings

log = logging.getLogger(__name__)


@dataclass
class RangesResult:
    """What one holder took from ranges round (t, s): the roster and a checked shard per range."""

    t: int
    stage: int
    roster: Roster | None = None
    shards: dict[int, RangeShard] = field(default_factory=dict)  # one checked shard per range resolved
    position: int | None = None  # our contribution's place in the roster (None: not in it)
    payload_bytes: int = 0  # our payload's size (its parts concatenated): the unit of `fetched`
    fetched: RangeBytes = field(default_factory=RangeBytes)
    owned: list[int] = field(default_factory=list)  # ranges we aggregated as an owner
    computed: list[int] = field(default_factory=list)  # ranges we computed because their owners failed
    refused: list[str] = field(default_factory=list)  # owners whose shard was not what they published
    timed_out: bool = False
    timings: dict[str, float] = field(default_factory=dict)  # roster_s, owned_s, wall_s
    wanted: frozenset[int] | None = None  # the ranges resolved (None: every range)
    behind: bool = False  # the swarm closed the round a round ago (a freeze): not committed here

    @property
    def complete(self) -> bool:
        if self.roster is None:
            return False
        return set(self.shards) >= (self.wanted if self.wanted is not None else set(range(self.roster.ranges)))

    @property
    def parsed(self) -> dict[int, Shard]:
        """The resolved shards, parsed, by range (what a commit assembles)."""
        return {r: s.shard for r, s in self.shards.items()}

    @property
    def replicas(self) -> list[str]:
        return [e.replica for e in self.roster.entries] if self.roster is not None else []


def gather_ranges(
    ctx: RoundContext,
    t: int,
    stage: int,
    timings: RoundTimings,
    plan: RangePlan,
    own: tuple[str, Sequence[Payload]] | None = None,
    stop: threading.Event | None = None,
    banned: Collection[str] = frozenset(),
    quorum: int = 1,
    peers: Mapping[str, str] | None = None,
    wanted: Collection[int] | None = None,
    mode: str | None = None,
) -> RangesResult:
    """Contribute `own` = (replica id, its parts in range order) if given, then take round (t, stage)'s
    roster and shards (module docstring). Owners per range beyond the primary: `swarm.range_backups`;
    what a shard is: `swarm.shard` ("exact": the range's exact aggregate; "topk": `swarm.shard_topk`
    entries per tile, 0: `sparseloco.topk`); `quorum`, `banned`,
    `peers` and `mode` as in `peer.node.round.result.RoundInputs`; `wanted`: the only ranges an observer resolves
    (a stage peer reads stage 0's embedding ranges alone)."""
    swarm = ctx.cfg.swarm
    wants = None if wanted is None else frozenset(wanted)
    settings = _Settings(swarm.range_backups, swarm.shard_topk or None, wants, swarm.shard == "exact")
    run = _RangesRound(ctx, t, stage, timings, plan, banned, settings)
    if own is not None:
        run.contribute(own, ctx.me.address, peers, mode)
    return run.run(stop, quorum)


@dataclass(frozen=True)
class _Settings:
    backups: int = 1  # owners per range beyond the primary
    shard_topk: int | None = None  # a shard's entries per tile (None: cfg.topk)
    wanted: frozenset[int] | None = None  # the only ranges resolved (None: all); an observer's choice
    exact: bool = False  # swarm.shard == "exact": shards of the exact aggregate (shard_topk unused)


class _RangesRound:
    """The state of one holder's ranges round (t, stage) across its phases (module docstring)."""

    def __init__(
        self,
        ctx: RoundContext,
        t: int,
        stage: int,
        timings: RoundTimings,
        plan: RangePlan,
        banned: Collection[str],
        settings: _Settings,
    ) -> None:
        self.dht, self.t, self.stage, self.timings, self.plan = ctx.dht, t, stage, timings, plan
        self.cfg: SparseLoCoConfig = ctx.cfg.sparseloco
        self.store, self.inc, self.refusals, self.banned = ctx.store, ctx.me.incarnation, ctx.refusals, banned
        self.me, self.presence = ctx.dht.peer_id, ctx.me
        self.started = time.monotonic()
        self.deadline = self.started + timings.deadline_s
        self.backups, self.shard_topk, self.exact = settings.backups, settings.shard_topk, settings.exact
        self.swarm = ctx.cfg.swarm  # the roster's quiet close, the owners' grace
        self.replica: str | None = None
        self.result = RangesResult(t, stage, wanted=settings.wanted)
        fetched = self.result.fetched
        self.fetcher = RangeFetcher(
            ctx.clients, self.store, self.me, t, stage, plan, self.cfg, timings.rpc_s, fetched, self.backups
        )
        self.fetcher.shard_topk, self.fetcher.exact = self.shard_topk, self.exact
        self.view = RoundView()
        self.warned: set[str] = set()

    def contribute(
        self,
        own: tuple[str, Sequence[Payload | bytes]],
        address: str,
        peers: Mapping[str, str] | None,
        mode: str | None,
    ) -> None:
        """Serve our parts (Payloads, or a voted round's vote parts as bytes) and announce them:
        merkle root, R, sha256 of the parts concatenated. Not when other parts of ours are announced
        for this round (a redone outer step, a restart): a sender announces one payload per round
        (`peer.node.round.payloads.first_payload`), and we observe the round instead."""
        replica, parts = own
        if len(parts) != self.plan.n:
            raise ValueError(f"{len(parts)} parts for a plan of {self.plan.n} ranges")
        data = [p if isinstance(p, bytes) else p.to_bytes() for p in parts]
        joined = b"".join(data)
        if announced_before(self.dht, self.presence, self.t, self.stage, sha256(joined)):
            return  # we (or our killed process) announced other parts for this round: we observe it
        self.store.put_parts(self.t, self.stage, data)
        closes = round(dht_time() + self.timings.deadline_s, 3)
        peers = dict(peers) if peers is not None else None
        root = merkle_root(data)
        ann = Announcement(
            sha256(joined), len(joined), address, replica, self.inc, closes, peers, root, self.plan.n, mode
        )
        self.dht.announce_payload(self.t, self.stage, ann.to_record(), ttl_s=self.timings.ttl_s)
        self.replica, self.result.payload_bytes = replica, len(joined)

    def run(self, stop: threading.Event | None, quorum: int) -> RangesResult:
        """Close the roster, agree on one, own our ranges, resolve every range (module docstring)."""
        result = self.result
        roster = self.roster(stop, quorum)
        for _ in range(3):  # a better-ranked roster seen late replaces ours (at most twice)
            if roster is None:
                result.timed_out = True
                log.warning("round %d stage %d: no roster by the deadline", self.t, self.stage)
                break
            result.roster, result.shards = roster, {}
            result.fetched.add("roster", len(json.dumps(roster.record().to_record())))
            result.position = next((i for i, e in enumerate(roster.entries) if e.replica == self.replica), None)
            self._own(roster)
            result.timings["owned_s"] = time.monotonic() - self.started
            resolver = Resolver(self.dht, self.fetcher, self.t, self.stage, self.plan, self.cfg, self.refusals)
            resolver.shard_topk, resolver.backups, resolver.poll_s = self.shard_topk, self.backups, self.timings.poll_s
            resolver.exact, resolver.owner_grace_s = self.exact, self.swarm.owner_grace_s
            if result.wanted is not None:
                resolver.wanted = sorted(result.wanted)
            better = resolver.run(roster, lambda: self._best_roster(reread=False), stop, self._deadlines())
            result.computed, result.refused = resolver.computed, resolver.refused
            result.shards = resolver.shards
            result.timed_out = not result.complete
            if better is None:
                break
            roster = better
        result.timings["wall_s"] = time.monotonic() - self.started
        return result

    def roster(self, stop: threading.Event | None, quorum: int) -> Roster | None:
        """Steps 1–2: close the announcements and take the best-ranked valid roster (None: none by the deadline)."""
        roster = self._agree(self._close(stop, quorum), stop)
        self.result.timings["roster_s"] = time.monotonic() - self.started
        return roster

    def _deadlines(self) -> tuple[float, float]:
        """(shard deadline: owners silent past it are counted as gone, the round's hard deadline)."""
        now, timings = time.monotonic(), self.timings
        return now + max(timings.grace_s, timings.deadline_s / 2), now + timings.deadline_s + timings.grace_s

    # ------------------------------------------------------------------ 2. the roster
    def _read(self) -> tuple[RoundView, dict[str, RosterRecord]] | None:
        """One DHT read: the round's view and the rosters published so far (None: the read failed)."""
        try:
            replicas, holders, payloads, stage0 = read_round(self.dht, self.t, self.stage)
            rosters = self.dht.get_round("roster", self.t, self.stage, RosterRecord.parse)
        except NetworkError as exc:
            if time.monotonic() >= self.deadline + self.timings.grace_s:
                raise
            log.info("round %d stage %d: DHT read failed, polling again: %s", self.t, self.stage, exc)
            return None
        holders = {p: r for p, r in holders.items() if not r.left}
        view = round_view(self.t, self.stage, payloads, stage0, replicas, holders, self.me, self.inc, self.banned)
        self.view = view
        return view, rosters

    def _planned(self, view: RoundView) -> tuple[dict[str, tuple[str, Announcement]], set[str]]:
        """Bound announcements planned for our R ranges ({sender: (replica, ann)}), and the replicas of
        the others (announced for another plan, or no ranges at all: not in this round)."""
        good, bad = {}, set()
        for sender, (rid, ann) in view.bound.items():
            if ann.root and ann.ranges == self.plan.n:
                good[sender] = (rid, ann)
            else:
                bad.add(rid)
        return good, bad

    def _close(self, stop: threading.Event | None, quorum: int) -> list[RosterEntry]:
        """Poll the announcements until the close rule closes them (or a roster is already out):
        our candidate roster, in replica order."""
        good: dict[str, tuple[str, Announcement]] = {}
        slow = 0  # reads in a row that took longer than FRESH_S: believed after MAX_SLOW_READS (a slow DHT)
        grew_at, n_held = time.monotonic(), 0  # when the last new contribution was read (the quiet close)
        while True:
            at = time.monotonic()
            read = self._read()
            if read is None:
                wait_until(self.deadline + self.timings.grace_s, stop, self.timings.poll_s)
                continue
            slow = slow + 1 if time.monotonic() - at > FRESH_S else 0
            view, rosters = read
            good, bad = self._planned(view)
            held = {rid for rid, _ in good.values()}
            if len(held) > n_held:
                grew_at, n_held = time.monotonic(), len(held)
            w = self.swarm
            quiet = quiet_close(
                len(held), len(view.expected | held), time.monotonic() - grew_at, w.roster_quiet_s, w.roster_quorum
            )
            poll = Poll(
                fresh=slow == 0 or slow >= MAX_SLOW_READS,
                past_deadline=time.monotonic() >= self.deadline,
                complete=view.expected <= held | bad | view.dropped or quiet,
                short=self.t == 0 and quorum > 1 and len(held) < quorum,
            )
            decision = close_decision(poll)
            if self._pick(view, rosters) is not None or decision in (Close.COMPLETE, Close.DEADLINE):
                break
            wait_until(self.deadline, stop, self.timings.poll_s)
        entries = [RosterEntry(rid, a.sha256, a.root or "", s, a.address) for s, (rid, a) in good.items()]
        return sorted(entries, key=lambda e: e.replica)

    def _agree(self, candidate: list[RosterEntry], stop: threading.Event | None) -> Roster | None:
        """The roster of the best-ranked publisher; ours published when it is our turn (module docstring)."""
        closed = time.monotonic()
        order = coordinator_order(self.t, self.stage, {e.sender for e in candidate} | {self.me})
        rank = order.index(self.me) if self.replica is not None else None
        published = False
        limit = max(self.deadline, closed) + self.timings.grace_s + self.timings.rpc_s * len(order)
        while time.monotonic() < limit:
            best = self._best_roster()
            if best is not None:
                return best
            if (
                rank is not None
                and not published
                and candidate
                and time.monotonic() - closed >= rank * self.timings.rpc_s
            ):
                digest = roster_digest([(e.replica, e.sha256) for e in candidate])
                record = RosterRecord(digest, self.plan.n, tuple(e.sender for e in candidate))
                self.dht.announce_round("roster", self.t, self.stage, record.to_record(), ttl_s=self.timings.ttl_s)
                published = True
                log.info(
                    "round %d stage %d: published the roster (%d contributions)", self.t, self.stage, len(candidate)
                )
                continue
            wait_until(limit, stop, self.timings.poll_s)
        return None

    def _best_roster(self, reread: bool = True) -> Roster | None:
        """The valid roster of the best-ranked publisher now in the DHT (None: none yet). `reread`:
        read the round's announcements again; else check the rosters against the last read."""
        if reread:
            read = self._read()
            if read is None:
                return None
            view, rosters = read
        else:
            try:
                rosters = self.dht.get_round("roster", self.t, self.stage, RosterRecord.parse)
            except NetworkError as exc:
                log.info("round %d stage %d: rosters not read: %s", self.t, self.stage, exc)
                return None
            view = self.view
        return self._pick(view, rosters)

    def _pick(self, view: RoundView, rosters: Mapping[str, RosterRecord]) -> Roster | None:
        """The best-ranked of the valid rosters published by a contributor of the round."""
        contributors = set(view.bound)
        valid = {}
        for p, rec in rosters.items():
            roster = self._resolve(p, rec, view) if p in contributors else None
            if roster is not None:
                valid[p] = roster
        if not valid:
            return None
        return valid[coordinator_order(self.t, self.stage, valid)[0]]

    def _resolve(self, publisher: str, rec: RosterRecord, view: RoundView) -> Roster | None:
        """A roster is taken only once every sender it names has a bound announcement planned for our R
        in our read of the round (else it waits for a later read), and only if it is well formed: our
        R, one entry per replica in replica order, its digest that of the (replica, sha256) pairs of
        those announcements."""
        if rec.ranges != self.plan.n:
            return self._ignore(publisher, f"it plans {rec.ranges} ranges, not {self.plan.n}")
        entries = []
        for sender in rec.senders:
            bound = view.bound.get(sender)
            if bound is None:
                return None  # not (yet) read: a later read may show it
            rid, ann = bound
            if not ann.root or ann.ranges != self.plan.n:
                return self._ignore(publisher, f"{sender[:12]} did not announce parts for {self.plan.n} ranges")
            entries.append(RosterEntry(rid, ann.sha256, ann.root, sender, ann.address))
        if not entries or [e.replica for e in entries] != sorted({e.replica for e in entries}):
            return self._ignore(publisher, "its entries are not one per replica in replica order")
        if rec.digest != roster_digest([(e.replica, e.sha256) for e in entries]):
            return self._ignore(publisher, "its digest is not that of the announcements it names, as we read them")
        return Roster(rec.digest, rec.ranges, tuple(entries))

    def _ignore(self, publisher: str, why: str) -> Roster | None:
        """Log (once per publisher) why its roster is not taken; None."""
        if publisher not in self.warned:
            self.warned.add(publisher)
            log.warning("round %d stage %d: ignoring the roster of %s: %s", self.t, self.stage, publisher[:12], why)
        return None

    # ------------------------------------------------------------------ 3. our ranges
    def _own(self, roster: Roster) -> None:
        """Aggregate the ranges we own over the roster, serve the shards and publish their hashes."""
        senders = [e.sender for e in roster.entries]
        mine = [r for r in range(self.plan.n) if self.me in owners(self.t, self.stage, r, senders, 1 + self.backups)]
        self.result.owned = mine
        if not mine:
            return
        self.publish("shards", roster, mine, self.fetcher, self._aggregate)

    def _aggregate(self, roster: Roster, r: int, parts: Sequence[Payload | None]) -> RangeShard:
        shard, _ = aggregate_range(
            self.t, self.stage, r, self.plan, parts, roster.digest, self.cfg, self.shard_topk, exact=self.exact
        )
        return made(shard)

    def publish(
        self, kind: RoundKind, roster: Roster, mine: Sequence[int], fetcher: RangeFetcher, make: Aggregate
    ) -> None:
        """As an owner of `mine`: fetch their parts, make each range's record, serve it (by its sha256)
        and publish the hashes as our `kind` record ("shards"; a voted round's "supports" too)."""
        parts = fetcher.parts(roster, mine)
        hashes = {}
        for r in mine:
            got = make(roster, r, parts[r])
            self.store.put_shard(self.t, self.stage, r, got.data)
            hashes[r] = got.sha256
        record = ShardsRecord(roster.digest, hashes)
        self.dht.announce_round(kind, self.t, self.stage, record.to_record(), ttl_s=self.timings.ttl_s)

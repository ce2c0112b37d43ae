"""One holder's voted round (t, s): a ranges round's roster over vote parts, then supports, values and means.

docs/protocol.md, VOTED; the math and wire formats are `peer.core.sparseloco.ranges.voted` and
`voted_range`. On top of the ranges round (`peer.node.round.ranges.exchange`: plan, roster, owners
and backups, merkle proofs, the resolver that refuses a liar and covers a dead owner):
1. votes: our vote parts (top-k per tile of e = β·e + Δ) are served and announced as a ranges
   round's parts; the roster is agreed as there;
2. supports: each owner tallies the vote parts of its ranges (a part that does not parse is refused
   whole: its sender left out of the tally), publishes `supports.{t}.{s}` and serves each support by
   its sha256; every holder resolves one support per range as shards are resolved (`Resolver` with
   kind "supports", recomputation `range_support` from the vote parts a support lists as counted);
3. values: a contributor encodes Q(e) at every range's support (`values_part`, on a copy of e: its
   commit adds `sent_adjustment`, −v̂ of each mean that includes it, to e), serves the parts under
   `values_stage(s)` and publishes their merkle root (`values.{t}.{s}`);
4. means: each owner waits for the roster's values records (up to the phase's shard deadline, or their
   quiet close), fetches the values parts of its ranges proven against those roots, publishes the mean
   shard (`mean_shard`, its values at `swarm.mean_bits`) as `shards.{t}.{s}`; every holder resolves one
   per range (`Resolver`, recomputation `mean_shard` from the values parts the shard lists as included).
Every phase waits with deadlines of its own, each as a ranges round's (the shard deadline max(grace,
T/2), the hard deadline T + grace, from the phase's start). A better-ranked roster seen after the
roster is taken is not followed (the ranges round restarts on one; here values are already out):
such a holder's commit differs and is reconciled as a ranges round's would be.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.ranges import RangePlan, merkle_root
from peer.core.sparseloco.ranges.owner import Shard
from peer.core.sparseloco.ranges.voted import voted_keep
from peer.core.sparseloco.ranges.voted_range import (
    Support,
    mean_shard,
    parse_values,
    parse_votes,
    range_support,
    values_part,
    vote_parts,
    voted,
)
from peer.errors import NetworkError, PeerError
from peer.net.range_records import Roster, RosterEntry, ValuesRecord
from peer.node.round.context import RoundContext
from peer.node.round.payloads import sha256
from peer.node.round.ranges.exchange import RangesResult, _RangesRound, _Settings
from peer.node.round.ranges.fetch import RangeFetcher, wait_until
from peer.node.round.ranges.ownership import owners, quiet_close
from peer.node.round.ranges.resolve import Resolver
from peer.node.round.ranges.shard import RangeShard, made
from peer.node.round.timings import RoundTimings

log = logging.getLogger(__name__)

VALUES_STAGE = 1 << 32  # values parts live under stage + this in the store and in PART requests


def values_stage(stage: int) -> int:
    """The stage key of a voted round's values parts (its vote parts keep the stage's own)."""
    return stage + VALUES_STAGE


@dataclass
class VotedResult(RangesResult):
    """A ranges result whose shards are the voted round's means, with the supports it took and, for
    a contributor, its error buffer after sending (module docstring)."""

    supports: dict[int, RangeShard[Support]] = field(default_factory=dict)
    errors: dict[str, Tensor] | None = None  # e − v̂ on every support (None: no values sent)
    sent_values: dict[int, list[np.ndarray]] = field(default_factory=dict)  # our v̂ per range, per band


def gather_voted(
    ctx: RoundContext,
    t: int,
    stage: int,
    timings: RoundTimings,
    plan: RangePlan,
    own: tuple[str, Mapping[str, Tensor]] | None = None,
    stop: threading.Event | None = None,
    banned: Collection[str] = frozenset(),
    quorum: int = 1,
    peers: Mapping[str, str] | None = None,
    wanted: Collection[int] | None = None,
    mode: str | None = None,
) -> VotedResult:
    """Contribute `own` = (replica id, its error buffer e = β·e + Δ of every tensor) if given, then take
    round (t, stage)'s roster, supports and mean shards (module docstring); the rest as `gather_ranges`."""
    swarm = ctx.cfg.swarm
    wants = None if wanted is None else frozenset(wanted)
    run = _VotedRound(ctx, t, stage, timings, plan, banned, _Settings(swarm.range_backups, None, wants, True))
    if own is not None:
        run.vote(own, ctx.me.address, peers, mode)
    return run.run_voted(stop, quorum)


class _VotedRound(_RangesRound):
    """The state of one holder's voted round (t, stage) across its phases (module docstring)."""

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
        super().__init__(ctx, t, stage, timings, plan, banned, settings)
        self.voted = VotedResult(t, stage, wanted=settings.wanted)
        self.result = self.voted  # the ranges round's steps fill it too
        self.fetcher.counts = self.voted.fetched
        self.fetcher.parse_part = lambda r, data: parse_votes(data, plan, r, self.cfg)
        self.keep = voted_keep(ctx.cfg.swarm.shard_topk, self.cfg.topk)
        self.mean_bits = ctx.cfg.swarm.mean_bits  # the bits of a mean shard's values (0: float32)
        self.seed = ctx.cfg.seed
        self.clients = ctx.clients
        self.e: dict[str, Tensor] | None = None

    def vote(
        self, own: tuple[str, Mapping[str, Tensor]], address: str, peers: Mapping[str, str] | None, mode: str | None
    ) -> None:
        """Phase 1: serve and announce our vote parts; keep a copy of e for the values phase."""
        replica, e = own
        self.e = {n: v.detach().to("cpu", torch.float32).contiguous().clone() for n, v in e.items()}
        self.contribute((replica, vote_parts(self.e, self.plan, self.cfg)), address, peers, mode)

    def run_voted(self, stop: threading.Event | None, quorum: int) -> VotedResult:
        result = self.voted
        roster = self.roster(stop, quorum)
        if roster is None:
            result.timed_out = True
            log.warning("round %d stage %d: no roster by the deadline", self.t, self.stage)
            return result
        result.roster = roster
        result.fetched.add("roster", len(json.dumps(roster.record().to_record())))
        result.position = next((i for i, e in enumerate(roster.entries) if e.replica == self.replica), None)
        contributing = result.position is not None and self.e is not None
        supports = self._supports(roster, stop, everything=contributing)
        if contributing and len(supports) == self.plan.n:
            self._send_values(roster, supports)
            result.timings["values_s"] = time.monotonic() - self.started
        self._means(roster, supports, stop)
        result.timed_out = not result.complete
        result.timings["wall_s"] = time.monotonic() - self.started
        return result

    # ------------------------------------------------------------------ helpers
    def _resolver(self, fetcher: RangeFetcher, wanted: Collection[int] | None) -> Resolver:
        resolver = Resolver(self.dht, fetcher, self.t, self.stage, self.plan, self.cfg, self.refusals)
        resolver.backups, resolver.poll_s = self.backups, self.timings.poll_s
        resolver.owner_grace_s = self.swarm.owner_grace_s
        if wanted is not None:
            resolver.wanted = sorted(wanted)
        return resolver

    def _mine(self, roster: Roster) -> list[int]:
        senders = [e.sender for e in roster.entries]
        return [r for r in range(self.plan.n) if self.me in owners(self.t, self.stage, r, senders, 1 + self.backups)]

    # ------------------------------------------------------------------ 2. supports
    def _made_support(self, roster: Roster, r: int, votes: Sequence[Any]) -> RangeShard[Support]:
        support = range_support(
            self.t,
            self.stage,
            r,
            self.plan,
            votes,
            roster.digest,
            self.cfg,
            self.keep,
            self.seed,
        )
        data = support.to_bytes(self.plan, self.cfg, self.keep)
        return RangeShard(sha256(data), data, support)

    def _parse_support(self, roster: Roster, r: int, data: bytes) -> Support:
        support = Support.from_bytes(data, self.plan, self.cfg, self.keep, len(roster.entries))
        if (support.t, support.stage, support.r, support.roster) != (self.t, self.stage, r, roster.digest):
            raise PeerError(
                f"its header names round {support.t} stage {support.stage} range {support.r} of another roster"
            )
        return support

    def _support_resolver(self, wanted: Collection[int] | None) -> Resolver:
        """A resolver of the supports of `wanted` ranges (None: all): kind "supports", served by hash,
        recomputed from the vote parts a support lists as counted."""
        resolver = self._resolver(self.fetcher, wanted)
        resolver.kind, resolver.aggregate = "supports", self._made_support
        resolver.fetch_one = lambda ro, r, want, addrs: self.fetcher.shard(
            ro, r, want, addrs, parse=self._parse_support
        )
        return resolver

    def _supports(
        self, roster: Roster, stop: threading.Event | None, everything: bool
    ) -> dict[int, RangeShard[Support]]:
        """Publish the supports of our ranges, then resolve one per range (every range for a contributor)."""
        mine = self._mine(roster)
        self.voted.owned = mine
        if mine:
            self.publish("supports", roster, mine, self.fetcher, self._made_support)
        resolver = self._support_resolver(None if everything else self.voted.wanted)
        resolver.run(roster, lambda: None, stop, self._deadlines())
        self.voted.refused += resolver.refused
        self.voted.supports = dict(resolver.shards)
        self.voted.timings["supports_s"] = time.monotonic() - self.started
        return self.voted.supports

    # ------------------------------------------------------------------ 3. values
    def _send_values(self, roster: Roster, supports: Mapping[int, RangeShard[Support]]) -> None:
        """Our values part of every range (e − v̂ on a copy of e), served and its merkle root published."""
        assert self.e is not None
        e = {n: v.clone() for n, v in self.e.items()}
        data = [values_part(e, self.plan, supports[r].shard, self.cfg) for r in range(self.plan.n)]
        self.store.put_parts(self.t, values_stage(self.stage), data)
        record = ValuesRecord(roster.digest, merkle_root(data))
        self.dht.announce_round("values", self.t, self.stage, record.to_record(), ttl_s=self.timings.ttl_s)
        self.voted.errors = e
        self.voted.sent_values = {
            r: parse_values(d, self.plan, supports[r].shard, self.cfg, self.keep) for r, d in enumerate(data)
        }

    # ------------------------------------------------------------------ 4. means
    def _values_roster(
        self, roster: Roster, stop: threading.Event | None, needed: bool, shard_deadline: float
    ) -> Roster:
        """The roster with each member's root replaced by its values root (\"\" where none was read):
        an owner waits for every member's record up to the phase's shard deadline, or until the quiet
        close of the roster's announcements (`ownership.quiet_close`) holds for the values records: a
        member that died after the roster sends no values, and its records would hold every owner."""
        roots: dict[str, str] = {}
        grew_at, n_in, w = time.monotonic(), 0, self.swarm
        members = {e.sender for e in roster.entries}
        while True:
            try:
                records = self.dht.get_round("values", self.t, self.stage, ValuesRecord.parse)
                roots = {p: rec.root for p, rec in records.items() if rec.roster == roster.digest and rec.root}
            except NetworkError as exc:
                log.info("round %d stage %d: values records not read: %s", self.t, self.stage, exc)
            now, n = time.monotonic(), len(members & roots.keys())
            if n > n_in:
                grew_at, n_in = now, n
            quiet = quiet_close(n, len(members), now - grew_at, w.roster_quiet_s, w.roster_quorum)
            if not needed or n == len(members) or quiet or now >= shard_deadline:
                break
            wait_until(shard_deadline, stop, self.timings.poll_s)
        entries = tuple(
            RosterEntry(e.replica, e.sha256, roots.get(e.sender, ""), e.sender, e.address) for e in roster.entries
        )
        return Roster(roster.digest, roster.ranges, entries)

    def _means(self, roster: Roster, supports: Mapping[int, RangeShard[Support]], stop: threading.Event | None) -> None:
        """Publish the mean shards of our ranges, then resolve one per wanted range (module docstring).

        An owner may wait for values records up to the phase's shard deadline and then fetch and publish,
        so a holder counts a silent owner as gone only half a shard window after it: at the shard deadline
        itself a holder that saw one owner's mean would take it while one that also saw its co-owner's
        (which counted a values record the first had not read) would arbitrate and pick the fuller one."""
        start = time.monotonic()
        values_deadline, hard = self._deadlines()
        fence = values_deadline + (values_deadline - start) / 2
        deadlines = (fence, max(hard, fence + self.timings.grace_s))
        mine = [r for r in self._mine(roster) if r in supports]
        vroster = self._values_roster(roster, stop, needed=bool(mine), shard_deadline=values_deadline)
        self.voted.timings["values_closed_s"] = time.monotonic() - self.started
        at_bits = replace(self.cfg, quant_bits=self.mean_bits)  # how a mean shard's values are coded
        fetcher = RangeFetcher(
            self.clients, self.store, self.me, self.t, self.stage, self.plan, at_bits,
            self.timings.rpc_s, self.voted.fetched, self.backups,
        )  # fmt: skip
        fetcher.exact, fetcher.wire_stage = True, values_stage(self.stage)
        fetcher.parse_part = lambda r, data: parse_values(
            data, self.plan, self._support(roster, r, supports), self.cfg, self.keep
        )

        def make(ro: Roster, r: int, values: Sequence[Any]) -> RangeShard[Shard]:
            support = self._support(roster, r, supports)
            return made(mean_shard(self.plan, support, values, self.cfg, self.mean_bits))

        if mine:
            self.publish("shards", vroster, mine, fetcher, make)
        resolver = self._resolver(fetcher, self.voted.wanted)
        resolver.aggregate = make
        resolver.run(vroster, lambda: None, stop, deadlines)
        self.voted.refused += resolver.refused
        self.voted.computed = resolver.computed
        self.voted.shards = resolver.shards

    def _support(self, roster: Roster, r: int, supports: Mapping[int, RangeShard[Support]]) -> Support:
        """Range r's resolved support (an observer that must check a mean resolves it now)."""
        if r not in supports:
            resolver = self._support_resolver([r])
            resolver.run(roster, lambda: None, None, self._deadlines())
            if r not in resolver.shards:
                raise PeerError(f"round {self.t} stage {self.stage}: no support of range {r} to check its mean by")
            self.voted.supports[r] = resolver.shards[r]
            return resolver.shards[r].shard
        return supports[r].shard


def sent_adjustment(result: VotedResult, plan: RangePlan, cfg: SparseLoCoConfig) -> dict[str, Tensor] | None:
    """What committing the round does to our error buffer e = β·e + Δ: −v̂ on the support of each range
    whose mean shard includes us (the rest of what we sent was not counted: it stays in e). None: we
    sent no values."""
    if result.errors is None or result.position is None:
        return None
    out = {n: torch.zeros_like(v) for n, v in result.errors.items()}
    for r, values in result.sent_values.items():
        got = result.shards.get(r)
        if got is None or not got.shard.is_included(result.position):
            continue
        sets = iter(result.supports[r].shard.sets)
        for band, v in zip(plan.ranges[r], values, strict=True):
            view = (out[band.name][band.row0 : band.row1] if out[band.name].dim() >= 2 else out[band.name]).reshape(-1)
            at = torch.from_numpy(next(sets)) if voted(band, cfg) else torch.arange(band.numel)
            view[at] = -torch.from_numpy(v)
    return out

"""Recomputing a claimed commit of round (t, s) from the state we committed it from (RECONCILE).

A claim names its set and, on a stage > 0, stage 0's set that moved its T⊥ (`peer.node.round.claims.Link`).
`recompute_set` fetches both by content, proves every entry genuine against its signed announcement
(`peer.node.round.verify`) and recomputes the commit from the state our own commit of that round
started from (`StageWorker.recompute`): the portable commit gives the same bits on every holder, so
the recomputed state id is the claim's if and only if the claim is true.

`ClaimChecks` makes RECONCILE's checks with them: the audit of every claim, the recomputation of a
better one before a switch, the rebase of T⊥ onto stage 0's set.

`stage0_set` says which stage-0 set a stage > 0 must move T⊥ by: the set a strict majority of stage
0's live, unrefused holders (ourselves included when we hold stage 0) claim for the round. T⊥ is one
tensor across stages after every round only if every stage moves it by that set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from peer.config import RunConfig, history_ttl_s
from peer.net.dht import dht_time
from peer.net.pool import ClientPool
from peer.net.records import Announcement, ReplicaRecord, StageRecord
from peer.node.metrics import MetricsWriter
from peer.node.round.claims import Claim, Entry, Link, parse_claims
from peer.node.round.contribution import Contribution
from peer.node.round.payloads import PayloadStore, round_reading, round_validator
from peer.node.round.refusals import Refusals
from peer.node.round.verify import SetFetcher, Verdict, alive, resolve
from peer.node.stage.commit import Outcome
from peer.node.stage.embed import stage0_change
from peer.node.stage.state import StageState
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)


@dataclass
class Recomputed:
    """What recomputing a set gave: the outcome (None: not computable now), the set's contributions in
    commit order, and the entries that no replica announced (`forged`) or nobody served (`missing`)."""

    outcome: Outcome | None = None
    payloads: list[Contribution] = field(default_factory=list)
    forged: list[Entry] = field(default_factory=list)
    missing: int = 0


@dataclass
class SetBytes:
    """A committed set fetched by content (`fetch_set`): its contributions in commit order, stage 0's
    embedding change its `embed` names, what could not be had, and the bytes read."""

    payloads: list[Contribution] = field(default_factory=list)
    embed_update: torch.Tensor | None = None
    forged: list[Entry] = field(default_factory=list)  # entries of the set no replica announced
    forged_embed: list[Entry] = field(default_factory=list)  # entries of the embed set no replica announced
    missing: int = 0  # entries nobody served (either set)
    nbytes: int = 0

    @property
    def complete(self) -> bool:
        return not self.forged and not self.forged_embed and not self.missing


def fetch_set(
    cfg: RunConfig,
    fetcher: SetFetcher,
    worker: StageState,
    t: int,
    entries: Sequence[Entry],
    embed: Sequence[Entry] | None,
    claimer_address: str | None = None,
    views: bool = False,
) -> SetBytes:
    """Round t's set `entries` of our stage and, on a stage > 0, stage 0's set `embed` that moves T⊥
    (its embedding change, `peer.node.stage.embed.stage0_change`), each entry proven genuine: the one
    fetch of a claimed set that RECONCILE and the replay both recompute from. `views`: stage 0's set
    is read as embedding views where u allows it (`round_reading`) — RECONCILE's sets, which stage 0's
    majority (or we) committed; a joiner's replay reads it whole (a view cannot prove the whole payload
    valid, and a replayed link's `embed` may be any stage-0 holder's: docs/protocol.md)."""
    parse = round_validator(cfg, worker, worker.stage)
    got = fetcher.fetch(t, worker.stage, entries, parse, claimer_address=claimer_address, n_stages=cfg.stages)
    out = SetBytes(forged=list(got.forged), missing=len(got.missing))
    if not got.complete:
        return out
    if embed is not None and worker.stage != 0:
        parse0 = round_reading(cfg, worker, 0) if views else round_validator(cfg, worker, 0)
        got0 = fetcher.fetch(t, 0, embed, parse0, claimer_address=claimer_address, n_stages=cfg.stages)
        out.forged_embed, out.missing = list(got0.forged), len(got0.missing)
        if not got0.complete:
            return out
        embed_set = [got0.payloads[e] for e in embed]
        out.embed_update = stage0_change(cfg, embed_set)
        out.nbytes += sum(len(c.data) for c in embed_set)
    out.payloads = [got.payloads[e] for e in entries]
    out.nbytes += sum(len(c.data) for c in out.payloads)
    return out


def linked_set(links: Mapping[str, Link], t: int, refused: Collection[str]) -> tuple[Entry, ...] | None:
    """The set of round t that a strict majority of the links stage 0's unrefused holders published
    for it (`chain.{t}.0`, kept for the history window) names; None when no set has one (or the
    round was a ranges round). What an observer whose own gather lost round t moves T⊥ by once stage
    0's holders have gone past it: their claims no longer name round t, their links still do."""
    votes: dict[tuple[Entry, ...], int] = {}
    for peer, link in links.items():
        if peer in refused or link.t != t or link.ranges is not None:
            continue
        votes[link.entries] = votes.get(link.entries, 0) + 1
    return _strict_majority(votes, sum(votes.values()))


def linked_stage0(
    cfg: RunConfig,
    dht: object,
    clients: ClientPool,
    store: PayloadStore,
    me: str,
    worker: StageState,
    links: Mapping[str, Link],
    t: int,
    refused: Collection[str],
) -> tuple[torch.Tensor, list[Entry]] | None:
    """Stage 0's committed set of round t as its holders' `links` name it (`linked_set`), its entries
    fetched by content as `worker`'s stage reads them (views: `round_reading`) and proven genuine,
    and its embedding change; None when no set has a majority or any entry could not be had."""
    embed = linked_set(links, t, refused)
    if embed is None:
        return None
    fetcher = SetFetcher.of_run(cfg, dht, clients, store, me, holders=True)
    got = fetcher.fetch(t, 0, embed, round_reading(cfg, worker, 0), n_stages=cfg.stages)
    update = stage0_change(cfg, [got.payloads[e] for e in embed]) if got.complete else None
    return None if update is None else (update, list(embed))


def recompute_set(
    cfg: RunConfig,
    dht: object,
    clients: ClientPool,
    store: PayloadStore,
    me: str,
    worker: StageWorker,
    t: int,
    entries: Sequence[Entry],
    embed: Sequence[Entry] | None,
    claimer_address: str | None = None,
) -> Recomputed:
    """The commit of round t with set `entries` (and, on a stage > 0, T⊥ moved by stage 0's set
    `embed`) from the state we committed round t from; nothing changes on the worker."""
    fetcher = SetFetcher.of_run(cfg, dht, clients, store, me)
    got = fetch_set(cfg, fetcher, worker, t, entries, embed, claimer_address, views=True)
    out = Recomputed(forged=got.forged + got.forged_embed, missing=got.missing)
    if not got.complete:
        return out
    out.payloads = got.payloads
    out.outcome = worker.recompute(got.payloads, got.embed_update)
    return out


def stage0_set(
    holders: Mapping[str, StageRecord],
    t: int,
    refused: Collection[str],
    own: Sequence[Entry] | None = None,
) -> tuple[Entry, ...] | None:
    """The set of round t that a strict majority of stage 0's live, unrefused holders claim (`own`:
    our own stage-0 set of round t, when we hold stage 0 and have committed it); None while no set
    has a strict majority (holders still reconciling: asked again at the next check)."""
    votes: dict[tuple[Entry, ...], int] = {}
    voters = 0
    for claim in parse_claims(holders, "", refused).values():
        if claim.outer_step < t + 1:
            voters += 1  # still gathering round t: it has not voted yet, but it counts
            continue
        if claim.link is None or claim.link.t != t:
            continue  # past round t already: its set of round t is not readable any more
        voters += 1
        votes[claim.link.entries] = votes.get(claim.link.entries, 0) + 1
    if own is not None:
        voters += 1
        votes[tuple(own)] = votes.get(tuple(own), 0) + 1
    return _strict_majority(votes, voters)


def _strict_majority(votes: Mapping[tuple[Entry, ...], int], voters: int) -> tuple[Entry, ...] | None:
    """The set more than half of `voters` voted for, if any."""
    return next((entries for entries, n in votes.items() if 2 * n > voters), None)


class ClaimChecks:
    """The checks RECONCILE makes of other holders' claims (docs/protocol.md, RECONCILE and "T⊥ is one
    tensor"): a cheap audit of every claim, recomputation of a better one before we switch to it, the
    rebase of our T⊥ onto stage 0's committed set. Refuses the holders of false claims."""

    def __init__(
        self,
        cfg: RunConfig,
        dht: Any,
        clients: ClientPool,
        store: PayloadStore,
        me: str,
        refusals: Refusals,
        metrics: MetricsWriter,
        publish: Callable[[], None],
    ) -> None:
        self.cfg, self.dht, self.clients, self.store, self.me = cfg, dht, clients, store, me
        self.refusals, self.metrics, self.publish = refusals, metrics, publish
        self.switches = 0  # commits replaced by a checked claim (recomputed, no download)
        self._audited: set[tuple[str, str]] = set()  # (holder, state id) claims already audited
        self.stage0: StageWorker | None = None  # our stage-0 worker, when we hold stage 0 beside others

    def audit(self, worker: StageWorker, claims: Iterable[Claim]) -> None:
        """Cheap checks of every claim, whatever its round (once per claim): a set naming payloads
        no replica announced (`peer.node.round.verify.resolve`), or our own set of that round from our
        own state with another state, is false: its holder is refused. Claims of other sets are
        checked by recomputation in `reconcile` (same round and state only)."""
        reads: dict[tuple[int, int], Mapping[str, Announcement]] = {}

        def announcements(t: int, stage: int) -> Mapping[str, Announcement]:
            if (t, stage) not in reads:
                reads[(t, stage)] = self.dht.get_payloads(t, stage)
            return reads[(t, stage)]

        replicas: Mapping[str, ReplicaRecord] | None = None
        for c in claims:
            if (c.peer, c.state) in self._audited:
                continue
            if c.link is None:  # an initial, downloaded or resumed state
                if c.outer_step == 0 and c.state != worker.initial_state_id:
                    self._audited.add((c.peer, c.state))
                    reason = f"it claims {c.state} as the initial state, which is {worker.initial_state_id}"
                    self.refusals.refuse(c.peer, worker.stage, 0, reason)
                continue
            self._audited.add((c.peer, c.state))
            link, ours = c.link, worker.ledger.history.get(c.link.t)
            if ours is not None and (ours.prev, ours.entries, ours.embed) == (link.prev, link.entries, link.embed):
                if ours.state != c.state:
                    self.refusals.refuse(c.peer, worker.stage, link.t, f"it claims state {c.state} for our set")
                continue
            replicas = self.dht.get_replicas() if replicas is None else replicas
            for stage, entries in ((worker.stage, link.entries), (0, link.embed or ())):
                anns, anns0 = announcements(link.t, stage), announcements(link.t, 0)
                whole = alive(anns, dht_time(), history_ttl_s(self.cfg.swarm))  # else none can be proven forged
                forged = [
                    e for e in entries if resolve(e, stage, anns, anns0, replicas, whole).verdict is Verdict.FORGED
                ]
                if forged:
                    names = ", ".join(r[:12] for r, _ in forged)
                    reason = f"its committed set names payloads no replica announced ({names})"
                    self.refusals.refuse(c.peer, worker.stage, link.t, reason)
                    break

    def stage0_set(self, worker: StageWorker) -> tuple[Entry, ...] | None:
        """Stage 0's committed set of the round our stage > 0 last committed (`recheck.stage0_set`):
        the set T⊥ must have moved by; None on stage 0, in a ranges round, or while stage 0's holders
        have no strict majority for one set."""
        link = worker.ledger.link
        if worker.stage == 0 or link is None or link.embed is None or link.ranges is not None:
            return None
        own = self.stage0.ledger.history.get(link.t) if self.stage0 is not None else None
        holders = self.dht.get_stage_peers(0)
        mine = own.entries if own is not None and own.ranges is None else None
        refused = self.refusals.peers() | {self.me}
        return stage0_set(holders, link.t, refused, mine)

    def _recompute(
        self, worker: StageWorker, claim: Claim, holders: Mapping[str, StageRecord], embed: Sequence[Entry] | None
    ) -> Recomputed:
        link = claim.link
        assert link is not None
        holder = holders.get(claim.peer)
        address = holder.address if holder is not None and holder.address else None
        return recompute_set(
            self.cfg, self.dht, self.clients, self.store, self.me, worker, link.t, link.entries, embed, address
        )

    def check_and_switch(self, worker: StageWorker, claim: Claim, holders: Mapping[str, StageRecord]) -> bool:
        """Check `claim` by recomputing its set from the state we committed its round from; switch
        to it when it holds (True), refuse its holder when it is false (False), or leave it for now
        when its payloads cannot be fetched (False)."""
        link, own = claim.link, worker.ledger.link
        assert link is not None and own is not None
        if (link.entries, link.embed) == (own.entries, own.embed):
            self.refusals.refuse(claim.peer, worker.stage, link.t, f"it claims state {claim.state} for our set")
            return False
        got = self._recompute(worker, claim, holders, link.embed)
        if got.forged:
            names = ", ".join(r[:12] for r, _ in got.forged)
            self.refusals.refuse(
                claim.peer, worker.stage, link.t, f"its committed set names payloads no replica announced ({names})"
            )
            return False
        if got.missing:
            log.info(
                "stage %d: cannot check the state %s of %s yet (%d payload(s) not available)",
                worker.stage,
                claim.state,
                claim.peer[:12],
                got.missing,
            )
            return False
        out = got.outcome
        if out is None:
            return False
        if out.state != claim.state:
            self.refusals.refuse(
                claim.peer,
                worker.stage,
                link.t,
                f"its state {claim.state} does not follow from its set (gives {out.state})",
            )
            return False
        why = f"the checked state {claim.state} of {claim.peer[:12]}"
        self._switch(worker, out, got.payloads, link.embed, why, claim.peer)
        return True

    def rebase_embed(self, worker: StageWorker, embed: tuple[Entry, ...], holders: Mapping[str, StageRecord]) -> bool:
        """Our stage > 0 moved T⊥ by another stage-0 set than the one stage 0 committed: recompute our
        own set with stage 0's set and take it (no download). True if the state changed."""
        own = worker.ledger.link
        assert own is not None
        mine = Claim(self.me, worker.outer_step, worker.state_id(), own)
        got = self._recompute(worker, mine, holders, embed)
        if got.outcome is None:
            log.info("stage %d: T⊥ not moved to stage 0's set of round %d yet (payloads missing)", worker.stage, own.t)
            return False
        self._switch(worker, got.outcome, got.payloads, embed, "stage 0's committed set for T⊥", self.me)
        return True

    def _switch(
        self,
        worker: StageWorker,
        out: Outcome,
        payloads: Sequence[Contribution],
        embed: Sequence[Entry] | None,
        why: str,
        peer: str,
    ) -> None:
        """Take a checked recomputation of our last round (`StageWorker.switch`), logged and published;
        `peer`: the holder whose claim it is (ours: a rebase of T⊥ onto stage 0's set)."""
        own = worker.ledger.link
        n_before = len(own.entries) if own is not None else 0
        worker.switch(out, payloads, embed)
        self.switches += 1
        log.info(
            "stage %d round %d: switched to %s (%d payloads; ours had %d)",
            worker.stage,
            out.t,
            why,
            len(payloads),
            n_before,
        )
        self.metrics.log(
            "switch",
            stage=worker.stage,
            t=worker.outer_step,
            round=out.t,
            state=worker.state_id(),
            param_hash=worker.param_hash(),
            perp_hash=worker.perp_hash(),
            peer=peer,
            why=why,
        )
        self.publish()

"""Recomputing a claimed commit of round (t, s) from the state we committed it from (RECONCILE).

A claim names its set and, on a stage > 0, stage 0's set that moved its T⊥ (`peer.node.claims.Link`).
`recompute_set` fetches both by content, proves every entry genuine against its signed announcement
(`peer.node.round.verify`) and recomputes the commit from the state our own commit of that round
started from (`StageWorker.recompute`): the portable commit gives the same bits on every holder, so
the recomputed state id is the claim's if and only if the claim is true.

`stage0_set` says which stage-0 set a stage > 0 must move T⊥ by: the set a strict majority of stage
0's live, unrefused holders (ourselves included when we hold stage 0) claim for the round. T⊥ is one
tensor across stages after every round only if every stage moves it by that set.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from peer.config import RunConfig
from peer.core.codec.format import Payload
from peer.core.commit import embedding_update
from peer.net.pool import ClientPool
from peer.net.records import StageRecord
from peer.node.claims import Entry, parse_claims
from peer.node.round.payloads import PayloadStore, round_validator
from peer.node.round.verify import SetFetcher
from peer.node.stage_commit import Outcome
from peer.node.stage_worker import StageWorker


@dataclass
class Recomputed:
    """What recomputing a set gave: the outcome (None: not computable now), the set's payloads in
    commit order, and the entries that no replica announced (`forged`) or nobody served (`missing`)."""

    outcome: Outcome | None = None
    payloads: list[Payload] = field(default_factory=list)
    forged: list[Entry] = field(default_factory=list)
    missing: int = 0


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
    timeout_s = min(3.0, cfg.swarm.rpc_timeout_s)
    fetcher = SetFetcher(dht, clients, store, me, timeout_s)
    parse = round_validator(cfg, worker, worker.stage)
    got = fetcher.fetch(t, worker.stage, entries, parse, claimer_address=claimer_address, n_stages=cfg.stages)
    out = Recomputed(forged=list(got.forged), missing=len(got.missing))
    embed_update = None
    if got.complete and embed is not None and worker.stage != 0:
        parse0 = round_validator(cfg, worker, 0)
        got0 = fetcher.fetch(t, 0, embed, parse0, claimer_address=claimer_address, n_stages=cfg.stages)
        out.forged += got0.forged
        out.missing += len(got0.missing)
        if got0.complete and got0.payloads:
            keys = [got0.replicas[e] for e in embed]
            parsed = [got0.payloads[e][1] for e in embed]  # fused: no dense Δ̂
            embed_update = embedding_update(parsed, cfg.sparseloco, keys=keys)
    if out.forged or out.missing:
        return out
    out.payloads = [got.payloads[e][1] for e in entries]
    out.outcome = worker.recompute(out.payloads, [got.replicas[e] for e in entries], embed_update)
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
    for entries, n in votes.items():
        if 2 * n > voters:
            return entries
    return None

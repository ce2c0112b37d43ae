"""A full replica's outer round by ranges (docs/protocol.md, RANGES): every stage's parts, one commit each.

`peer.node.round.rounds.Rounds.full_round` comes here when the round rule every holder computes alike
(`peer.node.round.ownership.round_rule` of the size of round t − 1's committed set, read from each
stage's ledger) says "ranges" for every stage: each stage's pseudo-gradient is encoded as parts
(`StageWorker.contribute_parts`), every stage's ranges round runs at once under one deadline
(`peer.node.round.ranges.gather_ranges`), and each stage commits the assembled shards
(`StageWorker.apply_ranges`; stage 0 first, since its embedding change moves the other stages' T⊥).
A stage whose round did not complete (no roster, a range left without a shard by the deadline)
returns our parts to the error buffer and re-syncs, like an all-to-all round committed elsewhere.

A full replica that downloaded state at a ranges round applies it as an observer (`Rounds.catch_up`:
no parts of its own, the roster and every shard fetched). Not yet here (docs/protocol.md, RANGES,
"Not yet"): pipeline heads and stage peers (a stage peer's observer gather of stage 0 for T⊥ reads
whole payloads), FOLLOW of another holder's ranges commit (a holder that missed the roster re-syncs
instead), hot spares.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from peer.core.ranges import RangePlan
from peer.errors import NetworkError, PeerError
from peer.node.claims import Entry, entry
from peer.node.round.gather import RoundResult, RoundTimings
from peer.node.round.ownership import round_rule
from peer.node.round.ranges import RangesResult, gather_ranges
from peer.node.stage_ranges import range_plan
from peer.node.stage_worker import StageWorker

if TYPE_CHECKING:
    from peer.node.round.rounds import Rounds

log = logging.getLogger(__name__)


def ranges_rule(rounds: Rounds, workers: Mapping[int, StageWorker]) -> bool:
    """Whether this round of a full replica runs by ranges: the rule says so for every stage."""
    swarm = rounds.cfg.swarm
    return bool(workers) and all(round_rule(swarm, w.n_prev()) == "ranges" for w in workers.values())


def full_ranges_round(
    rounds: Rounds, workers: Mapping[int, StageWorker], t: int, stop: threading.Event, contribute: bool = True
) -> dict[int, RoundResult]:
    """Contribute every stage's parts (unless not `contribute`: an observer, e.g. `Rounds.catch_up`,
    which fetches the shards alone), gather every stage's ranges round at once, commit (module docstring)."""
    cfg, me = rounds.cfg, rounds.me
    plans = {s: range_plan(cfg.sparseloco, w.start, w.n_prev()) for s, w in workers.items()}
    parts = {s: w.contribute_parts(me.peer_id, plans[s]) for s, w in workers.items()} if contribute else {}
    timings = RoundTimings.from_config(cfg.swarm)

    def gather(s: int) -> RangesResult:
        try:
            return _gather(s)
        except NetworkError as exc:  # the DHT unreachable past the deadline: our parts go back (below)
            log.warning("stage %d: ranges round %d failed: %s", s, t, exc)
            return RangesResult(t, s, timed_out=True)

    def _gather(s: int) -> RangesResult:
        return gather_ranges(
            rounds.dht,
            rounds.clients,
            t,
            s,
            timings,
            plans[s],
            cfg.sparseloco,
            own=(me.peer_id, parts[s]) if contribute else None,
            store=rounds.store,
            address=me.address,
            inc=me.incarnation,
            refusals=rounds.refusals,
            backups=cfg.swarm.range_backups,
            shard_topk=cfg.swarm.shard_topk or None,
            stop=stop,
            banned=workers[s].ledger.bans.banned(t),
            quorum=cfg.swarm.min_replicas if t == 0 else 1,
        )

    with ThreadPoolExecutor(max_workers=len(workers)) as pool:
        results = dict(zip(workers, pool.map(gather, list(workers)), strict=True))
    rounds.pg_bytes += sum(r.fetched.total for r in results.values())
    if not all(r.complete for r in results.values()):
        _give_up(rounds, workers, t)
        return {s: summary(r, behind=True) for s, r in results.items()}
    _commit(workers, plans, results)
    rounds.publish()  # the committed state's claim, at once (docs/protocol.md, FOLLOW)
    for w in workers.values():
        try:
            rounds.resync.reconcile(w)
        except PeerError as exc:
            log.warning("stage %d: canonical state not checked after round %d: %s", w.stage, t, exc)
    return {s: summary(r) for s, r in results.items()}


def _commit(
    workers: Mapping[int, StageWorker], plans: Mapping[int, RangePlan], results: Mapping[int, RangesResult]
) -> None:
    """Each stage commits its shards, stage 0 first: its embedding change is the others' T⊥ update."""
    update: torch.Tensor | None = None
    embed_set: list[Entry] | None = None
    for s in sorted(workers):
        w, r = workers[s], results[s]
        assert r.roster is not None
        roster = [(e.replica, e.sha256) for e in r.roster.entries]
        shards = {k: (r.shards[k], r.parsed[k]) for k in r.parsed}
        embed = (update, embed_set if w.U is not None else None) if s != 0 else (None, None)
        commit = w.apply_ranges(plans[s], roster, r.roster.digest, shards, r.position, *embed)
        if s == 0:
            update, embed_set = commit.embed_update, [entry(rid, sha) for rid, sha in roster]


def _give_up(rounds: Rounds, workers: Mapping[int, StageWorker], t: int) -> None:
    """A stage's ranges round did not complete: our parts go back, every stage re-syncs."""
    for w in workers.values():
        w.return_unsent_parts()
        try:
            rounds.resync.sync_state(w, f"ranges round {t} did not complete here", keep_errors=True)
        except PeerError as exc:
            log.warning("stage %d: could not re-sync after ranges round %d: %s", w.stage, t, exc)
        w.observe()


def summary(result: RangesResult, behind: bool = False) -> RoundResult:
    """A ranges round as the trainer's round record reads it (participants, wall time, bytes)."""
    return RoundResult(
        t=result.t,
        stage=result.stage,
        replicas=result.replicas,
        expected=len(result.replicas),
        timed_out=result.timed_out,
        behind=behind,
        wall_s=result.timings.get("wall_s", 0.0),
        bytes_fetched=result.fetched.total,
    )

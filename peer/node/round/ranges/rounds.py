"""Which rule each of a peer's round runs, and the gathers of a round in which any stage runs by ranges.

docs/protocol.md, RANGES. Every holder of a stage must run the same rule in the same round, whatever
kind of peer it is (a full replica, a pipeline's head, a stage peer): the rule of round (t, s) is
`peer.node.round.ranges.ownership.round_rule` of the size of round t − 1's committed set of stage s, read
from the holder's committed state (`n_prev_of`: its link; the stage's other holders' claims when it
adopted a state without one). A stage peer that moves its T⊥ by stage 0's embedding change reads
stage 0's rule from the stage-0 set its link names (`stage0_n_prev`).

A round is a list of `Job`s, one per stage round this peer takes part in: its own stages
(contributing a payload or parts, or observing) and, for a stage peer, stage 0 observed for the
embedding's change (by ranges: only the shards of the ranges that hold embed.weight's bands,
`peer.node.stage.embed.embed_ranges`). `own_job` / `embed_job` pick each job's rule and encode
our contribution; `run_jobs` gathers every job at once under one deadline (an all-to-all job through
the gather it is given, `Rounds.gather`; a ranges job through `peer.node.round.ranges.exchange.gather_ranges`,
or with `swarm.shard` "voted" through `peer.node.round.ranges.voted.gather_voted`: our e = β·e + Δ instead
of parts, its commit's `sent_adjustment` as the error feedback);
nothing here calls back into `Rounds`. `Rounds.commit_jobs`
commits them, stage 0 first. A ranges round that did not complete here (no roster, a range left
without a shard by the deadline) returns our parts to the error buffer and re-syncs, like an
all-to-all round committed elsewhere.

Not yet here (docs/protocol.md, RANGES, "Not yet"): FOLLOW of another holder's ranges commit (a
holder that missed the roster re-syncs instead), hot spares.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from peer.config import RunConfig
from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.commit import RoundCommit
from peer.core.sparseloco.ranges import RangePlan
from peer.errors import NetworkError
from peer.node.round.agreement import round_bans
from peer.node.round.claims import Entry, entry, parse_claims
from peer.node.round.context import RoundContext
from peer.node.round.contribution import Contribution
from peer.node.round.ranges.exchange import RangesResult, gather_ranges
from peer.node.round.ranges.ownership import round_rule
from peer.node.round.ranges.voted import VotedResult, gather_voted, sent_adjustment
from peer.node.round.result import RoundResult
from peer.node.round.timings import RoundTimings
from peer.node.stage.embed import EmbedShards, embed_ranges, stage0_change
from peer.node.stage.ranges import range_plan
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

Gathered = RoundResult | RangesResult
AllToAll = Callable[["Job", int, threading.Event], RoundResult]  # gathers an all-to-all job's round (t, stage)


@dataclass
class Job:
    """One stage round as this peer runs it: `stage` is the worker's own (contributing in `replica`'s
    name, or observing when None) or stage 0 observed by a holder of another stage (T⊥)."""

    worker: StageWorker
    stage: int
    plan: RangePlan | None = None  # the round's ranges; None: an all-to-all round
    replica: str | None = None  # the replica we contribute for (None: an observer)
    payload: Contribution | None = None  # our all-to-all contribution
    parts: list[Payload] | None = None  # our parts of a ranges round
    peers: Mapping[str, str] | None = None  # a head's binding of its stage peers (stage 0)
    mode: str | None = None  # a head's boundary mode of the outer step (stage 0), named by its announcement
    wanted: list[int] | None = None  # the only ranges resolved (an observer of stage 0: the embedding's)
    errors: dict[str, torch.Tensor] | None = None  # our e = β·e + Δ to vote and send from (`swarm.shard` "voted")

    @property
    def own(self) -> bool:
        return self.stage == self.worker.stage


def failed(result: Gathered) -> bool:
    """The round cannot be committed here: closed elsewhere (all-to-all) or not complete (ranges)."""
    return result.behind if isinstance(result, RoundResult) else result.behind or not result.complete


def _claimed_n_prev(ctx: RoundContext, stage: int, t: int) -> int:
    """The size of round t − 1's committed set of `stage` as most of its other holders at outer step
    t claim it (0 when none does, or the DHT cannot be read: the rule then is "all")."""
    try:
        claims = parse_claims(ctx.dht.get_stage_peers(stage), ctx.me.peer_id, ctx.refusals.peers())
    except NetworkError as exc:
        log.warning("stage %d: round %d's rule not read from the claims (%s); taking all-to-all", stage, t, exc)
        return 0
    sizes = Counter(
        len(c.link.entries) for c in claims.values() if c.link is not None and c.outer_step == t and c.link.t == t - 1
    )
    return max(sizes.items(), key=lambda kv: (kv[1], kv[0]))[0] if sizes else 0


def n_prev_of(ctx: RoundContext, worker: StageWorker) -> int:
    """round t − 1's committed-set size for the worker's stage (t = its outer step): from its link,
    else from the stage's claims (a state adopted without its link, e.g. an old checkpoint)."""
    known = worker.n_prev()
    return known if known is not None else _claimed_n_prev(ctx, worker.stage, worker.outer_step)


def stage0_n_prev(ctx: RoundContext, worker: StageWorker) -> int:
    """Stage 0's committed-set size of round t − 1 for a holder of another stage: the stage-0 set its
    link names (its T⊥ moved by it), else stage 0's claims."""
    link, t = worker.ledger.link, worker.outer_step
    if t == 0:
        return 0
    if link is not None and link.t == t - 1 and link.embed is not None:
        return len(link.embed)
    return _claimed_n_prev(ctx, 0, t)


def own_job(
    ctx: RoundContext,
    worker: StageWorker,
    replica: str | None,
    peers: Mapping[str, str] | None = None,
    mode: str | None = None,
) -> Job:
    """The worker's own stage round by its rule; our contribution encoded now when `replica` is given
    (a payload, or parts of the round's plan); `peers` and `mode`: a head's, for its announcement."""
    n = n_prev_of(ctx, worker)
    if round_rule(ctx.cfg.swarm, n) == "all":
        payload = worker.contribution(replica) if replica is not None else None
        return Job(worker, worker.stage, None, replica, payload, peers=peers, mode=mode)
    shapes = {name: tuple(v.shape) for name, v in worker.start.items()}
    plan = range_plan(ctx.cfg.sparseloco, shapes, n)
    if replica is None:
        worker.observe()
        return Job(worker, worker.stage, plan)
    if ctx.cfg.swarm.shard == "voted":
        return Job(worker, worker.stage, plan, replica, peers=peers, mode=mode, errors=worker.contribute_votes())
    parts = worker.contribute_parts(replica, plan)
    return Job(worker, worker.stage, plan, replica, parts=parts, peers=peers, mode=mode)


def embed_job(ctx: RoundContext, worker: StageWorker) -> Job | None:
    """Stage 0 observed by a holder of another stage for its embedding change (None: not needed, a
    ranges round of a run without a subspace)."""
    cfg = ctx.cfg
    n = stage0_n_prev(ctx, worker)
    if round_rule(cfg.swarm, n) == "all":
        return Job(worker, 0)
    if worker.U is None:
        return None
    plan = range_plan(cfg.sparseloco, stage_shapes(cfg.model, 0, cfg.stages), n)
    return Job(worker, 0, plan, wanted=embed_ranges(plan))


def any_ranges(jobs: Sequence[Job]) -> bool:
    return any(j.plan is not None for j in jobs)


def run_jobs(ctx: RoundContext, gather: AllToAll, jobs: Sequence[Job], t: int, stop: threading.Event) -> list[Gathered]:
    """Gather every job's round (t, stage) at once, under one deadline: an all-to-all job through
    `gather`, a ranges job through `gather_ranges`."""
    with ThreadPoolExecutor(max_workers=max(1, len(jobs))) as pool:
        return list(pool.map(lambda j: _run(ctx, gather, j, t, stop), jobs))


def _run(ctx: RoundContext, gather: AllToAll, job: Job, t: int, stop: threading.Event) -> Gathered:
    if job.plan is None:
        return gather(job, t, stop)
    me, swarm = ctx.me, ctx.cfg.swarm
    banned = job.worker.ledger.bans.banned(t) if job.own else round_bans(ctx.dht.get_stage_peers(0), t, me.peer_id)
    if swarm.shard == "voted":
        return _run_voted(ctx, job, t, stop, banned)
    try:
        result = gather_ranges(
            ctx,
            t,
            job.stage,
            RoundTimings.from_config(swarm),
            job.plan,
            own=(job.replica, job.parts) if job.replica is not None and job.parts is not None else None,
            stop=stop,
            banned=banned,
            quorum=swarm.min_replicas if t == 0 else 1,
            peers=job.peers,
            mode=job.mode,
            wanted=job.wanted,
        )
    except NetworkError as exc:  # the DHT unreachable past the deadline: our parts go back (commit_jobs)
        log.warning("stage %d: ranges round %d failed: %s", job.stage, t, exc)
        return RangesResult(t, job.stage, timed_out=True)
    return result


def _run_voted(ctx: RoundContext, job: Job, t: int, stop: threading.Event, banned: Collection[str]) -> Gathered:
    """A ranges job of a run with `swarm.shard` "voted" (`peer.node.round.ranges.voted`)."""
    assert job.plan is not None
    swarm = ctx.cfg.swarm
    own = (job.replica, job.errors) if job.replica is not None and job.errors is not None else None
    try:
        return gather_voted(
            ctx, t, job.stage, RoundTimings.from_config(swarm), job.plan, own=own, stop=stop, banned=banned,
            quorum=swarm.min_replicas if t == 0 else 1, peers=job.peers, wanted=job.wanted, mode=job.mode,
        )  # fmt: skip
    except NetworkError as exc:  # the DHT unreachable past the deadline: e = β·e + Δ stays whole
        log.warning("stage %d: voted round %d failed: %s", job.stage, t, exc)
        return VotedResult(t, job.stage, timed_out=True)


def committed_set(result: Gathered) -> list[Entry]:
    """A gathered round's committed set as a link names it: (replica prefix, sha256 prefix)."""
    if isinstance(result, RangesResult):
        assert result.roster is not None
        return [entry(e.replica, e.sha256) for e in result.roster.entries]
    return [c.entry for c in result.contributions]


def apply_job(job: Job, result: Gathered, update: torch.Tensor | None, embed_set: list[Entry] | None) -> RoundCommit:
    """Commit an own-stage job's round (stage 0's `update` and `embed_set` move a later stage's T⊥)."""
    w = job.worker
    link_embed = embed_set if w.stage != 0 and w.U is not None else None
    update = update if w.stage != 0 else None
    if isinstance(result, RangesResult):
        assert result.roster is not None and job.plan is not None
        roster, digest = [(e.replica, e.sha256) for e in result.roster.entries], result.roster.digest
        sent = sent_adjustment(result, job.plan, w.cfg.sparseloco) if isinstance(result, VotedResult) else None
        return w.apply_ranges(job.plan, roster, digest, result.shards, result.position, update, link_embed, sent)
    return w.commit_round(result.contributions, update, link_embed)


def observed_embed(cfg: RunConfig, job: Job, result: Gathered) -> torch.Tensor | None:
    """Stage 0's committed embedding change from an observer job of stage 0 (None: no contribution):
    `stage0_change` of its contributions (all-to-all) or of the embedding ranges' shards alone."""
    if isinstance(result, RoundResult):
        return stage0_change(cfg, result.contributions)
    assert job.plan is not None
    return stage0_change(cfg, EmbedShards(job.plan, result.parsed))


def summary(result: Gathered, behind: bool = False) -> RoundResult:
    """A round as the trainer's round record reads it (participants, wall time, bytes)."""
    if isinstance(result, RoundResult):
        return result
    return RoundResult(
        t=result.t,
        stage=result.stage,
        replicas=result.replicas,
        expected=len(result.replicas),
        timed_out=result.timed_out,
        behind=behind or failed(result),
        wall_s=result.timings.get("wall_s", 0.0),
        bytes_fetched=result.fetched.total,
    )

"""One peer's outer rounds: gather (contributing or observing), commit, check, record.

Round (t, s) — DESIGN §3, docs/protocol.md. `Rounds` holds a peer's round entry points (a head's,
a full replica's and a stage peer's round): each gathers its stages' rounds (`peer.node.round.gather`)
and commits every gathered set through `StageWorker.commit_round` → `peer.core.sparseloco.commit.commit_state`
(portable: the same bits on every holder); each payload travels as one `Contribution`
(`peer.node.round.contribution`), hashed and parsed once where it was encoded or fetched; each stage's round runs
all-to-all or by ranges, as the round rule every holder of the stage computes alike says
(`peer.node.round.ranges.rounds`: the jobs of a round, `commit_jobs` commits them). A set taken from another
holder's claim (FOLLOW) is committed by us, and the claimer's state is then compared with ours: a
holder whose state does not follow from the set it named is refused (`peer.node.round.refusals`).
Hot spares and compressed stages that only need stage 0's embedding change run the same gather
without a payload of their own (observers). After a commit the canonical-state check runs at once
(`Resync.reconcile`: claims of the same round from the same state, checked by recomputation).
After a state download at outer step t, `catch_up` applies round t as an observer: the others did
not expect this replica in round t.

Expected replicas for round t: live replica records (pipelines' heads and full replicas) that joined
at or before t and are at outer step t − 1 or later. A dead replica drops out when its record
expires; a slow one is waited for until the deadline. The DHT offers no notifications, so the
wait is a bounded poll under one deadline.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Mapping, Sequence

import torch

from peer.errors import NetworkError, PeerError
from peer.net.dht import dht_time
from peer.node.metrics import log_round
from peer.node.round.agreement import Commit, Late, commit_decision, expected_replicas, round_bans, round_view
from peer.node.round.censors import Evidence, recent
from peer.node.round.claims import Entry, closed_elsewhere, majority, parse_claims
from peer.node.round.context import RoundContext
from peer.node.round.contribution import Contribution
from peer.node.round.gather import gather_round
from peer.node.round.payloads import round_reading
from peer.node.round.ranges.exchange import RangesResult
from peer.node.round.ranges.rounds import (
    Gathered,
    Job,
    apply_job,
    committed_set,
    embed_job,
    failed,
    observed_embed,
    own_job,
    run_jobs,
    summary,
)
from peer.node.round.recheck import linked_stage0
from peer.node.round.replay import parse_chain
from peer.node.round.result import RoundInputs, RoundResult
from peer.node.round.resync import Resync
from peer.node.round.stalls import stall_watch
from peer.node.round.timings import FRESH_S, RoundTimings
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)


class Rounds:
    """One peer's outer rounds: gather (contributing or observing), commit, record."""

    def __init__(self, ctx: RoundContext, resync: Resync) -> None:
        """`ctx.publish` refreshes this peer's DHT records (after every commit); `resync` checks and
        repairs the committed state (the swarm's clock, `reconcile`, `sync_state`)."""
        self.ctx, self.cfg, self.dht, self.clients, self.store = ctx, ctx.cfg, ctx.dht, ctx.clients, ctx.store
        self.me, self.refusals, self.metrics = ctx.me, ctx.refusals, ctx.metrics
        self.publish, self.resync = ctx.publish, resync
        self.pg_bytes = 0  # pseudo-gradient bytes this peer fetched, over the run
        self.evidence: dict[int, tuple[Evidence, ...]] = {}  # per stage: its recent rounds, as seen (censors)
        # when the current round began: our payload encoded, or an observer's gathers started (`_closed_elsewhere`)
        self.started = time.monotonic()
        stall_watch()  # watching for stalls from now on (`peer.node.round.stalls`)

    def gather(
        self,
        worker: StageWorker,
        t: int,
        replica_id: str | None,
        stop: threading.Event,
        stage: int | None = None,
        peers: Mapping[str, str] | None = None,
        payload: Contribution | None = None,
        mode: str | None = None,
    ) -> RoundResult:
        """Contribute worker's payload (if replica_id; `payload` when already encoded) and collect
        round (t, stage); `peers` and `mode`: a head's, for its announcement."""
        own_stage = stage is None or stage == worker.stage
        stage = worker.stage if stage is None else stage
        own = None
        if replica_id is not None:
            own = payload if payload is not None else worker.contribution(replica_id)
        elif own_stage:
            worker.observe()
        swarm = self.cfg.swarm
        banned = (
            worker.ledger.bans.banned(t)
            if own_stage
            else round_bans(self.dht.get_stage_peers(stage), t, self.me.peer_id)
        )
        timings = RoundTimings.from_config(swarm)
        inputs = RoundInputs(
            own=own,
            validate=round_reading(self.cfg, worker, stage),
            peers=peers,
            mode=mode,
            quorum=swarm.min_replicas if t == 0 else 1,
            banned=banned,
            prev=worker.state_id() if own_stage else None,
            established=_established(worker, own_stage),
            previous=self.evidence.get(stage, ()) if own_stage else (),
        )
        result = gather_round(self.ctx, t, stage, timings, inputs, stop)
        if own_stage:
            self.evidence[stage] = recent(self.evidence.get(stage, ()), result.evidence, dht_time(), timings.grace_s)
        self.pg_bytes += result.bytes_fetched
        return result

    def gather_jobs(self, jobs: Sequence[Job], t: int, stop: threading.Event) -> list[Gathered]:
        """Every job's round (t, stage) at once, under one deadline (`run_jobs`): all-to-all jobs
        through `gather`; the bytes a ranges job fetched counted here as `gather` counts its own.
        `started` is when the round began here (its payloads encoded: `head_job`, `full_jobs`,
        `stage_job`; else now): a stall since then counts (`_closed_elsewhere`)."""
        self.started = self.started if any(j.replica is not None for j in jobs) else time.monotonic()
        results = run_jobs(self.ctx, self._gather_job, jobs, t, stop)
        self.pg_bytes += sum(r.fetched.total for r in results if isinstance(r, RangesResult))
        return results

    def _gather_job(self, job: Job, t: int, stop: threading.Event) -> RoundResult:
        return self.gather(
            job.worker, t, job.replica, stop, stage=job.stage, peers=job.peers, payload=job.payload, mode=job.mode
        )

    def commit(
        self,
        workers: Mapping[int, StageWorker],
        results: Mapping[int, RoundResult],
        embed: RoundResult | None = None,
    ) -> bool:
        """Apply each worker's all-to-all round (`commit_jobs`); `embed`: an observer gather of stage 0
        by a holder of other stages. False if anything re-synced."""
        jobs = [Job(w, s) for s, w in workers.items()]
        gathered: list[Gathered] = [results[s] for s in workers]
        if embed is not None:
            jobs.append(Job(next(iter(workers.values())), 0))
            gathered.append(embed)
        return self.commit_jobs(jobs, gathered)

    def commit_jobs(self, jobs: Sequence[Job], results: Sequence[Gathered]) -> bool:
        """Apply each own stage's committed round, all-to-all or by ranges (`peer.node.round.ranges.rounds`).
        Stage 0's embedding change moves every other stage's T⊥: from stage 0's own commit when this
        peer holds it, else from an observer job of stage 0 (no contribution there: T⊥ stays). What
        the late checks find (`_late_checks`) decides (`peer.node.round.agreement.commit_decision`):
        a round committed elsewhere that this peer could not reproduce (`behind`), or a ranges round
        that did not complete here, is not applied: the worker re-syncs instead. What a round took
        from our own payload or parts returns to our error buffer. A followed claim whose state
        differs from the one we computed from its set is refused. Then the canonical-state check
        runs (`Resync.reconcile`). False if anything re-synced."""
        pairs = list(zip(jobs, results, strict=True))
        own = {j.stage: (j, r) for j, r in pairs if j.own}
        embed = next(((j, r) for j, r in pairs if not j.own), None)
        late, checked = self._late_checks(own, embed)
        decision = commit_decision(late)
        if decision is Commit.LEAVE:
            for _, r in own.values():  # a re-sync moved us: the round is applied by the others
                r.behind = True
            return False
        if decision is Commit.RESYNC:
            for j, r in own.values():
                self._resync_behind(j.worker, r)
            return False
        linked = None
        if decision is Commit.APPLY_WITHOUT_EMBED:
            assert embed is not None
            linked = self._linked_embed(embed[0].worker, embed[1].t)
            if linked is None:
                log.warning(
                    "round %d: stage 0's committed set is gone; committing stage(s) %s with T⊥ unchanged",
                    embed[1].t,
                    sorted(own),
                )
            embed = None
        self._apply(own, embed, linked)
        frozen = self._frozen_while_applying(checked, [r for _, r in own.values()])
        if commit_decision(dataclasses.replace(late, frozen=frozen)) is Commit.WITHDRAW:
            for j, r in own.values():
                r.behind = True  # the trainers record no round (as when closed elsewhere before applying)
                self._resync_behind(j.worker, r)
            return False
        for job, result in own.values():
            if isinstance(result, RoundResult):
                self._check_followed(job.worker, result)
        # publish the committed set at once (before validation): a holder closing round t late
        # follows it instead of committing a set of its own (docs/protocol.md, FOLLOW)
        self.publish()
        for job, _ in own.values():
            try:
                self.resync.reconcile(job.worker)
            except PeerError as exc:
                w = job.worker
                log.warning("stage %d: canonical state not checked after round %d: %s", w.stage, w.outer_step - 1, exc)
        return True

    def _late_checks(
        self, own: Mapping[int, tuple[Job, Gathered]], embed: tuple[Job, Gathered] | None
    ) -> tuple[Late, float]:
        """What `commit_decision` reads, checked in order right before applying, each read only when
        the decision needs it; and when the swarm's clock was read (for `_frozen_while_applying`).
        A round the swarm closed elsewhere is marked `behind` here: the trainers skip it."""
        owned = [r for _, r in own.values()]
        if own and not self._checked_before([j for j, _ in own.values()], owned[0].t, keep=True):
            return Late(moved=True), time.monotonic()
        checked = time.monotonic()  # the swarm's clock, read right before applying
        closed = self._closed_elsewhere(owned)
        if closed:
            for r in owned:
                r.behind = True
        workers = {s: j.worker for s, (j, _) in own.items()}
        embed_lost = embed is not None and failed(embed[1]) and 0 not in workers
        ahead = embed_lost and self._stage_ahead(workers)
        lost = any(failed(r) for r in owned)
        return Late(closed_elsewhere=closed, failed=lost, embed_lost=embed_lost, stage_ahead=ahead), checked

    def _linked_embed(self, worker: StageWorker, t: int) -> tuple[torch.Tensor, list[Entry]] | None:
        """Stage 0's committed set of round t as its holders' links name it (`recheck.linked_set`),
        fetched, and its embedding change: for an observer whose gather of stage 0 lost the round
        because stage 0's holders went on past it (chaos: a stage peer that then kept T⊥ unchanged
        held another T⊥ than its stage for four rounds). None when no set has a majority or its
        payloads cannot be had (T⊥ then stays, as before)."""
        try:
            links = self.dht.get_round("chain", t, 0, parse_chain)
            me, refused = self.me.peer_id, self.refusals.peers()
            got = linked_stage0(self.cfg, self.dht, self.clients, self.store, me, worker, links, t, refused)
        except NetworkError as exc:
            log.info("round %d: stage 0's linked set not fetched: %s", t, exc)
            return None
        if got is not None:
            log.info("round %d: stage 0's set taken from its holders' links (%d payloads)", t, len(got[1]))
        return got

    def _apply(
        self,
        own: Mapping[int, tuple[Job, Gathered]],
        embed: tuple[Job, Gathered] | None,
        linked: tuple[torch.Tensor, list[Entry]] | None = None,
    ) -> None:
        """Commit each own stage's round, stage 0 first: its embedding change (else the observed one
        of `embed`, or `linked`: stage 0's set as its links name it) moves the later stages' T⊥."""
        update, embed_set = linked if linked is not None else (None, None)
        if embed is not None:
            update, embed_set = observed_embed(self.cfg, *embed), committed_set(embed[1])
        for s in sorted(own):
            job, result = own[s]
            commit = apply_job(job, result, update, embed_set)
            if s == 0:
                update, embed_set = commit.embed_update, committed_set(result)

    def _check_followed(self, worker: StageWorker, result: RoundResult) -> None:
        """The holder whose committed set we took claims the state that set gives from our state: ours.
        If not (same set, same stage-0 set), its claim is false (the commit is portable): refused."""
        claim, ours = result.followed, worker.ledger.link
        if claim is None or claim.link is None or ours is None or claim.state == worker.state_id():
            return
        if (claim.link.entries, claim.link.embed) != (ours.entries, ours.embed):
            return  # another stage-0 set moved its T⊥ (or the set changed): nothing to conclude here
        self.refusals.refuse(
            claim.peer,
            worker.stage,
            result.t,
            f"it claims state {claim.state} for its committed set, which gives {worker.state_id()}",
        )

    def _closed_elsewhere(self, results: Sequence[Gathered]) -> bool:
        """Whether the swarm's clock, read now, is two rounds past the round about to be committed.

        A gather decides on a fresh view, but the process may freeze between that decision and its
        commit (a SIGSTOP, a stalled machine); others then close the round without the payloads
        only it held. Read again right before applying: never commit a round the swarm closed a
        round ago (`peer.node.round.claims.closed_elsewhere`), or at all if we stalled since the round
        began for longer than our records live, re-sync instead."""
        if not results or all(failed(r) for r in results):
            return False
        t = results[0].t
        try:
            clock = self.resync.clock()
        except NetworkError as exc:  # not known: the gather's fresh decision stands
            log.info("round %d: swarm clock not read before committing: %s", t, exc)
            return False
        stalled = RoundTimings.from_config(self.cfg.swarm).stalled(self.started)
        if closed_elsewhere(clock, t, stalled, self.cfg.train.overlap):
            why = "this process stood still past its records' lifetime" if stalled else "a freeze?"
            log.warning("round %d: the swarm is at outer step %d by now (%s); re-syncing instead", t, clock, why)
            return True
        return False

    def _frozen_while_applying(self, checked: float, results: Sequence[Gathered]) -> bool:
        """Whether applying took longer than a fresh read lasts (`FRESH_S`: the process may have been
        frozen mid-apply, after the clock was read at `checked`) and the swarm, read again, closed
        this round a round ago meanwhile: then our set is not published; the worker re-syncs and its
        applied state is overwritten by the majority's."""
        return time.monotonic() - checked > FRESH_S and self._closed_elsewhere(results)

    def _stage_ahead(self, workers: Mapping[int, StageWorker]) -> bool:
        """A strict majority of another stage's holders claims a state past our outer step, at a
        step the swarm's clock admits: a state to sync to (one holder's claim alone is not)."""
        clock = self.resync.clock()
        for s, w in workers.items():
            claims = parse_claims(self.dht.get_stage_peers(s), self.me.peer_id, self.refusals.peers())
            win = majority(claims.values(), max(clock, w.outer_step))
            if win is not None and win.outer_step > w.outer_step:
                return True
        return False

    def _resync_behind(self, worker: StageWorker, result: Gathered) -> None:
        """Round t was committed without us being able to reproduce it: take the majority's state.
        Our parts of a ranges round go back whole; our payload too unless the set we followed holds it."""
        last = worker.ledger.last_contribution
        followed = None
        if isinstance(result, RoundResult) and result.followed is not None and result.followed.link is not None:
            followed = result.followed.link.replicas
        unsent = last is not None and (followed is None or last.replica[:16] not in followed)
        worker.return_unsent_parts()
        try:
            self.resync.sync_state(worker, f"round {result.t} committed elsewhere", keep_errors=True)
        except PeerError as exc:
            log.warning("stage %d: could not re-sync after round %d: %s", worker.stage, result.t, exc)
            return
        if unsent and last is not None:
            worker.return_unsent(last.payload)
        worker.observe()

    def head_job(self, worker: StageWorker, peers: Mapping[str, str] | None = None) -> Job:
        """A head's stage-0 job of the current round, our payload encoded now (announcing `peers`,
        {"<stage>": peer id}, the stage peers that did this outer step's last inner step: the
        round's binding) and the outer step's boundary mode, "compressed" or "uncompressed" (read now:
        with overlap the next outer step may choose another)."""
        self.started = time.monotonic()
        mode = "compressed" if worker.boundary_compressed else "uncompressed"
        return own_job(self.ctx, worker, self.me.peer_id, dict(peers or {}), mode)

    def full_jobs(self, workers: Mapping[int, StageWorker]) -> list[Job]:
        """A full replica's jobs of the current round, one per stage, our payloads encoded now."""
        self.started = time.monotonic()
        return [own_job(self.ctx, w, self.me.peer_id) for w in workers.values()]

    def head_round(
        self,
        worker: StageWorker,
        t: int,
        stop: threading.Event,
        peers: Mapping[str, str] | None = None,
        job: Job | None = None,
    ) -> RoundResult:
        """Stage 0 of a head: contribute (`head_job`, unless `job` was encoded already: overlap),
        gather and apply; all-to-all or by ranges, as the round rule says (`peer.node.round.ranges.rounds`)."""
        job = job if job is not None else self.head_job(worker, peers)
        if not self._checked_before([job], t):
            return RoundResult(t=t, stage=worker.stage, behind=True)
        result = self.gather_jobs([job], t, stop)[0]
        committed = self.commit_jobs([job], [result])
        return summary(result, behind=not committed)

    def full_round(
        self, workers: Mapping[int, StageWorker], t: int, stop: threading.Event, jobs: Sequence[Job] | None = None
    ) -> dict[int, RoundResult]:
        """A full replica: contribute to and gather every stage's round at once (each stage all-to-all
        or by ranges, as its rule says: `peer.node.round.ranges.rounds`), then apply them; `jobs`:
        encoded already (`full_jobs`, overlap)."""
        jobs = list(jobs) if jobs is not None else self.full_jobs(workers)
        if not self._checked_before(jobs, t):
            return {w.stage: RoundResult(t=t, stage=w.stage, behind=True) for w in workers.values()}
        results = self.gather_jobs(jobs, t, stop)
        committed = self.commit_jobs(jobs, results)
        return {j.stage: summary(r, behind=not committed) for j, r in zip(jobs, results, strict=True)}

    def _checked_before(self, jobs: Sequence[Job], t: int, keep: bool = False) -> bool:
        """The canonical-state check before round t, after our payloads are encoded (as `stage_round`
        does for a stage peer), and again right before round t is applied (`keep`: its payloads are
        in the round already): a better set of round t − 1 that another holder committed meanwhile
        (it held a payload our deadline did not wait for: FOLLOW never drops it, so the larger set
        must win here) replaces our commit, and round t is applied on top of it; our payloads stay
        ours. False when a worker moved to another outer step (a re-sync): unless `keep`, the
        payloads go back, and the round is left to the others."""
        for job in jobs:
            try:
                self.resync.reconcile(job.worker, before_round=True)
            except PeerError as exc:
                log.warning("stage %d: canonical state not reachable before round %d: %s", job.worker.stage, t, exc)
        if all(job.worker.outer_step == t for job in jobs):
            return True
        for job in jobs if not keep else ():
            if job.payload is not None:
                job.worker.return_unsent(job.payload.payload)
            job.worker.return_unsent_parts()
            job.worker.observe()
        return False

    def stage_round(
        self, worker: StageWorker, contributor: str | None, stop: threading.Event, job: Job | None = None
    ) -> None:
        """A stage > 0 peer: its own round (contributing if it trained) + stage 0's for T⊥ (by ranges:
        the shards of the embedding's ranges alone).

        A claimed stage peer is never idle between rounds, so the canonical-state check
        (`Resync.reconcile`) runs here, after our payload is encoded and before the round: a
        disagreement seen in round t is repaired before round t commits. `job`: our own, encoded
        already (overlap)."""
        t = worker.outer_step
        job = job if job is not None else self.stage_job(worker, contributor)
        try:
            self.resync.reconcile(worker, before_round=True)
        except PeerError as exc:
            log.warning("stage %d: canonical state not reachable before round %d: %s", worker.stage, t, exc)
        if worker.outer_step != t:  # the canonical holder had moved on: our payload waits for the next round
            if job.payload is not None:
                worker.return_unsent(job.payload.payload)
            worker.return_unsent_parts()
            worker.observe()
            return
        # both gathers at once, under one deadline: a replica that froze mid-round costs the round
        # one deadline, not one for our stage and then another for stage 0's set
        jobs = [job] + [j for j in [embed_job(self.ctx, worker)] if j is not None]
        results = self.gather_jobs(jobs, t, stop)
        if self.commit_jobs(jobs, results):
            ours = summary(results[0])
            self.record(t, {worker.stage: (worker, ours.participants)}, None, None, ours.wall_s)

    def stage_job(self, worker: StageWorker, contributor: str | None) -> Job:
        """A stage peer's own job of the current round (our payload encoded now when `contributor`)."""
        self.started = time.monotonic()
        return own_job(self.ctx, worker, contributor)

    def catch_up(self, workers: Mapping[int, StageWorker], stop: threading.Event, full: bool = False) -> None:
        """After a state download at outer step t, apply round t as an observer instead of
        contributing to it: the others did not expect this replica in round t (each stage's round
        all-to-all or by ranges, as its rule says; by ranges: the roster and the shards alone)."""
        t = min(w.outer_step for w in workers.values())
        if self.me.joined_at <= t or not expected_replicas(self.dht, t):
            return
        jobs = [own_job(self.ctx, w, None) for w in workers.values()]
        if 0 not in workers:
            embed = embed_job(self.ctx, next(iter(workers.values())))
            jobs += [embed] if embed is not None else []
        self.commit_jobs(jobs, self.gather_jobs(jobs, t, stop))
        self.metrics.log("catch_up", t=t)
        self.publish()

    def complete(self, t: int, stage: int) -> bool:
        """Round (t, stage) can be applied by a hot spare: another holder committed it, or every
        expected replica has announced (or was dropped). Until then the spare stays claimable: a
        head still at outer step t may need it."""
        dht = self.dht
        try:
            payloads = dht.get_payloads(t, stage)
            stage0 = payloads if stage == 0 else dht.get_payloads(t, 0)
            replicas, holders = dht.get_replicas(), dht.get_stage_peers(stage)
        except NetworkError as exc:  # not known to be complete: asked again at the next poll
            log.info("round %d stage %d: DHT read failed: %s", t, stage, exc)
            return False
        view = round_view(t, stage, payloads, stage0, replicas, holders, self.me.peer_id, self.me.incarnation)
        if any(c.outer_step > t for c in parse_claims(holders, self.me.peer_id, self.refusals.peers()).values()):
            return True  # committed (or passed) by another holder: the spare follows it
        announced = {rid for rid, _ in view.bound.values()}
        return bool(announced or view.dropped) and view.expected <= announced | view.dropped

    def record(
        self,
        t: int,
        stages: Mapping[int, tuple[StageWorker, int]],
        train_loss: float | None,
        val_loss: float | None,
        wall_s: float,
        activations: tuple[int, int] = (0, 0),
    ) -> None:
        """After a committed round: the `round` metrics event, then fresh DHT records."""
        log_round(self.metrics, t, stages, train_loss, val_loss, wall_s, self.pg_bytes, activations)
        self.publish()
        log.info(
            "round %d committed: %s train %s val %s", t, {s: n for s, (_, n) in stages.items()}, train_loss, val_loss
        )


def _established(worker: StageWorker, own_stage: bool) -> list[str]:
    """The replicas of the last round we committed, of our own stage or (an observer of stage 0)
    of stage 0's set that moved our T⊥: every holder expects them in the next round."""
    link = worker.ledger.link
    if link is None:
        return []
    return link.replicas if own_stage else [rid for rid, _ in link.embed or ()]

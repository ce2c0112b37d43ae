"""`peer join`: the training loops of a stage peer, a pipeline head and a full replica.

Reads top to bottom: connect to the swarm and verify the manifest (peer.node.session), build the stage
workers, serve them over gRPC, then loop over outer steps t (rounds: peer.node.round.rounds; re-syncs:
peer.node.round.resync; every committed round goes through peer.core.sparseloco.commit):
- head (stage 0):   H inner steps driven through a claimed pipeline (peer.node.pipeline.driver) → round for
                    stage 0 → validation loss;
- full replica:     H inner steps on all stages locally, no compression → a round for every stage;
                    a head and a full replica share one outer loop (peer.node.outer_loop) and differ only
                    in what `_Head` and `_Full` do inside it (inner step, pause, round, validation);
- stage peer (s>0): serves forward/backward/step for the pipeline that claimed it; after the H-th
                    step (or, as a hot spare, when the round's first payload appears) it runs the
                    round for its stage plus an observer gather of stage 0 for T⊥.
With `train.overlap` 1 every role encodes its payload at the end of outer step t and trains t + 1
while round t runs in the background (peer.node.round.in_flight; docs/protocol.md, "Overlapped
outer steps").
After every `swarm.checkpoint_every_rounds` committed rounds each process saves its stage state to
`<data-dir>/checkpoints` (peer.node.checkpoints.stage); `peer join --resume` restores it before training.
Every process writes `<data-dir>/metrics.jsonl` and exits 0 after `train.outer_steps` rounds or on
SIGINT/SIGTERM (records withdrawn, server and DHT stopped).
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from peer.core.data.loader import Corpus
from peer.core.model.inner import MicroForward
from peer.errors import ConfigError, NetworkError, PeerError
from peer.node.fit import check_join
from peer.node.outer_loop import run_outer_loop
from peer.node.pipeline.driver import PipelineDriver
from peer.node.pipeline.failures import PipelineBehind
from peer.node.pipeline.mode import LinkFigures, ModeDecision
from peer.node.pipeline.schedule import with_in_flight
from peer.node.replica.data_parallel import chain_loss, chain_step
from peer.node.round.in_flight import InFlight
from peer.node.round.result import RoundResult
from peer.node.service import PeerService
from peer.node.session import Session, SessionOptions
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

YIELD_S = 2e-4  # between two overlapped inner steps of a full replica (`_Full.held`): locks are not fair


def run_stage_peer(opts: SessionOptions, stage: int, stop: threading.Event) -> int:
    """Hold one stage > 0 of compressed pipelines until the run's last round."""
    with Session.open(opts, role="stage", stage=stage, stop=stop) as session:
        cfg = session.cfg
        if not 0 < stage < cfg.stages:
            raise ConfigError(
                f"--stage {stage} does not exist in this run (stages 0..{cfg.stages - 1}); "
                "stage 0 is a head, or use --full-replica"
            )
        check_join(cfg, stage, session.opts)  # before the stage is built or announced
        worker = _worker(session, stage, compressed=True)
        session.checkpoints.resume({stage: worker})
        triggers: queue.Queue[tuple[str, int]] = queue.Queue()
        service = session.serve({stage: worker}, on_last_step=lambda pipeline, t: triggers.put((pipeline, t)))
        session.resync.late_join(worker)
        session.records.announce(
            lambda: session.records.stage(worker, role="trainer" if service.claimed_by else "spare")
        )
        last_check = time.monotonic()
        flight: InFlight | None = None
        try:
            while not stop.is_set():
                if flight is not None and not flight.running:
                    flight.land()
                    flight = None
                if flight is None and worker.outer_step >= cfg.train.outer_steps:
                    break
                session.check_alive()  # a dead DHT process ends the role instead of idling forever
                t = worker.outer_step
                contributor: str | None
                try:
                    pipeline, trained = triggers.get(timeout=0.2)
                    contributor = pipeline
                except queue.Empty:
                    if flight is not None:
                        continue  # nothing to repair or observe while our round is in flight
                    if time.monotonic() - last_check > cfg.swarm.announce_interval_s:
                        last_check = time.monotonic()
                        _housekeeping(session, service, worker)
                    # hot spare: once round (t, stage) is complete, apply the same committed set
                    if service.claimed_by is not None or not session.rounds.complete(t, stage):
                        continue
                    if not service.begin_observing():
                        continue  # claimed by a head in the meantime
                    contributor = None
                if contributor is not None and cfg.train.overlap:
                    if flight is not None:  # round t − 1 lands before round t is encoded
                        flight.land()
                        flight = None
                    flight = _stage_launch(session, service, worker, contributor, trained, stop)
                    continue
                try:
                    session.rounds.stage_round(worker, contributor, stop)
                    session.checkpoints.after_round({stage: worker})  # still in the round: no pipeline can touch it
                except NetworkError as exc:  # the DHT or every holder unreachable: housekeeping re-syncs
                    log.warning("stage %d: round %d did not complete: %s", stage, t, exc)
                finally:
                    service.round_done()
        finally:
            if flight is not None:
                flight.land()
        return session.finish(stop)


def _stage_launch(
    session: Session, service: PeerService, worker: StageWorker, pipeline: str, trained: int, stop: threading.Event
) -> InFlight | None:
    """Overlap on a stage peer: encode round t now, serve the pipelines' inner steps of t + 1 while
    the round runs in the background. None (nothing launched) when the outer step the pipeline
    trained is not ours (our round t − 1 did not commit here): housekeeping re-syncs."""
    t = worker.outer_step
    try:
        if trained != t:
            log.warning(
                "stage %d: the pipeline trained outer step %d on our outer step %d; not contributing",
                worker.stage,
                trained,
                t,
            )
            return None
        job = session.rounds.stage_job(worker, pipeline)
        worker.begin_overlap()
    finally:
        service.round_done()  # claimable for the next outer step at once
    session.records.refresh()

    def run() -> dict[int, RoundResult]:
        session.rounds.stage_round(worker, pipeline, stop, job=job)
        return {}

    def checkpoint(results: Mapping[int, RoundResult], val: float | None) -> None:
        session.checkpoints.after_round({worker.stage: worker})  # a copy: the next outer step trains

    flight = InFlight(t, [worker], run, checkpoint)
    flight.val.set_result(None)  # a stage peer measures no validation loss
    return flight


def run_head(opts: SessionOptions, stop: threading.Event) -> int:
    """Stage 0: drive a pipeline through the other stages' peers, compressed or not by its links."""
    with Session.open(opts, role="head", stage=0, stop=stop) as session:
        check_join(session.cfg, 0, session.opts)  # before the stage is built or announced
        worker = _worker(session, 0, compressed=True)
        data, shard, service = _join(session, {0: worker}, "pipeline")
        head = _Head(session, worker, _head_driver(session, service, worker, stop), stop)
        driver = head.driver
        session.records.announce(
            lambda: session.records.stage(worker, role="head"),
            lambda: session.records.replica(
                "pipeline",
                worker.outer_step,
                shard,
                driver.last_loss,
                driver.tokens_per_s(),
                pipeline_peers={str(s): pid for s, (pid, _) in list(driver.peers.items())},
                mode=driver.mode,
            ),
        )
        run_outer_loop(session, head, data, shard, stop)
        return session.finish(stop)


def _head_driver(session: Session, service: PeerService, worker: StageWorker, stop: threading.Event) -> PipelineDriver:
    """The head's pipeline: claims from the DHT's stage records, binds published in the head's
    record, the chosen schedule shown in its `info` and record (`PeerService.schedule`)."""

    def show_schedule(schedule: dict[str, Any]) -> None:
        service.schedule = schedule

    def record_mode(t: int, decision: ModeDecision, figures: LinkFigures | None) -> None:
        fields = {} if figures is None else figures.to_fields()
        util = decision.util_uncompressed
        session.metrics.log("mode", t=t, mode=decision.mode, reason=decision.reason, util_uncompressed=util, **fields)

    return PipelineDriver(
        with_in_flight(session.cfg, session.opts.in_flight),  # this head's own window K (`--in-flight`)
        session.peer_id,
        worker,
        session.dht,
        session.clients,
        stop,
        on_bind=session.records.refresh,
        on_schedule=show_schedule,
        policy=session.opts.compression,  # `peer join --stage 0 --compression`
        on_mode=record_mode,
    )


def run_full_replica(opts: SessionOptions, stop: threading.Event, make: MakeFull | None = None) -> int:
    """All stages locally, no boundary compression; contributes to every stage's round.

    `make` (torchrun's rank 0, peer.node.replica.ranks): builds the `_Full` that trains across the
    replica's ranks, once the session and its data are up; it is closed when the loop ends."""
    with Session.open(opts, role="full", stage=None, stop=stop) as session:
        cfg = session.cfg
        check_join(cfg, None, session.opts)  # before the stages are built or announced
        device = session.opts.device if make is None else make.device(session.opts.device)
        workers = {s: _worker(session, s, compressed=False, device=device) for s in range(cfg.stages)}
        data, shard, _ = _join(session, workers, "full")
        full = _Full(session, workers, stop) if make is None else make(session, workers, data, shard, stop)
        batch = cfg.train.batch_size  # per rank: the record says ranks × batch
        session.records.announce(
            lambda: session.records.replica(
                "full", workers[0].outer_step, shard, full.last_loss, full.tokens_per_s, full.ranks, batch
            ),
            *[lambda w=w: session.records.stage(w, role="full") for w in workers.values()],
        )
        try:
            run_outer_loop(session, full, data, shard, stop)
        finally:
            full.close()
        return session.finish(stop)


class MakeFull(Protocol):
    """Builds a full replica that trains across several ranks (peer.node.replica.ranks)."""

    def device(self, device: str) -> str:
        """The device this rank's stages live on."""

    def __call__(
        self, session: Session, workers: dict[int, StageWorker], data: Corpus, shard: int, stop: threading.Event
    ) -> _Full: ...


def _worker(session: Session, stage: int, compressed: bool, device: str | None = None) -> StageWorker:
    """A stage worker with this peer's device (or `device`), precision and activation checkpointing."""
    opts = session.opts
    return StageWorker(
        session.cfg, stage, compressed, device or opts.device, opts.precision, opts.activation_checkpointing
    )


def _join(session: Session, workers: dict[int, StageWorker], kind: str) -> tuple[Corpus, int, PeerService]:
    """A head or full replica (`kind` "pipeline" or "full") joins: resume its checkpoint, serve its
    stages, catch up with the swarm, claim its data shard (a resumed peer's own when still free),
    fetch the dataset files that shard reads (`peer.node.data.shard.ShardData`) and open the corpus;
    the service. Its replica record goes out once its state is caught up and its shard's files are
    here, before they load: holders gathering the round it joins at expect its payload instead of
    closing without it (the records' loop starts once the peer trains). Not before the files are
    fetched: a fresh joiner's download can outlast a round, which would then wait for it to its
    deadline (`peer bench chaos`: a 26 s fetch held round 127 for 8 s)."""
    resumed = session.checkpoints.resume(workers) or {}
    service = session.serve(workers)
    for w in workers.values():
        session.resync.late_join(w)
    shard = session.data.claim(session.cfg, prefer=resumed.get("extra", {}).get("shard"))
    session.cfg = session.data.fetch(session.cfg, shard)
    step = min(w.outer_step for w in workers.values())
    session.records.publish_once(lambda: session.records.replica(kind, step, shard, None, 0.0))
    return session.data.load(session.cfg), shard, service


class _Head:
    """A head's outer steps: stage 0 here, the inner steps through a claimed pipeline."""

    chain = None
    ranks = 1

    def __init__(self, session: Session, worker: StageWorker, driver: PipelineDriver, stop: threading.Event) -> None:
        self.session, self.worker, self.driver, self.stop = session, worker, driver, stop
        self.workers = {0: worker}

    def inner_step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.driver.inner_step(t, h, x, y)

    def pause(self, t: int, exc: NetworkError) -> None:
        """Free the pipeline; re-sync at once when a stage peer is ahead of us (`PipelineBehind`)."""
        self.worker.restart_outer_step()  # else stage 0 refuses the restarted inner step 0 as stale
        self.driver.release()
        if isinstance(exc, PipelineBehind):
            self.session.resync.maintain(self.worker, max_lag=0)
        else:
            self.stop.wait(self.session.cfg.swarm.announce_interval_s)

    def round(self, t: int) -> Mapping[int, RoundResult]:
        bound = {str(s): pid for s, (pid, _) in list(self.driver.peers.items())}  # who did the last step
        try:
            return {0: self.session.rounds.head_round(self.worker, t, self.stop, peers=bound)}
        finally:
            self.driver.release()

    def launch(self, t: int) -> Callable[[], Mapping[int, RoundResult]]:
        bound = {str(s): pid for s, (pid, _) in list(self.driver.peers.items())}
        try:
            job = self.session.rounds.head_job(self.worker, bound)
            self.worker.begin_overlap()
        finally:
            self.driver.release()  # the stage peers take the next outer step's claims
        return lambda: {0: self.session.rounds.head_round(self.worker, t, self.stop, peers=bound, job=job)}

    def evaluate(self, t: int, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        try:
            return self.driver.evaluate(val)
        except NetworkError as exc:  # e.g. the stage peer re-synced past us: the next step repairs it
            log.warning("validation after round %d skipped: %s", t, exc)
            return None

    @property
    def activations(self) -> tuple[int, int]:
        return self.driver.act_bytes


class _Full:
    """A full replica's outer steps: every stage here, uncompressed, chained in this process."""

    activations = (0, 0)
    ranks = 1  # a subclass trains across torchrun's ranks (peer.node.replica.ranks)

    def __init__(self, session: Session, workers: dict[int, StageWorker], stop: threading.Event) -> None:
        self.session, self.workers, self.stop = session, workers, stop
        self.chain = [workers[s] for s in range(len(workers))]
        self.last_loss: float | None = None
        self.tokens_per_s = 0.0  # of the whole replica (every rank)
        self._started = 0.0  # when the outer step's first inner step started

    def forward(self) -> MicroForward:
        """One inner step's micro-batch forward through the chain (`peer.core.model.inner.accumulate`)."""
        return lambda mx, my: (chain_loss(self.chain, mx, my), 0)

    def held(self) -> contextlib.ExitStack:
        """With overlap, every stage's lock for one inner step: a round in flight writes the
        parameters between two steps, never inside one (no lock needed without overlap)."""
        stack = contextlib.ExitStack()
        if self.chain[0].cfg.train.overlap:
            time.sleep(YIELD_S)  # a round thread waiting for a stage's lock takes it now, not after many steps
            for w in self.chain:
                stack.enter_context(w.lock)
        return stack

    def inner_step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """`peer.node.replica.data_parallel.chain_step`: every stage's micro-batches, then their clipped steps."""
        if h == 0:
            self._started = time.monotonic()
        with self.held():
            loss = self.step(t, h, x, y)
        self.last_loss = loss
        self.tokens_per_s = (h + 1) * x.numel() * self.ranks / max(1e-9, time.monotonic() - self._started)
        return loss

    def step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """The inner step itself (a sharded replica's ranks run their own)."""
        return chain_step(self.chain, self.forward(), t, h, x, y)

    def close(self) -> None:
        """The outer loop ended (finished, stopped or failed): nothing to release on one rank."""

    def pause(self, t: int, exc: NetworkError) -> None:
        """Forget the outer step's gradients and wait (its inner steps are local: none waits on a peer)."""
        for w in self.chain:
            w.zero_grad()
        self.stop.wait(self.session.cfg.swarm.announce_interval_s)

    def round(self, t: int) -> Mapping[int, RoundResult]:
        return self.session.rounds.full_round(self.workers, t, self.stop)

    def launch(self, t: int) -> Callable[[], Mapping[int, RoundResult]]:
        with self.held():
            jobs = self.session.rounds.full_jobs(self.workers)
            for w in self.chain:
                w.begin_overlap()
        return lambda: self.session.rounds.full_round(self.workers, t, self.stop, jobs=jobs)

    @torch.no_grad()
    def evaluate(self, t: int, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        with self.held():
            losses = [chain_loss(self.chain, x, y).item() for x, y in val]
        return sum(losses) / max(1, len(losses))


def _housekeeping(session: Session, service: PeerService, worker: StageWorker) -> None:
    """A stage peer between requests: free the claim of a dead head, re-sync when behind/diverged."""
    service.release_if_idle(2 * session.cfg.swarm.rpc_timeout_s)
    if service.claimed_by is None and not service.in_round:
        try:
            session.resync.maintain(worker)
        except PeerError as exc:
            log.warning("stage %d: could not re-sync yet: %s", worker.stage, exc)


def run_role(opts: SessionOptions, stage: int | None, stop: threading.Event) -> int:
    """`peer join`: a full replica (stage None), a head (stage 0) or a stage peer; its exit code."""
    if stage is None:
        return run_full_replica(opts, stop)
    if stage == 0:
        return run_head(opts, stop)
    return run_stage_peer(opts, stage, stop)


def data_dir_default(role: str, stage: int | None) -> Path:
    return Path("runs") / (f"{role}-{stage}" if stage is not None else role)

"""`peer join`: the training loops of a stage peer, a pipeline head and a full replica.

Reads top to bottom: connect to the swarm and verify the manifest (peer.node.session), build the stage
workers, serve them over gRPC, then loop over outer steps t (rounds: peer.node.round.rounds; re-syncs:
peer.node.resync; every committed round goes through peer.core.outer.commit_round):
- head (stage 0):   H inner steps driven through a claimed pipeline (peer.node.pipeline) → round for
                    stage 0 → validation loss;
- full replica:     H inner steps on all stages locally, no compression → a round for every stage;
- stage peer (s>0): serves forward/backward/step for the pipeline that claimed it; after the H-th
                    step (or, as a hot spare, when the round's first payload appears) it runs the
                    round for its stage plus an observer gather of stage 0 for T⊥.
After every `swarm.checkpoint_every_rounds` committed rounds each process saves its stage state to
`<data-dir>/checkpoints` (peer.node.checkpoints.stage); `peer join --resume` restores it before training.
Every process writes `<data-dir>/metrics.jsonl` and exits 0 after `train.outer_steps` rounds or on
SIGINT/SIGTERM (records withdrawn, server and DHT stopped).
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
import torch.nn.functional as F

from peer.core.data import train_batch, val_batches
from peer.core.outer import accumulate
from peer.errors import ConfigError, NetworkError, PeerError
from peer.node.pipeline import PipelineBehind, PipelineDriver
from peer.node.service import PeerService
from peer.node.session import Session, SessionOptions
from peer.node.stage_worker import StageWorker

log = logging.getLogger(__name__)

VAL_BATCHES = 2


def run_stage_peer(opts: SessionOptions, stage: int, stop: threading.Event) -> int:
    """Hold one stage > 0 of compressed pipelines until the run's last round."""
    with Session.open(opts, role="stage", stage=stage, stop=stop) as session:
        cfg = session.cfg
        if not 0 < stage < cfg.stages:
            raise ConfigError(
                f"--stage {stage} does not exist in this run (stages 0..{cfg.stages - 1}); "
                "stage 0 is a head, or use --full-replica"
            )
        worker = StageWorker(cfg, stage, compressed=True, device=session.opts.device)
        session.checkpoints.resume({stage: worker})
        triggers: queue.Queue[tuple[str, int]] = queue.Queue()
        service = session.serve({stage: worker}, on_last_step=lambda pipeline, t: triggers.put((pipeline, t)))
        session.resync.late_join(worker)
        session.records.announce(
            lambda: session.records.stage(worker, role="trainer" if service.claimed_by else "spare")
        )
        last_check = time.monotonic()
        while worker.outer_step < cfg.train.outer_steps and not stop.is_set():
            t = worker.outer_step
            contributor: str | None
            try:
                pipeline, _ = triggers.get(timeout=0.2)
                contributor = pipeline
            except queue.Empty:
                if time.monotonic() - last_check > cfg.swarm.announce_interval_s:
                    last_check = time.monotonic()
                    _housekeeping(session, service, worker)
                # hot spare: once round (t, stage) is complete, apply the same committed set
                if service.claimed_by is not None or not session.rounds.complete(t, stage):
                    continue
                if not service.begin_observing():
                    continue  # claimed by a head in the meantime
                contributor = None
            try:
                session.rounds.stage_round(worker, contributor, stop)
                session.checkpoints.after_round({stage: worker})  # still in the round: no pipeline can touch it
            except NetworkError as exc:  # the DHT or every holder unreachable: housekeeping re-syncs
                log.warning("stage %d: round %d did not complete: %s", stage, t, exc)
            finally:
                service.round_done()
        return session.finish(stop)


def run_head(opts: SessionOptions, stop: threading.Event) -> int:
    """Stage 0: drive a compressed pipeline through the other stages' peers."""
    with Session.open(opts, role="head", stage=0, stop=stop) as session:
        cfg = session.cfg
        worker = StageWorker(cfg, 0, compressed=True, device=session.opts.device)
        resumed = session.checkpoints.resume({0: worker}) or {}
        session.serve({0: worker})
        session.resync.late_join(worker)
        data = session.load_data()
        shard = session.claim_shard(prefer=resumed.get("extra", {}).get("shard"))
        driver = PipelineDriver(session, worker, stop)
        session.records.announce(
            lambda: session.records.stage(worker, role="head"),
            lambda: session.records.replica(
                "pipeline",
                worker.outer_step,
                shard,
                driver.last_loss,
                driver.tokens_per_s(),
                pipeline_peers={str(s): pid for s, (pid, _) in list(driver.peers.items())},
            ),
        )
        H, train = cfg.train.inner_steps, cfg.train
        val = val_batches(data, train.batch_size, train.seq_len, max_batches=VAL_BATCHES)
        session.wait_for_quorum(worker.outer_step, stop)
        while worker.outer_step < train.outer_steps and not stop.is_set():
            if not _repair(session, {0: worker}, stop):
                continue
            t = worker.outer_step
            if t >= train.outer_steps:
                break
            losses = []
            try:
                for h in range(H):
                    x, y = train_batch(data, shard, cfg.swarm.n_shards, t * H + h, train.batch_size, train.seq_len)
                    losses.append(driver.inner_step(t, h, x, y))
                    session.metrics.log("step", t=t, h=h, loss=losses[-1], tokens=x.numel())
            except NetworkError as exc:
                # no usable peer for a stage: pause, then start the outer step over (re-synced if behind)
                log.warning("pipeline paused at outer step %d: %s", t, exc)
                session.metrics.log("pause", t=t, reason=str(exc))
                worker.zero_grad()
                driver.release()
                if isinstance(exc, PipelineBehind):
                    session.resync.maintain(worker, max_lag=0)
                else:
                    stop.wait(cfg.swarm.announce_interval_s)
                continue
            bound = {str(s): pid for s, (pid, _) in list(driver.peers.items())}  # who did the last step
            try:
                result = session.rounds.head_round(worker, t, stop, peers=bound)
            except NetworkError as exc:  # the DHT unreachable past the deadline: repaired before the next step
                log.warning("round %d did not complete: %s", t, exc)
                driver.release()
                continue
            driver.release()
            if result.behind:  # round t was committed without us: we re-synced instead
                continue
            try:
                val_loss = driver.evaluate(val)
            except NetworkError as exc:  # e.g. the stage peer re-synced past us: the next step repairs it
                log.warning("validation after round %d skipped: %s", t, exc)
                val_loss = None
            session.rounds.record(
                t,
                {0: (worker, result.participants)},
                sum(losses) / len(losses),
                val_loss,
                result.wall_s,
                activations=driver.act_bytes,
            )
            session.checkpoints.after_round({0: worker}, {"shard": shard})  # data position: (shard, outer step)
        return session.finish(stop)


def run_full_replica(opts: SessionOptions, stop: threading.Event) -> int:
    """All stages locally, no boundary compression; contributes to every stage's round."""
    with Session.open(opts, role="full", stage=None, stop=stop) as session:
        cfg = session.cfg
        workers = {s: StageWorker(cfg, s, compressed=False, device=session.opts.device) for s in range(cfg.stages)}
        resumed = session.checkpoints.resume(workers) or {}
        session.serve(workers)
        for w in workers.values():
            session.resync.late_join(w)
        data = session.load_data()
        shard = session.claim_shard(prefer=resumed.get("extra", {}).get("shard"))
        stats: dict[str, float | None] = {"loss": None, "tokens_per_s": 0.0}
        session.records.announce(
            lambda: session.records.replica(
                "full", workers[0].outer_step, shard, stats["loss"], stats["tokens_per_s"] or 0.0
            ),
            *[lambda w=w: session.records.stage(w, role="full") for w in workers.values()],
        )
        session.wait_for_quorum(workers[0].outer_step, stop)
        train, H = cfg.train, cfg.train.inner_steps
        val = val_batches(data, train.batch_size, train.seq_len, max_batches=VAL_BATCHES)
        chain = [workers[s] for s in range(cfg.stages)]
        while chain[0].outer_step < train.outer_steps and not stop.is_set():
            if not _repair(session, workers, stop, chain):
                continue
            t = chain[0].outer_step
            if t >= train.outer_steps:
                break
            losses, started = [], time.monotonic()
            for h in range(H):
                x, y = train_batch(data, shard, cfg.swarm.n_shards, t * H + h, train.batch_size, train.seq_len)
                losses.append(_full_inner_step(chain, x, y, t, h))
                stats["loss"] = losses[-1]
                stats["tokens_per_s"] = (h + 1) * x.numel() / max(1e-9, time.monotonic() - started)
                session.metrics.log("step", t=t, h=h, loss=losses[-1], tokens=x.numel())
                if stop.is_set():
                    break
            if stop.is_set():
                break
            try:
                results = session.rounds.full_round(workers, t, stop)
            except NetworkError as exc:  # the DHT unreachable past the deadline: repaired before the next step
                log.warning("round %d did not complete: %s", t, exc)
                continue
            if any(r.behind for r in results.values()):
                continue  # re-synced instead of committing: align the stages before the next step
            val_loss = _full_eval(chain, val)
            session.rounds.record(
                t,
                {s: (workers[s], results[s].participants) for s in workers},
                sum(losses) / len(losses),
                val_loss,
                max(r.wall_s for r in results.values()),
            )
            session.checkpoints.after_round(workers, {"shard": shard})
        return session.finish(stop)


def _housekeeping(session: Session, service: PeerService, worker: StageWorker) -> None:
    """A stage peer between requests: free the claim of a dead head, re-sync when behind/diverged."""
    service.release_if_idle(2 * session.cfg.swarm.rpc_timeout_s)
    if service.claimed_by is None and not service.in_round:
        try:
            session.resync.maintain(worker)
        except PeerError as exc:
            log.warning("stage %d: could not re-sync yet: %s", worker.stage, exc)


def _repair(
    session: Session, workers: Mapping[int, StageWorker], stop: threading.Event, chain: list[StageWorker] | None = None
) -> bool:
    """Before an outer step of a head or full replica: re-sync what is behind or not canonical,
    align a full replica's stages, apply a round we synced into. False (after a pause) when a
    holder to sync from is not reachable yet: the caller tries again, it never exits on it."""
    try:
        for w in workers.values():
            session.resync.maintain(w)
        if chain is not None and not _align(session, chain):
            stop.wait(session.cfg.swarm.announce_interval_s)
            return False
        session.rounds.catch_up(workers, stop)
    except NetworkError as exc:
        log.warning("could not re-sync yet: %s", exc)
        stop.wait(session.cfg.swarm.announce_interval_s)
        return False
    return True


def _align(session: Session, chain: list[StageWorker], attempts: int = 3) -> bool:
    """A full replica's stages at different outer steps (one re-synced ahead): re-sync the ones
    behind to the swarm's state until all are at the same outer step (bounded)."""
    for _ in range(attempts):
        top = max(w.outer_step for w in chain)
        behind = [w for w in chain if w.outer_step < top]
        if not behind:
            return True
        for w in behind:
            try:
                session.resync.sync_state(w, f"stage behind the replica's other stages (outer step {w.outer_step})")
            except PeerError as exc:
                log.warning("stage %d: could not align with the other stages yet: %s", w.stage, exc)
                return False
    return len({w.outer_step for w in chain}) == 1


def _chain_loss(chain: list[StageWorker], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of a (b, L) batch through every stage of a full replica, uncompressed."""
    hdn = x.to(chain[0].device)
    for w in chain:
        hdn = w.module(hdn)
    return F.cross_entropy(hdn.flatten(0, 1).float(), y.to(chain[0].device).flatten())


def _full_inner_step(chain: list[StageWorker], x: torch.Tensor, y: torch.Tensor, t: int, h: int) -> float:
    """One inner step of a full replica: micro-batches through every stage, then each stage's step,
    clipped by the gradient norm over all stages (as the whole model and a pipeline clip)."""
    loss, _ = accumulate(lambda mx, my: (_chain_loss(chain, mx, my), 0), x, y, chain[0].cfg.train.microbatches)
    total_norm = math.sqrt(math.fsum(w.grad_sq_norm() for w in chain))
    for w in chain:
        w.step(t, h, total_norm)
    return loss


@torch.no_grad()
def _full_eval(chain: list[StageWorker], batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> float:
    losses = [_chain_loss(chain, x, y).item() for x, y in batches]
    return sum(losses) / max(1, len(losses))


def run_role(opts: SessionOptions, stage: int | None, stop: threading.Event) -> int:
    """`peer join`: a full replica (stage None), a head (stage 0) or a stage peer; its exit code."""
    if stage is None:
        return run_full_replica(opts, stop)
    if stage == 0:
        return run_head(opts, stop)
    return run_stage_peer(opts, stage, stop)


def data_dir_default(role: str, stage: int | None) -> Path:
    return Path("runs") / (f"{role}-{stage}" if stage is not None else role)

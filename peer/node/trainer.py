"""`peer join`: the training loops of a stage peer, a pipeline head and a full replica.

Reads top to bottom: connect to the swarm and verify the manifest (peer.node.session), build the stage
workers, serve them over gRPC, then loop over outer steps t:
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
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F

from peer.core.data import train_batch, val_batches
from peer.core.sparseloco import Payload
from peer.errors import NetworkError, PeerError
from peer.node.pipeline import PipelineBehind, PipelineDriver
from peer.node.session import Swarm, SwarmOptions
from peer.node.stage_worker import StageWorker

log = logging.getLogger(__name__)

VAL_BATCHES = 2


def run_stage_peer(opts: SwarmOptions, stage: int, stop: threading.Event) -> int:
    """Hold one stage > 0 of compressed pipelines until the run's last round."""
    with Swarm.session(opts, role="stage", stage=stage, stop=stop) as swarm:
        cfg = swarm.cfg
        if not 0 < stage < cfg.stages:
            from peer.errors import ConfigError

            raise ConfigError(
                f"--stage {stage} does not exist in this run (stages 0..{cfg.stages - 1}); "
                "stage 0 is a head, or use --full-replica"
            )
        worker = StageWorker(cfg, stage, compressed=True, device=swarm.opts.device)
        swarm.resume({stage: worker})
        triggers: queue.Queue[tuple[str, int]] = queue.Queue()
        swarm.serve({stage: worker}, on_last_step=lambda pipeline, t: triggers.put((pipeline, t)))
        swarm.sync_late_join(worker)
        swarm.start_announcing(
            lambda: swarm.stage_record(worker, role="trainer" if swarm.service.claimed_by else "spare")
        )
        last_check = time.monotonic()
        while worker.outer_step < cfg.train.outer_steps and not stop.is_set():
            t = worker.outer_step
            try:
                pipeline, _ = triggers.get(timeout=0.2)
                contributor = pipeline
            except queue.Empty:
                if time.monotonic() - last_check > cfg.swarm.announce_interval_s:
                    last_check = time.monotonic()
                    _housekeeping(swarm, worker)
                # hot spare: once round (t, stage) is complete, apply the same committed set
                if swarm.service.claimed_by is not None or not swarm.round_complete(t, stage):
                    continue
                if not swarm.service.begin_observing():
                    continue  # claimed by a head in the meantime
                contributor = None
            try:
                swarm.run_stage_round(worker, contributor, stop)
                swarm.checkpoint({stage: worker})  # still in the round: no pipeline can touch the worker
            finally:
                swarm.service.round_done()
        return swarm.finish(stop)


def run_head(opts: SwarmOptions, stop: threading.Event) -> int:
    """Stage 0: drive a compressed pipeline through the other stages' peers."""
    with Swarm.session(opts, role="head", stage=0, stop=stop) as swarm:
        cfg = swarm.cfg
        worker = StageWorker(cfg, 0, compressed=True, device=swarm.opts.device)
        resumed = swarm.resume({0: worker}) or {}
        swarm.serve({0: worker})
        swarm.sync_late_join(worker)
        data = swarm.load_data()
        shard = swarm.claim_shard(prefer=resumed.get("extra", {}).get("shard"))
        driver = PipelineDriver(swarm, worker, stop)
        swarm.start_announcing(
            lambda: swarm.stage_record(worker, role="head"),
            lambda: swarm.replica_record(
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
        swarm.wait_for_quorum(worker.outer_step, stop)
        while worker.outer_step < train.outer_steps and not stop.is_set():
            swarm.maintain(worker)
            swarm.catch_up({0: worker}, stop)
            t = worker.outer_step
            if t >= train.outer_steps:
                break
            losses = []
            try:
                for h in range(H):
                    x, y = train_batch(data, shard, cfg.swarm.n_shards, t * H + h, train.batch_size, train.seq_len)
                    losses.append(driver.inner_step(t, h, x, y))
                    swarm.log_event("step", t=t, h=h, loss=losses[-1], tokens=x.numel())
            except NetworkError as exc:
                # no usable peer for a stage: pause, then start the outer step over (re-synced if behind)
                log.warning("pipeline paused at outer step %d: %s", t, exc)
                swarm.log_event("pause", t=t, reason=str(exc))
                worker.zero_grad()
                driver.release()
                if isinstance(exc, PipelineBehind):
                    swarm.maintain(worker, max_lag=0)
                else:
                    stop.wait(cfg.swarm.announce_interval_s)
                continue
            result = swarm.contribute(worker, t, swarm.peer_id, stop)
            driver.release()
            val_loss = driver.evaluate(val)
            swarm.log_round(
                t,
                {0: (worker, result.participants)},
                sum(losses) / len(losses),
                val_loss,
                result.wall_s,
                activations=driver.act_bytes,
            )
            swarm.checkpoint({0: worker}, {"shard": shard})  # data position: (shard, outer step)
        return swarm.finish(stop)


def run_full_replica(opts: SwarmOptions, stop: threading.Event) -> int:
    """All stages locally, no boundary compression; contributes to every stage's round."""
    with Swarm.session(opts, role="full", stage=None, stop=stop) as swarm:
        cfg = swarm.cfg
        workers = {s: StageWorker(cfg, s, compressed=False, device=swarm.opts.device) for s in range(cfg.stages)}
        resumed = swarm.resume(workers) or {}
        swarm.serve(workers)
        for w in workers.values():
            swarm.sync_late_join(w)
        data = swarm.load_data()
        shard = swarm.claim_shard(prefer=resumed.get("extra", {}).get("shard"))
        stats = {"loss": None, "tokens_per_s": 0.0}
        swarm.start_announcing(
            lambda: swarm.replica_record("full", workers[0].outer_step, shard, stats["loss"], stats["tokens_per_s"]),
            *[lambda w=w: swarm.stage_record(w, role="full") for w in workers.values()],
        )
        swarm.wait_for_quorum(workers[0].outer_step, stop)
        train, H = cfg.train, cfg.train.inner_steps
        val = val_batches(data, train.batch_size, train.seq_len, max_batches=VAL_BATCHES)
        chain = [workers[s] for s in range(cfg.stages)]
        while chain[0].outer_step < train.outer_steps and not stop.is_set():
            for w in chain:
                swarm.maintain(w)
            swarm.catch_up(workers, stop)
            t = chain[0].outer_step
            if t >= train.outer_steps:
                break
            losses, started = [], time.monotonic()
            for h in range(H):
                x, y = train_batch(data, shard, cfg.swarm.n_shards, t * H + h, train.batch_size, train.seq_len)
                losses.append(_full_inner_step(chain, x, y, t, h))
                stats["loss"] = losses[-1]
                stats["tokens_per_s"] = (h + 1) * x.numel() / max(1e-9, time.monotonic() - started)
                swarm.log_event("step", t=t, h=h, loss=losses[-1], tokens=x.numel())
                if stop.is_set():
                    break
            if stop.is_set():
                break
            with ThreadPoolExecutor(max_workers=cfg.stages) as pool:
                futures = {s: pool.submit(swarm.gather_for, workers[s], t, swarm.peer_id, stop) for s in workers}
                results = {s: f.result() for s, f in futures.items()}
            embed_update = StageWorker.embed_update([Payload.from_bytes(p) for p in results[0].payloads], cfg)
            for s, w in workers.items():
                w.apply_round([Payload.from_bytes(p) for p in results[s].payloads], embed_update)
            val_loss = _full_eval(chain, val)
            swarm.log_round(
                t,
                {s: (workers[s], results[s].participants) for s in workers},
                sum(losses) / len(losses),
                val_loss,
                max(r.wall_s for r in results.values()),
            )
            swarm.checkpoint(workers, {"shard": shard})
        return swarm.finish(stop)


def _housekeeping(swarm: Swarm, worker: StageWorker) -> None:
    """A stage peer between requests: free the claim of a dead head, re-sync when behind/diverged."""
    swarm.service.release_if_idle(2 * swarm.cfg.swarm.rpc_timeout_s)
    if swarm.service.claimed_by is None and not swarm.service.in_round:
        try:
            swarm.maintain(worker)
        except PeerError as exc:
            log.warning("stage %d: could not re-sync yet: %s", worker.stage, exc)


def _full_inner_step(chain: list[StageWorker], x: torch.Tensor, y: torch.Tensor, t: int, h: int) -> float:
    """One inner step of a full replica: micro-batches through every stage, uncompressed."""
    n_micro = chain[0].cfg.train.microbatches
    total = 0.0
    for mb_x, mb_y in zip(x.chunk(n_micro), y.chunk(n_micro)):
        hdn = mb_x.to(chain[0].device)
        for w in chain:
            hdn = w.module(hdn)
        loss = F.cross_entropy(hdn.flatten(0, 1).float(), mb_y.to(chain[0].device).flatten())
        (loss / n_micro).backward()
        total += loss.item() / n_micro
    for w in chain:
        w.step(t, h)
    return total


@torch.no_grad()
def _full_eval(chain: list[StageWorker], batches) -> float:
    losses = []
    for x, y in batches:
        hdn = x.to(chain[0].device)
        for w in chain:
            hdn = w.module(hdn)
        losses.append(F.cross_entropy(hdn.flatten(0, 1).float(), y.to(chain[0].device).flatten()).item())
    return sum(losses) / max(1, len(losses))


def data_dir_default(role: str, stage: int | None) -> Path:
    return Path("runs") / (f"{role}-{stage}" if stage is not None else role)

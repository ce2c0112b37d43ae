"""The outer steps of a head or a full replica, synchronous or with one round in flight.

`run_outer_loop`: repair, H inner steps on our shard, the round of every stage held, validation,
the record, the checkpoint — in that order (the
synchronous schedule, `train.overlap` 0), or with the round of outer step t in the background while
the inner steps of t + 1 run (`train.overlap` 1: `peer.node.round.in_flight.InFlight`; docs/protocol.md,
"Overlapped outer steps"). A head and a full replica differ only in what their `Replica` does
inside the loop (peer.node.trainer: `_Head`, `_Full`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Protocol

import torch

from peer.core.data.loader import Corpus, train_batch, val_batches
from peer.errors import NetworkError, PeerError
from peer.node.replica.data_parallel import rank_batch_index
from peer.node.round.in_flight import InFlight
from peer.node.round.result import RoundResult
from peer.node.session import Session
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

VAL_BATCHES = 2


class Replica(Protocol):
    """What a head and a full replica do their own way inside the one outer loop (`run_outer_loop`)."""

    @property
    def workers(self) -> Mapping[int, StageWorker]:
        """The stages this replica holds, by stage."""

    @property
    def chain(self) -> list[StageWorker] | None:
        """Every stage in order, kept at one outer step (a full replica); None: a head."""

    @property
    def ranks(self) -> int:
        """Processes training this replica together (torchrun); rank 0 runs this loop."""

    def inner_step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        """One inner step on a (b, L) batch; its loss (NetworkError: no usable peer for a stage)."""

    def pause(self, t: int, exc: NetworkError) -> None:
        """An inner step failed: forget the outer step's gradients and wait before it starts over."""

    def round(self, t: int) -> Mapping[int, RoundResult]:
        """Round t of every stage held: the results by stage (NetworkError: the DHT unreachable)."""

    def launch(self, t: int) -> Callable[[], Mapping[int, RoundResult]]:
        """Overlap: encode round t's payloads now and train ahead (`StageState.begin_overlap`); the
        round itself, to run in the background (`InFlight`)."""

    def evaluate(self, t: int, val: list[tuple[torch.Tensor, torch.Tensor]]) -> float | None:
        """The validation loss after round t (None: skipped)."""

    @property
    def activations(self) -> tuple[int, int]:
        """Stage-boundary bytes so far, as the `round` metric counts them."""


def run_outer_loop(session: Session, replica: Replica, data: Corpus, shard: int, stop: threading.Event) -> None:
    """The outer steps of a head or a full replica until the run's last round (or `stop`): repair,
    H inner steps on our shard, the round of every stage held, validation, the record, the checkpoint.
    With `train.overlap` 1 the round of outer step t runs in the background (`InFlight`) while the
    inner steps of t + 1 run; it is landed before round t + 1 is encoded."""
    cfg = session.cfg
    train, first = cfg.train, replica.workers[0]
    val = val_batches(data, train.batch_size, train.seq_len, max_batches=VAL_BATCHES)
    session.wait_for_quorum(first.outer_step, stop)
    flight: InFlight | None = None
    try:
        while not stop.is_set():
            session.check_alive()  # a dead DHT process ends the role instead of re-syncing forever
            if flight is None and not repair(session, replica.workers, stop, replica.chain):
                continue
            t = first.outer_step if flight is None else flight.t + 1
            if t >= train.outer_steps:
                break
            try:
                losses = _inner_steps(session, replica, data, shard, t, stop, flight)
            except NetworkError as exc:  # no usable peer for a stage: pause, then start the outer step over
                log.warning("pipeline paused at outer step %d: %s", t, exc)
                session.metrics.log("pause", t=t, reason=str(exc))
                _land(flight)
                flight = None
                replica.pause(t, exc)
                continue
            if stop.is_set():
                return
            if flight is not None and not flight.land():
                flight = None
                continue  # round t − 1 did not commit here: the progress on it was dropped; repair
            flight = None
            if train.overlap:
                flight = _launch(session, replica, t, losses, val, shard)
            else:
                _round(session, replica, t, losses, val, shard)
    finally:
        _land(flight)


def _inner_steps(
    session: Session,
    replica: Replica,
    data: Corpus,
    shard: int,
    t: int,
    stop: threading.Event,
    flight: InFlight | None = None,
) -> list[float]:
    """The H inner steps of outer step t on our shard (rank 0's batches; torchrun's other ranks
    follow); their losses (fewer when `stop` is set, or when round t − 1, in `flight`, did not commit).

    Round t − 1 lands before the last inner step: a head then announces round t right after it,
    as in the synchronous schedule, so its stage peers' payloads of round t are never bound by its
    replica record alone for longer than without overlap (a head that died in between would leave
    them unprovable to a later replay once that record expired)."""
    cfg = session.cfg
    train, H = cfg.train, cfg.train.inner_steps
    losses: list[float] = []
    for h in range(H):
        if h == H - 1 and flight is not None and not flight.land():
            break
        batch = rank_batch_index(t, h, H, replica.ranks, 0)  # rank 0's; the others' follow it
        x, y = train_batch(data, shard, cfg.swarm.n_shards, batch, train.batch_size, train.seq_len)
        started = time.monotonic()
        losses.append(replica.inner_step(t, h, x, y))
        step_s = time.monotonic() - started  # the step alone: `peer bench utilisation` sums these
        session.metrics.log("step", t=t, h=h, loss=losses[-1], tokens=x.numel(), step_s=step_s)
        if stop.is_set():
            break
    return losses


def _round(
    session: Session,
    replica: Replica,
    t: int,
    losses: list[float],
    val: list[tuple[torch.Tensor, torch.Tensor]],
    shard: int,
) -> None:
    """The synchronous schedule: round t, validation, the record and the checkpoint, in order."""
    try:
        results = replica.round(t)
    except NetworkError as exc:  # the DHT unreachable past the deadline: repaired before the next step
        log.warning("round %d did not complete: %s", t, exc)
        return
    if any(r.behind for r in results.values()):
        return  # round t was committed without us: we re-synced instead (aligned before the next step)
    _record(session, replica, t, results, losses, replica.evaluate(t, val))
    session.checkpoints.after_round(replica.workers, {"shard": shard})  # data position: (shard, outer step)


def _launch(
    session: Session,
    replica: Replica,
    t: int,
    losses: list[float],
    val: list[tuple[torch.Tensor, torch.Tensor]],
    shard: int,
) -> InFlight:
    """Overlap: encode round t now, train ahead, and run the round in the background; validation
    (of the local model at the boundary) here meanwhile."""
    run = replica.launch(t)

    def on_commit(results: Mapping[int, RoundResult], val_loss: float | None) -> None:
        session.checkpoints.after_round(replica.workers, {"shard": shard})  # a copy: the next step trains
        _record(session, replica, t, results, losses, val_loss)

    flight = InFlight(t, list(replica.workers.values()), run, on_commit)
    try:
        flight.val.set_result(replica.evaluate(t, val))
    finally:
        if not flight.val.done():
            flight.val.set_result(None)
    return flight


def _land(flight: InFlight | None) -> None:
    """Wait for a round in flight (the loop ends or pauses); its outcome is logged by `land`."""
    if flight is not None:
        flight.land()


def _record(
    session: Session,
    replica: Replica,
    t: int,
    results: Mapping[int, RoundResult],
    losses: list[float],
    val_loss: float | None,
) -> None:
    train_loss, wall_s = sum(losses) / max(1, len(losses)), max(r.wall_s for r in results.values())
    session.records.committed(t, train_loss, val_loss, wall_s)  # published by the record's refresh below
    session.rounds.record(
        t,
        {s: (replica.workers[s], r.participants) for s, r in results.items()},
        train_loss,
        val_loss,
        wall_s,
        activations=replica.activations,
    )


def repair(
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
        session.rounds.catch_up(workers, stop, full=chain is not None)
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

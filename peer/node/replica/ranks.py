"""`torchrun --nproc-per-node N -m peer join --full-replica …`: one full replica trained by N processes.

Rank 0 is the replica in the swarm: it opens the session (DHT first, then the process group),
resumes, re-syncs, claims the shard, publishes the records (N ranks, the N × b global batch,
tokens/s of all ranks) and runs every round, exactly as a one-process full replica
(`peer.node.trainer.run_full_replica` with `_Lead`). The other ranks open no DHT and no server:
they take the verified config, the tokenizer, the prepared dataset's folder and the shard from
rank 0 (`peer.node.replica.group`, key "setup"), build the same stage workers and follow rank 0's
control messages (`follow`):
- "step t h": draw this rank's batch of the shard (`rank_batch_index`) and run the inner step
  under DDP (`peer.node.replica.data_parallel`); every rank takes the same averaged step;
- `state` set on a message: first adopt each stage's `state_dict()` from rank 0, sent whenever
  rank 0's committed state changed (a commit, a re-sync, `--resume`), so every rank holds the same bits;
- "stop": exit with rank 0's code (its last committed state adopted first).
Each rank logs the hash of its live parameters after the H inner steps of every outer step
(`replica_hash`; rank 0 in metrics.jsonl, rank r in `metrics-rank<r>.jsonl`) and a follower the
state it adopted (`replica_state`), so the ranks' lockstep is checkable.

With `--sharded` (`peer.node.replica.sharded`) every rank trains its shards of every stage (FSDP2)
instead of a DDP copy; rank 0's whole stages are the round's: "gather" (before each round) all-gathers
the live parameters and AdamW state into them, and a changed committed state is scattered back to the
shards (`state` on the next message). A follower holds no whole stage, so it logs no `replica_hash`;
its `replica_state` names the hashes rank 0 scattered. A sharded rank leaves with `exit_now`.

Failure: a rank that dies closes its sockets; the others' next collective raises `RankLost`:
rank 0 leaves the swarm (records withdrawn, server and DHT stopped) and exits 2, so
`torchrun --max-restarts R … --resume` starts the replica again from rank 0's checkpoint. torchrun
itself SIGTERMs the other ranks when one fails: rank 0 then leaves as on Ctrl-C, a follower stops
at its next control message (at most `replica_group.POLL_S`) and exits 0.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch

from peer.config import RunConfig
from peer.core.data.loader import Corpus, open_corpus, train_batch
from peer.core.data.shards import PreparedDataset
from peer.core.files import atomic_write_bytes
from peer.core.model.inner import MicroForward
from peer.core.model.state import state_hash
from peer.errors import ConfigError
from peer.node.fit import check_join
from peer.node.metrics import MetricsWriter
from peer.node.replica.data_parallel import DataParallel, chain_loss, chain_step, rank_batch_index
from peer.node.replica.group import Control, RankLost, ReplicaGroup, launched_ranks
from peer.node.replica.sharded import ShardedChain
from peer.node.round.result import RoundResult
from peer.node.session import Session, SessionOptions
from peer.node.stage.worker import StageWorker
from peer.node.trainer import _Full, run_full_replica, run_role

log = logging.getLogger(__name__)


def run_join(opts: SessionOptions, stage: int | None, stop: threading.Event) -> int:
    """`peer join`: under torchrun with several processes a full replica across them, else `run_role`."""
    ranks = launched_ranks()
    if opts.sharded and (ranks == 1 or stage is not None):
        raise ConfigError(
            "--sharded shards a full replica over torchrun's processes: torchrun --nproc-per-node N "
            "(N ≥ 2) -m peer join --full-replica --sharded …"
        )
    if opts.gather_per_step and not opts.sharded:
        raise ConfigError("--gather-per-step applies to a sharded replica: add --sharded")
    if ranks == 1:
        return run_role(opts, stage, stop)
    if stage is not None:
        raise ConfigError(f"--stage runs in one process; under torchrun ({ranks} processes) use --full-replica")
    group = ReplicaGroup.from_env()
    code = run_full_replica(opts, stop, make=_Lead(group, opts.sharded)) if group.lead else follow(opts, stop, group)
    if opts.sharded:
        exit_now(code)
    return code


def exit_now(code: int) -> NoReturn:
    """Exit with `code` at once, logs flushed: after FSDP2 on gloo, torch 2.13's interpreter exit
    sometimes aborts ("terminate called without an active exception", SIGABRT), which torchrun
    would take for a failed rank (and restart the replica)."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def live_hashes(chain: list[StageWorker]) -> dict[str, str]:
    """{stage: hash of its live parameters}: equal on two ranks iff bit-identical."""
    return {str(w.stage): state_hash(dict(w.module.named_parameters())) for w in chain}


def parallel_chain(chain: list[StageWorker], group: ReplicaGroup) -> DataParallel:
    """The chain under DDP (a collective: every rank builds it at the same point)."""
    device = chain[0].device
    ids = [device.index] if device.type == "cuda" and device.index is not None else None
    return DataParallel(chain, lambda x, y: chain_loss(chain, x, y), device_ids=ids)


class _Lead:
    """Rank 0's part in `run_full_replica`: set the followers up, then the `_Ranked` replica."""

    def __init__(self, group: ReplicaGroup, sharded: bool = False) -> None:
        self.group, self.sharded = group, sharded

    def device(self, device: str) -> str:
        return self.group.device(device)

    def __call__(
        self, session: Session, workers: dict[int, StageWorker], data: Corpus, shard: int, stop: threading.Event
    ) -> _Full:
        cfg, tokenizer = session.cfg, session.cfg.data.tokenizer
        if self.sharded and cfg.train.overlap:
            raise ConfigError("--sharded runs the round between two inner steps: a run with train.overlap 0")
        setup = {"cfg": cfg, "shard": shard, "device": session.opts.device, "dataset": str(data.dataset.root)}
        setup["tokenizer"] = Path(tokenizer).read_bytes() if tokenizer else None
        setup |= {"sharded": self.sharded, "precision": workers[0].precision}
        setup["per_step"] = session.opts.gather_per_step  # every rank gathers as rank 0 does
        self.group.post(setup, key="setup")
        self.group.open(session.opts.device)  # after the DHT (Session.open): hivemind has forked
        return (_Sharded if self.sharded else _Ranked)(session, workers, stop, self.group)


class _Ranked(_Full):
    """Rank 0 of a replica over several ranks: each inner step announced, then run under DDP."""

    def __init__(
        self, session: Session, workers: dict[int, StageWorker], stop: threading.Event, group: ReplicaGroup
    ) -> None:
        super().__init__(session, workers, stop)
        self.group, self.ranks = group, group.world
        self._shared: tuple[Any, ...] | None = None  # which state the followers hold
        self._failed = False
        self._build()

    def _build(self) -> None:
        self.parallel = parallel_chain(self.chain, self.group)

    def forward(self) -> MicroForward:
        return self.parallel.forward()

    def inner_step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        self._tell(Control("step", t, h))
        with self._collective():
            loss = super().inner_step(t, h, x, y)
        if h == self.session.cfg.train.inner_steps - 1:
            self._log_hashes(t)
        return loss

    def _log_hashes(self, t: int) -> None:
        self.session.metrics.log("replica_hash", t=t, rank=0, stages=live_hashes(self.chain))

    @contextlib.contextmanager
    def _collective(self) -> Iterator[None]:
        """RankLost when the collective inside raises: gloo/NCCL, a rank closed its sockets."""
        try:
            yield
        except RuntimeError as exc:
            self._failed = True
            raise RankLost(f"a rank of this replica is gone ({exc}); stopping the replica") from None

    def close(self) -> None:
        """Tell the followers to stop: with the last committed state, unless a rank is gone or
        torchrun is stopping every rank (SIGTERM): then the state would wait on ranks that left."""
        quick = self._failed or self.stop.is_set()
        self._tell(Control("stop", code=1 if self._failed else 0), share=not quick)

    def _tell(self, msg: Control, share: bool = True) -> None:
        """Post `msg`; first the stages' states when they changed since the followers got them."""
        held = tuple((w.outer_step, w.state_id(), w.loads) for w in self.chain)
        send = share and held != self._shared
        self.group.post(dataclasses.replace(msg, state=send))
        if send:
            try:
                self._share()
            except RankLost:
                self._failed = True
                raise
            self._shared = held

    def _share(self) -> None:
        self.group.share_states({w.stage: w.state_dict() for w in self.chain})


class _Sharded(_Ranked):
    """Rank 0 of a sharded replica (`peer.node.replica.sharded`): every rank trains its shards; the
    round gathers them into rank 0's whole stages first, a changed committed state is scattered back."""

    def _build(self) -> None:
        per_step = self.session.opts.gather_per_step
        self.sharded = ShardedChain(self.session.cfg, self.chain[0].device, self.chain[0].precision, per_step)

    def step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.sharded.step(t, h, x, y)

    def _log_hashes(self, t: int) -> None:
        """Logged by `round`, once the live parameters are gathered here."""

    def round(self, t: int) -> Mapping[int, RoundResult]:
        self._tell(Control("gather"), share=False)  # the followers' shards are the live state
        with self._collective():
            self.sharded.gather(self.chain)
        super()._log_hashes(t)
        return super().round(t)

    def close(self) -> None:
        """Tell the followers to stop (a follower holds no state worth adopting before it exits)."""
        self._tell(Control("stop", code=1 if self._failed else 0), share=False)

    def _share(self) -> None:
        with self._collective():
            self.sharded.scatter(self.chain)


def follow(opts: SessionOptions, stop: threading.Event, group: ReplicaGroup) -> int:
    """A rank > 0: train the replica rank 0 speaks for, step by step, until it says stop."""
    setup = group.receive(stop, key="setup")
    cfg = _local_config(setup, opts.data_dir, group.rank)
    group.open(setup["device"])
    device = group.device(setup["device"])
    local = dataclasses.replace(opts, device=str(device))
    sharded, per_step = bool(setup.get("sharded")), bool(setup.get("per_step"))
    local = dataclasses.replace(local, gather_per_step=per_step)
    check_join(cfg, None, local, group.world if sharded else 1, sharded)  # this rank's own device fits too
    data = open_corpus(PreparedDataset.open(setup["dataset"]), cfg.data.seed)  # rank 0's folder, its seed
    metrics = MetricsWriter(opts.data_dir, "full", name=f"metrics-rank{group.rank}.jsonl")
    precision = setup["precision"]  # rank 0's, resolved: every rank computes in the same dtype
    metrics.log("start", rank=group.rank, ranks=group.world, device=device, sharded=sharded, precision=precision)
    rank = (
        _ShardRank(cfg, device, precision, metrics, per_step)
        if sharded
        else _WholeRank(cfg, device, precision, group, metrics)
    )
    train, shard = cfg.train, int(setup["shard"])
    try:
        while True:
            msg: Control = group.receive(stop)
            try:
                if msg.state:
                    rank.adopt()
                if msg.kind == "stop":
                    metrics.log("exit", reason=f"rank 0 stopped (exit code {msg.code})")
                    return msg.code
                if msg.kind == "gather":
                    rank.gather()
                    continue
                batch = rank_batch_index(msg.t, msg.h, train.inner_steps, group.world, group.rank)
                x, y = train_batch(data, shard, cfg.swarm.n_shards, batch, train.batch_size, train.seq_len)
                loss = rank.step(msg.t, msg.h, x, y)
            except RuntimeError as exc:  # gloo/NCCL: a rank closed its sockets
                raise RankLost(f"rank {group.rank}: a rank of this replica is gone ({exc})") from None
            metrics.log("step", t=msg.t, h=msg.h, loss=loss, tokens=x.numel())
            if msg.h == train.inner_steps - 1:
                rank.log_hashes(msg.t, group.rank)
    except BaseException as exc:
        metrics.log("exit", reason="stopped" if stop.is_set() else f"error: {exc}")
        raise
    finally:
        metrics.close()


class _WholeRank:
    """A follower of a DDP replica: every stage whole, rank 0's committed states adopted."""

    def __init__(
        self, cfg: RunConfig, device: str, precision: str, group: ReplicaGroup, metrics: MetricsWriter
    ) -> None:
        self.chain = [
            StageWorker(cfg, s, compressed=False, device=device, precision=precision) for s in range(cfg.stages)
        ]
        self.parallel = parallel_chain(self.chain, group)
        self.group, self.metrics = group, metrics

    def adopt(self) -> None:
        _adopt(self.chain, self.group.share_states(None), self.metrics)

    def gather(self) -> None:
        raise RuntimeError("a DDP replica's rank 0 holds the live state: nothing to gather")

    def step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        return chain_step(self.chain, self.parallel.forward(), t, h, x, y)

    def log_hashes(self, t: int, rank: int) -> None:
        self.metrics.log("replica_hash", t=t, rank=rank, stages=live_hashes(self.chain))


class _ShardRank:
    """A follower of a sharded replica: its shards only (`ShardedChain`); rank 0 gathers and scatters."""

    def __init__(self, cfg: RunConfig, device: str, precision: str, metrics: MetricsWriter, per_step: bool) -> None:
        self.sharded = ShardedChain(cfg, device, precision, per_step)
        self.metrics = metrics

    def adopt(self) -> None:
        said = self.sharded.scatter(None)
        stages = {s: {"param_hash": h} for s, h in said["param_hashes"].items()}
        self.metrics.log("replica_state", outer_step=said["outer_step"], stages=stages, held=self.sharded.held_bytes())

    def gather(self) -> None:
        self.sharded.gather(None)

    def step(self, t: int, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        return self.sharded.step(t, h, x, y)

    def log_hashes(self, t: int, rank: int) -> None:
        """A shard has no whole-stage hash; rank 0 logs the gathered one (`_Sharded.round`)."""


def _adopt(chain: list[StageWorker], states: Mapping[int, Mapping[str, Any]], metrics: MetricsWriter) -> None:
    """Load rank 0's states; log what this rank now holds (θ_start and live parameter hashes)."""
    for w in chain:
        w.load_state_dict(states[w.stage])
    live = live_hashes(chain)
    stages = {str(w.stage): {"param_hash": w.param_hash(), "live_hash": live[str(w.stage)]} for w in chain}
    metrics.log("replica_state", outer_step=chain[0].outer_step, stages=stages)


def _local_config(setup: Mapping[str, Any], data_dir: Path, rank: int) -> RunConfig:
    """Rank 0's verified config with the tokenizer it sent written to this rank's own file."""
    cfg: RunConfig = setup["cfg"]
    if setup.get("tokenizer") is None:
        return cfg
    path = data_dir / f"tokenizer-rank{rank}.model"
    atomic_write_bytes(path, setup["tokenizer"])
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=path))

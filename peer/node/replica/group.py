"""The ranks of one full replica spread over processes (`torchrun … -m peer join --full-replica`).

Rank 0 speaks for the replica in the swarm; the other ranks ("followers") only train. They talk
over two channels, both set up by torchrun:
- the control channel is torchrun's key-value store (`TCPStore`): rank 0 posts numbered
  `Control` messages ("step t h", "stop"), a follower polls for the next one in short waits, so it
  notices SIGTERM within `POLL_S` however long rank 0 spends in the swarm (a round, a re-sync, a
  DHT outage) — no collective has to outlast the swarm's deadlines;
- the process group (gloo on CPU, NCCL on CUDA) carries the data-parallel gradients and, after
  every change of the committed state, each stage's `state_dict()` from rank 0, so every rank
  holds the same bits. Collectives only start once every rank has read the control message that
  announces them, so their timeout (`COLLECTIVE_TIMEOUT_S`) bounds one inner step or one state
  transfer, never a swarm wait. A rank that dies closes its sockets: the others' collective raises
  at once (`RankLost`) instead of waiting for the timeout.

Keys live under `peer/<restart count>/`, so a replica that torchrun restarts (`--max-restarts`)
never reads its previous attempt's messages. Invariant: rank 0 posts message k+1 only after every
rank read message k (the step between them ends in an all-reduce, or the message was the last).
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

from peer.errors import PeerError

log = logging.getLogger(__name__)

POLL_MIN_S = 0.0005  # a follower's first pause between two looks for the next control message
POLL_S = 0.1  # its longest pause (a round of rank 0's): also how soon it notices `stop` (SIGTERM)
COLLECTIVE_TIMEOUT_S = 600.0  # one inner step's all-reduce or one state transfer, on the slowest rank
STORE_TIMEOUT_S = 60.0  # connecting to torchrun's store


class RankLost(PeerError):
    """Another rank of this replica is gone (its collective raised): the replica stops."""


@dataclass(frozen=True)
class Control:
    """What rank 0 tells the followers next: "step" (run inner step h of outer step t) or "stop"
    (exit with `code`); `state`: the stages' states follow on the process group first."""

    kind: str
    t: int = 0
    h: int = 0
    state: bool = False
    code: int = 0


def launched_ranks(environ: Mapping[str, str] = os.environ) -> int:
    """How many ranks torchrun started for this replica (1: not under torchrun, or one rank)."""
    try:
        return max(1, int(environ.get("WORLD_SIZE", "1")))
    except ValueError:
        return 1


class ReplicaGroup:
    """This process's rank in the replica: the control channel and the process group."""

    def __init__(self, rank: int, world: int, local_rank: int, connect: Callable[[], dist.Store]) -> None:
        """`connect`: opens the control channel's store (`connect()`; rank 0 only after its DHT forked)."""
        self.rank, self.world, self.local_rank = rank, world, local_rank
        self._connect = connect
        self._store: dist.Store | None = None
        self._sent = 0  # rank 0: messages posted
        self._read = 0  # followers: messages read
        self.backend = ""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> ReplicaGroup:
        """This rank, as torchrun set it; the store is torchrun's agent's (`TORCHELASTIC_USE_AGENT_STORE`),
        else rank 0 hosts it."""
        try:
            rank, world = int(environ["RANK"]), int(environ["WORLD_SIZE"])
            local_rank = int(environ.get("LOCAL_RANK", rank))
            host, port = environ["MASTER_ADDR"], int(environ["MASTER_PORT"])
        except (KeyError, ValueError) as exc:
            raise PeerError(f"not started by torchrun (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT): {exc}") from None
        hosted_by_agent = environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        attempt = environ.get("TORCHELASTIC_RESTART_COUNT", "0")

        def connect() -> dist.Store:
            store = dist.TCPStore(
                host,
                port,
                world,
                is_master=rank == 0 and not hosted_by_agent,
                timeout=timedelta(seconds=STORE_TIMEOUT_S),
                wait_for_workers=False,
            )
            return dist.PrefixStore(f"peer/{attempt}/", store)

        return cls(rank, world, local_rank, connect)

    @property
    def store(self) -> dist.Store:
        """The control channel, connected on first use (a socket a later fork would inherit)."""
        if self._store is None:
            self._store = self._connect()
        return self._store

    @property
    def lead(self) -> bool:
        return self.rank == 0

    # ------------------------------------------------------------------ the process group
    def open(self, device: str) -> None:
        """Create the process group: NCCL on CUDA (one GPU per local rank), gloo otherwise."""
        if device.startswith("cuda"):
            torch.cuda.set_device(self.local_rank)
            self.backend = "nccl"
        else:
            self.backend = "gloo"
        dist.init_process_group(
            self.backend,
            store=dist.PrefixStore("pg/", self.store),
            rank=self.rank,
            world_size=self.world,
            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
        log.info("rank %d of %d: process group up (%s)", self.rank, self.world, self.backend)

    def device(self, device: str) -> str:
        """The device this rank trains on: its own GPU under CUDA."""
        return f"cuda:{self.local_rank}" if device.startswith("cuda") else device

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # ------------------------------------------------------------------ the control channel
    def post(self, msg: Control | Mapping[str, Any], key: str | None = None) -> None:
        """Rank 0: the next control message (or, with `key`, a value under that name)."""
        raw = cast(str, pickle.dumps(msg))  # the store takes bytes (its stub says str)
        if key is not None:
            self.store.set(key, raw)
            return
        self.store.set(f"ctl/{self._sent}", raw)
        if self._sent >= 2:  # read by every rank (module invariant): keep the store small
            self.store.delete_key(f"ctl/{self._sent - 2}")
        self._sent += 1

    def receive(self, stop: threading.Event, key: str | None = None) -> Any:
        """A follower: the next control message (or the value under `key`), waiting in `POLL_S` slices;
        PeerError when `stop` is set meanwhile (SIGTERM), RankLost when the store is gone."""
        name = key if key is not None else f"ctl/{self._read}"
        pause = POLL_MIN_S
        while True:
            if stop.is_set():
                raise PeerError("stopped while waiting for rank 0")
            try:
                if self.store.check([name]):  # no blocking wait: it would log every timeout
                    break
            except RuntimeError as exc:  # DistError: the store is gone with torchrun's agent
                raise RankLost(f"rank {self.rank}: torchrun's store is gone: {exc}") from None
            stop.wait(pause)
            pause = min(POLL_S, 2 * pause)  # right after rank 0's previous message: the next is near
        value = pickle.loads(self.store.get(name))
        if key is None:
            self._read += 1
        return value

    # ------------------------------------------------------------------ the stages' states
    def share_states(self, states: Mapping[int, Mapping[str, Any]] | None) -> dict[int, dict[str, Any]]:
        """Rank 0 sends {stage: state_dict()} (on the CPU, bit for bit); a follower returns it (rank 0: {})."""
        payload: list[Any] = [None]
        if self.lead:
            buf = io.BytesIO()
            torch.save({s: _to_cpu(st) for s, st in (states or {}).items()}, buf)
            payload = [buf.getvalue()]
        try:
            dist.broadcast_object_list(payload, src=0)
        except RuntimeError as exc:
            raise RankLost(f"rank {self.rank}: a rank left during the state transfer: {exc}") from None
        if self.lead:
            return {}
        out: dict[int, dict[str, Any]] = torch.load(io.BytesIO(payload[0]), map_location="cpu", weights_only=True)
        return out


def _to_cpu(obj: Any) -> Any:
    """A copy of nested dicts/lists of tensors with every tensor on the CPU (what any rank can load)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, Mapping):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj

"""Where and how `peer simulate` runs: worker processes, device, checkpoint (`session`).

The loops (`peer.research.simulate.loops`) ask `current()` for the pool of worker processes
(`peer.research.simulate.pool`; None: the replicas run in this process), the device the replicas train on,
and the sweep's checkpoint (`peer.research.simulate.checkpoint`; None: nothing is written). Outside a
`session` it is today's in-process run on the CPU without checkpoints, so library callers and
tests see no change.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from peer.errors import ConfigError
from peer.research.simulate.checkpoint import SweepCheckpoint
from peer.research.simulate.pool import ReplicaPool, check_workers
from peer.research.simulate.replica import LocalReplica

DEVICES = ("cpu", "cuda")


@dataclass
class Runtime:
    workers: int = 1  # 1: in this process
    device: str = "cpu"
    checkpoint: SweepCheckpoint | None = None
    fused_commit: bool = True  # False: decode every payload densely first (the old path; `bench_simulate`)
    _pool: ReplicaPool | None = field(default=None, repr=False)
    threads: int = 0  # this process's torch threads outside the session (0: unchanged)

    @contextmanager
    def all_threads(self) -> Iterator[None]:
        """Inside: this process computes on the threads it had before the session gave the cores to workers."""
        inside = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(inside)

    def pool(self, replicas: int) -> ReplicaPool | None:
        """The worker pool (started on first use, kept for the session), or None for in-process."""
        if min(self.workers, replicas) <= 1:
            return None
        if self._pool is None:
            self._pool = ReplicaPool(self.workers)
        return self._pool

    def place(self, rep: LocalReplica) -> LocalReplica:
        """Move a freshly built replica (no optimizer state yet) to the session's device."""
        if self.device != "cpu":
            for stage in rep.stages:
                stage.to(self.device)
            if rep.U is not None:
                rep.U = rep.U.to(self.device)
        return rep

    def restore(self, key: str) -> Any | None:
        """The stored loop state of an interrupted run `key` (None: none, or no checkpoint)."""
        record = self.checkpoint.load(key) if self.checkpoint is not None else None
        return record["state"] if record is not None and not record["done"] else None

    def finished(self, key: str) -> Any | None:
        """The stored result of a finished run `key` (None: not finished, or no checkpoint)."""
        record = self.checkpoint.load(key) if self.checkpoint is not None else None
        return record["state"] if record is not None and record["done"] else None

    def save(self, key: str, state: Any, done: bool = False) -> None:
        if self.checkpoint is not None:
            self.checkpoint.save(key, state, done)

    def batches(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self.device == "cpu":
            return batches
        return [(x.to(self.device), y.to(self.device)) for x, y in batches]


_stack: list[Runtime] = [Runtime()]


def current() -> Runtime:
    return _stack[-1]


def check_device(device: str, workers: int | None) -> None:
    """ConfigError naming the flag: an unknown device, CUDA without a visible GPU, CUDA with workers."""
    if device not in DEVICES:
        raise ConfigError(f"--device: choose one of {', '.join(DEVICES)}, got {device!r}")
    if device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if device == "cuda" and workers is not None and workers > 1:
        raise ConfigError(
            "--workers > 1 with --device cuda: the replicas share the GPU in one process; use --workers 1"
        )


@contextmanager
def worker_threads() -> Iterator[None]:
    """Inside: this process's torch threads are a worker's, one (`pool._serve`), so in-process inner
    steps round as the workers' do: more threads split some kernels otherwise (measured: a 2-thread
    in-process sweep and a 2-worker one differ in the last bits of the second loss on this 2-core CPU),
    and `--workers N` gives the same bits for every N."""
    inside = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(inside)


@contextmanager
def session(
    workers: int = 1, device: str = "cpu", checkpoint: SweepCheckpoint | None = None, fused_commit: bool = True
) -> Iterator[Runtime]:
    """Run the loops inside with these settings; the worker pool is closed on any exit."""
    check_workers(workers)
    check_device(device, workers)
    threads = torch.get_num_threads()
    rt = Runtime(workers, device, checkpoint, fused_commit, threads=threads)
    _stack.append(rt)
    if workers > 1:  # the workers take the cores: this process scores beside them on one thread
        torch.set_num_threads(1)
    failed = True
    try:
        yield rt
        failed = False
    finally:
        _stack.pop()
        torch.set_num_threads(threads)
        if rt._pool is not None:
            rt._pool.close(force=failed)

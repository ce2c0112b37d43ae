"""Parallel replicas of `peer simulate`: spawned worker processes that run the inner steps.

Each worker (spawned, never forked: the parent's torch threads may already run) sets torch to one
thread, opens the run's corpus itself (the prepared folder and its seed: `Corpus` reads memory
maps, so nothing large crosses) and serves one request, `inner`: whole `LocalReplica`s (pickled as
they are, so every field — optimizer state, buffers, whatever the class gains — rides along) run
their H inner steps of one outer step, in order, and come back with each step's `StepStats`.
Data-parallel AdamW stays in the coordinator (`peer.research.simulate.loops.run_adamw`).

Messages are pickled by `dumps`: storages as raw bytes (faster than torch's own), and a tensor's
`.grad` kept (torch's pickling drops it), so a replica's accumulated gradients travel too. Read
back, every storage is torch's own 64-byte aligned allocation, as a fresh one is (`_untyped`): the
same layout, so the same kernels' code paths and bits (the sweep checkpoint reads through it too).

Replica m goes to worker m mod N. A replica's inner steps read only itself and its batches, so the
results are bit-identical to the in-process path (tests compare every curve value and byte count).
The pool is closed on any exit: a worker that does not stop when asked is terminated, so no
process outlives the sweep (KeyboardInterrupt included: workers ignore SIGINT, the parent ends them).
"""

from __future__ import annotations

import contextlib
import io
import multiprocessing as mp
import os
import pickle
import signal
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy
import torch

from peer.core.data.loader import Corpus, train_batch
from peer.core.data.shards import PreparedDataset
from peer.errors import ConfigError
from peer.research.simulate.replica import LocalReplica, StepStats

CorpusKey = tuple[str, int]  # (prepared folder, seed): how a worker opens the run's corpus


def default_workers(replicas: int) -> int:
    """All cores, at most one per replica."""
    return max(1, min(os.cpu_count() or 1, replicas))


def check_workers(workers: int | None) -> None:
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers must be >= 1 (1: the replicas run in this process), got {workers}")


def corpus_key(data: Corpus) -> CorpusKey:
    return str(data.dataset.root), data.seed


def batch(data: Corpus, m: int, replicas: int, step: int, rep: LocalReplica) -> tuple[torch.Tensor, torch.Tensor]:
    """Replica m's batch of global `step`, on the device of the replica's weights."""
    train = rep.cfg.train
    x, y = train_batch(data, m, replicas, step, train.batch_size, train.seq_len)
    device = next(rep.stages[0].parameters()).device
    return (x, y) if device.type == "cpu" else (x.to(device), y.to(device))


def inner_steps(
    data: Corpus, rep: LocalReplica, m: int, replicas: int, first: int, count: int
) -> tuple[LocalReplica, list[StepStats]]:
    """Replica m's inner steps first … first + count − 1 (global step numbers)."""
    stats = [rep.inner_step(*batch(data, m, replicas, step, rep), step) for step in range(first, first + count)]
    return rep, stats


def _untyped(raw: bytes) -> torch.UntypedStorage:
    """A CPU storage from its bytes (`dumps`), allocated by torch as a fresh tensor's is.

    The layout of a tensor read back must be the layout it had, or kernels may round differently:
    torch's allocator aligns every storage to 64 bytes, a Python buffer only to 16 (where in 64
    depends on the heap's history), and MKL's GEMM on Intel CPUs picks its code path by the operands'
    alignment. A resumed sweep whose weights came from a `bytearray` could train to other bits than
    the uninterrupted one (issue 34); copied into torch's own allocation, every tensor read back sits
    where a freshly computed one would (the same offset within 64 bytes: its storage offset)."""
    data = torch.empty(len(raw), dtype=torch.uint8)  # torch's allocator: 64-byte aligned
    if raw:
        data.numpy()[:] = numpy.frombuffer(raw, dtype=numpy.uint8)
    return data.untyped_storage()


def _typed(data: torch.UntypedStorage, dtype: torch.dtype) -> torch.TypedStorage:
    """The typed view torch's tensor pickling asks for, over one storage read back once (`dumps`)."""
    return torch.TypedStorage(wrap_storage=data, dtype=dtype, _internal=True)


def _with_grad(data: torch.Tensor, grad: torch.Tensor, requires_grad: bool, parameter: bool) -> torch.Tensor:
    """A tensor (or Parameter) with its `.grad` (`dumps`)."""
    out = torch.nn.Parameter(data, requires_grad) if parameter else data.requires_grad_(requires_grad)
    out.grad = grad
    return out


class _Pickler(pickle.Pickler):
    """pickle, with CPU storages as their raw bytes (torch pickles each through `torch.save`: slower),
    read back once per storage however many tensors view it, and a tensor's `.grad` kept (torch
    drops it: a replica's accumulated gradients ride along)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.is_leaf and obj.grad is not None:
            parameter = isinstance(obj, torch.nn.Parameter)
            return _with_grad, (obj.detach(), obj.grad, obj.requires_grad, parameter)
        if type(obj) is torch.TypedStorage and obj._untyped_storage.device.type == "cpu":
            # torch wraps a tensor's storage anew for every tensor; the untyped storage underneath is
            # one object per storage, so pickle's memo keeps tensors that share one sharing it
            return _typed, (obj._untyped_storage, obj.dtype)
        if type(obj) is torch.UntypedStorage and obj.device.type == "cpu":
            raw = torch.empty(0, dtype=torch.uint8).set_(obj).numpy().tobytes() if obj.nbytes() else b""
            return _untyped, (raw,)
        return NotImplemented


def dumps(obj: Any) -> bytes:
    """`pickle.dumps` (protocol 5), faster for tensors; `pickle.loads` reads it back, the same values."""
    out = io.BytesIO()
    _Pickler(out, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return out.getvalue()


_OPS: dict[str, Callable[..., Any]] = {"inner": inner_steps}


def _serve(conn: Connection) -> None:
    """A worker's loop: (op, corpus key, jobs) in, ("ok", results) or ("err", exception) out."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends the pool
    torch.set_num_threads(1)
    corpora: dict[CorpusKey, Corpus] = {}
    while True:
        try:
            op, key, args = pickle.loads(conn.recv_bytes())
        except EOFError:  # the parent is gone
            return
        if op == "stop":
            return
        try:
            if key not in corpora:
                corpora[key] = Corpus(PreparedDataset.open(Path(key[0])), None, key[1])
            reply: tuple[str, Any] = ("ok", [_OPS[op](corpora[key], *job) for job in args])
        except Exception as exc:  # noqa: BLE001  # sent to the parent, which raises it
            reply = ("err", _picklable(exc))
        conn.send_bytes(dumps(reply))


def _picklable(exc: Exception) -> Exception:
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"simulator worker failed:\n{''.join(traceback.format_exception(exc))}")


@dataclass(frozen=True)
class Pending:
    """Jobs sent to the workers (`ReplicaPool.submit`), not yet collected."""

    n_jobs: int
    shares: list[list[int]]  # per worker: its jobs' positions


class ReplicaPool:
    """N spawned workers; `map` sends one request per worker slot and gathers the replies in order."""

    def __init__(self, workers: int) -> None:
        ctx = mp.get_context("spawn")
        self.conns: list[Connection] = []
        self.procs: list[Any] = []
        try:
            for i in range(workers):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_serve, args=(child,), name=f"peer-sim-{i}", daemon=True)
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
        except BaseException:
            self.close(force=True)
            raise

    @property
    def size(self) -> int:
        return len(self.procs)

    def map(self, op: str, key: CorpusKey, jobs: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run jobs[j] on worker j mod N (each worker's share in one message, run in order); the
        results in job order. A worker's failure is raised here once every worker has replied."""
        return self.collect(self.submit(op, key, jobs))

    def submit(self, op: str, key: CorpusKey, jobs: Sequence[tuple[Any, ...]]) -> Pending:
        """Send the jobs (pickled now: later changes to their objects do not travel); `collect` waits."""
        shares = [list(range(w, len(jobs), self.size)) for w in range(self.size)]
        for w, share in enumerate(shares):
            if share:
                message = (op, key, [jobs[j] for j in share])
                self.conns[w].send_bytes(dumps(message))
        return Pending(len(jobs), shares)

    def collect(self, pending: Pending) -> list[Any]:
        """The results of `submit`'s jobs, in job order (the first failure raised after every reply)."""
        results: list[Any] = [None] * pending.n_jobs
        failure: BaseException | None = None
        for w, share in enumerate(pending.shares):
            if not share:
                continue
            status, value = self._receive(w)
            if status != "ok":
                failure = failure or value
                continue
            for j, out in zip(share, value, strict=True):
                results[j] = out
        if failure is not None:
            raise failure
        return results

    def _receive(self, w: int) -> tuple[str, Any]:
        try:
            reply: tuple[str, Any] = pickle.loads(self.conns[w].recv_bytes())
        except (EOFError, OSError):
            self.procs[w].join(timeout=5)
            return "err", RuntimeError(f"simulator worker {w} exited (exit code {self.procs[w].exitcode})")
        return reply

    def close(self, force: bool = False) -> None:
        """Stop every worker (asked, then terminated after a grace period or at once with `force`)."""
        for conn in self.conns:
            if not force:
                with contextlib.suppress(OSError):
                    conn.send_bytes(pickle.dumps(("stop", None, ())))
        for proc in self.procs:
            proc.join(timeout=0 if force else 5)
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []

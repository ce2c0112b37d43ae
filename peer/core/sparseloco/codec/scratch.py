"""Reused float32 buffers: dense decode targets and accumulators that skip the OS's fresh pages.

A fresh dense tensor of a model's size costs a page fault per 4 KiB page the first time it is
written (the kernel zeroes and maps each page), and for a sparse decode or an accumulator that
is most of the work and most of its spread; a buffer that was written before costs one memset.
`BufferPool.lend` hands out such buffers by shape and takes them back when its block ends.

Ownership (the one rule that keeps reuse safe): a lent buffer belongs to the block that borrowed
it, from `with pool.lend(...) as bufs:` to the block's end. Nothing computed into it may be kept
past the block (copy what must outlive it); two blocks open at once, on any threads, never share a
buffer. A lent buffer holds whatever its last borrower left: the borrower writes every entry or
zeroes it first. The pool keeps what it lent (at most the largest number of blocks open at once
per shape) until `clear`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["ACCUMULATORS", "BufferPool"]


class BufferPool:
    """Contiguous CPU float32 tensors by shape, lent to one block at a time (module docstring)."""

    def __init__(self) -> None:
        self._free: dict[tuple[int, ...], list[Tensor]] = {}
        self._lock = threading.Lock()

    @contextmanager
    def lend(self, shapes: Mapping[str, tuple[int, ...]]) -> Iterator[dict[str, Tensor]]:
        """{name: a buffer of that shape} for the duration of the block; contents are undefined."""
        bufs = {name: self._take(tuple(shape)) for name, shape in shapes.items()}
        try:
            yield bufs
        finally:
            with self._lock:
                for buf in bufs.values():
                    self._free.setdefault(tuple(buf.shape), []).append(buf)

    def _take(self, shape: tuple[int, ...]) -> Tensor:
        with self._lock:
            free = self._free.get(shape)
            if free:
                return free.pop()
        return torch.empty(shape, dtype=torch.float32)

    def held_bytes(self) -> int:
        """Bytes of the buffers waiting to be lent again."""
        with self._lock:
            return sum(4 * b.numel() for bufs in self._free.values() for b in bufs)

    def clear(self) -> None:
        """Forget every buffer not lent now (they are freed when no block holds them)."""
        with self._lock:
            self._free.clear()


ACCUMULATORS = BufferPool()  # the commit's Σ Δ̂ per tensor (`peer.core.sparseloco.commit`): one set per open commit

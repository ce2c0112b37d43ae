"""The commit's memory: reused float32 buffers that skip the OS's fresh pages, and recycled pages for the new state.

A fresh dense tensor of a model's size costs a page fault per 4 KiB page the first time it is
written (the kernel zeroes and maps each page), and for a sparse decode or an accumulator that
is most of the work and most of its spread; a buffer that was written before costs one memset.
`BufferPool.lend` hands out such buffers by shape and takes them back when its block ends.

What must outlive the commit (the new state's tensors) cannot be lent: `FreshPages` (`fresh`) maps
it, and takes a region back for the next array of its size once nothing views it any more (a state
a holder dropped: the one the next commit replaces). Faults serialise on the process's memory map,
so writing a 380 MB state to new pages kept the commit's second core waiting: on a 2-core VM a 178M
stage-0 commit at M 8 ran 1.56x faster on 2 cores than on 1 with fresh pages, 1.86x with recycled
ones (`peer bench commit --threads 1,2`, docs/results.md). New regions are plain pages: advising
them onto transparent huge pages (`madvise(MADV_HUGEPAGE)`) made no difference once regions were
recycled and made a process's first commit slower on the VM measured (docs/results.md). The bytes are
the same either way; only where the pages come from differs.

Ownership (the one rule that keeps reuse safe): a lent buffer belongs to the block that borrowed
it, from `with pool.lend(...) as bufs:` to the block's end. Nothing computed into it may be kept
past the block (copy what must outlive it); two blocks open at once, on any threads, never share a
buffer. A lent buffer holds whatever its last borrower left: the borrower writes every entry or
zeroes it first. The pool keeps what it lent (at most the largest number of blocks open at once
per shape) until `clear`.
"""

from __future__ import annotations

import mmap
import os
import threading
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np
import torch
from torch import Tensor

__all__ = ["ACCUMULATORS", "FRESH", "FRESH_MIN_BYTES", "BufferPool", "FreshPages", "fresh"]

FRESH_MIN_BYTES = 8 << 20  # arrays from this size up come from `FRESH`'s regions (smaller: malloc's)


class FreshPages:
    """Large flat arrays that outlive any block, on pages that were written before (module docstring).

    `array` hands out a view of a mapped region (new ones advised onto huge pages); when the last
    array or tensor that views it is gone, the region waits here for the next `array` of its size
    instead of going back to the OS. So it holds at most as many regions of a size as were ever in
    use at once (a commit's new state, while the state it replaces is still held), until `clear`."""

    def __init__(self, min_bytes: int = FRESH_MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self._free: dict[int, list[mmap.mmap]] = {}
        # re-entrant: a region comes back from a finalizer, which the garbage collector may run on a
        # thread that holds the lock already (any allocation under it can start a collection)
        self._lock = threading.RLock()
        forked = weakref.WeakMethod(self._forked)  # the hook must not keep a pool alive
        os.register_at_fork(after_in_child=lambda: (hook := forked()) is not None and hook())

    def _forked(self) -> None:  # a forked child has no other threads: its copy of the lock starts free
        self._lock = threading.RLock()

    def array(self, n: int, dtype: np.dtype | type = np.float32) -> np.ndarray:
        """An uninitialised flat array of n elements (`np.empty` below `min_bytes`)."""
        dt = np.dtype(dtype)
        nbytes = n * dt.itemsize
        if nbytes < self.min_bytes:
            return np.empty(n, dtype=dt)
        with self._lock:
            free = self._free.get(nbytes)
            region = free.pop() if free else None
        if region is None:
            region = _mapped(nbytes)
        out = np.frombuffer(region, dtype=dt, count=n)
        done = weakref.finalize(out, self._give_back, nbytes, region)  # the region outlives its last view
        done.atexit = False  # nothing to give back at exit
        return out

    def _give_back(self, nbytes: int, region: mmap.mmap) -> None:
        with self._lock:
            self._free.setdefault(nbytes, []).append(region)

    def held_bytes(self) -> int:
        """Bytes of the regions waiting to be handed out again."""
        with self._lock:
            held = [(size, len(regions)) for size, regions in list(self._free.items())]
        return sum(size * n for size, n in held)

    def clear(self) -> None:
        """Give every region not in use back to the OS."""
        with self._lock:
            self._free = {}


def _mapped(nbytes: int) -> mmap.mmap:
    """A fresh anonymous private mapping of nbytes (plain pages: module docstring)."""
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


FRESH = FreshPages()  # the commit's new state (`peer.core.sparseloco.elementwise`, `portable.split64`)


def fresh(n: int, dtype: np.dtype | type = np.float32) -> np.ndarray:
    """`FRESH.array(n, dtype)`: an uninitialised flat array that may outlive the commit."""
    return FRESH.array(n, dtype)


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

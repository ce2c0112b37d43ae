"""The 1F1B epoch gate of one stage: which micro-batch may run now (no networking, no tensors).

Several forwards and backwards of one inner step may be in progress at once, but the gradients of
micro-batch i are accumulated only after those of i − 1 (a backward waits for its turn, releasing
the stage's lock), so the sum is the sequential schedule's bit for bit whatever the network does.
A forward of micro-batch i waits until at most `window − stage` micro-batches are stashed (1F1B).

The epoch (outer step, inner step, attempt) orders replays: a higher one drops the step's
gradients and wakes every waiter of the old one (which fails), a lower one is stale and refused.
The next inner step's micro-batches wait for the step of a complete one (the head does not wait
for its answer); one that does not come within the timeout is dropped with its gradients.

Invariants: every method runs under the stage's lock (the gate's Condition is built on it); a
reset of the step's gradients bumps `generation`, so a waiter of an older one gives up.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from peer.errors import PeerError

Epoch = tuple[int, int, int]  # (outer step, inner step, attempt)


class StaleMicrobatch(PeerError):
    """A micro-batch of an older (outer step, inner step, attempt) than the stage runs (`epoch`):
    refused, never run (the service answers it as a typed STALE refusal)."""

    def __init__(self, stage: int, epoch: Epoch, message: str) -> None:
        super().__init__(message)
        self.stage, self.epoch = stage, epoch


class EpochGate:
    """Admission of one stage's micro-batches, in epoch and micro-batch order."""

    def __init__(
        self, lock: threading.RLock, stage: int, microbatches: int, timeout_s: float, reset_step: Callable[[], None]
    ) -> None:
        """reset_step: forget the step's gradients (it calls `reset` back); timeout_s bounds every wait."""
        self.stage, self.microbatches, self.timeout_s = stage, microbatches, timeout_s
        self._turn = threading.Condition(lock)  # micro-batch order of gradient accumulation
        self._reset_step = reset_step
        self.epoch: Epoch | None = None  # the epoch in progress
        self.applied = 0  # micro-batches whose gradients are accumulated (in order) in this epoch
        self.generation = 0  # bumped by every reset: waiters of an older one give up

    def admit(self, mb: int, full: Epoch, window: int, turn: bool) -> None:
        """Enter epoch `full` and wait (lock released) until micro-batch `mb` may run here.

        turn: its gradients are next in micro-batch order; window: fewer than window − stage
        micro-batches are stashed. StaleMicrobatch when the epoch is stale; ValueError when a
        replay superseded the wait or the timeout passed."""
        if self._unstepped(full) and not self._turn.wait_for(  # only a later epoch waits, so check stale after
            lambda: not self._unstepped(full), timeout=self.timeout_s
        ):
            self._reset_step()  # the step is lost (as with a replaced peer); a replay starts clean
            raise ValueError(f"stage {self.stage}: inner step {full[1] - 1} was never stepped before {full}")
        if self.epoch is not None and full < self.epoch:
            raise StaleMicrobatch(
                self.stage, self.epoch, f"micro-batch {mb} of {full} is stale: stage {self.stage} runs {self.epoch}"
            )
        if self.epoch is None or full > self.epoch:
            self._reset_step()
            self.epoch = full
        generation = self.generation
        limit = max(1, window - self.stage)

        def ready() -> bool:
            if generation != self.generation:
                return True
            return (not turn or self.applied == mb) and (window <= 0 or mb - self.applied < limit)

        if not self._turn.wait_for(ready, timeout=self.timeout_s):
            raise ValueError(f"stage {self.stage}: micro-batch {mb} waited too long for micro-batch {self.applied}")
        if generation != self.generation:
            raise ValueError(f"stage {self.stage}: micro-batch {mb} was superseded by a replay")

    def _unstepped(self, full: Epoch) -> bool:
        """The inner step before `full` is complete but its `step` (sent unwaited) has not arrived."""
        cur = self.epoch
        return cur is not None and cur[:2] == (full[0], full[1] - 1) and self.applied >= self.microbatches

    def accumulated(self) -> None:
        """One more micro-batch's gradients are in: wake the next one."""
        self.applied += 1
        self._turn.notify_all()

    def reset(self) -> None:
        """The step's gradients are gone: count from micro-batch 0 again and wake every waiter."""
        self.applied = 0
        self.generation += 1
        self._turn.notify_all()

    def forget(self) -> None:
        """A loaded state (its outer step may have gone back): no epoch of it is stale."""
        self.epoch = None

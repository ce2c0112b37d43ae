"""One round in flight while the next outer step trains (`train.overlap` 1).

docs/protocol.md, "Overlapped outer steps".

The trainer encodes its payloads of round t at the end of outer step t's inner steps, marks its
stages as trained ahead (`StageState.begin_overlap`) and hands the round to an `InFlight`: a thread
that gathers and commits round t (the same `Rounds` entry points as the synchronous schedule),
runs what follows a committed round while the stages are still ahead (`on_commit`: the checkpoint,
which copies the state between two optimizer steps, and the round's record), and ends the overlap
of every stage (`end_overlap`: kept when the stage committed round t, dropped otherwise). The
trainer lands it (`land`) before it encodes round t + 1, so never more than one round is in flight.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future

from peer.errors import NetworkError
from peer.node.round.result import RoundResult
from peer.node.stage.worker import StageWorker

log = logging.getLogger(__name__)

Results = Mapping[int, RoundResult]


class InFlight:
    """Round `t` of `workers` gathered and committed by a thread of its own."""

    def __init__(
        self,
        t: int,
        workers: Sequence[StageWorker],
        run: Callable[[], Results],
        on_commit: Callable[[Results, float | None], None] = lambda results, val: None,
    ) -> None:
        """`run`: the round (its payloads encoded already); `on_commit(results, val)`: after a round
        every stage committed, before the overlap ends; `val` is what the trainer sets in `val`."""
        self.t, self.workers, self._run, self._on_commit = t, list(workers), run, on_commit
        self.val: Future[float | None] = Future()  # the validation loss the trainer measures meanwhile
        self.error: BaseException | None = None
        self.committed = False
        self._landed: bool | None = None
        self._thread = threading.Thread(target=self._main, name=f"round-{t}", daemon=True)
        self._thread.start()

    def _main(self) -> None:
        try:
            results = self._run()
            committed = not any(r.behind for r in results.values())
            committed = committed and all(w.outer_step == self.t + 1 for w in self.workers)
            if committed:
                self._on_commit(results, self.val.result())
            self.committed = committed
        except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread by `land`
            self.error = exc
        finally:
            kept = [w.end_overlap() for w in self.workers]
            self.committed = self.committed and all(kept)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def land(self) -> bool:
        """Wait for the round; True when every stage committed it (their progress since the boundary
        rebased onto it), False when it did not (that progress dropped; the trainer repairs).
        A NetworkError of the round is logged here; any other error is raised here. Landing again
        answers the same."""
        if self._landed is not None:
            return self._landed
        if not self.val.done():
            self.val.set_result(None)
        self._thread.join()
        self._landed = False
        if isinstance(self.error, NetworkError):
            log.warning("round %d did not complete: %s", self.t, self.error)
            return False
        if self.error is not None:
            raise self.error
        self._landed = self.committed
        return self.committed

"""How long this process stood still: a watch thread that ticks and remembers the late ticks.

A SIGSTOP, a suspended VM or a long swap stops every thread of the process, the one that refreshes
its DHT records too. Others then see a holder whose records lapsed, give its payload up and may close
a round without it (docs/protocol.md, GATHER). A holder that stalled that long cannot trust what it
decided before the stall: `peer.node.round.claims.closed_elsewhere` then takes one round of the
swarm's clock past ours as proof the round closed without us, not two.

`stall_watch()` is the process's one watch, started on first use; `longest_since(t0)` is the
longest stall that ended after `t0` (monotonic), or the one going on now.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

__all__ = ["StallWatch", "stall_watch"]

TICK_S = 0.2  # how often the watch thread wakes
LATE_S = 1.0  # a tick this late is remembered as a stall
KEEP = 32  # stalls remembered (the oldest go first)


class StallWatch:
    """Ticks every `tick_s` on a daemon thread; a tick later than `late_s` is a stall (end, length)."""

    def __init__(
        self,
        tick_s: float = TICK_S,
        late_s: float = LATE_S,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        """`start`: tick on a thread of its own (else whoever calls `tick`); `clock`: monotonic seconds."""
        self.tick_s, self.late_s, self.clock = tick_s, late_s, clock
        self._stalls: deque[tuple[float, float]] = deque(maxlen=KEEP)
        self._last = clock()
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None
        if start:
            self.thread = threading.Thread(target=self._run, name="peer-stall-watch", daemon=True)
            self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.tick_s)
            self.tick()

    def tick(self) -> None:
        now = self.clock()
        with self._lock:
            gap = now - self._last
            if gap > self.late_s:
                self._stalls.append((now, gap))
            self._last = now

    def longest_since(self, t0: float) -> float:
        """The longest stall (seconds) that ended after monotonic time `t0`, the current one included."""
        now = self.clock()
        with self._lock:
            ended = [length for end, length in self._stalls if end > t0]
            current = now - self._last
        return max([*ended, current if current > self.late_s else 0.0])


_WATCH: StallWatch | None = None
_WATCH_LOCK = threading.Lock()


def stall_watch() -> StallWatch:
    """The process's stall watch, started on first use (a forked child starts its own)."""
    global _WATCH
    with _WATCH_LOCK:
        if _WATCH is None or (_WATCH.thread is not None and not _WATCH.thread.is_alive()):
            _WATCH = StallWatch()
        return _WATCH

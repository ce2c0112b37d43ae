"""Upload and download caps of one peer: token buckets shared by every data-plane byte.

`TokenBucket(rate)` hands out bytes at `rate` bytes/s with a burst of `burst` bytes. A message
larger than the burst is never refused: it takes what is there and leaves the bucket in debt, so
the long-run rate is exactly `rate` whatever the message sizes (1 MiB chunks at a 1 Mbit/s cap).
Two priorities: `HIGH` (pipeline activations and gradients, Info) and `LOW` (round payloads, state,
artefacts). A LOW acquire waits while any HIGH one waits, so rounds yield to activations on a
shared link; with no pipeline traffic they get the whole cap.

`Link` is one peer's link: an upload bucket, a download bucket and a relay bucket (bytes this
peer forwards for others, `peer join --relay`), with byte counters. The session builds one from
its caps and hands it to every server and client it runs (`peer.net.transport.dialer.Outbound`,
`peer.net.transport.gate.Gate`). A rate of None or <= 0 means no cap (counted, never delayed).

Invariants: waits are bounded by the bytes asked for (at most debt / rate + a short poll); the
counters only grow; every method is thread-safe. No grpc here: the transport wraps its message
iterators with `Link.throttle`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

HIGH, LOW = 0, 1
MBIT = 1e6 / 8  # bytes per second in one Mbit/s
_POLL_S = 0.05  # a waiter re-checks priorities at least this often
T = TypeVar("T")


def mbps_to_bytes(mbps: float | None) -> float | None:
    """Mbit/s -> bytes/s; None for no cap (None, 0 or negative)."""
    return None if mbps is None or mbps <= 0 else float(mbps) * MBIT


class TokenBucket:
    """A byte budget refilled at `rate` bytes/s up to `burst` bytes (None: unlimited).

    `clock` and `sleep` are injectable so unit tests run on a fake clock; with the real ones a
    waiter sleeps on a condition so higher-priority arrivals are noticed.
    """

    def __init__(
        self,
        rate: float | None,
        burst: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
    ) -> None:
        self.rate = rate if rate is not None and rate > 0 else None
        self.burst = float(burst) if burst is not None else (self.rate * 0.25 if self.rate else 0.0)
        self.burst = max(self.burst, 16 * 1024.0)
        self._clock, self._sleep = clock, sleep
        self._cond = threading.Condition()
        self._tokens = self.burst
        self._stamp = clock()
        self._waiting = [0, 0]  # waiters per priority
        self.total = 0  # bytes granted over the bucket's life
        self.waited_s = 0.0  # time spent waiting in acquire, summed over callers

    def _refill(self) -> None:
        now = self._clock()
        if self.rate is not None:
            self._tokens = min(self.burst, self._tokens + (now - self._stamp) * self.rate)
        self._stamp = now

    def acquire(self, n: int, priority: int = HIGH) -> float:
        """Take `n` bytes (waits until the bucket is out of debt and no higher priority waits).

        Returns the seconds waited."""
        with self._cond:
            self.total += n
            if self.rate is None:
                return 0.0
            t0 = self._clock()
            self._waiting[priority] += 1
            try:
                while True:
                    self._refill()
                    blocked = priority == LOW and self._waiting[HIGH] > 0
                    if self._tokens > 0 and not blocked:
                        self._tokens -= n
                        break
                    need = _POLL_S if blocked else min(_POLL_S, -self._tokens / self.rate + 1e-4)
                    self._wait(max(need, 1e-4))
            finally:
                self._waiting[priority] -= 1
                self._cond.notify_all()
            waited = self._clock() - t0
            self.waited_s += waited
            return waited

    def _wait(self, dt: float) -> None:
        if self._sleep is None:
            self._cond.wait(dt)
        else:
            self._sleep(dt)

    def set_rate(self, rate: float | None) -> None:
        """Change the cap (None: no cap); the burst follows unless it was given."""
        with self._cond:
            self._refill()
            self.rate = rate if rate is not None and rate > 0 else None
            self.burst = max(self.rate * 0.25 if self.rate else 0.0, 16 * 1024.0)
            self._tokens = min(self._tokens, self.burst)
            self._cond.notify_all()


@dataclass(frozen=True)
class LinkCaps:
    """A peer's caps in Mbit/s (None: no cap)."""

    upload_mbps: float | None = None
    download_mbps: float | None = None
    relay_mbps: float | None = None


class Link:
    """One process's upload, download and relay buckets and byte counters."""

    def __init__(self, caps: LinkCaps = LinkCaps(), clock: Callable[[], float] = time.monotonic) -> None:
        self.caps = caps
        self.up = TokenBucket(mbps_to_bytes(caps.upload_mbps), clock=clock)
        self.down = TokenBucket(mbps_to_bytes(caps.download_mbps), clock=clock)
        self.relay = TokenBucket(mbps_to_bytes(caps.relay_mbps), clock=clock)

    def configure(self, caps: LinkCaps) -> None:
        self.caps = caps
        self.up.set_rate(mbps_to_bytes(caps.upload_mbps))
        self.down.set_rate(mbps_to_bytes(caps.download_mbps))
        self.relay.set_rate(mbps_to_bytes(caps.relay_mbps))

    def throttle(self, items: Iterable[T], bucket: TokenBucket, priority: int, size: Callable[[T], int]) -> Iterator[T]:
        """`items` with `bucket.acquire(size(item))` before each is handed on."""
        for item in items:
            bucket.acquire(size(item), priority)
            yield item

    def snapshot(self) -> dict[str, Any]:
        """Caps and byte totals, for info / records / status."""
        return {
            "max_upload_mbps": self.caps.upload_mbps,
            "max_download_mbps": self.caps.download_mbps,
            "relay_max_mbps": self.caps.relay_mbps,
            "bytes_up": self.up.total,
            "bytes_down": self.down.total,
            "bytes_relayed": self.relay.total,
        }

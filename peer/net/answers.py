"""Waiting for an answer from a background process (the hivemind DHT) with a deadline that
survives this process being frozen.

A deadline counts the time this process ran: a wait that overslept its deadline by more than
FROZEN_S (SIGSTOP, a suspended VM) was frozen, not unanswered, and waits once more; every wait
lasts at least MIN_WAIT_S, since a deadline shared by several waits may have been spent by a
freeze before this one began. Given `alive`, the wait checks every POLL_S that the process that
answers still runs, and ends as soon as it does not (a DHT process stopped by a signal to the
whole process group never answers; waiting out the deadline made leaving take 15 s). Anything
else that fails is a NetworkError naming what was asked.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from peer.errors import NetworkError, ProcessGoneError

__all__ = ["FROZEN_S", "MIN_WAIT_S", "POLL_S", "await_answer"]

FROZEN_S = 5.0  # a wait that overran its deadline by this much was frozen, not unanswered
MIN_WAIT_S = 1.0  # the shortest wait for an answer already on its way
POLL_S = 0.25  # how often a wait checks that the answering process still runs


class _Gone(Exception):
    """The process that would answer has exited."""


def _result(future: Any, timeout_s: float, alive: Callable[[], bool] | None) -> Any:
    """future.result(timeout_s), ended early by _Gone once `alive()` is False."""
    if alive is None:
        return future.result(timeout=timeout_s)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return future.result(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
            if not alive():
                raise _Gone from None


def await_answer(
    future: Any,
    what: str,
    timeout_s: float,
    retry_s: float,
    hint: str,
    alive: Callable[[], bool] | None = None,
    gone: str = "the process that answers it exited",
) -> Any:
    """future.result() within `timeout_s` (at least MIN_WAIT_S), once more within max(timeout_s,
    `retry_s`) if the wait overslept (frozen); NetworkError "<what> got no answer …; <hint>", or
    ProcessGoneError "<what>: <gone>" as soon as `alive()` turns False."""
    timeout_s = max(MIN_WAIT_S, timeout_s)
    started = time.monotonic()
    try:
        try:
            return _result(future, timeout_s, alive)
        except TimeoutError:
            if time.monotonic() - started < timeout_s + FROZEN_S:
                raise
            return _result(future, max(timeout_s, retry_s), alive)
    # the future is never cancelled: an answer that comes after we gave up is dropped with it, while
    # cancelling races hivemind's delivery thread (the answer of a frozen wait arrives as it times
    # out), which then logs a traceback of its own
    except _Gone as e:
        raise ProcessGoneError(f"{what}: {gone}") from e
    except TimeoutError as e:
        raise NetworkError(f"{what} got no answer within {timeout_s:.0f} s; {hint}") from e
    except Exception as e:
        text = " ".join(str(e).split())[:200]
        raise NetworkError(f"{what} failed ({type(e).__name__}: {text}); {hint}") from e

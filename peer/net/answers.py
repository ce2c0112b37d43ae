"""Waiting for an answer from a background process (the hivemind DHT) with a deadline that
survives this process being frozen.

A deadline counts the time this process ran: a wait that overslept its deadline by more than
FROZEN_S (SIGSTOP, a suspended VM) was frozen, not unanswered, and waits once more; every wait
lasts at least MIN_WAIT_S, since a deadline shared by several waits may have been spent by a
freeze before this one began. Anything else that fails is a NetworkError naming what was asked.
"""

from __future__ import annotations

import time
from typing import Any

from peer.errors import NetworkError

__all__ = ["FROZEN_S", "MIN_WAIT_S", "await_answer"]

FROZEN_S = 5.0  # a wait that overran its deadline by this much was frozen, not unanswered
MIN_WAIT_S = 1.0  # the shortest wait for an answer already on its way


def await_answer(future: Any, what: str, timeout_s: float, retry_s: float, hint: str) -> Any:
    """future.result() within `timeout_s` (at least MIN_WAIT_S), once more within max(timeout_s,
    `retry_s`) if the wait overslept (frozen); NetworkError "<what> got no answer …; <hint>"."""
    timeout_s = max(MIN_WAIT_S, timeout_s)
    started = time.monotonic()
    try:
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            if time.monotonic() - started < timeout_s + FROZEN_S:
                raise
            return future.result(timeout=max(timeout_s, retry_s))
    except TimeoutError as e:
        future.cancel()
        raise NetworkError(f"{what} got no answer within {timeout_s:.0f} s; {hint}") from e
    except Exception as e:
        text = " ".join(str(e).split())[:200]
        raise NetworkError(f"{what} failed ({type(e).__name__}: {text}); {hint}") from e

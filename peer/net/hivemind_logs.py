"""Keeps a benign hivemind race out of the peer's logs.

A DHT call that times out on our side cancels its `MPFuture`; when the DHT process finishes the
call afterwards, hivemind's `DHT._run_coroutine` tries to set the result of that cancelled future
and asyncio logs "Task exception was never retrieved" with an `InvalidStateError` traceback. The
call's caller already got its timeout; nothing is lost. `quiet_cancelled_futures` installs a filter
on the `asyncio` logger that drops exactly those records (every other asyncio error still logs).
It runs before the DHT process forks, so the filter is inherited by that process, where the
record is emitted.
"""

from __future__ import annotations

import logging
from concurrent.futures import InvalidStateError

__all__ = ["quiet_cancelled_futures"]


class _CancelledFutureFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, InvalidStateError) and "CANCELLED" in str(exc):
                return False
            exc = exc.__context__
        message = record.getMessage()
        return not ("InvalidStateError" in message and "CANCELLED" in message)


_FILTER = _CancelledFutureFilter()


def quiet_cancelled_futures() -> None:
    """Idempotent: drop asyncio's reports of results set on cancelled DHT futures."""
    logger = logging.getLogger("asyncio")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)

"""Keeps a benign hivemind race out of the peer's logs.

A DHT call that times out on our side cancels its `MPFuture`; when the DHT process finishes the
call afterwards, hivemind's `DHT._run_coroutine` tries to set the result of that cancelled future
and asyncio logs "Task exception was never retrieved" with an `InvalidStateError` traceback. The
call's caller already got its timeout; nothing is lost. `quiet_cancelled_futures` installs a filter
on the `asyncio` logger that drops exactly those records (every other asyncio error still logs).
The DHT process installs it when it starts (`peer.net.dht_child`), since that is where the
record is emitted; the peer's process installs it too.

A second, related case: when the peer process dies (`kill -9`) while it is handing the DHT process
a call, the DHT process's pipe read fails (`ConnectionResetError`, `EOFError`, ...) and hivemind
logs the full traceback, then keeps polling until the watchdog (`peer.net.watchdog`) stops it. The
filter on `hivemind.dht.dht` turns that record into one warning line without the traceback; a
failed pipe read while the parent is alive still logs, as a warning with the exception's text.
When the read ends in `EOFError`, which hivemind does not catch, the DHT process's main loop
raised it and multiprocessing printed the traceback; `peer.net.dht_child.DHTProcess` (the DHT
node `peer` starts) ends that process with one warning line instead.

A third: a connection handed between the two processes travels through multiprocessing's
`resource_sharer`, whose server thread reports any failed hand-off through `sys.excepthook`. When a
signal to the process group stops both ends at once, that hand-off fails (`ConnectionResetError`,
`EOFError`) and the thread printed a full traceback. `quiet_fd_handoffs` (installed with the other
filters, in both processes) turns exactly those reports into one warning line; every other uncaught
exception still reaches the previous hook.
"""

from __future__ import annotations

import logging
import sys
from concurrent.futures import InvalidStateError
from types import TracebackType

__all__ = ["quiet_cancelled_futures", "quiet_fd_handoffs"]

PIPE_ERRORS = (ConnectionError, EOFError, OSError)


class _CancelledFutureFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        while exc is not None:
            if isinstance(exc, InvalidStateError) and "CANCELLED" in str(exc):
                return False
            exc = exc.__context__
        message = record.getMessage()
        return not ("InvalidStateError" in message and "CANCELLED" in message)


class _ParentPipeFilter(logging.Filter):
    """The DHT process's failed read of its parent's pipe: one line, no traceback."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if record.funcName == "_run" and isinstance(exc, PIPE_ERRORS):
            record.msg = "DHT process: the pipe from its peer process failed (%s: %s); the peer has likely exited"
            record.args = (type(exc).__name__, exc)
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
        return True


def _through_resource_sharer(tb: TracebackType | None) -> bool:
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.replace("\\", "/").endswith("multiprocessing/resource_sharer.py"):
            return True
        tb = tb.tb_next
    return False


class _FdHandoffHook:
    """`sys.excepthook` that reports a failed fd hand-off of multiprocessing's resource sharer in one line."""

    def __init__(self, previous: object) -> None:
        self.previous = previous

    def __call__(self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        if issubclass(kind, PIPE_ERRORS) and _through_resource_sharer(tb):
            logging.getLogger("hivemind.dht.dht").warning(
                "a connection hand-off between the peer and its DHT process failed (%s: %s); one side is exiting",
                kind.__name__,
                exc,
            )
            return
        self.previous(kind, exc, tb)  # type: ignore[operator]


def quiet_fd_handoffs() -> None:
    """Idempotent: one warning line instead of a traceback when the resource sharer's hand-off fails."""
    if not isinstance(sys.excepthook, _FdHandoffHook):
        sys.excepthook = _FdHandoffHook(sys.excepthook)


_FILTER = _CancelledFutureFilter()
_PIPE_FILTER = _ParentPipeFilter()


def quiet_cancelled_futures() -> None:
    """Idempotent: drop asyncio's reports of results set on cancelled DHT futures, and shorten the
    DHT process's report of a dead parent's pipe to one line."""
    logger = logging.getLogger("asyncio")
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
    dht_logger = logging.getLogger("hivemind.dht.dht")
    if _PIPE_FILTER not in dht_logger.filters:
        dht_logger.addFilter(_PIPE_FILTER)
    quiet_fd_handoffs()

"""`quiet_cancelled_futures`: asyncio's report of a result set on a cancelled DHT future is dropped,
every other asyncio error still reaches the log."""

from __future__ import annotations

import logging
from concurrent.futures import InvalidStateError

from peer.net.hivemind_logs import quiet_cancelled_futures


def _raise_chain() -> BaseException:
    try:
        try:
            raise InvalidStateError("Can't set_result to a future that is CANCELLED (42)")
        except InvalidStateError as first:
            raise InvalidStateError("Can't set_exception to a future that is CANCELLED (42)") from first
    except InvalidStateError as exc:
        return exc


def test_only_the_cancelled_future_race_is_filtered(caplog):
    quiet_cancelled_futures()
    quiet_cancelled_futures()  # idempotent
    logger = logging.getLogger("asyncio")
    assert sum(f.__class__.__name__ == "_CancelledFutureFilter" for f in logger.filters) == 1
    exc = _raise_chain()
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        logger.error("Task exception was never retrieved", exc_info=(type(exc), exc, exc.__traceback__))
        logger.error("Task exception was never retrieved", exc_info=(ValueError, ValueError("real bug"), None))
    assert len(caplog.records) == 1 and caplog.records[0].exc_info[0] is ValueError


def test_a_dead_parents_pipe_is_one_line_without_a_traceback(caplog):
    quiet_cancelled_futures()
    logger = logging.getLogger("hivemind.dht.dht")
    try:
        raise ConnectionResetError(104, "Connection reset by peer")
    except ConnectionResetError as exc:
        reset = exc
    with caplog.at_level(logging.DEBUG, logger="hivemind.dht.dht"):
        # what hivemind's DHT._run does when the pipe read fails: logger.exception(e)
        record = logger.makeRecord(
            logger.name, logging.ERROR, "dht.py", 130, reset, (), (ConnectionResetError, reset, None), func="_run"
        )
        logger.handle(record)
        logger.error("another failure", exc_info=(ValueError, ValueError("real bug"), None))
    first, second = caplog.records
    assert first.levelno == logging.WARNING and first.exc_info is None
    assert "ConnectionResetError" in first.getMessage() and "Traceback" not in caplog.text.split("\n")[0]
    assert second.levelno == logging.ERROR and second.exc_info[0] is ValueError  # other errors untouched

"""`quiet_cancelled_futures`: asyncio's report of a result set on a cancelled DHT future is dropped,
every other asyncio error still reaches the log."""

from __future__ import annotations

import logging
import subprocess
import sys
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


_HANDOFF = """
import logging, sys, time
from multiprocessing import connection, current_process, resource_sharer
from peer.net.hivemind_logs import quiet_fd_handoffs
logging.basicConfig(level=logging.WARNING)
if sys.argv[1] == "quiet":
    quiet_fd_handoffs()
r, w = connection.Pipe()
resource_sharer.DupFd(r.fileno())  # what pickling a connection for another process does: a hand-off server
address = resource_sharer._resource_sharer._address
connection.Client(address, authkey=current_process().authkey).close()  # the other side dies mid-hand-off
time.sleep(1.0)  # the server thread reports the failed hand-off
raise ValueError("a real bug still prints its traceback")
"""


def test_a_failed_fd_handoff_is_one_line_without_a_traceback():
    """A real resource-sharer server thread whose client vanishes: one warning line with the hook, a
    traceback without it; an ordinary uncaught exception keeps its traceback either way."""

    def run(mode: str) -> str:
        proc = subprocess.run([sys.executable, "-c", _HANDOFF, mode], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1, proc.stderr
        return proc.stderr

    bare, quiet = run("bare"), run("quiet")
    assert bare.count("Traceback (most recent call last)") == 2 and "resource_sharer.py" in bare, bare
    assert quiet.count("Traceback (most recent call last)") == 1 and "resource_sharer.py" not in quiet, quiet
    assert "hand-off between the peer and its DHT process failed (EOFError" in quiet, quiet
    assert "ValueError: a real bug still prints its traceback" in quiet

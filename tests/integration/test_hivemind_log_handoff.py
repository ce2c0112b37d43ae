"""A real resource-sharer hand-off that fails in a child interpreter: one warning line with
`peer.net.hivemind_logs.quiet_fd_handoffs`, a traceback without it (subprocess, so not a unit test).
"""

from __future__ import annotations

import subprocess
import sys

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

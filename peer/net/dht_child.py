"""The hivemind DHT process, started from a clean process that never held gRPC state.

hivemind's `DHT` is a `multiprocessing` process started by `fork`: the child is a copy of the
peer's process, with whatever gRPC servers, channels and threads that process had. A forked child
must never touch them (their threads do not exist there and their locks may be held forever), yet
Python's garbage collector in the child frees whatever inherited garbage it finds, gRPC objects
included. That is how a full CI run once ended with 7 failures and 16 errors, every one "DHT node
did not start within 30 s", after in-process gRPC in earlier tests.

So `peer` starts the DHT process through a *forkserver* of its own: a fresh interpreter, started
(exec, not fork) the first time this process starts a DHT node, that imports only this module
(hivemind, torch; never gRPC) and forks each DHT process from itself. The DHT process therefore
inherits no gRPC module, object or thread, whatever the peer's process did before. What a fork
used to carry over implicitly is handed over explicitly: the environment, the root log level and
the log filters (`peer.net.hivemind_logs`, `peer.net.identity_check`) are installed in `run`.

The main module of the peer's process is never re-run in the child (`multiprocessing` would
re-import it, which a script without a ``__main__`` guard does not survive); `_Popen` leaves it
out of the start data.
"""

from __future__ import annotations

import io
import logging
import multiprocessing.forkserver as forkserver
import os
import sys
from multiprocessing import popen_forkserver, reduction, spawn, util
from multiprocessing.context import set_spawning_popen
from typing import Any

import hivemind

from peer.net.hivemind_logs import quiet_cancelled_futures
from peer.net.identity_check import install_identity_check

__all__ = ["DHTProcess", "start_forkserver"]

_PRELOAD = [__name__]  # all a DHT process needs, imported once by the forkserver
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as the CLI's (peer.cli.main)


def start_forkserver() -> None:
    """Start this process's forkserver if it is not running (returns at once; it imports in the background)."""
    forkserver.set_forkserver_preload(_PRELOAD)
    forkserver.ensure_running()


class _Popen(popen_forkserver.Popen):
    """Start a process through the forkserver without re-running this process's main module there."""

    def _launch(self, process_obj: Any) -> None:
        prep = spawn.get_preparation_data(process_obj._name)
        prep.pop("init_main_from_path", None)
        prep.pop("init_main_from_name", None)
        buf = io.BytesIO()
        set_spawning_popen(self)
        try:
            reduction.dump(prep, buf)
            reduction.dump(process_obj, buf)
        finally:
            set_spawning_popen(None)
        self.sentinel, w = forkserver.connect_to_new_process(self._fds)  # type: ignore[attr-defined]  # set by the base class
        parent_w = os.dup(w)  # the child's sentinel of this process, as the stock forkserver start keeps it
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))  # type: ignore[attr-defined]
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class DHTProcess(hivemind.DHT):  # type: ignore[misc]  # hivemind has no type information
    """hivemind's DHT process, forked from `peer`'s clean forkserver (see the module's docstring).

    When its peer process is gone (the pipe reads EOF) it exits with one warning line instead of a
    traceback (the watchdog, `peer.net.watchdog`, stops whatever it leaves)."""

    _start_method = "forkserver"

    @staticmethod
    def _Popen(process_obj: Any) -> _Popen:
        start_forkserver()
        return _Popen(process_obj)

    def start(self) -> None:
        """Record what a fork would have carried over, then start the process."""
        self._peer_environ = dict(os.environ)
        self._peer_log_level = logging.getLogger().getEffectiveLevel()
        super().start()

    def run(self) -> None:
        os.environ.clear()
        os.environ.update(self._peer_environ)
        logging.basicConfig(level=self._peer_log_level, format=_LOG_FORMAT, stream=sys.stderr)
        quiet_cancelled_futures()
        install_identity_check()
        try:
            super().run()
        except EOFError:
            logging.getLogger("hivemind.dht.dht").warning(
                "DHT process: the pipe from its peer process is closed; the peer has exited, so this process exits"
            )

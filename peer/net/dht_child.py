"""The hivemind DHT process, started so that it never holds gRPC state of its peer's process.

hivemind's `DHT` is a `multiprocessing` process started by `fork`: the child is a copy of the
peer's process, with whatever gRPC servers, channels and threads that process had. A forked child
must never touch them (their threads do not exist there and their locks may be held forever), yet
Python's garbage collector in the child frees whatever inherited garbage it finds, gRPC objects
included. That is how a full CI run once ended with 7 failures and 16 errors, every one "DHT node
did not start within 30 s", after in-process gRPC in earlier tests.

So the DHT process is forked only from a process in which gRPC's core is not running:
- a peer's own process, while it runs no gRPC core thread (`grpc_running`: gRPC starts its threads,
  `grpc_global_timer`, `event_engine`, `lifeguard`, with its first channel or server and they end
  with its last): `peer join` and `peer bootstrap` start their DHT before any gRPC object, so they
  fork at once, as hivemind does;
- otherwise a *forkserver* of this process: a fresh interpreter, started (exec, not fork) the first
  time it is needed, that imports only this module (hivemind, torch; never gRPC) and forks each DHT
  process from itself. What a fork carries over implicitly is handed over explicitly: the
  environment and the root log level are set in `run`, and `run` installs the log filters
  (`peer.net.hivemind_logs`) and the identity check (`peer.net.identity_check`) in both cases.
Either way the DHT process inherits no gRPC module state, object or thread. The main module of the
peer's process is never re-run in a forkserver's child (`multiprocessing` would re-import it, which a
script without a ``__main__`` guard does not survive); `_Popen` leaves it out of the start data.
"""

from __future__ import annotations

import glob
import io
import logging
import multiprocessing.forkserver as forkserver
import os
import sys
import time
from multiprocessing import popen_fork, popen_forkserver, reduction, spawn, util
from multiprocessing.context import set_spawning_popen
from pathlib import Path
from typing import Any

import hivemind

from peer.net.hivemind_logs import quiet_cancelled_futures
from peer.net.identity_check import install_identity_check

READY_POLL_S = 0.25  # how often a starting node checks that its process still runs

__all__ = ["DHTProcess", "grpc_running", "start_forkserver", "start_shared_memory_manager"]

_PRELOAD = [__name__]  # all a DHT process needs, imported once by the forkserver
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # as the CLI's (peer.cli.main)
_GRPC_THREADS = ("grpc_global_tim", "event_engine", "lifeguard")  # gRPC core's threads, as the kernel names them


def start_shared_memory_manager() -> None:
    """Start torch's shared-memory manager now, before a command installs its SIGINT/SIGTERM handler.

    hivemind's futures keep their state in shared memory that torch's `torch_shm_manager` process
    hands out (hivemind sets the "file_system" strategy); the first future of a process starts that
    manager (fork, exec, then it leaves our process group). A SIGTERM to our process group in that
    window — a supervisor stopping a peer just after its start — left the main thread spinning in
    torch's start-up of the manager, past any handler: a `peer join` that never left
    (tests/e2e/test_leave_on_sigterm.py). Started here, before the handler, a signal in the window
    ends the process by the default action instead; once started, the manager is beyond a
    signal to our group.
    """
    from hivemind.utils.mpfuture import SharedBytes

    SharedBytes.next()


def grpc_running() -> bool:
    """Whether gRPC's core runs in this process: one of its threads is there (a channel or server
    exists, or their garbage does). True where threads cannot be listed (no /proc): the safe answer."""
    try:
        names = [Path(path).read_text().strip() for path in glob.glob(f"/proc/{os.getpid()}/task/*/comm")]
    except OSError:  # a thread ended while we listed them: list again next time, take the safe way now
        return True
    return not names or any(name.startswith(_GRPC_THREADS) for name in names)


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
    """hivemind's DHT process, forked where no gRPC runs (see the module's docstring).

    When its peer process is gone (the pipe reads EOF) it exits with one warning line instead of a
    traceback (the watchdog, `peer.net.watchdog`, stops whatever it leaves)."""

    @staticmethod
    def _Popen(process_obj: Any) -> popen_fork.Popen:
        if not grpc_running():
            return popen_fork.Popen(process_obj)  # nothing of gRPC to inherit: fork, as hivemind does
        start_forkserver()
        return _Popen(process_obj)

    def start(self) -> None:
        """Record what a fork would have carried over, then start the process."""
        self._peer_environ = dict(os.environ)
        self._peer_log_level = logging.getLogger().getEffectiveLevel()
        super().start()

    def wait_ready(self, timeout_s: float, poll_s: float = READY_POLL_S) -> bool:
        """Until the process is ready (TimeoutError past `timeout_s`); False at once if it exited
        meanwhile (a SIGTERM to the whole process group while it started), not at the deadline."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.wait_until_ready(max(0.0, min(poll_s, deadline - time.monotonic())))
                return True
            except TimeoutError:
                if not self.is_alive():
                    return False
                if time.monotonic() >= deadline:
                    raise

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

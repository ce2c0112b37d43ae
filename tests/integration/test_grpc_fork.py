"""A process that imported `peer` forks safely while another thread is inside gRPC.

hivemind forks the DHT child without exec, and that child forks again to start p2pd. With
gRPC's fork handlers on (grpcio's default since 1.78), a fork taken while another thread is in
gRPC left the child with half-held gRPC locks: the child aborted or segfaulted on its own next
fork (CI: "DHT node did not start within 30 s" after "Fatal Python error: Aborted"). Importing
`peer` switches the handlers off; this runs the pattern in a fresh interpreter, on real sockets.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SCRIPT = textwrap.dedent(
    """
    import os, subprocess, threading
    import peer  # before grpc, as every entry point imports it
    import grpc
    from concurrent import futures

    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stop = threading.Event()

    def busy():  # keeps a thread inside gRPC while the main thread forks
        while not stop.is_set():
            try:
                grpc.channel_ready_future(channel).result(timeout=0.01)
            except grpc.FutureTimeoutError:
                pass

    threading.Thread(target=busy, daemon=True).start()
    crashed = 0
    for _ in range(40):
        pid = os.fork()
        if pid == 0:  # the DHT child's pattern: fork without exec, then start a program
            subprocess.run(["true"], check=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        crashed += status != 0
    stop.set()
    server.stop(None)
    print(os.environ.get("GRPC_ENABLE_FORK_SUPPORT", "unset"), crashed)
    """
)


def test_forked_children_survive_a_thread_inside_grpc():
    env = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=100, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    setting, crashed = done.stdout.split()
    assert setting == "false"
    assert int(crashed) == 0, f"{crashed} of 40 forked children died: {done.stderr[-2000:]}"

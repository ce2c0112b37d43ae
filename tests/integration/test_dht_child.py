"""The hivemind DHT process inherits nothing of its peer's gRPC (`peer.net.dht_child`).

A full CI run once ended with 7 failures and 16 errors, every one "DHT node did not start within
30 s", after in-process gRPC in earlier tests: the DHT process was forked from a process that
served and called gRPC, and gRPC state freed in the copy waited forever on locks of threads that
the fork left behind. Now a clean forkserver forks every DHT process. These tests hold a gRPC
server, a channel and a thread inside a call in this process while DHT nodes start, and look at
the DHT process from outside (its memory map and its p2pd's environment), on real processes; a
fresh interpreter shows which way each node starts (forked at once while no gRPC runs, else by
the forkserver).

Before the fix, the first test failed: the forked DHT process mapped gRPC's core library
(`cygrpc`), as every fork of this process does.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import uuid
from collections.abc import Iterator
from concurrent import futures

import grpc
import psutil
import pytest

from peer.net.dht import SwarmDHT

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
def busy_grpc() -> Iterator[None]:
    """A gRPC server, a channel to it and a thread that keeps calling into gRPC, all in this process."""
    server = grpc.server(futures.ThreadPoolExecutor(2))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    stop = threading.Event()

    def busy() -> None:
        while not stop.is_set():
            ready = grpc.channel_ready_future(channel)
            try:
                ready.result(timeout=0.01)
            except grpc.FutureTimeoutError:
                ready.cancel()

    thread = threading.Thread(target=busy, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join(5)
    server.stop(None)


def _grpc_mapped(pid: int) -> bool:
    """Whether gRPC's core library is mapped into the process (it is once anything imported grpc)."""
    return any("cygrpc" in m.path for m in psutil.Process(pid).memory_maps())


def _p2pd(dht: SwarmDHT) -> psutil.Process:
    (daemon,) = [p for p in psutil.Process(dht.process_pid).children() if "p2pd" in " ".join(p.cmdline())]
    return daemon


def test_the_dht_process_holds_no_grpc_of_its_peer(busy_grpc, reap_children):
    assert _grpc_mapped(os.getpid())  # this process serves and calls gRPC while the node starts
    with SwarmDHT() as first, SwarmDHT(initial_peers=first.visible_maddrs()) as second:
        for node in (first, second):
            assert psutil.Process(node.process_pid).ppid() != os.getpid()  # forked by the forkserver
            assert not _grpc_mapped(node.process_pid)
        second.set_run("child-run", n_stages=2)
        first.set_run("child-run", n_stages=2)
        second.announce_stage(1, {"address": "127.0.0.1:1", "outer_step": 0}, ttl_s=60)
        assert [r.address for r in first.get_stage_peers(1).values()] == ["127.0.0.1:1"]


def test_the_dht_process_runs_with_its_peers_environment_of_now(reap_children):
    """The forkserver starts with the environment of its first DHT node; a later node still gets the
    peer's environment as it is when that node starts (as a fork would), down to its p2pd."""
    with SwarmDHT():  # the forkserver runs from here on
        mark = uuid.uuid4().hex
        os.environ["PEER_TEST_DHT_CHILD_MARK"] = mark
        try:
            with SwarmDHT() as later:
                assert _p2pd(later).environ().get("PEER_TEST_DHT_CHILD_MARK") == mark
        finally:
            del os.environ["PEER_TEST_DHT_CHILD_MARK"]


FRESH = textwrap.dedent(
    """
    import os, psutil
    from concurrent import futures
    import grpc
    from peer.net.dht import SwarmDHT
    from peer.net.dht_child import grpc_running

    def parent_of(dht):
        return "self" if psutil.Process(dht.process_pid).ppid() == os.getpid() else "forkserver"

    first = SwarmDHT()  # grpc is imported, but no channel or server exists: gRPC's core does not run
    print(grpc_running(), parent_of(first), flush=True)
    server = grpc.server(futures.ThreadPoolExecutor(1))
    server.add_insecure_port("127.0.0.1:0")
    server.start()
    second = SwarmDHT(initial_peers=first.visible_maddrs())
    print(grpc_running(), parent_of(second), flush=True)
    first.set_run("fresh", 2)
    second.set_run("fresh", 2)
    first.announce_stage(1, {"address": "127.0.0.1:1", "outer_step": 0}, ttl_s=60)
    print(sorted(second.get_stage_peers(1)) == [first.peer_id], flush=True)
    second.shutdown()
    first.shutdown()
    server.stop(None)
    """
)


def test_a_process_without_grpc_forks_its_dht_at_once_and_one_with_grpc_uses_the_forkserver(reap_children):
    done = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split("\n")[:3] == ["False self", "True forkserver", "True"], done.stdout

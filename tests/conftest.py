"""Shared test fixtures: a child-process reaper, psutil helpers to check for leftovers, tier markers.

Tiers: tests/unit (pure math, milliseconds), tests/integration (real gRPC + hivemind DHT on
127.0.0.1, in-process peers), tests/e2e (the `peer` CLI as separate processes).

Processes are looked up with psutil; a pid is signalled only through a `psutil.Process`, which
checks the process's creation time first, so a pid reused by an unrelated process is never killed.
"""

from __future__ import annotations

import contextlib
import os
import time

import psutil
import pytest

_GONE = (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)


def _running(proc: psutil.Process) -> bool:
    try:
        return proc.is_running() and proc.status() not in _GONE
    except psutil.Error:
        return False


def is_live(pid: int) -> bool:
    """True while `pid` is a running process (not a zombie, not dead)."""
    try:
        return _running(psutil.Process(pid))
    except psutil.Error:
        return False


def cmdline(pid: int) -> str:
    """The command line of `pid`, space-separated ("" once it is gone)."""
    try:
        return " ".join(psutil.Process(pid).cmdline()).strip()
    except psutil.Error:
        return ""


def _descendants(pid: int) -> list[psutil.Process]:
    """Every descendant of `pid` (zombies included); empty once `pid` is gone."""
    try:
        return list(psutil.Process(pid).children(recursive=True))
    except psutil.Error:
        return []


def live_descendants(pid: int) -> set[int]:
    """Running descendants of `pid` (hivemind children, p2pd, CLI peers...)."""
    return {p.pid for p in _descendants(pid) if _running(p)}


def _is_shm_manager(pid: int) -> bool:
    """torch's shared-memory manager lives as long as this process; killing it aborts pytest.

    (hivemind's MPFuture state lives in torch shared memory, so the first DHT node starts it.)
    """
    return "torch_shm_manager" in cmdline(pid)


def _is_resource_tracker(pid: int) -> bool:
    """Python's multiprocessing resource tracker: started by the first spawn pool of this process (the
    dataset preparation a test session's first swarm runs), it lives as long as this process does."""
    return "multiprocessing.resource_tracker" in cmdline(pid)


def _is_forkserver(pid: int) -> bool:
    """The forkserver that forks every DHT process (`peer.net.dht_child`): started by the first DHT
    node of this process, it lives as long as this process does. Its children (the DHT processes,
    which keep its command line) are counted: only the one whose parent is not a forkserver is it."""
    if "multiprocessing.forkserver" not in cmdline(pid):
        return False
    try:
        return "multiprocessing.forkserver" not in cmdline(psutil.Process(pid).ppid())
    except psutil.Error:
        return False


def _is_helper(pid: int) -> bool:
    return _is_shm_manager(pid) or _is_resource_tracker(pid) or _is_forkserver(pid)


def _leftovers(before: set[int]) -> list[psutil.Process]:
    return [p for p in _descendants(os.getpid()) if p.pid not in before and _running(p) and not _is_helper(p.pid)]


def leftover_children(before: set[int]) -> set[int]:
    """Running descendants of this process that were not there `before` (torch's shm manager,
    Python's resource tracker and the DHT forkserver aside: helpers of this process, not of the
    code under test)."""
    return {p.pid for p in _leftovers(before)}


def wait_gone(pids: set[int], timeout_s: float) -> list[int]:
    """Wait up to `timeout_s` for every pid to exit; the ones still running."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(is_live(p) for p in pids):
        time.sleep(0.05)
    return sorted(p for p in pids if is_live(p))


def assert_no_leftover_children(before: set[int], wait_s: float = 0.0, what: str = "leaked child processes") -> None:
    """Fail unless every process started since `before` has exited (within `wait_s`)."""
    deadline = time.monotonic() + wait_s
    while leftover_children(before) and time.monotonic() < deadline:
        time.sleep(0.2)
    leaked = leftover_children(before)
    assert not leaked, f"{what}: {[cmdline(p) for p in sorted(leaked)]}"


@pytest.fixture
def reap_children():
    """Kill every process a test started and left behind (DHT daemons, CLI peers), and reap it."""
    before = {p.pid for p in _descendants(os.getpid())}
    yield
    live = _leftovers(before)
    for proc in live:
        with contextlib.suppress(psutil.Error):  # gone meanwhile
            proc.kill()  # psutil checks first that the pid still names the same process
    deadline = time.monotonic() + 5.0
    while live and time.monotonic() < deadline:  # reap our own children; a zombie others reap counts as gone
        _, live = psutil.wait_procs(live, timeout=0.05)
        live = [p for p in live if _running(p)]


# integration modules that build network namespaces (fixed names, `tc` on shared veths): with the swarms
NETNS_MODULES = {"test_nat.py", "test_bench_pipeline.py"}
# end-to-end modules, or tests ("module::test"), whose processes wait on no round deadline (research
# commands, dataset preparation, a bootstrap alone, a join refused before it trains): beside a swarm, on
# the other worker (their own waits allow seconds to minutes)
E2E_WITHOUT_ROUNDS = {
    "test_cli_research.py",
    "test_data_prepare_cli.py",
    "test_join_memory.py",
    "test_bootstrap_cli.py",
    "test_join_cli.py::test_unusable_data_dir_is_one_line_and_exit_code_2",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if f"{os.sep}integration{os.sep}" in path:
            item.add_marker(pytest.mark.integration)
        elif f"{os.sep}e2e{os.sep}" in path:
            item.add_marker(pytest.mark.e2e)


def work_unit(nodeid: str) -> str:
    """What one pytest-xdist worker runs in one go (pyproject's addopts: `-n 2`): every swarm of
    processes (tests/e2e, the namespace tests) is one unit, so swarms run one at a time as without
    xdist, while the other worker takes the in-process tiers: an integration module at a time (its
    module fixtures built once), unit tests one by one."""
    path = nodeid.split("::", 1)[0]
    name = os.path.basename(path)
    test = name + "::" + nodeid.split("::", 1)[-1].split("[", 1)[0]
    rounds = name not in E2E_WITHOUT_ROUNDS and test not in E2E_WITHOUT_ROUNDS
    if (path.startswith("tests/e2e/") and rounds) or name in NETNS_MODULES:
        return "swarm"
    if path.startswith("tests/e2e/"):
        return path
    return path if path.startswith("tests/integration/") else nodeid


def pytest_runtest_setup(item):
    """On an xdist worker, in-process tests yield the CPU to the swarms (nice 10, inherited by what they
    start): a swarm's deadlines then see the machine as without xdist, the in-process tiers its idle time."""
    if os.environ.get("PYTEST_XDIST_WORKER") and work_unit(item.nodeid) != "swarm":
        os.nice(max(0, 10 - os.nice(0)))


def pytest_xdist_make_scheduler(config, log):
    """`work_unit`'s units, largest first (xdist's load-scope scheduling; its `xdist_group` marker
    is not used: pytest 9.2 ignores the node ids it rewrites)."""
    from xdist.scheduler import LoadScopeScheduling

    class Units(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return Units(config, log)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """One cache of prepared datasets per test session, never the user's ~/.cache/peer."""
    cache = tmp_path_factory.getbasetemp() / "peer-cache"
    monkeypatch.setenv("PEER_CACHE_DIR", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def pytest_configure(config):
    """Tiny models run fastest single-threaded, and CLI subprocesses share the 2 cores."""
    import torch

    torch.set_num_threads(1)

"""Shared test fixtures: a child-process reaper, /proc helpers to check for leftovers, tier markers.

Tiers: tests/unit (pure math, milliseconds), tests/integration (real gRPC + hivemind DHT on
127.0.0.1, in-process peers), tests/e2e (the `peer` CLI as separate processes).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of `pid` from /proc/<pid>/stat, or None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()  # the command name may hold spaces and parentheses
    return fields[0], int(fields[1])


def is_live(pid: int) -> bool:
    """True while `pid` is a running process (not a zombie, not dead)."""
    stat = _stat(pid)
    return stat is not None and stat[0] not in ("Z", "X")


def cmdline(pid: int) -> str:
    """The command line of `pid`, space-separated ("" once it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _children(pid: int, live_only: bool = False) -> set[int]:
    """All descendant pids of `pid` (only running ones with `live_only`), read from /proc (Linux)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        stat = _stat(int(entry.name))
        if stat is None or (live_only and stat[0] in ("Z", "X")):
            continue
        kids.setdefault(stat[1], []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def live_descendants(pid: int) -> set[int]:
    """Running descendants of `pid` (hivemind children, p2pd, CLI peers...)."""
    return _children(pid, live_only=True)


def _is_shm_manager(pid: int) -> bool:
    """torch's shared-memory manager lives as long as this process; killing it aborts pytest.

    (hivemind's MPFuture state lives in torch shared memory, so the first DHT node starts it.)
    """
    return "torch_shm_manager" in cmdline(pid)


def leftover_children(before: set[int]) -> set[int]:
    """Running descendants of this process that were not there `before` (torch's shm manager aside)."""
    return {pid for pid in live_descendants(os.getpid()) - before if not _is_shm_manager(pid)}


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
    """Kill every process a test started and left behind (DHT daemons, CLI peers)."""
    before = _children(os.getpid())
    yield
    for pid in leftover_children(before):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = str(item.fspath)
        if f"{os.sep}integration{os.sep}" in path:
            item.add_marker(pytest.mark.integration)
        elif f"{os.sep}e2e{os.sep}" in path:
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory, monkeypatch):
    """One tokenizer/token cache per test session, never the user's ~/.cache/peer."""
    cache = tmp_path_factory.getbasetemp() / "peer-cache"
    monkeypatch.setenv("PEER_CACHE_DIR", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")


def pytest_configure(config):
    """Tiny models run fastest single-threaded, and CLI subprocesses share the 2 cores."""
    import torch

    torch.set_num_threads(1)

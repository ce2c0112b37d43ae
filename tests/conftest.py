"""Shared test fixtures: a child-process reaper and tier markers.

Tiers: tests/unit (pure math, milliseconds), tests/integration (real gRPC + hivemind DHT on
127.0.0.1, in-process peers), tests/e2e (the `peer` CLI as separate processes).
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest


def _children(pid: int) -> set[int]:
    """All descendant pids of `pid`, read from /proc (Linux)."""
    kids: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry.name))
    out, todo = set(), [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            if child not in out:
                out.add(child)
                todo.append(child)
    return out


def _is_shm_manager(pid: int) -> bool:
    """torch's shared-memory manager lives as long as this process; killing it aborts pytest."""
    try:
        return b"torch_shm_manager" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def leftover_children(before: set[int]) -> set[int]:
    return {pid for pid in _children(os.getpid()) - before if not _is_shm_manager(pid)}


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

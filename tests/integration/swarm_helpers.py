"""Scaffolding of the in-process swarm tests (test_swarm, test_resume).

`InProcessSwarm` starts a bootstrap node and runs `peer join` roles (peer.node.trainer functions) in
threads, each with its own DHT node and gRPC server, exactly as the CLI would. An exception in a
role is recorded, never swallowed; `assert_clean()` (after the `with` block) fails on any of them,
on a role thread still running, and on a DHT daemon left behind.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from peer.bootstrap.node import BootstrapNode
from peer.config import RunConfig, build_config
from peer.node.metrics import read_events
from peer.node.session import SessionOptions
from tests.conftest import assert_no_leftover_children, live_descendants

OUTER = 4


def swarm_config(outer_steps: int = OUTER) -> RunConfig:
    """The tiny 2-stage run of these tests (no PEER_* environment)."""
    return build_config(
        overrides={
            "train.inner_steps": 3,
            "train.outer_steps": outer_steps,
            "train.batch_size": 4,
            "train.microbatches": 2,
            "train.seq_len": 32,
            "data.max_chars": 200_000,
            "swarm.min_replicas": 2,
            "swarm.round_timeout_s": 90,
            "swarm.claim_timeout_s": 90,
            "swarm.announce_interval_s": 0.5,
        },
        environ={},
    )


def events(path: Path, kind: str) -> list[dict]:
    """The `kind` events of a metrics.jsonl (none if it does not exist yet)."""
    return read_events(path, kind)


def rounds(path: Path) -> dict[int, dict]:
    """Round events of a metrics.jsonl by outer step."""
    return {r["t"]: r for r in events(path, "round")}


class InProcessSwarm:
    """A bootstrap node plus peer roles in threads; data dirs are `root / <role name>`."""

    def __init__(self, cfg: RunConfig, root: Path) -> None:
        self.cfg, self.root = cfg, root
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        self._before: set[int] = set()
        self._node: BootstrapNode | None = None
        self.peers: tuple[str, ...] = ()

    def __enter__(self) -> InProcessSwarm:
        self._before = live_descendants(os.getpid())
        self._node = BootstrapNode(self.cfg).__enter__()
        self.peers = tuple(self._node.info.initial_peers)
        return self

    def opts(self, name: str, resume: bool = False) -> SessionOptions:
        return SessionOptions(initial_peers=self.peers, data_dir=self.root / name, manifest_timeout_s=30, resume=resume)

    def metrics(self, name: str) -> Path:
        return self.root / name / "metrics.jsonl"

    def spawn(self, name: str, fn: Callable[..., int], *args) -> threading.Thread:
        """Run `fn(*args)` (a trainer role) in a thread; it must return 0."""

        def target() -> None:
            try:
                assert fn(*args) == 0
            except BaseException as exc:  # reported by assert_clean, never swallowed
                self.errors.append(exc)

        th = threading.Thread(target=target, name=name, daemon=True)
        th.start()
        self.threads.append(th)
        return th

    def wait_for(self, condition: Callable[[], object], timeout_s: float = 240, poll_s: float = 0.2) -> bool:
        """Poll until `condition()` holds, a role failed, or `timeout_s` passed; whether it holds."""
        deadline = time.monotonic() + timeout_s
        while not condition() and time.monotonic() < deadline and not self.errors:
            time.sleep(poll_s)
        return bool(condition())

    def join(self, timeout_s: float = 360) -> None:
        """Wait for every role to finish by itself."""
        for th in self.threads:
            th.join(timeout=timeout_s)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self._node is not None:
            self._node.__exit__(*exc)

    def assert_clean(self) -> None:
        """After the `with` block: no role failed or still runs, and no DHT daemon was left behind."""
        assert not self.errors, self.errors
        assert not [th.name for th in self.threads if th.is_alive()]
        assert_no_leftover_children(self._before, wait_s=10, what="DHT daemons left running after every peer closed")

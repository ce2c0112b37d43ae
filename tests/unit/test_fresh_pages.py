"""The commit's new state on recycled pages (`peer.core.sparseloco.codec.scratch.FreshPages`).

- a region is handed out again only once the last array or tensor viewing it is gone, so what a
  holder keeps is never written by a later array; small arrays are plain `np.empty`;
- a commit whose state comes from recycled regions gives the bits of one on fresh memory, never
  writes the state an earlier commit returned while it is held, and reuses it once it is dropped.
"""

from __future__ import annotations

import gc

import numpy as np
import torch

from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.codec.scratch import FRESH, FreshPages
from peer.core.sparseloco.commit import commit_state
from peer.core.subspace.state import EMBED

MIB = 1 << 20


def _address(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_a_region_returns_only_after_its_last_view_is_gone():
    pages = FreshPages(min_bytes=MIB)
    a = pages.array(MIB // 4)  # 1 MiB of float32
    a[:] = 7.0
    first = _address(a)
    kept = torch.from_numpy(a).view(256, 1024)[1:]  # a view of a view: the region stays in use
    del a
    gc.collect()
    assert pages.held_bytes() == 0
    b = pages.array(MIB // 4)
    assert _address(b) != first  # the held region is not handed out
    b[:] = -1.0
    assert bool((kept == 7.0).all())
    del kept
    gc.collect()
    assert pages.held_bytes() == MIB
    c = pages.array(MIB // 4)
    assert _address(c) == first and pages.held_bytes() == 0  # reused once nothing viewed it
    d = pages.array(MIB // 8, np.float64)  # another size: its own region
    assert _address(d) not in (first, _address(b))
    del b, c, d
    gc.collect()
    assert pages.held_bytes() == 2 * MIB + MIB
    pages.clear()
    assert pages.held_bytes() == 0


def test_small_arrays_are_plain_numpy():
    pages = FreshPages(min_bytes=MIB)
    a = pages.array(16, np.int64)
    assert a.dtype == np.int64 and a.size == 16 and a.flags.owndata
    del a
    gc.collect()
    assert pages.held_bytes() == 0


SHAPES = {EMBED: (96, 40), "blocks.0.w": (640, 512), "blocks.1.w": (640, 512), "head.w": (40, 33)}


def _payloads(m: int, cfg: SparseLoCoConfig, seed: int):
    g = torch.Generator().manual_seed(seed)
    return [compress({n: torch.randn(s, generator=g) for n, s in SHAPES.items()}, None, cfg)[0] for _ in range(m)]


def _bits(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {n: t.numpy().tobytes() for n, t in state.items()}


def test_a_commit_on_recycled_regions_gives_the_same_bits_and_leaves_held_states_alone(monkeypatch):
    cfg = SparseLoCoConfig()
    g = torch.Generator().manual_seed(1)
    start = {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}
    keys = [f"r{i}" for i in range(4)]
    rounds = [_payloads(4, cfg, seed) for seed in (2, 3)]
    plain = [_bits(commit_state(start, None, r, cfg, None, keys=keys).params) for r in rounds]  # 1.25 MiB: malloc's

    monkeypatch.setattr(FRESH, "min_bytes", MIB)  # the two large tensors now come from FRESH
    FRESH.clear()
    first = commit_state(start, None, rounds[0], cfg, None, keys=keys)
    regions = {_address(first.params[n].numpy()) for n in ("blocks.0.w", "blocks.1.w")}
    held = _bits(first.params)
    second = commit_state(start, None, rounds[1], cfg, None, keys=keys)  # while the first is held
    assert _bits(first.params) == held == plain[0]
    assert _bits(second.params) == plain[1]
    del first
    gc.collect()
    assert FRESH.held_bytes() == 2 * 640 * 512 * 4
    third = commit_state(start, None, rounds[0], cfg, None, keys=keys)
    assert {_address(third.params[n].numpy()) for n in ("blocks.0.w", "blocks.1.w")} == regions  # reused
    assert _bits(third.params) == plain[0] and _bits(second.params) == plain[1]
    FRESH.clear()


def test_a_region_freed_by_the_collector_under_the_lock_comes_back_without_a_deadlock():
    pages = FreshPages(min_bytes=MIB)
    a = pages.array(MIB // 4)
    cycle: list[object] = [a]
    cycle.append(cycle)  # only the collector frees it
    del a, cycle
    with pages._lock:  # the collection runs on a thread that holds the lock
        gc.collect()
        assert pages.held_bytes() == MIB
    assert pages.array(MIB // 4) is not None and pages.held_bytes() == 0

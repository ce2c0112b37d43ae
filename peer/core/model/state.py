"""A stage's state by global parameter name: taken (`stage_state`), checked before it is adopted
(`check_stage_state`) and hashed (`state_hash`; `StateHasher` hashes it while it is being made).

Layer keys are global (`layers.3.attn.wq.weight` on whichever stage holds layer 3), so states of
one stage from different holders compare name by name.

Invariants: `state_hash` is equal iff the tensors are bit-identical (names, dtypes, shapes,
bytes); `check_stage_state` raises before anything changes.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from peer.core.model.decoder import Decoder
from peer.core.subspace.state import perp_of


def stage_state(stage: Decoder) -> dict[str, torch.Tensor]:
    """Trainable parameters of a stage by global name (detached clones)."""
    return {name: p.detach().clone() for name, p in stage.named_parameters()}


def check_stage_state(
    module: Decoder,
    stage: int,
    start: Mapping[str, torch.Tensor],
    params: Mapping[str, torch.Tensor],
    perp: torch.Tensor,
) -> None:
    """ValueError unless `start` and `params` name exactly `module`'s parameters with their shapes
    and `perp` has T⊥'s shape (a state to adopt, checked before anything changes)."""
    own = dict(module.named_parameters())
    for what, tensors in (("state", start), ("parameters", params)):
        if set(tensors) != set(own):
            missing, extra = set(own) - set(tensors), set(tensors) - set(own)
            raise ValueError(
                f"{what} for stage {stage} does not match: missing {sorted(missing)[:3]}, "
                f"unexpected {sorted(extra)[:3]}"
            )
        for name, value in tensors.items():
            if own[name].shape != value.shape:
                raise ValueError(f"{name}: shape {tuple(value.shape)} != {tuple(own[name].shape)}")
    if perp.shape != perp_of(module).shape:
        raise ValueError(f"T⊥: shape {tuple(perp.shape)} != {tuple(perp_of(module).shape)}")


def state_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """sha256 over names, dtypes, shapes and bytes, in name order: equal iff bit-identical."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        _update(h, name, tensors[name])
    return h.hexdigest()[:16]


def _update(h: Any, name: str, t: torch.Tensor) -> None:
    """One tensor into a running `state_hash` (its bytes read in place: hashlib takes the buffer)."""
    t = t.detach().contiguous().cpu()
    h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
    if t.numel():
        h.update(t.view(torch.uint8).numpy())


class StateHasher:
    """`state_hash` of a state whose tensors are handed in one by one (`add`, any order) while the
    caller computes the rest: each is hashed as soon as every name before it (in name order) is in,
    on a thread of its own when `background` (hashlib releases the GIL while it hashes), else in
    `add`. `digest()` is state_hash of everything added: the same string. Use it as a context
    manager: leaving the block stops the thread (a block that raised hashes nothing more)."""

    def __init__(self, names: Iterable[str], background: bool = True) -> None:
        self._names = sorted(names)
        self._next = 0  # index into _names of the next tensor to hash
        self._have: dict[str, torch.Tensor] = {}  # added, not hashed yet
        self._added: set[str] = set()
        self._h = hashlib.sha256()
        self._cond = threading.Condition()
        self._stop = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._drain, name="peer-state-hash", daemon=True) if background else None
        if self._thread is not None:
            self._thread.start()

    def __enter__(self) -> StateHasher:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def add(self, name: str, t: torch.Tensor) -> None:
        """Hand in the final value of `name` (it must not change until `digest`)."""
        with self._cond:
            if name in self._added or name not in self._names:
                raise ValueError(f"{name!r} is not a tensor this hash still waits for")
            self._added.add(name)
            self._have[name] = t
            self._cond.notify_all()
        if self._thread is None:
            self._hash_ready()

    def digest(self) -> str:
        """The hash of every name, once all are in (waits for the thread)."""
        missing = sorted(set(self._names) - self._added)
        if missing:
            raise ValueError(f"state hash: {missing[:3]} never added")
        if self._thread is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        self._hash_ready()
        return self._h.hexdigest()[:16]

    def _hash_ready(self) -> None:
        """Hash the next names while they are in (one thread at a time: the thread, or the caller)."""
        while self._next < len(self._names):
            name = self._names[self._next]
            with self._cond:
                t = self._have.pop(name, None)
            if t is None:
                return
            _update(self._h, name, t)
            self._next += 1

    def _drain(self) -> None:
        try:
            while self._next < len(self._names):
                with self._cond:
                    while not self._stop and self._names[self._next] not in self._have:
                        self._cond.wait()
                    if self._names[self._next] not in self._have:
                        return  # stopped
                self._hash_ready()
        except BaseException as exc:  # noqa: BLE001  # re-raised by digest()
            self._error = exc

"""The outer step of a stage's state from its Δ̄, a tensor at a time as each Δ̄ is final, hashed as made.

    θ      = θ_start + fl32(fl32(−η)·Δ̄)                 every parameter but the embedding
    u      = fl32(fl32(−η)·Δ̄[embed])                     the embedding's change
    T_S    = fl32(T_S + p);  T⊥ = fl32(T⊥ + (u − p))     p = Π(u) in float64 (`portable.split64`)
    stages without the embedding: T⊥ = fl32(T⊥ + (u − Π(u))) with stage 0's committed u

(paper Alg. 1, eq. 4, and §3.2 for the T_S/T⊥ re-projection; `peer.core.sparseloco.commit` runs
it). `OuterStep.take(name, Δ̄)` makes one tensor's new value as soon as its Δ̄ is final — the fused
commit calls it from the aggregation, on whichever kernel-pool thread summed that tensor, so the
step of one tensor and the hash of another overlap the sums of the rest — and `finish` makes the
rest (the tensors Δ̄ does not name, T⊥ of a stage without the embedding). Each tensor's value is
a function of its own θ_start and Δ̄ alone (`peer.core.sparseloco.elementwise`), so the order in
which tensors are taken, and the thread that takes one, never changes a bit.

`Hashing` makes the state's hashes (`state_hash` of θ and of {"perp": T⊥}) while the state is made:
a `StateHasher` each, on a thread of its own when the commit runs on several cores, fed every
tensor as soon as it is final. The hash is one SHA-256 stream over the tensors in name order (the
definition every holder compares), so it can start on a tensor only once every tensor before it in
name order is in: the fused commit takes tensors in name order for that reason.

Invariants: nothing passed in is modified; every returned tensor is fresh (none aliases θ_start,
T⊥ or a lent Δ̄ buffer); `take` may be called from several threads at once, each name once.
Pure torch/numpy: no networking imports.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping

from torch import Tensor

from peer.core.model.state import StateHasher
from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.codec.fused import n_workers
from peer.core.sparseloco.elementwise import Device, copied, scaled, stepped
from peer.core.subspace.compression import embedding_outer_update, perp_outer_update
from peer.core.subspace.state import EMBED

__all__ = ["Hashing", "OuterStep", "apply_update", "decayed", "outer_delta"]


def outer_delta(agg: Tensor, lr: float, device: Device = None) -> Tensor:
    """fl32(fl32(−η)·Δ̄): the committed change of one tensor (CPU float32; computed on `device`)."""
    return scaled(agg, -lr, device)


def decayed(perp: Tensor | None, U: Tensor | None, perp_factor: float, device: Device) -> Tensor | None:
    """A fresh CPU float32 T⊥ after the round's weight decay (`peer.core.sparseloco.commit.perp_decay`)."""
    if perp is not None and U is not None and perp_factor != 1.0:
        return scaled(perp, perp_factor, device)
    return None if perp is None else copied(perp)


class Hashing:
    """θ's and T⊥'s hashes (`state_hash` of θ and of {"perp": T⊥}), each made by a `StateHasher` while
    the commit makes the state: on a thread of its own when the commit runs on several, every tensor
    handed in as soon as it is final (`param`, `perp`). A context manager (its threads end with it)."""

    def __init__(self, names: Iterable[str], has_perp: bool) -> None:
        background = n_workers() > 1
        self._params = StateHasher(names, background)
        self._perp = StateHasher(["perp"] if has_perp else [], background)

    def __enter__(self) -> Hashing:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._params, self._perp:
            pass

    def param(self, name: str, t: Tensor) -> None:
        self._params.add(name, t)

    def perp(self, t: Tensor | None) -> None:
        if t is not None:
            self._perp.add("perp", t)

    def digests(self) -> tuple[str, str]:
        """(θ's hash, T⊥'s hash), once every tensor is in (waits for the threads)."""
        return self._params.digest(), self._perp.digest()


class OuterStep:
    """The new state of one stage from θ_start and T⊥ (after this round's decay: a fresh tensor this
    step may replace), one tensor of Δ̄ at a time (module docstring). `hashing` (optional) is fed every
    tensor as soon as it is final."""

    def __init__(
        self,
        start: Mapping[str, Tensor],
        perp: Tensor | None,
        cfg: SparseLoCoConfig,
        U: Tensor | None,
        embed_update: Tensor | None = None,
        device: Device = None,
        hashing: Hashing | None = None,
    ) -> None:
        self._start, self._perp, self._cfg, self._U = start, perp, cfg, U
        self._embed_update, self._device, self._hashing = embed_update, device, hashing
        self._params: dict[str, Tensor] = {}
        self._taken: set[str] = set()
        self._own_update: Tensor | None = None
        self._perp_final = False
        self._lock = threading.Lock()  # guards `_taken`: a name is taken once

    def take(self, name: str, agg: Tensor) -> None:
        """θ of `name` from its Δ̄ (not kept: it may be a lent buffer); a name θ_start lacks is ignored."""
        if name not in self._start:
            return
        with self._lock:
            if name in self._taken:
                raise ValueError(f"outer step: Δ̄ of {name!r} given twice")
            self._taken.add(name)
        value, lr, device = self._start[name], self._cfg.outer_lr, self._device
        if name == EMBED:
            self._own_update = outer_delta(agg, lr, device)
            if self._U is not None and self._perp is not None:
                self._params[name], self._perp = embedding_outer_update(value, self._perp, self._own_update, self._U)
                self._perp_final = True
                if self._hashing is not None:
                    self._hashing.perp(self._perp)  # final now: hashed while the other tensors are made
            else:
                self._params[name] = stepped(value, agg, lr, device)
        else:
            self._params[name] = stepped(value, agg, lr, device)
        if self._hashing is not None:
            self._hashing.param(name, self._params[name])

    def finish(self) -> tuple[dict[str, Tensor], Tensor | None, Tensor | None]:
        """(θ, T⊥, the embedding's committed change u when this stage holds it and Δ̄ named it): the
        tensors never taken stay θ_start (copied), and a stage without the embedding moves T⊥ by
        stage 0's committed change."""
        for name in sorted(set(self._start) - self._taken):
            self._params[name] = copied(self._start[name])
            if self._hashing is not None:
                self._hashing.param(name, self._params[name])
        perp, U, update = self._perp, self._U, self._embed_update
        if EMBED not in self._start and perp is not None and U is not None and update is not None:
            perp = perp_outer_update(perp, update, U)
        if self._hashing is not None and not self._perp_final:
            self._hashing.perp(perp)
        return {name: self._params[name] for name in self._start}, perp, self._own_update


def apply_update(
    start: Mapping[str, Tensor],
    perp: Tensor | None,
    summed: Mapping[str, Tensor],
    cfg: SparseLoCoConfig,
    U: Tensor | None,
    embed_update: Tensor | None = None,
    device: Device = None,
    hashing: Hashing | None = None,
) -> tuple[dict[str, Tensor], Tensor | None, Tensor | None]:
    """θ = θ_start + fl32(−η·Δ̄) for every name of `summed` (the others stay θ_start), with the
    embedding's T_S/T⊥ split and a stage without the embedding's T⊥ moved by stage 0's committed
    change: `OuterStep` given all of Δ̄ at once, in name order. `perp` is T⊥ after this round's decay
    (a fresh tensor this function may replace). Returns (θ, T⊥, the embedding's committed change u
    when this stage holds it). Every step is elementwise float32 (`peer.core.sparseloco.elementwise`,
    on `device`) or `peer.core.sparseloco.portable`'s float64 split (on the CPU's cores): any holder
    gets the same bits from the same Δ̄, however Δ̄ was aggregated (all-to-all, or assembled from
    range shards)."""
    step = OuterStep(start, perp, cfg, U, embed_update, device, hashing)
    for name in sorted(summed):
        step.take(name, summed[name])
    return step.finish()

"""The commit's elementwise float32 steps, on the CPU's cores or on a CUDA device: the same bits.

    u  = fl32(fl32(−η)·Δ̄)              `scaled(Δ̄, −η)`: a tensor's committed change
    θ  = fl32(θ_start + fl32(fl32(−η)·Δ̄))   `stepped(θ_start, Δ̄, η)`: a tensor's new value
    T⊥ ← fl32(T⊥·fl32(decay_t))         `scaled(T⊥, decay_t)`: T⊥'s weight decay

Each is one IEEE-754 binary32 multiply, or one multiply then one add, per element; each operation
is correctly rounded (to nearest, ties to even) by every conforming unit, and an element's result
depends on nothing but its own operands. torch's CPU kernels (vectorised or not, on any number of
threads: an element is one lane of one instruction) and its CUDA kernels compute exactly that for
`torch.mul` of a float32 tensor by a float32 scalar and `torch.add` of two float32 tensors, so
the bits depend neither on the device nor on the thread count. What this module avoids, and why
(docs/protocol.md, "The portable commit"):
- `a + α·b` kernels (`add(alpha=)`, `addcmul`, `lerp`): one fused multiply-add on some kernel
  sets and two roundings on others. The multiply and the add are separate calls here, so no
  compiler can contract them (nvcc contracts a·b + c only within one kernel's expression; torch's
  add with α = 1 may run as fma(b, 1, a), which is exactly round(a + b)).
- a factor that is not a float32: every factor is rounded to float32 first (`f32`), so a kernel
  that widens it (to float64, or CUDA's opmath) computes the same product: a product of two
  float32 values is exact in float64 and rounds once to float32.
- division by a scalar, which torch's CUDA kernel computes as a product with the reciprocal (not
  correctly rounded): the mean Δ̄ = Σ/M is formed on the CPU (`peer.core.sparseloco.algorithm`).
Not covered: the bits of a NaN (IEEE-754 leaves its payload open, and a GPU returns its canonical
NaN); payloads are finite on the wire, so only a sum that overflows float32 could make one.
Results come back as fresh CPU float32 tensors: the state is hashed and kept on the CPU.
Pure torch: no networking imports.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

__all__ = ["Device", "copied", "f32", "scaled", "stepped"]

Device = torch.device | str | None  # where the elementwise steps run (None: the CPU)


def f32(x: float) -> float:
    """x rounded to float32, as the Python float of exactly that value."""
    return float(np.float32(x))


def _on(t: Tensor, device: Device) -> Tensor:
    """t as float32 on `device` (t itself when it already is: it is only read)."""
    return t.detach().to(torch.device("cpu" if device is None else device), torch.float32)


def _cpu(t: Tensor) -> Tensor:
    """A result on the CPU (a device's result copied back exactly; a CPU result is already fresh)."""
    return t if t.device.type == "cpu" else t.to("cpu")


def scaled(t: Tensor, factor: float, device: Device = None) -> Tensor:
    """fl32(t·fl32(factor)): a fresh CPU float32 tensor, computed on `device`."""
    return _cpu(torch.mul(_on(t, device), f32(factor)))


def stepped(start: Tensor, agg: Tensor, lr: float, device: Device = None) -> Tensor:
    """θ_start + fl32(fl32(−lr)·Δ̄), the outer step of one tensor: a multiply, then an add (never one
    `a + α·b` kernel); a fresh CPU float32 tensor, computed on `device`."""
    change = torch.mul(_on(agg, device), f32(-lr))
    return _cpu(torch.add(_on(start, device), change, out=change))  # θ_start first, as written


def copied(t: Tensor) -> Tensor:
    """A fresh CPU float32 copy of t (a tensor the commit leaves as it was)."""
    return t.detach().to("cpu", torch.float32, copy=True).contiguous()

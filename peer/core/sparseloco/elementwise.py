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

On the CPU (`device` None) a large tensor takes one compiled pass per block of BLOCK elements
(`_step_jit`, `_scale_jit`, `_copy_jit`: numba, nogil, no fastmath, so LLVM never contracts the
multiply and the add into an FMA; a test inspects the machine code), written straight into the
fresh result, the blocks shared out over the kernel pool's threads and taken as they come
(`codec.fused.run_split`): torch's own threads would cut the tensor in equal halves, and a half whose
core is busy elsewhere (the state's hash runs beside the commit) holds up the whole step. The
multiply's result is a float32 value before the add reads it, as in the two torch calls; which
thread computes a block is irrelevant to its bits. Small tensors, or no numba: the torch calls.
Pure torch/numba: no networking imports.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from peer.core.sparseloco.codec import kernels as codec_kernels
from peer.core.sparseloco.codec.fused import run_split
from peer.core.sparseloco.codec.scratch import fresh

__all__ = ["Device", "copied", "f32", "scaled", "stepped"]

Device = torch.device | str | None  # where the elementwise steps run (None: the CPU)
BLOCK = 1 << 16  # elements of one compiled pass (256 KiB of float32): the unit the threads take
MIN_COMPILED = 1 << 18  # elements below which the torch calls run (tiny tests never JIT-compile)


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
    if device is None and (kernel := _kernel(_scale_jit, t)) is not None:
        return _blocks(kernel, t, _flat(t), np.float32(f32(factor)))
    return _cpu(torch.mul(_on(t, device), f32(factor)))


def stepped(start: Tensor, agg: Tensor, lr: float, device: Device = None) -> Tensor:
    """θ_start + fl32(fl32(−lr)·Δ̄), the outer step of one tensor: a multiply, then an add (never one
    `a + α·b` kernel); a fresh CPU float32 tensor, computed on `device`."""
    if device is None and start.shape == agg.shape and (kernel := _kernel(_step_jit, start)) is not None:
        return _blocks(kernel, start, _flat(start), _flat(agg), np.float32(f32(-lr)))
    change = torch.mul(_on(agg, device), f32(-lr))
    return _cpu(torch.add(_on(start, device), change, out=change))  # θ_start first, as written


def copied(t: Tensor) -> Tensor:
    """A fresh CPU float32 copy of t (a tensor the commit leaves as it was)."""
    if (kernel := _kernel(_copy_jit, t)) is not None:
        return _blocks(kernel, t, _flat(t))
    return t.detach().to("cpu", torch.float32, copy=True).contiguous()


def _kernel(fn: Any, like: Tensor) -> Any:
    """The compiled pass `fn` for a tensor of `like`'s size, or None: small, or numba not in use."""
    return codec_kernels.compiled_function(fn) if like.numel() >= MIN_COMPILED else None


def _flat(t: Tensor) -> np.ndarray:
    """t's values as a flat contiguous CPU float32 array (t's own memory when it already is one)."""
    out: np.ndarray = _on(t, None).contiguous().view(-1).numpy()
    return out


def _blocks(kernel: Any, like: Tensor, *args: Any) -> Tensor:
    """A fresh CPU float32 tensor of `like`'s shape, kernel(*args, out, block, b0, b1) over its blocks
    of BLOCK elements on the kernel pool (elements are independent: the split never shows), written
    on recycled pages (`codec.scratch.fresh`: the state outlives the commit)."""
    out = fresh(like.numel(), np.float32)
    run_split(kernel, -(-out.size // BLOCK), out.size, *args, out, BLOCK)
    return torch.from_numpy(out).view(like.shape)


# ------------------------------------------------------------------------------------------
# numba kernels (plain Python here; compiled by `codec.kernels.compiled_function`, nogil, no fastmath)
# ------------------------------------------------------------------------------------------


def _step_jit(
    start: np.ndarray, agg: np.ndarray, factor: np.float32, out: np.ndarray, block: int, b0: int, b1: int
) -> int:
    # out = start + fl32(agg · factor) on elements [b0·block, b1·block): the product is a float32
    # (two float32 operands), rounded before the add reads it; no fastmath, so never one FMA.
    for i in range(b0 * block, min(out.size, b1 * block)):
        change = np.float32(agg[i] * factor)
        out[i] = start[i] + change
    return 0


def _scale_jit(t: np.ndarray, factor: np.float32, out: np.ndarray, block: int, b0: int, b1: int) -> int:
    for i in range(b0 * block, min(out.size, b1 * block)):
        out[i] = t[i] * factor
    return 0


def _copy_jit(t: np.ndarray, out: np.ndarray, block: int, b0: int, b1: int) -> int:
    lo, hi = b0 * block, min(out.size, b1 * block)
    out[lo:hi] = t[lo:hi]
    return 0

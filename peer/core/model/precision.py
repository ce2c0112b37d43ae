"""Compute precision of the inner steps: which dtype autocast runs in, and fp16's loss scaling.

`--precision bf16|fp16|fp32` (`auto`: `resolve_precision`) chooses the dtype the matrix products
of forward and backward run in (`autocast`, torch's own op lists: matmuls in the low dtype,
reductions, norms and the loss in float32). What every holder must agree on never changes with
it: parameters stay float32 (the master weights AdamW updates), gradients land in `.grad` as
float32, θ_start, the error buffer and every commit (`peer.core.sparseloco.commit`) are float32 and
portable. A swarm may mix precisions freely; only the inner steps' arithmetic differs, as it
already does between a CPU and a GPU.

fp16 has 5 exponent bits: small gradients underflow to zero. A `LossScaler` multiplies the
gradient a stage backpropagates by S (a power of two, so scaling and unscaling are exact), keeps
`.grad` scaled for the whole inner step and unscales it before clipping and AdamW. A non-finite
gradient norm skips the step and halves S; `growth_interval` finite steps in a row double it
(the dynamic scaling of Micikevicius et al. 2018, "Mixed Precision Training", §3.2, written out
here rather than borrowed from `torch.amp.GradScaler`, whose optimizer wrapper does not fit a
step split over stages). bf16 and fp32 need no scaling: their scaler is a no-op with S = 1.

Weights cast once per inner step (`CastWeights`): autocast casts every matmul weight to the
compute dtype anew in each forward, and autograd keeps that copy for the backward, so K
micro-batches in flight would hold K low-precision copies of a stage's weights. `CastWeights`
casts the weights autocast would cast (`nn.Linear`'s weight and bias: `linear` is on autocast's
lower-precision list on CPU and CUDA; embeddings and norms are not) once, through `_Cast`, a node
that saves nothing, and every micro-batch's forward uses that one copy
(`torch.func.functional_call`; autocast leaves a tensor already in its dtype as it is). Each
micro-batch's backward runs the shared node once and adds its float32 gradient into the master
parameter's `.grad`, as autocast's own cast does: values and gradients are the per-forward casts'
bit for bit. Invariant: the copy is used only while every parameter is the same tensor, unchanged
since the cast (its identity, storage and `_version`, the in-place update counter), so an AdamW
step, `load_state_dict`, a commit or a re-sync makes the next forward cast again by itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from peer.errors import ConfigError

__all__ = [
    "PRECISIONS",
    "CastWeights",
    "LossScaler",
    "autocast",
    "compute_dtype",
    "matmul_weights",
    "resolve_precision",
]

PRECISIONS = ("bf16", "fp16", "fp32")  # what `resolve_precision` returns
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision(precision: str, device: str | torch.device) -> str:
    """`bf16`, `fp16` or `fp32` for `precision` (`auto` or one of them) on `device`.

    `auto` is bf16 on a CUDA device with native bf16 (Ampere, compute capability 8.0, and later)
    and fp32 everywhere else: on a CPU (bf16 is emulated and an order of magnitude slower on CPUs
    without AVX512-BF16 or AMX, docs/configuration.md; ask for it where the CPU has them) and on
    older GPUs (V100, T4, the GTX/RTX 20 series), which get fp32 because fp16 needs loss scaling
    and is only taken when asked for (`--precision fp16`).
    """
    if precision in PRECISIONS:
        return precision
    if precision != "auto":
        raise ConfigError(f"precision must be auto, bf16, fp16 or fp32, got {precision!r}")
    if torch.device(device).type == "cuda" and torch.cuda.is_bf16_supported(including_emulation=False):
        return "bf16"
    return "fp32"


def compute_dtype(precision: str) -> torch.dtype:
    """The dtype autocast computes matrix products in: bfloat16, float16 or float32."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be bf16, fp16 or fp32, got {precision!r}")
    return _DTYPES.get(precision, torch.float32)


@contextlib.contextmanager
def autocast(device: torch.device | str, precision: str) -> Iterator[None]:
    """Run the block under `torch.autocast` in `precision`'s dtype on `device`; fp32: as it is.

    Wrap the forward only: backward runs each op in the dtype its forward used."""
    dtype = compute_dtype(precision)
    if dtype == torch.float32:
        yield
        return
    with torch.autocast(device_type=torch.device(device).type, dtype=dtype):
        yield


def matmul_weights(module: nn.Module) -> dict[str, nn.Parameter]:
    """{name: parameter} of what autocast casts in `module`'s forward: every `nn.Linear`'s weight
    and bias (`linear` runs in the low dtype on CPU and CUDA); embeddings and norms stay float32."""
    return {
        f"{prefix}.{name}" if prefix else name: p
        for prefix, sub in module.named_modules()
        if isinstance(sub, nn.Linear)
        for name, p in sub.named_parameters(recurse=False)
    }


class _Cast(torch.autograd.Function):
    """w → w in a lower dtype; backward: the gradient back in w's dtype (as autocast's own cast
    does). It saves no tensor, so one node can serve every micro-batch's graph."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.master_dtype = w.dtype
        return w.to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.to(ctx.master_dtype), None


def _cast(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out: torch.Tensor = _Cast.apply(w, dtype)  # type: ignore[no-untyped-call]  # torch's apply is untyped
    return out


class CastWeights:
    """`module`'s matmul weights cast to `precision`'s compute dtype once, shared by every forward
    until a parameter changes (the module docstring); fp32: nothing to cast."""

    def __init__(self, module: nn.Module, precision: str) -> None:
        self.module = module
        self.dtype = compute_dtype(precision)
        self._cast: dict[str, torch.Tensor] = {}
        # (parameter, data_ptr, _version, requires_grad) of each cast weight when it was cast
        self._made_from: list[tuple[torch.Tensor, int, int, bool]] = []

    def get(self) -> dict[str, torch.Tensor]:
        """{name: the cast tensor} for `torch.func.functional_call`, cast again if anything changed."""
        if self.dtype == torch.float32:
            return {}
        if not self._valid():
            self.clear()  # the stale copy goes before the new one is made
            weights = matmul_weights(self.module)
            with torch.enable_grad():  # a copy made under no_grad (evaluate) must still train
                self._cast = {n: _cast(p, self.dtype) for n, p in weights.items()}
            self._made_from = [(p, p.data_ptr(), p._version, p.requires_grad) for p in weights.values()]
        return self._cast

    def _valid(self) -> bool:
        weights = list(matmul_weights(self.module).values())
        return (
            bool(self._cast)
            and len(weights) == len(self._made_from)
            and all(
                p is q and p.data_ptr() == ptr and p._version == version and p.requires_grad == grad
                for p, (q, ptr, version, grad) in zip(weights, self._made_from, strict=True)
            )
        )

    def clear(self) -> None:
        """Drop the copy (after a step: the next forward casts the new parameters anyway)."""
        self._cast, self._made_from = {}, []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`module(x)` with the shared cast; call it under `autocast` in the same precision."""
        out: torch.Tensor = torch.func.functional_call(self.module, self.get(), (x,))
        return out


class LossScaler:
    """The loss scale S of one stage: fp16's dynamic scaling, or a no-op (S = 1) for bf16 and fp32.

    `update(finite)` after every inner step: a non-finite gradient norm halves S (down to
    `min_scale`), `growth_interval` finite steps in a row double it. S stays a power of two."""

    def __init__(
        self, enabled: bool, init_scale: float = 2.0**16, growth_interval: int = 2000, min_scale: float = 1.0
    ) -> None:
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.enabled, self.growth_interval, self.min_scale = enabled, growth_interval, min_scale
        self._scale = float(init_scale) if enabled else 1.0
        self._good_steps = 0  # finite steps since the last change of S

    @classmethod
    def for_precision(cls, precision: str, init_scale: float = 2.0**16, growth_interval: int = 2000) -> LossScaler:
        """Dynamic scaling for fp16, the no-op scaler otherwise."""
        compute_dtype(precision)  # ConfigError on an unknown precision
        return cls(precision == "fp16", init_scale, growth_interval)

    @property
    def scale(self) -> float:
        """S: the factor the backpropagated gradient carries (1.0 when disabled)."""
        return self._scale

    def update(self, finite: bool) -> None:
        """After an inner step: halve S when its gradients were not finite, double it after
        `growth_interval` finite steps in a row."""
        if not self.enabled:
            return
        if not finite:
            self._scale = max(self.min_scale, self._scale / 2)
            self._good_steps = 0
            return
        self._good_steps += 1
        if self._good_steps >= self.growth_interval:
            self._scale *= 2
            self._good_steps = 0

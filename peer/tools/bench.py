"""Benchmark of the SparseLoCo payload on a real model's pseudo-gradient (DESIGN.md §5).

Builds the model preset (or a preset with its layer count changed) whose parameter count is
closest to the request, runs a few real AdamW steps on random tokens, takes Δ = θ_start − θ_now,
and measures the serialized payload: bytes per parameter (budget ≤ 0.014 at defaults), the ratio
to dense fp32, and the time to compress + serialize and to parse + decompress.

Invariant: bytes are counted from `Payload.to_bytes()`, i.e. exactly what goes on the wire.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
import torch.nn.functional as F

from peer.config import TrainConfig
from peer.core.model import PRESETS, ModelConfig, build_model, get_preset
from peer.core.optim import build_adamw, clip_grads
from peer.core.sparseloco import (
    Payload,
    SparseLoCoConfig,
    compress,
    decompress,
    ideal_bytes_per_param,
    payload_density,
    pseudo_gradient,
)
from peer.errors import ConfigError

log = logging.getLogger(__name__)


def closest_model(n_params: int) -> tuple[str, ModelConfig]:
    """The preset, possibly with another n_layers (1 … 2× its own), closest to n_params."""
    if n_params < 1:
        raise ConfigError(f"--params must be a positive parameter count, got {n_params}")
    best: tuple[int, str, ModelConfig] | None = None
    for name, preset in PRESETS.items():
        for n_layers in range(1, 2 * preset.n_layers + 1):
            cfg = get_preset(name, n_layers=n_layers)
            gap = abs(cfg.n_params - n_params)
            if best is None or gap < best[0]:
                label = name if n_layers == preset.n_layers else f"{name}@{n_layers}layers"
                best = (gap, label, cfg)
    return best[1], best[2]


def bench_payload(
    n_params: int, seed: int = 0, steps: int = 3, cfg: SparseLoCoConfig | None = None, seq_len: int = 16
) -> dict:
    """Measure the payload of one round for a model of about `n_params` parameters."""
    cfg = cfg or SparseLoCoConfig()
    preset, model_cfg = closest_model(n_params)
    torch.manual_seed(seed)
    model = build_model(model_cfg, seed=seed)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    train = TrainConfig()
    opt = build_adamw(model.named_parameters(), train)
    gen = torch.Generator().manual_seed(seed)
    seq_len = min(seq_len, model_cfg.max_seq_len)
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens = torch.randint(0, model_cfg.vocab_size, (1, seq_len + 1), generator=gen)  # (1, L+1)
        logits = model(tokens[:, :-1])  # (1, L, V)
        loss = F.cross_entropy(logits.reshape(-1, model_cfg.vocab_size), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        clip_grads(model.parameters(), train.grad_clip)
        opt.step()
    train_s = time.perf_counter() - t0
    delta = pseudo_gradient(start, dict(model.named_parameters()))
    del opt, start
    total = sum(t.numel() for t in delta.values())

    t0 = time.perf_counter()
    payload, errors = compress(delta, None, cfg)
    wire = payload.to_bytes()
    compress_s = time.perf_counter() - t0

    t0 = time.perf_counter()
    decoded = decompress(Payload.from_bytes(wire, max_bytes=max(len(wire), 1), max_elements=total, cfg=cfg))
    decompress_s = time.perf_counter() - t0

    sent_norm = sum(float(d.double().square().sum()) for d in decoded.values()) ** 0.5
    delta_norm = sum(float(d.double().square().sum()) for d in delta.values()) ** 0.5
    result = {
        "n_params": total,
        "target_params": n_params,
        "preset": preset,
        "model": model_cfg.to_dict(),
        "sparseloco": dataclasses.asdict(cfg),
        "steps": steps,
        "seed": seed,
        "payload_bytes": len(wire),
        "bytes_per_param": len(wire) / total,
        "ideal_bytes_per_param": ideal_bytes_per_param(cfg),
        "ratio_vs_fp32": 4 * total / len(wire),
        "density": payload_density(cfg),
        "n_tensors": len(payload.entries),
        "compress_s": compress_s,
        "decompress_s": decompress_s,
        "train_s": train_s,
        "sent_norm_fraction": sent_norm / delta_norm if delta_norm else 0.0,
        "roundtrip_exact": Payload.from_bytes(wire, max_bytes=len(wire), max_elements=total).to_bytes() == wire,
    }
    log.info(
        "payload benchmark: %s params (%s), %d bytes, %.5f B/param, %.0fx vs fp32",
        total,
        preset,
        len(wire),
        result["bytes_per_param"],
        result["ratio_vs_fp32"],
    )
    del errors
    return result

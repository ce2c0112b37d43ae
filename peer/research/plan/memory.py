"""`peer plan --memory`: the estimated peak memory of one stage's holder for every preset, on a GPU
(device memory, and the host RAM beside it) and on a CPU device.

For every shape in `peer.research.plan.command.PLAN_PRESETS` (tiny … 1B, and the plan-only 7B, 13B, 70B) and
1, 2, 4 and 8 stages (where the layers allow), the largest `peer.core.memory.estimate_stage` peak
over the stages, at fp32 and bf16, with and without activation checkpointing, for the flags'
micro-batch size, sequence length (capped at each preset's `max_seq_len`) and micro-batches in
flight (the auto window's cap: all the micro-batches, at most `MAX_STASH`). The same numbers
`peer join` checks against the device before it claims a stage.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from peer.core.memory import estimate_stage
from peer.core.subspace.compression import k_from_ratio
from peer.errors import ConfigError
from peer.node.pipeline.schedule import MAX_STASH
from peer.research.plan.command import PLAN_PRESETS

STAGE_COUNTS = (1, 2, 4, 8)
MODES = (("fp32", False), ("bf16", False), ("fp32", True), ("bf16", True))


def mode_name(precision: str, checkpointing: bool) -> str:
    return precision + (" ckpt" if checkpointing else "")


def memory_rows(microbatch_size: int, seq_len: int, microbatches: int, k_ratio: str) -> list[dict[str, Any]]:
    """One row per (preset, stage count): the largest stage's peak bytes in each mode on a GPU
    (`device`: weights, gradients, AdamW, activations, workspace), its host RAM beside it (θ_start,
    the previous state, the error buffer and a round's transients), and the peak when the device
    is the CPU (`cpu <mode>`: one memory holds both)."""
    rows = []
    for name, cfg in PLAN_PRESETS.items():
        L = min(seq_len, cfg.max_seq_len)
        k = k_from_ratio(cfg.d_model, k_ratio)
        for S in (s for s in STAGE_COUNTS if s <= cfg.n_layers):
            window = 1 if S == 1 else min(microbatches, MAX_STASH)
            row: dict[str, Any] = {"model": name, "n_params": cfg.n_params, "stages": S, "seq_len": L}
            row["in_flight"] = window
            for precision, ckpt in MODES:
                stages = [
                    estimate_stage(
                        cfg,
                        s,
                        S,
                        microbatch_size=microbatch_size,
                        seq_len=L,
                        in_flight=window,
                        precision=precision,
                        checkpointing=ckpt,
                        k=k,
                        device_kind="cuda",
                    )
                    for s in range(S)
                ]
                row[mode_name(precision, ckpt)] = max(m.device for m in stages)
                row["host"] = max(m.host for m in stages)  # the same in every mode
                row["cpu " + mode_name(precision, ckpt)] = max(m.peak for m in stages)  # a CPU device: one memory
            rows.append(row)
    return rows


def plan_memory(args: Mapping[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """`peer plan --memory`: the inputs it sizes (the flags' micro-batch shape) and its rows (one --k-ratio)."""
    inputs = {n: args[n] for n in ("microbatch_size", "seq_len", "microbatches", "k_ratio")}
    if "," in str(inputs["k_ratio"]):
        raise ConfigError(f"--memory takes one --k-ratio (the boundary width it sizes), got {inputs['k_ratio']!r}")
    return inputs, memory_rows(**inputs)

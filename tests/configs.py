"""The small two-stage run most math and simulator tests train: 4 sequences of 16 tokens in 2
micro-batches, 2 inner and 2 outer steps on the `tiny` preset (`tiny_run`, with overrides)."""

from __future__ import annotations

from typing import Any

from peer.config import RunConfig, build_config

TINY_RUN: dict[str, Any] = {
    "train.batch_size": 4,
    "train.microbatches": 2,
    "train.seq_len": 16,
    "train.inner_steps": 2,
    "train.outer_steps": 2,
    "stages": 2,
}


def tiny_run(**overrides: Any) -> RunConfig:
    """`TINY_RUN` with dotted-key `overrides`, read with no environment (a user's `PEER_*` never leaks in)."""
    return build_config(overrides={**TINY_RUN, **overrides}, environ={})

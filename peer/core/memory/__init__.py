"""Memory: the sizes users type (`sizes`) and what a stage needs on its device (`estimate`).

`estimate_stage` / `estimate_replica` add up a holder's state, the activations its micro-batches
keep for backward (`activations`, counted op by op from the model) and its transient peaks;
`peer.node.fit` checks the result against the device before a peer claims a stage, and
`peer plan --memory` prints it for every preset. `estimate_sharded_replica` (`sharded`) is one rank
of a full replica sharded over N ranks, the FSDP2 layout issue 40 plans (a model only so far).
"""

from peer.core.memory.activations import (
    PRECISIONS,
    MicroBatch,
    block_bytes,
    cast_bytes,
    head_bytes,
    stash_bytes,
)
from peer.core.memory.estimate import StageMemory, estimate_replica, estimate_stage
from peer.core.memory.sharded import MAX_RANKS, estimate_sharded_replica
from peer.core.memory.sizes import format_bytes, parse_bytes

__all__ = [
    "MAX_RANKS",
    "PRECISIONS",
    "MicroBatch",
    "StageMemory",
    "block_bytes",
    "cast_bytes",
    "estimate_replica",
    "estimate_sharded_replica",
    "estimate_stage",
    "format_bytes",
    "head_bytes",
    "parse_bytes",
    "stash_bytes",
]

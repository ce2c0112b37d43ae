"""The data-plane messages as plain dataclasses: what the rest of `peer` sends and receives.

Nothing here knows about protobuf; `peer.net.transport.codec` maps these to and from the wire
(protos/peer.proto). Conventions:
- token ids (`tokens`, `targets`) are int32 (b, L); the codec also accepts int64 and narrows it.
- boundary tensors (`hidden`, `grad`) are float (b, L, k) in a compressed call or (b, L, d) in an
  uncompressed one (the request's `compressed` flag: its head's mode for the outer step); on the
  wire they use the sender's wire dtype (fp32, bf16, fp16) and the receiver gets them in that
  dtype (cast with `.to(...)` before use).
- steps, micro-batch and stage indices are non-negative ints.
Messages are immutable containers (frozen); `eq=False` because tensors have no boolean equality.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor

__all__ = [
    "ArtifactRequest",
    "BackwardReply",
    "BackwardRequest",
    "FileSlice",
    "ForwardReply",
    "ForwardRequest",
    "PayloadKind",
    "PayloadRequest",
    "RangeBlob",
    "RangesReply",
    "StateReply",
    "StateRequest",
    "StepReply",
    "StepRequest",
]


@dataclass(frozen=True, eq=False)
class ForwardRequest:
    """The head sends a micro-batch's boundary activation into `stage`.

    For the last stage `targets` is set and the stage runs forward, loss and (when `train`)
    backward in one call, answering with the loss and the gradient w.r.t. its input. With a
    `route` (stage-to-stage streaming) an intermediate stage forwards its output to `route[0]`
    itself, backpropagates the gradient that comes back and answers like the last stage.
    """

    pipeline_id: str
    microbatch: int
    outer_step: int
    inner_step: int
    stage: int
    tokens: Tensor  # (b, L) int32
    hidden: Tensor  # (b, L, k or d) float
    targets: Tensor | None = None  # (b, L) int32, last stage only
    train: bool = True  # False: evaluation; the stage keeps nothing for a backward pass
    attempt: int = 0  # replay number of this inner step: higher restarts it on the stage, lower is stale
    route: tuple[str, ...] = ()  # streaming: addresses of stages stage+1 .. S-1 (targets travel along)
    window: int = 0  # micro-batches in flight (0: sequential); stage s stashes at most window - s
    defer_norms: bool = False  # last micro-batch, streamed: Σ‖g‖² follow the answer (see ForwardReply.late)
    compressed: bool = True  # False: an uncompressed pipeline's call, `hidden` and the gradient (b, L, d)


@dataclass(frozen=True, eq=False)
class ForwardReply:
    """Intermediate stage: `hidden` (b, L, k or d). Last stage: `loss`, plus `grad` (b, L, k or d)
    w.r.t. its input when the request had `train=True`."""

    hidden: Tensor | None = None
    loss: float | None = None
    grad: Tensor | None = None
    grad_sq_norm: float | None = None  # last training micro-batch: the stage's Σ‖g‖² (global clipping)
    sq_norms: tuple[float, ...] = ()  # streamed, last micro-batch: Σ‖g‖² of stages S-1, S-2, ..., this one
    served_s: float | None = None  # seconds the stage held the request (queue, compute, later hops)
    # asked with `defer_norms`: Σ‖g‖² of stages S-1 .. this one, sent after the answer once the
    # weight gradients are done (a second message on the same stream); not itself on the wire
    late: Callable[[], tuple[float, ...]] | None = field(default=None, repr=False)

    def norms(self) -> tuple[float, ...]:
        """Σ‖g‖² of the answering stages (S-1 .. this one), wherever they came: in the reply, or
        after it (`late`, which waits for them); () when the reply carries none."""
        if self.sq_norms:
            return self.sq_norms
        if self.grad_sq_norm is not None:
            return (self.grad_sq_norm,)
        return () if self.late is None else self.late()


@dataclass(frozen=True, eq=False)
class BackwardRequest:
    """The head sends the gradient w.r.t. `stage`'s output for one micro-batch."""

    pipeline_id: str
    microbatch: int
    outer_step: int
    inner_step: int
    stage: int
    grad: Tensor  # (b, L, k or d) float
    compressed: bool = True  # the forward pass's mode (`ForwardRequest.compressed`)


@dataclass(frozen=True, eq=False)
class BackwardReply:
    """Gradient w.r.t. the stage's input (b, L, k or d); None only when nobody upstream needs it."""

    grad: Tensor | None = None
    grad_sq_norm: float | None = None  # last micro-batch of the inner step: the stage's Σ‖g‖²


@dataclass(frozen=True, eq=False)
class StepRequest:
    """The head tells a stage to take its optimizer step for `inner_step` after `n_microbatches`."""

    pipeline_id: str
    outer_step: int
    inner_step: int
    n_microbatches: int
    tokens: int  # tokens processed by the pipeline in this inner step
    grad_norm: float | None = None  # gradient norm over all stages; None: each stage clips by its own


@dataclass(frozen=True, eq=False)
class StepReply:
    ok: bool
    message: str = ""


class PayloadKind(enum.IntEnum):
    """What a `PayloadRequest` asks for (the proto's PayloadRequest.Kind)."""

    PAYLOAD = 0  # a whole payload (answer: its bytes)
    PART = 1  # a ranges round: `sender`'s parts of `ranges`, with merkle proofs (answer: a RangesReply)
    SHARD = 2  # a ranges round: shards of `ranges` the peer holds, `sender` = the sha256 wanted (answer: a RangesReply)
    EMBED = 3  # a payload's embedding view (answer: its bytes; peer.core.sparseloco.codec.sections)


@dataclass(frozen=True, eq=False)
class PayloadRequest:
    """Ask for `sender`'s SparseLoCo payload of `stage` in round `outer_step` (answer: bytes; kind
    EMBED: its embedding view), or parts
    or shards of `ranges` in a ranges round (`kind`; docs/protocol.md, RANGES)."""

    outer_step: int
    stage: int
    sender: str
    kind: PayloadKind = PayloadKind.PAYLOAD
    ranges: tuple[int, ...] = ()


@dataclass(frozen=True, eq=False)
class RangeBlob:
    """One range's bytes: a part with its merkle path (sibling hashes, 16 bytes each, leaf first) or a shard."""

    range: int
    data: bytes
    proof: tuple[bytes, ...] = ()


@dataclass(frozen=True, eq=False)
class RangesReply:
    """The answer to a PART or SHARD `PayloadRequest` (carried as the bytes of a Blob)."""

    items: tuple[RangeBlob, ...] = ()


@dataclass(frozen=True, eq=False)
class StateRequest:
    """Ask for the current weights and buffers of `stage` (late joiners, re-sync)."""

    stage: int


@dataclass(frozen=True, eq=False)
class StateReply:
    """A stage's state tagged with the outer step it belongs to; `meta` is JSON-serialisable."""

    outer_step: int
    meta: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, Tensor] = field(default_factory=dict)


@dataclass(frozen=True, eq=False)
class ArtifactRequest:
    """Ask for a named artefact (e.g. the tokenizer model, a dataset shard by sha256) from byte
    `offset` on (answer: bytes, or a `FileSlice` the server streams from disk)."""

    name: str
    offset: int = 0


@dataclass(frozen=True)
class FileSlice:
    """A handler's answer to `get_artifact` that the server streams from disk, chunk by chunk:
    `size` bytes of the file at `path` from byte `offset` (the file is never read whole)."""

    path: Path
    offset: int
    size: int

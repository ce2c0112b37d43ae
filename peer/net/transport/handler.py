"""The synchronous interface a peer implements to serve the data plane (`PeerServer(handler)`).

Methods take and return the dataclasses of `peer.net.transport.messages`; they never see protobuf or
gRPC. The server calls them from its worker threads, possibly concurrently, so an implementation
guards its own state. Requests arrive already validated by the codec (dtypes, shapes, finite
values, token range when the server knows the vocabulary).

Signalling failures: raise `NotFoundError` for something this peer does not hold (answered as
NOT_FOUND), `TransportError` for a request it cannot accept as sent (INVALID_ARGUMENT), any other
`PeerError` for a request that is valid but wrong for this peer's state, e.g. another outer step
(FAILED_PRECONDITION). Other exceptions are bugs: the server logs the traceback, answers INTERNAL
and keeps serving.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from peer.net.transport.messages import (
    ArtifactRequest,
    BackwardReply,
    BackwardRequest,
    FileSlice,
    ForwardReply,
    ForwardRequest,
    PayloadRequest,
    RangesReply,
    StateReply,
    StateRequest,
    StepReply,
    StepRequest,
)

HANDLER_METHODS = ("forward", "backward", "step", "get_payload", "get_state", "get_artifact", "info")


@runtime_checkable
class PeerHandler(Protocol):
    def forward(self, request: ForwardRequest) -> ForwardReply:
        """Run the stage on a boundary activation (last stage: forward + loss + backward)."""
        ...

    def backward(self, request: BackwardRequest) -> BackwardReply:
        """Back-propagate the gradient w.r.t. the stage output of an earlier forward."""
        ...

    def step(self, request: StepRequest) -> StepReply:
        """Take the optimizer step for the inner step once all micro-batches are done."""
        ...

    def get_payload(self, request: PayloadRequest) -> bytes | RangesReply:
        """The serialized SparseLoCo payload of (outer_step, stage, sender), or (a PART or SHARD
        request of a ranges round) the parts or shards it asks for."""
        ...

    def get_state(self, request: StateRequest) -> StateReply:
        """Current weights and buffers of a stage, tagged with the outer step."""
        ...

    def get_artifact(self, request: ArtifactRequest) -> bytes | FileSlice:
        """A named artefact (e.g. "tokenizer.model") from `request.offset` on: bytes, or a
        `FileSlice` the server streams from disk (large artefacts: dataset shards)."""
        ...

    def info(self) -> dict[str, Any]:
        """Health and identity as a JSON-serialisable dict (cheap; used as a ping)."""
        ...

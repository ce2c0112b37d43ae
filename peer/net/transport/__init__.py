"""The gRPC data plane: the only package that imports grpc or the generated protobuf stubs.

Public API (everything else in here is wire detail):
- messages: ForwardRequest/Reply, BackwardRequest/Reply, StepRequest/Reply, PayloadRequest,
  StateRequest/Reply, ArtifactRequest (plain dataclasses with tensors); FileSlice, an artefact a
  handler answers from disk (streamed, never held whole: peer.net.transport.blobs).
- PeerHandler: the synchronous interface a peer implements; PeerServer serves it.
- PeerClient: synchronous calls with deadlines, bounded retries and byte counters.
- encoded_size / framed_size: exact wire bytes of a message, for planners and metrics.
- TransportError, RemoteError, NotFoundError (and peer.errors.NetworkError); Refusal, RefusalKind:
  the typed reason a peer refused a pipeline call (`RemoteError.refusal`; a handler raises
  `Refused`, or a NotFoundError / TransportError / HopError with a refusal).
It imports no math module of `peer` (model, subspace, sparseloco, data).
"""

from peer.config import WIRE_DTYPES
from peer.net.transport.client import PeerClient
from peer.net.transport.codec import encoded_size
from peer.net.transport.errors import (
    NetworkError,
    NotFoundError,
    Refusal,
    RefusalKind,
    Refused,
    RemoteError,
    TransportError,
)
from peer.net.transport.framing import CHUNK_BYTES, framed_size
from peer.net.transport.handler import PeerHandler
from peer.net.transport.messages import (
    ArtifactRequest,
    BackwardReply,
    BackwardRequest,
    FileSlice,
    ForwardReply,
    ForwardRequest,
    PayloadRequest,
    StateReply,
    StateRequest,
    StepReply,
    StepRequest,
)
from peer.net.transport.server import PeerServer
from peer.net.transport.tensors import WireLimits

__all__ = [
    "CHUNK_BYTES",
    "WIRE_DTYPES",
    "ArtifactRequest",
    "BackwardReply",
    "BackwardRequest",
    "FileSlice",
    "ForwardReply",
    "ForwardRequest",
    "NetworkError",
    "NotFoundError",
    "PayloadRequest",
    "PeerClient",
    "PeerHandler",
    "PeerServer",
    "Refusal",
    "RefusalKind",
    "Refused",
    "RemoteError",
    "StateReply",
    "StateRequest",
    "StepReply",
    "StepRequest",
    "TransportError",
    "WireLimits",
    "encoded_size",
    "framed_size",
]

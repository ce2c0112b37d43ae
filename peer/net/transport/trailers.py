"""A typed refusal on the wire: `Refusal` <-> protobuf, in an error status's trailing metadata.

The server sets `REFUSAL_KEY` (a binary key: the value is a serialized `peer.v1.Refusal`) before it
ends a call with an error status; a reverse stream carries the same message in the call's last
Frame (`peer.net.transport.reverse`). The client reads it back with `refusal_from_metadata`. What a
peer sends is a claim: a value that does not parse, an unknown kind or a negative stage gives
None (the call is then classified by its status code alone), never an exception.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from google.protobuf.message import DecodeError

from peer.net.transport import peer_pb2 as pb
from peer.net.transport.errors import Refusal, RefusalKind

REFUSAL_KEY = "peer-refusal-bin"  # gRPC carries keys ending in -bin as raw bytes
MAX_REFUSAL_BYTES = 256  # five small fields; anything longer is not one


def to_pb(refusal: Refusal) -> pb.Refusal:
    return pb.Refusal(
        kind=int(refusal.kind),  # type: ignore[arg-type]  # the enum's numbers are the proto's
        stage=refusal.stage,
        outer_step=refusal.outer_step,
        inner_step=refusal.inner_step,
        attempt=refusal.attempt,
    )


def from_pb(msg: pb.Refusal) -> Refusal | None:
    """The Refusal a message carries; None for no kind, a kind this build does not know, or a
    negative stage."""
    try:
        kind = RefusalKind(int(msg.kind))
    except ValueError:
        return None
    if kind is RefusalKind.UNSPECIFIED or msg.stage < 0:
        return None
    return Refusal(kind, int(msg.stage), int(msg.outer_step), int(msg.inner_step), int(msg.attempt))


def trailing_metadata(refusal: Refusal) -> tuple[tuple[str, bytes], ...]:
    """The trailing metadata that carries `refusal`."""
    return ((REFUSAL_KEY, to_pb(refusal).SerializeToString()),)


def refusal_pb_from_metadata(metadata: Iterable[Any] | None) -> pb.Refusal | None:
    """The `peer.v1.Refusal` message under `REFUSAL_KEY`, or None (absent, too long, malformed)."""
    for item in metadata or ():
        key, value = item[0], item[1]
        if key != REFUSAL_KEY or not isinstance(value, bytes) or len(value) > MAX_REFUSAL_BYTES:
            continue
        try:
            msg: pb.Refusal = pb.Refusal.FromString(value)
        except DecodeError:
            return None
        return msg
    return None


def refusal_from_metadata(metadata: Iterable[Any] | None) -> Refusal | None:
    """The typed refusal in a call's trailing metadata, or None."""
    msg = refusal_pb_from_metadata(metadata)
    return None if msg is None else from_pb(msg)

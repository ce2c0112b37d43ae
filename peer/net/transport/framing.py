"""Chunk framing: one serialized message <-> a stream of `Chunk` (peer.proto) of <= 1 MiB each.

Invariants: a stream carries exactly one message; every chunk but the last has `last = false`;
the receiver stops at the first `last = true`, rejects a stream that ends without it and any
stream whose total exceeds its limit as soon as the limit is crossed (it never buffers more than
the limit). An empty message is a single empty chunk with `last = true`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from peer.net.transport import peer_pb2 as pb
from peer.net.transport.errors import TransportError

CHUNK_BYTES = 1 << 20
# Largest single gRPC message either side accepts: a full chunk plus its framing, and every
# unary message (Step, Info) comfortably fits too.
GRPC_MESSAGE_LIMIT = CHUNK_BYTES + (1 << 16)


def split(data: bytes, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.Chunk]:
    """Yield the chunks that carry `data`."""
    n = len(data)
    if n == 0:
        yield pb.Chunk(data=b"", last=True)
        return
    view = memoryview(data)
    for start in range(0, n, chunk_bytes):
        end = min(start + chunk_bytes, n)
        yield pb.Chunk(data=bytes(view[start:end]), last=end == n)


def join(chunks: Iterable[pb.Chunk], max_bytes: int, what: str) -> bytes:
    """Reassemble one message from `chunks`; TransportError on a bad or oversized stream."""
    parts: list[bytes] = []
    total = 0
    for chunk in chunks:
        total += len(chunk.data)
        if total > max_bytes:
            raise TransportError(
                f"{what} is larger than the {max_bytes}-byte message limit; raise max_message_bytes on "
                "the receiving side if this size is expected"
            )
        parts.append(chunk.data)
        if chunk.last:
            return b"".join(parts)
    raise TransportError(f"{what} stream ended before its last chunk; the sender was cut off or is incompatible")


def chunk_size(n_data: int, last: bool) -> int:
    """Serialized size of one Chunk with `n_data` bytes of data (== Chunk(...).ByteSize())."""
    size = 1 + _varint_size(n_data) + n_data if n_data else 0
    return size + (2 if last else 0)


def framed_size(n_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Bytes on the wire (gRPC message payloads) of a message of `n_bytes` sent with `split`."""
    if n_bytes == 0:
        return chunk_size(0, True)
    full, rest = divmod(n_bytes, chunk_bytes)
    if rest == 0:
        return (full - 1) * chunk_size(chunk_bytes, False) + chunk_size(chunk_bytes, True)
    return full * chunk_size(chunk_bytes, False) + chunk_size(rest, True)


def _varint_size(value: int) -> int:
    size = 1
    while value >= 0x80:
        value >>= 7
        size += 1
    return size

"""A Blob streamed between a file and the wire, never held whole (large artefacts: dataset shards).

protobuf encodes `Blob{data}` as the byte 0x0a (field 1, length-delimited), varint(len(data)) and
the data; an empty Blob is no bytes at all. `file_chunks` yields exactly the Chunks that
`framing.split(Blob(data=<the file's bytes>).SerializeToString())` would, reading the file
`CHUNK_BYTES` at a time; `write_blob` takes a received Chunk stream apart again and writes the data
to a binary file as it arrives. So a shard streamed from disk and a tokenizer held in memory are the
same bytes on the wire, and a reader of either kind understands both.

Invariants: a sender that cannot read the bytes it promised raises `OSError` before the chunk marked
last (the receiver sees a broken stream, never a short artefact); a receiver accepts a stream only
when its declared length is the length it asked for and the chunks carry exactly that many bytes,
so a peer can neither send more than was asked (the receiver stops as soon as it would) nor end
early unnoticed. Memory: one chunk per stream, whatever the artefact's size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import BinaryIO

from peer.net.transport import peer_pb2 as pb
from peer.net.transport.errors import TransportError
from peer.net.transport.framing import CHUNK_BYTES

_BLOB_DATA_TAG = 0x0A  # field 1 (Blob.data), wire type 2 (length-delimited)
_MAX_HEADER = 11  # the tag and a varint of at most 10 bytes


def blob_header(size: int) -> bytes:
    """The bytes protobuf puts before `size` bytes of Blob.data (none for an empty Blob)."""
    if size == 0:
        return b""
    out = bytearray([_BLOB_DATA_TAG])
    while size >= 0x80:
        out.append((size & 0x7F) | 0x80)
        size >>= 7
    out.append(size)
    return bytes(out)


def file_chunks(path: Path, offset: int, size: int, chunk_bytes: int = CHUNK_BYTES) -> Iterator[pb.Chunk]:
    """The Chunks of a Blob holding `size` bytes of `path` from byte `offset`, read as they are sent.

    OSError when the file is missing or ends before `size` bytes (then no last chunk was sent)."""
    header = blob_header(size)
    if not header:
        yield pb.Chunk(data=b"", last=True)
        return
    done = 0  # bytes of the file sent so far
    with open(path, "rb") as f:
        f.seek(offset)
        while done < size:
            room = max(1, chunk_bytes - len(header)) if done == 0 else chunk_bytes
            want = min(room, size - done)
            data = f.read(want)
            if len(data) != want:
                raise OSError(f"{path} ends {size - done - len(data)} bytes short of the {size} promised from {offset}")
            yield pb.Chunk(data=header + data if done == 0 else data, last=done + want == size)
            done += want


def _read_header(head: bytes) -> tuple[int, int] | None:
    """(declared size, header length) once `head` holds a whole header; None while it is too short."""
    if not head:
        return None
    if head[0] != _BLOB_DATA_TAG:
        raise TransportError(f"artefact stream starts with byte {head[0]:#04x}, not a Blob's data field")
    size, shift = 0, 0
    for i, byte in enumerate(head[1:_MAX_HEADER], start=1):
        size |= (byte & 0x7F) << shift
        if byte < 0x80:
            return size, i + 1
        shift += 7
    if len(head) >= _MAX_HEADER:
        raise TransportError("artefact stream has a malformed Blob length")
    return None


def write_blob(chunks: Iterable[pb.Chunk], sink: BinaryIO, expected: int) -> int:
    """Write the data of the Blob carried by `chunks` to `sink` as it arrives; returns its length.

    TransportError when the Blob's declared length is not `expected`, the stream carries more or
    fewer bytes than it declared, or it ends without its last chunk."""
    head = b""
    header: tuple[int, int] | None = None
    written = 0
    for chunk in chunks:
        data = chunk.data
        if header is None:
            head += data
            header = _read_header(head)
            if header is not None:
                if header[0] != expected:
                    raise TransportError(f"the peer sends an artefact of {header[0]} bytes; {expected} were asked for")
                data = head[header[1] :]
            elif not chunk.last:
                continue
            else:
                data = b""
        if written + len(data) > expected:
            raise TransportError(f"the peer sends more than the {expected} bytes of the artefact it declared")
        if data:
            sink.write(data)
            written += len(data)
        if chunk.last:
            if header is None and head:
                raise TransportError("artefact stream ended inside its Blob header")
            if written != expected:
                raise TransportError(f"the peer's artefact stream ended after {written} of {expected} bytes")
            return written
    raise TransportError(f"artefact stream ended before its last chunk ({written} of {expected} bytes)")

"""Blobs streamed from a file: the same chunks as a Blob held in memory, taken apart again exactly,
and every malformed or oversized stream refused (peer.net.transport.blobs)."""

from __future__ import annotations

import io

import pytest

from peer.net.transport import ArtifactRequest, TransportError, codec, framing
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.blobs import blob_header, file_chunks, write_blob


@pytest.mark.parametrize("size", [0, 1, 127, 128, 1000, 16384, 40_000])
@pytest.mark.parametrize("offset", [0, 7])
def test_a_file_streams_as_the_chunks_of_its_blob_and_reads_back(tmp_path, size, offset):
    raw = bytes(range(256)) * ((size + offset) // 256 + 1)
    path = tmp_path / "shard.bin"
    path.write_bytes(raw[: size + offset])
    want = raw[offset : offset + size]
    blob = pb.Blob(data=want).SerializeToString()
    assert blob_header(size) == blob[: len(blob) - size]
    streamed = list(file_chunks(path, offset, size, chunk_bytes=4096))
    assert [(c.data, c.last) for c in streamed] == [(c.data, c.last) for c in framing.split(blob, 4096)]
    sink = io.BytesIO()
    assert write_blob(iter(streamed), sink, size) == size and sink.getvalue() == want


def test_a_small_blob_held_in_memory_is_read_by_the_streaming_reader():
    sink = io.BytesIO()
    chunks = framing.split(codec.to_bytes(b"tokenizer bytes"), 3)  # header split over chunks too
    assert write_blob(chunks, sink, 15) == 15 and sink.getvalue() == b"tokenizer bytes"


def test_a_file_shorter_than_promised_never_sends_its_last_chunk(tmp_path):
    path = tmp_path / "short.bin"
    path.write_bytes(b"x" * 100)
    sent = []
    with pytest.raises(OSError, match="short"):
        for chunk in file_chunks(path, 0, 150, chunk_bytes=64):
            sent.append(chunk)
    assert sent and not any(c.last for c in sent)


def _chunks(data: bytes, chunk_bytes: int = 10) -> list[pb.Chunk]:
    return list(framing.split(data, chunk_bytes))


@pytest.mark.parametrize(
    "stream, expected, match",
    [
        (_chunks(pb.Blob(data=b"a" * 50).SerializeToString()), 40, "50 bytes; 40 were asked"),
        (_chunks(b"\x12\x03abc"), 3, "not a Blob's data field"),
        (_chunks(pb.Blob(data=b"a" * 50).SerializeToString())[:-1], 50, "before its last chunk"),
        ([pb.Chunk(data=blob_header(50) + b"a" * 20, last=True)], 50, "ended after 20 of 50"),
        ([pb.Chunk(data=blob_header(5) + b"a" * 9, last=True)], 5, "more than the 5 bytes"),
        ([pb.Chunk(data=b"", last=True)], 5, "ended after 0 of 5"),
        ([pb.Chunk(data=b"\x0a\xff", last=True)], 5, "inside its Blob header"),
    ],
    ids=["other-size", "other-field", "no-last", "short", "long", "empty", "cut-header"],
)
def test_malformed_streams_are_refused(stream, expected, match):
    sink = io.BytesIO()
    with pytest.raises(TransportError, match=match):
        write_blob(iter(stream), sink, expected)
    assert len(sink.getvalue()) <= expected  # never more than asked for reaches the file


def test_artifact_request_offset_travels_and_a_negative_one_is_invalid():
    msg = codec.encode(ArtifactRequest("ab" * 32, offset=12345))
    assert codec.decode(msg).offset == 12345 and codec.decode(msg).name == "ab" * 32
    with pytest.raises(TransportError, match="offset"):
        codec.decode(pb.ArtifactRequest(name="dataset-index", offset=-1))

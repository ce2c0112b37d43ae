"""A payload's id, over three sections, and its embedding view: the one entry a later stage needs.

A holder of a stage s > 0 of a compressed pipeline moves its T⊥ by stage 0's committed change
u = fl32(−η·Δ̄[embed.weight]) (`peer.core.sparseloco.commit`). Of each stage-0 payload, u reads the
embedding's entry and the whole payload's norm (the median clip scales a contribution by its norm over
every tensor) and nothing else (outlier screening screens the embedding apart from the rest:
`peer.core.sparseloco.robust.sections`). So the id
that announcements and committed sets name is a hash over three sections of the payload's bytes
rather than the sha256 of the bytes, and a view — the embedding's section with what proves it — is
checked against that id alone (docs/protocol.md, "Embedding views"):

    index = header (the payload's first HEADER_NBYTES bytes) ‖ u32 position of the embed.weight entry
            (NO_ENTRY: none) ‖ f64 ‖Δ̂‖ over every entry (`clip.payload_norm`, exactly rounded)
    embed = the bytes of the embed.weight entry (empty without one)
    rest  = the bytes of every other entry, in payload order
    id    = sha256(DOMAIN ‖ sha256(index) ‖ sha256(embed) ‖ sha256(rest))          (hex, 64 digits)
    view  = VIEW_MAGIC ‖ index ‖ sha256(rest) ‖ embed

Invariants: the id is a function of the payload's bytes alone — the index is derived from them, so
whoever holds the whole payload recomputes the id, and an announcer cannot pair real bytes with
another index; a view that hashes to an id carries exactly the header, the embedding entry and the
norm of the whole payload with that id (sha256's collision resistance); one payload has one id.
What a view cannot prove is that a whole payload with that id exists and is valid: a holder of
stage 0 checks the whole, an observer checks it only when a claim leaves the payload out
(`peer.node.round.gather`). Pure: no networking, no torch.
"""

from __future__ import annotations

import hashlib
import math
import struct
from dataclasses import dataclass

from peer.core.sparseloco.codec.clip import payload_norm
from peer.core.sparseloco.codec.format import (
    HEADER_NBYTES,
    Payload,
    PayloadError,
    SparseLoCoConfig,
    entry_nbytes,
    read_entry,
    read_header,
)

__all__ = ["EMBED_ENTRY", "Sections", "View", "payload_id", "read_view", "sections", "view_bytes", "view_nbytes"]

EMBED_ENTRY = "embed.weight"  # the entry a view carries (peer.core.subspace.state.EMBED; a test keeps them one)
DOMAIN = b"SLCO-ID1"  # separates a payload id from a plain sha256 of the same bytes
VIEW_MAGIC = b"SLCV"
NO_ENTRY = 0xFFFFFFFF  # the index's position when the payload has no embedding entry
_TAIL = struct.Struct("<Id")  # the index after the header: the entry's position, the payload's norm
INDEX_NBYTES = HEADER_NBYTES + _TAIL.size
DIGEST_NBYTES = 32


@dataclass(frozen=True)
class Sections:
    """A payload cut for its id: the index (header, embedding position, norm), the embedding entry's
    bytes and every other entry's bytes, in payload order."""

    index: bytes
    embed: bytes
    rest: bytes
    norm: float

    @property
    def id(self) -> str:
        return _id(self.index, _sha(self.embed), _sha(self.rest))


@dataclass(frozen=True)
class View:
    """A checked view: the id it proves, the payload reduced to its embedding entry, the whole norm."""

    id: str
    payload: Payload  # only the embedding's entry (none when the payload had none)
    norm: float  # ‖Δ̂‖ of the whole payload, as `payload_norm` gives it


def _sha(b: bytes) -> bytes:
    return hashlib.sha256(b).digest()


def _id(index: bytes, embed_digest: bytes, rest_digest: bytes) -> str:
    return hashlib.sha256(DOMAIN + _sha(index) + embed_digest + rest_digest).hexdigest()


def sections(data: bytes, payload: Payload) -> Sections:
    """`data` (a payload's bytes; `payload` parsed from them, or the object they were serialized from)
    cut into its sections. Every entry's span is its layout size (`entry_nbytes`), in payload order."""
    at, spans, position = HEADER_NBYTES, [], NO_ENTRY
    for i, e in enumerate(payload.entries):
        n = entry_nbytes(e.name, e.kind, e.shape, payload.chunk, payload.topk, payload.quant_bits)
        spans.append((at, at + n))
        position = i if e.name == EMBED_ENTRY else position
        at += n
    if at != len(data):
        raise ValueError(f"{len(data)} bytes, the payload's layout says {at}")
    norm = payload_norm(payload)
    index = data[:HEADER_NBYTES] + _TAIL.pack(position, norm)
    embed = b"" if position == NO_ENTRY else data[spans[position][0] : spans[position][1]]
    rest = b"".join(data[a:b] for i, (a, b) in enumerate(spans) if i != position)
    return Sections(index, embed, rest, norm)


def payload_id(data: bytes, payload: Payload | None = None) -> str:
    """The id announced for a payload and named by committed sets (module docstring); `payload`:
    `data` parsed (parsed here when None; PayloadError for bytes that are no payload)."""
    return sections(data, payload if payload is not None else Payload.from_bytes(data)).id


def view_bytes(data: bytes, payload: Payload) -> bytes:
    """The view of a payload (module docstring): what a holder serves to an observer of the embedding."""
    cut = sections(data, payload)
    return VIEW_MAGIC + cut.index + _sha(cut.rest) + cut.embed


def view_nbytes(embed_entry_nbytes: int) -> int:
    """A view's size for an embedding entry of `embed_entry_nbytes` (`entry_nbytes`): what `peer plan`
    and `peer bench swarm` count for a later stage's fetch of a stage-0 payload."""
    return len(VIEW_MAGIC) + INDEX_NBYTES + DIGEST_NBYTES + embed_entry_nbytes


def read_view(data: bytes, cfg: SparseLoCoConfig, max_elements: int) -> View:
    """Parse and check a view with this run's settings: the index's header (the run's quant_bits, chunk
    and topk), a finite norm no smaller than the entry's own, and the embedding entry (validated as
    `Payload.from_bytes` validates it, at most `max_elements` elements, named EMBED_ENTRY). Returns the
    id it proves — the caller compares it with the announced one. PayloadError, and nothing else, on
    any invalid input."""
    fixed = len(VIEW_MAGIC) + INDEX_NBYTES + DIGEST_NBYTES
    if len(data) < fixed or data[: len(VIEW_MAGIC)] != VIEW_MAGIC:
        raise PayloadError(f"invalid payload view: {len(data)} bytes without the view's magic and index")
    index = data[len(VIEW_MAGIC) : len(VIEW_MAGIC) + INDEX_NBYTES]
    rest_digest, embed = data[fixed - DIGEST_NBYTES : fixed], data[fixed:]
    qb, chunk, topk, n_tensors = read_header(index[:HEADER_NBYTES], cfg)
    position, norm = _TAIL.unpack(index[HEADER_NBYTES:])
    if not (math.isfinite(norm) and norm >= 0):
        raise PayloadError(f"invalid payload view: norm {norm}")
    if position == NO_ENTRY:
        if embed:
            raise PayloadError("invalid payload view: entry bytes without an entry position")
        entries = []
    else:
        if position >= n_tensors:
            raise PayloadError(f"invalid payload view: entry #{position} of {n_tensors}")
        entry = read_entry(embed, chunk, topk, qb, max_elements)
        if entry.name != EMBED_ENTRY:
            raise PayloadError(f"invalid payload view: it carries {entry.name[:64]!r}, not {EMBED_ENTRY!r}")
        entries = [entry]
    reduced = Payload(entries, chunk, topk, qb)
    if payload_norm(reduced) > norm:  # a part's exactly rounded norm never exceeds the whole's
        raise PayloadError(f"invalid payload view: the entry's norm exceeds the payload's {norm}")
    return View(_id(index, _sha(embed), rest_digest), reduced, norm)

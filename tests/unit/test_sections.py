"""A payload's id over three sections and its embedding view (`peer.core.sparseloco.codec.sections`).

A later stage's holder fetches only the view of each stage-0 payload: it must prove exactly the bytes
of the whole payload's embedding entry, header and norm against the id the announcement and committed
sets name — a tampered entry, index or rest digest gives another id — and u computed from views must
be the very bits stage 0's holders commit from the whole payloads.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from peer.core.sparseloco.algorithm import compress, decompress
from peer.core.sparseloco.codec.clip import payload_norm
from peer.core.sparseloco.codec.format import HEADER_NBYTES, Payload, PayloadError, SparseLoCoConfig, entry_nbytes
from peer.core.sparseloco.codec.sections import (
    DIGEST_NBYTES,
    EMBED_ENTRY,
    INDEX_NBYTES,
    VIEW_MAGIC,
    payload_id,
    read_view,
    sections,
    view_bytes,
    view_nbytes,
)
from peer.core.sparseloco.commit import commit_state, embedding_update
from peer.core.subspace.state import EMBED

FIXTURE = Path(__file__).parent.parent / "fixtures" / "sparseloco_payload_v3.bin"
FIXTURE_ID = "d3fa1685ce1b577bc3d9e6cea60d2306514b0337107066fcaff51113a14c8e3f"  # the id's definition, pinned
CFG = SparseLoCoConfig(screening=False)
SHAPES = {EMBED: (256, 64), "layers.0.attn.wq.weight": (64, 64), "layers.0.attn_norm.weight": (64,)}
MAX = 256 * 64
EMBED_AT = len(VIEW_MAGIC) + INDEX_NBYTES + DIGEST_NBYTES  # where a view's entry bytes begin


def _payload(seed: int, scale: float = 1e-2, cfg: SparseLoCoConfig = CFG) -> Payload:
    gen = torch.Generator().manual_seed(seed)
    return compress({n: torch.randn(s, generator=gen) * scale for n, s in SHAPES.items()}, None, cfg)[0]


def test_the_id_of_the_pinned_payload_is_the_sections_hash_not_the_bytes_sha256():
    data = FIXTURE.read_bytes()
    assert payload_id(data) == FIXTURE_ID  # a change of the definition is a change of protocol
    assert payload_id(data) != hashlib.sha256(data).hexdigest()
    assert EMBED_ENTRY == EMBED
    cut = sections(data, Payload.from_bytes(data))  # its embedding is the last entry: any position works
    assert cut.index[:HEADER_NBYTES] == data[:HEADER_NBYTES] and cut.embed and data.endswith(cut.embed)
    assert len(cut.index) + len(cut.embed) + len(cut.rest) == len(data) + INDEX_NBYTES - HEADER_NBYTES


def test_a_view_proves_the_whole_payloads_embedding_entry_and_norm_against_its_id():
    p = _payload(1)
    data = p.to_bytes()
    view = view_bytes(data, p)
    got = read_view(view, CFG, MAX)
    assert got.id == payload_id(data)
    assert got.norm == payload_norm(p)  # the whole payload's, bit for bit
    assert [e.name for e in got.payload.entries] == [EMBED]
    assert got.payload.to_bytes() == Payload([p.entries[0]], p.chunk, p.topk, p.quant_bits).to_bytes()
    size = entry_nbytes(EMBED, 0, SHAPES[EMBED], CFG.chunk, CFG.topk, CFG.quant_bits)
    assert len(view) == view_nbytes(size) < len(data)


def test_a_payload_without_the_embedding_has_an_empty_view():
    gen = torch.Generator().manual_seed(3)
    p = compress({"layers.1.ffn.w1.weight": torch.randn(64, 64, generator=gen)}, None, CFG)[0]
    got = read_view(view_bytes(p.to_bytes(), p), CFG, MAX)
    assert got.id == payload_id(p.to_bytes()) and got.payload.entries == ()


@pytest.mark.parametrize("where", ["entry", "index norm", "index position", "rest digest"])
def test_a_tampered_view_proves_another_id_or_none(where):
    p = _payload(2)
    view = bytearray(view_bytes(p.to_bytes(), p))
    if where == "entry":
        view[-1] ^= 0x01  # one code bit of the embedding's last value
    elif where == "index norm":
        at = len(VIEW_MAGIC) + HEADER_NBYTES + 4
        view[at : at + 8] = struct.pack("<d", struct.unpack("<d", view[at : at + 8])[0] * 2)
    elif where == "index position":
        view[len(VIEW_MAGIC) + HEADER_NBYTES] ^= 0x01
    else:
        view[EMBED_AT - 1] ^= 0x01
    with contextlib.suppress(PayloadError):  # no view at all, or a view of another id
        assert read_view(bytes(view), CFG, MAX).id != payload_id(p.to_bytes())


def test_an_index_that_lies_is_caught_by_whoever_checks_the_whole():
    """An announcer may hash a lying index (a smaller norm: its payload escapes the clip) and serve a
    view that proves that id; the whole payload's id, recomputed from its bytes, is another, so every
    holder of stage 0 refuses it (and an observer that a claim leaves it out to checks it whole)."""
    p = _payload(4, scale=1.0)
    data, view = p.to_bytes(), bytearray(view_bytes(p.to_bytes(), p))
    at = len(VIEW_MAGIC) + HEADER_NBYTES + 4
    true_norm = struct.unpack("<d", view[at : at + 8])[0]
    embed_norm = payload_norm(read_view(bytes(view), CFG, MAX).payload)
    view[at : at + 8] = struct.pack("<d", (embed_norm + true_norm) / 2)
    lying = read_view(bytes(view), CFG, MAX)
    assert lying.norm < true_norm and lying.id != payload_id(data)
    view[at : at + 8] = struct.pack("<d", embed_norm / 2)  # below the entry's own norm: no view
    with pytest.raises(PayloadError, match="exceeds"):
        read_view(bytes(view), CFG, MAX)


@pytest.mark.parametrize(
    "bad",
    [
        lambda v: b"XXXX" + v[4:],  # not a view
        lambda v: v[:EMBED_AT] + v[EMBED_AT:-1],  # a truncated entry
        lambda v: v[:EMBED_AT],  # an entry position without its bytes
        lambda v: v[:8] + bytes([9]) + v[9:],  # a header of another format version
    ],
    ids=["magic", "truncated", "no entry", "version"],
)
def test_a_malformed_view_raises_payload_error_only(bad):
    p = _payload(5)
    with pytest.raises(PayloadError):
        read_view(bad(view_bytes(p.to_bytes(), p)), CFG, MAX)
    with pytest.raises(PayloadError):
        read_view(view_bytes(p.to_bytes(), p), CFG, MAX // 2)  # more elements than the embedding's


@pytest.mark.parametrize("aggregation", ["mean-over-all", "mean-over-contributors"])
def test_u_from_views_is_the_bits_stage_0_commits_from_whole_payloads(aggregation):
    cfg = SparseLoCoConfig(screening=False, aggregation=aggregation)
    payloads = [_payload(10 + i, scale=(1e-2, 3e-2, 1e-1, 2e-2)[i], cfg=cfg) for i in range(4)]  # clip binds
    start = {n: torch.zeros(s) for n, s in SHAPES.items()}
    stage0 = commit_state(start, None, payloads, cfg, None).commit
    assert stage0.clip.n_clipped > 0 and stage0.embed_update is not None
    views = [read_view(view_bytes(p.to_bytes(), p), cfg, MAX) for p in payloads]
    keys = [f"r{i}" for i in range(4)]
    u = embedding_update([v.payload for v in views], cfg, keys=keys, norms=[v.norm for v in views])
    assert np.array_equal(u.numpy().view(np.int32), stage0.embed_update.numpy().view(np.int32))


def _agreeing(seed: int, cfg: SparseLoCoConfig, times: dict[str, float]) -> Payload:
    """One of a round's honest payloads around a shared direction, its tensors `times` larger."""
    common, own = torch.Generator().manual_seed(0), torch.Generator().manual_seed(seed)
    dense = {
        n: (torch.randn(shape, generator=common) + 0.5 * torch.randn(shape, generator=own)) * 1e-2 * times.get(n, 1.0)
        for n, shape in SHAPES.items()
    }
    return compress(dense, None, cfg)[0]


def test_with_screening_on_the_embedding_is_screened_apart_and_views_give_stage_0s_u():
    """Contribution 1's embedding and contribution 3's blocks are norm outliers: each is dropped from
    its own section only, the fused and dense commits agree, and u from views is stage 0's u."""
    cfg = SparseLoCoConfig(screening=True)
    big = {1: {EMBED: 100.0}, 3: {n: 100.0 for n in SHAPES if n != EMBED}}
    payloads = [_agreeing(30 + i, cfg, big.get(i, {})) for i in range(6)]
    keys = [f"r{i}" for i in range(6)]
    start = {n: torch.zeros(s) for n, s in SHAPES.items()}
    fused = commit_state(start, None, payloads, cfg, None, keys=keys)
    dense = commit_state(start, None, [decompress(p) for p in payloads], cfg, None, keys=keys)
    screened = fused.commit.screen
    assert screened.embedding is not None and screened.embedding.dropped == (1,) and screened.dropped == (3,)
    assert fused.commit.dropped == (1, 3) == dense.commit.dropped  # outliers of the round (what bans count)
    assert all(torch.equal(fused.params[n], dense.params[n]) for n in SHAPES)
    views = [read_view(view_bytes(p.to_bytes(), p), cfg, MAX) for p in payloads]
    u = embedding_update([v.payload for v in views], cfg, keys=keys, norms=[v.norm for v in views])
    assert fused.commit.embed_update is not None
    assert np.array_equal(u.numpy().view(np.int32), fused.commit.embed_update.numpy().view(np.int32))
    # each section keeps what it did not drop: contribution 1's blocks are in Δ̄, its embedding is not
    unscreened = commit_state(start, None, payloads, dataclasses.replace(cfg, screening=False), None, keys=keys)
    assert not torch.equal(unscreened.params[EMBED], fused.params[EMBED])
    others = [i for i in range(6) if i != 3]
    without_3 = commit_state(start, None, [payloads[i] for i in others], cfg, None, keys=[keys[i] for i in others])
    assert not torch.equal(without_3.params[EMBED], fused.params[EMBED])  # 3's embedding was kept

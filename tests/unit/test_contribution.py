"""One contribution record, identified once (`peer.node.round.contribution`).

Our own payload is never parsed back from its bytes: the gather holds the encoder's `Payload` object.
That is sound only if the encoder's object commits to exactly the bits the parsed bytes do — tested
here on stage 0 (the embedding's T⊥ move included) and a later stage, with quantization and clipping
on, on both the state and the error buffer's feedback. The record also refuses bytes that do not
match their announcement, and names a set the way a link does.
"""

from __future__ import annotations

import pytest
import torch

from peer.config import build_config
from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.codec.clip import payload_norm
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.codec.sections import view_bytes
from peer.core.subspace.state import EMBED
from peer.errors import PeerError
from peer.node.round.contribution import Mismatch, ViewReader, bare, encoded, payload_id, received
from peer.node.round.payloads import round_reading, view_validator
from peer.node.stage.worker import StageWorker

SMALL = {"train.batch_size": 4, "train.microbatches": 2, "train.seq_len": 16, "stages": 2}


def _trained(stage: int, seed: int) -> StageWorker:
    cfg = build_config(overrides=SMALL, environ={})
    w = StageWorker(cfg, stage)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in w.module.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 1e-2)
    return w


@pytest.mark.parametrize("stage", [0, 1])
def test_the_encoders_payload_commits_to_the_same_bits_as_its_bytes_parsed(stage):
    ours, twin = _trained(stage, 1), _trained(stage, 1)
    others = [_trained(stage, 2 + i).contribution(f"r{i + 1}") for i in range(2)]
    mine, same = ours.contribution("r0"), twin.contribution("r0")
    assert mine.data == same.data and mine.sha256 == payload_id(mine.data)
    parsed = received("r0", same.sha256, same.data, Payload.from_bytes)
    assert parsed.payload is not same.payload  # the twin commits the bytes parsed back
    twin.ledger.last_contribution = parsed
    ours.commit_round([mine, *others], None)
    twin.commit_round([parsed, *others], None)
    assert ours.state_id() == twin.state_id()
    assert ours.ledger.link == twin.ledger.link
    for name, e in ours.optim.errors.items():
        assert torch.equal(e, twin.optim.errors[name]), name


def test_bytes_that_do_not_match_their_announcement_are_refused():
    data, other = _trained(1, 1).contribution("r0").data, _trained(1, 2).contribution("r0").data
    with pytest.raises(Mismatch):
        received("r0", payload_id(other), data, Payload.from_bytes)
    with pytest.raises(PeerError):
        received("r0", payload_id(other), b"junk", Payload.from_bytes)


def test_a_set_is_named_by_replica_and_sha256_prefixes_and_bare_payloads_by_position():
    c = encoded("r" * 40, _trained(1, 1).encode_round())
    assert c.entry == ("r" * 16, c.sha256[: len(c.entry[1])])
    anonymous = bare([c.payload])
    assert anonymous[0].replica == "" and anonymous[0].sha256 == c.sha256
    assert bare([c.payload], ["x"])[0].replica == "x"


def test_a_view_is_received_against_the_whole_payloads_id_and_a_view_of_another_is_refused():
    cfg = build_config(overrides={**SMALL, "sparseloco.screening": False}, environ={})
    whole, other = _trained(0, 1).contribution("r0"), _trained(0, 2).contribution("r0")
    reading = view_validator(stage_shapes(cfg.model, 0, cfg.stages), cfg.sparseloco)
    got = received("r0", whole.sha256, view_bytes(whole.data, whole.payload), reading)
    assert got.view and got.sha256 == whole.sha256 and got.whole_norm == payload_norm(whole.payload)
    assert [e.name for e in got.payload.entries] == [EMBED] and len(got.data) < len(whole.data)
    with pytest.raises(Mismatch):
        received("r0", whole.sha256, view_bytes(other.data, other.payload), reading)


def test_a_holder_reads_stage_0s_views_through_the_stage_before_its_own_from_stage_2_on():
    """Relays (`peer.node.round.fetcher`): stage 1 asks the senders, stage s ≥ 2 the holders of s − 1;
    stage 0's own holders read their round whole."""
    cfg = build_config(overrides={**SMALL, "stages": 4}, environ={})
    readings = {s: round_reading(cfg, StageWorker(cfg, s), 0) for s in range(4)}
    assert not isinstance(readings[0], ViewReader)
    relays = {s: r.relay for s, r in readings.items() if isinstance(r, ViewReader)}
    assert relays == {1: None, 2: 1, 3: 2}

"""Error feedback (peer.core.sparseloco.feedback): what a round returns to a sender, against dense references."""

from __future__ import annotations

import torch

from peer.core.sparseloco.algorithm import compress, decompress
from peer.core.sparseloco.codec.clip import ClipStats, clipped_mass
from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.feedback import add_to_errors, returned
from peer.core.sparseloco.robust import NOTHING, Screen
from peer.core.subspace.state import EMBED


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _stats(scales: tuple[float | None, ...]) -> ClipStats:
    return ClipStats(sum(s is not None for s in scales), (1.0,) * len(scales), 1.0, 1.0, scales)


def test_a_payload_that_missed_the_commit_goes_back_whole():
    cfg = SparseLoCoConfig(quant_bits=0)
    delta = {"w": _rand(64, 128, seed=11), "g": _rand(7, seed=12)}
    payload, errors = compress(delta, None, cfg)
    back = add_to_errors(errors, decompress(payload))
    assert back is not None
    for k in delta:
        assert torch.equal(back[k], delta[k])  # e − Δ̂ + Δ̂: nothing lost
    fresh = add_to_errors(None, decompress(payload))
    assert fresh is not None and torch.equal(fresh["w"], decompress(payload)["w"])


def test_add_to_errors_adds_and_subtracts_without_writing_its_inputs():
    errors = {"w": torch.tensor([1.0, 2.0])}
    change = {"w": torch.tensor([0.5, -1.0]), "b": torch.tensor([3.0])}
    up = add_to_errors(errors, change)
    down = add_to_errors(up, change, -1.0)
    assert up is not None and down is not None
    assert torch.equal(up["w"], torch.tensor([1.5, 1.0])) and torch.equal(up["b"], torch.tensor([3.0]))
    assert torch.equal(down["w"], errors["w"]) and torch.equal(down["b"], torch.tensor([0.0]))
    assert torch.equal(errors["w"], torch.tensor([1.0, 2.0])) and set(errors) == {"w"}
    assert add_to_errors(None, None) is None
    kept = add_to_errors(errors, None)
    assert kept is not None and kept["w"] is errors["w"]


def test_returned_by_position_dropped_clipped_or_kept():
    cfg = SparseLoCoConfig(quant_bits=0)
    payloads = [compress({"w": _rand(64, 64, seed=s)}, None, cfg)[0] for s in range(3)]
    decoded = [decompress(p) for p in payloads]
    clip = _stats((None, 0.25, None))
    assert returned(payloads[0], 0, clip, NOTHING) is None
    whole = returned(payloads[2], 2, clip, Screen((2,)))
    assert whole is not None and torch.equal(whole["w"], decoded[2]["w"])
    mass = returned(payloads[1], 1, clip, NOTHING)
    assert mass is not None
    assert torch.equal(mass["w"], decoded[1]["w"] - decoded[1]["w"] * 0.25)  # the dense reference
    ref = clipped_mass(decoded[1], 0.25)
    assert ref is not None and torch.equal(mass["w"], ref["w"])
    same = returned(decoded[1], 1, clip, NOTHING)  # decoded tensors give the same as the payload
    assert same is not None and torch.equal(same["w"], mass["w"])
    assert returned(payloads[0], 0, ClipStats(0, (), 0.0, 0.0), NOTHING) is None  # no clip stats: kept


def test_a_section_dropped_returns_whole_and_the_rest_returns_its_clipped_mass():
    """Screened by sections (stage 0): the embedding left out of Δ̄ goes back whole, the blocks that
    were kept but clipped give back what clipping removed; nothing else returns."""
    cfg = SparseLoCoConfig(quant_bits=0)
    payload = compress({EMBED: _rand(64, 64, seed=1), "w": _rand(64, 64, seed=2)}, None, cfg)[0]
    decoded = decompress(payload)
    embedding_out = Screen((), embedding=Screen((0,)))
    back = returned(payload, 0, _stats((0.5,)), embedding_out)
    assert back is not None and set(back) == {EMBED, "w"}
    assert torch.equal(back[EMBED], decoded[EMBED])
    assert torch.equal(back["w"], decoded["w"] - decoded["w"] * 0.5)
    blocks_out = returned(payload, 0, _stats((None,)), Screen((0,), embedding=NOTHING))
    assert blocks_out is not None and set(blocks_out) == {"w"} and torch.equal(blocks_out["w"], decoded["w"])
    assert returned(payload, 0, _stats((None,)), Screen((), embedding=NOTHING)) is None

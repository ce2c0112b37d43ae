"""Unit tests for peer.node.checkpoints.model: round trip, TE folding, atomic replace, corruption."""

from __future__ import annotations

import json

import pytest
import torch

from peer.core.model.decoder import build_model, get_preset
from peer.errors import CheckpointError, PeerError
from peer.node.checkpoints.model import load_model_checkpoint, save_model_checkpoint

CFG = get_preset("tiny", n_layers=2, vocab_size=128)


def _model(seed: int = 1):
    return build_model(CFG, seed)


def _siblings(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_round_trip(tmp_path):
    model = _model()
    tok = tmp_path / "sp.model"
    tok.write_bytes(b"\x00sentencepiece-bytes\xff")
    out = save_model_checkpoint(tmp_path / "ckpt", model.state_dict(), CFG, tok, {"outer_step": 5, "run": "abc"})
    assert out == tmp_path / "ckpt"
    state, cfg, meta = load_model_checkpoint(out)
    assert cfg == CFG
    assert meta["model"] == CFG.to_dict()
    assert (meta["outer_step"], meta["run"]) == (5, "abc")
    assert meta["tokenizer_file"] == "tokenizer.model"
    assert (out / "tokenizer.model").read_bytes() == tok.read_bytes()
    ref = model.state_dict()
    assert set(state) == set(ref)
    for k in ref:
        assert torch.equal(state[k], ref[k]), k
    restored = build_model(cfg, seed=99)
    restored.load_state_dict(state)  # strict: every name lines up
    ids = torch.randint(0, CFG.vocab_size, (1, 6))
    assert torch.equal(restored(ids), model(ids))


def test_without_tokenizer_and_meta(tmp_path):
    save_model_checkpoint(tmp_path / "c", _model().state_dict(), CFG, None, {})
    _, _, meta = load_model_checkpoint(tmp_path / "c")
    assert meta["tokenizer_file"] is None
    assert not (tmp_path / "c" / "tokenizer.model").exists()


def test_perp_is_folded_into_the_stored_embedding(tmp_path):
    model = _model()
    perp = torch.full((CFG.vocab_size, CFG.d_model), 0.5)
    model.embed.enable_subspace(perp)
    save_model_checkpoint(tmp_path / "c", model.state_dict(), CFG, None, {})
    state, _, _ = load_model_checkpoint(tmp_path / "c")
    assert "embed.perp" not in state
    assert torch.equal(state["embed.weight"], model.embed.weight.detach() + perp)


def test_overwrite_replaces_atomically_and_leaves_no_temp_dirs(tmp_path):
    target = tmp_path / "ckpt"
    save_model_checkpoint(target, _model(1).state_dict(), CFG, None, {"outer_step": 1})
    save_model_checkpoint(target, _model(2).state_dict(), CFG, None, {"outer_step": 2})
    state, _, meta = load_model_checkpoint(target)
    assert meta["outer_step"] == 2
    assert torch.equal(state["head.weight"], _model(2).head.weight.detach())
    assert _siblings(target) == []


def test_failed_save_keeps_the_previous_checkpoint(tmp_path):
    target = tmp_path / "ckpt"
    save_model_checkpoint(target, _model(1).state_dict(), CFG, None, {"outer_step": 1})
    with pytest.raises(TypeError):  # meta that is not JSON fails after the tensors were written
        save_model_checkpoint(target, _model(2).state_dict(), CFG, None, {"bad": object()})
    _, _, meta = load_model_checkpoint(target)
    assert meta["outer_step"] == 1
    assert _siblings(target) == []


def test_reserved_meta_keys_are_refused(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        save_model_checkpoint(tmp_path / "c", _model().state_dict(), CFG, None, {"model": 1})


def test_missing_tokenizer_file_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="tokenizer"):
        save_model_checkpoint(tmp_path / "c", _model().state_dict(), CFG, tmp_path / "nope", {})
    assert not (tmp_path / "c").exists()


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg and isinstance(err.value, PeerError)
    return msg


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(CheckpointError) as err:
        load_model_checkpoint(tmp_path / "absent")
    assert "does not exist" in _one_line(err)
    save_model_checkpoint(tmp_path / "c", _model().state_dict(), CFG, None, {})
    (tmp_path / "c" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors") as err:
        load_model_checkpoint(tmp_path / "c")
    _one_line(err)


def test_corrupt_tensor_file(tmp_path):
    save_model_checkpoint(tmp_path / "c", _model().state_dict(), CFG, None, {})
    path = tmp_path / "c" / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF  # flip bits inside a tensor: only the recorded hash can tell
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="corrupt") as err:
        load_model_checkpoint(tmp_path / "c")
    _one_line(err)


def test_truncated_tensor_file_without_recorded_hash(tmp_path):
    save_model_checkpoint(tmp_path / "c", _model().state_dict(), CFG, None, {})
    meta_path = tmp_path / "c" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta.pop("model_sha256")
    meta_path.write_text(json.dumps(meta))
    path = tmp_path / "c" / "model.safetensors"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="unreadable") as err:
        load_model_checkpoint(tmp_path / "c")
    _one_line(err)


@pytest.mark.parametrize(
    "content", ["{not json", "[1, 2]", '{"model": {"d_model": 4}}', '{"model": {"vocab_size": 1, "wrong": 2}}']
)
def test_corrupt_meta(tmp_path, content):
    save_model_checkpoint(tmp_path / "c", _model().state_dict(), CFG, None, {})
    (tmp_path / "c" / "meta.json").write_text(content)
    with pytest.raises(CheckpointError, match="meta.json") as err:
        load_model_checkpoint(tmp_path / "c")
    _one_line(err)

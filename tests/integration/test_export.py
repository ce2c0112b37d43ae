"""Export a peer checkpoint and load it with transformers' LlamaForCausalLM: same logits."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from peer.core.model.decoder import build_model, build_stage, get_preset
from peer.errors import CheckpointError
from peer.export.command import export_hf, list_configurations, resolve_checkpoint
from peer.node.checkpoints.model import save_model_checkpoint

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.integration


def _export_and_load(tmp_path: Path, cfg, model, tokenizer_file=None):
    ckpt = save_model_checkpoint(tmp_path / "ckpt", model.state_dict(), cfg, tokenizer_file, {"outer_step": 3})
    out = export_hf(ckpt, tmp_path / "hf")
    assert out == tmp_path / "hf"
    hf = transformers.LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    return out, hf.eval()


def _compare_logits(cfg, model, hf, seed=0):
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(input_ids=ids).logits
    assert theirs.shape == ours.shape
    assert torch.allclose(ours, theirs, atol=1e-5), (ours - theirs).abs().max().item()


def test_export_matches_transformers_logits(tmp_path):
    cfg = get_preset("tiny", rope_theta=500.0)
    model = build_model(cfg, seed=11).eval()
    # A trained-looking model: non-trivial norm gains, and a T⊥ buffer that export must fold in.
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, generator=g))
    model.embed.enable_subspace(0.02 * torch.randn(cfg.vocab_size, cfg.d_model, generator=g))

    out, hf = _export_and_load(tmp_path, cfg, model)
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (config["num_key_value_heads"], config["head_dim"]) == (cfg.n_heads, cfg.head_dim)
    assert config["tie_word_embeddings"] is False
    assert not (out / "tokenizer.model").exists()
    _compare_logits(cfg, model, hf)


def test_export_with_attention_width_different_from_d_model(tmp_path):
    cfg = get_preset("tiny", n_heads=2, head_dim=16, n_layers=2)  # like the 1B preset
    model = build_model(cfg, seed=3).eval()
    _, hf = _export_and_load(tmp_path, cfg, model)
    _compare_logits(cfg, model, hf, seed=1)


def _train_sentencepiece(tmp_path: Path, **options) -> Path:
    spm = pytest.importorskip("sentencepiece")
    corpus = tmp_path / "corpus.txt"
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    corpus.write_text("".join((stdlib / n).read_text() for n in ("json/__init__.py", "shlex.py")))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=600,
        model_type="bpe",
        bos_id=-1,
        eos_id=1,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
        **options,
    )
    return tmp_path / "sp.model"


def test_export_copies_tokenizer(tmp_path, caplog):
    # Llama-style sentencepiece options: the only ones HF's LlamaTokenizer reproduces exactly.
    sp_path = _train_sentencepiece(
        tmp_path, normalization_rule_name="identity", remove_extra_whitespaces=False, byte_fallback=True
    )
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_file=str(sp_path))
    cfg = get_preset("tiny", vocab_size=sp.get_piece_size(), n_layers=1)
    model = build_model(cfg, seed=0).eval()

    with caplog.at_level("WARNING", logger="peer.export.command"):
        out, hf = _export_and_load(tmp_path, cfg, model, tokenizer_file=sp_path)
    assert not [r for r in caplog.records if r.name == "peer.export.command"]
    assert (out / "tokenizer.model").read_bytes() == sp_path.read_bytes()
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "LlamaTokenizer"
    assert tok_cfg["eos_token"] == sp.id_to_piece(1)

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.eos_token_id == 1
    for text in (
        "def parse(s):\n    return json.loads(s)  # split with shlex",
        "tab\there, é ü 中 and  two spaces\n\n",
    ):
        ids = sp.encode(text)
        assert tokenizer(text)["input_ids"] == ids
        assert tokenizer.decode(ids) == sp.decode(ids)
    _compare_logits(cfg, model, hf)


def test_export_warns_about_a_normalising_tokenizer(tmp_path, caplog):
    sp_path = _train_sentencepiece(tmp_path)  # sentencepiece defaults: nmt_nfkc, collapse spaces
    cfg = get_preset("tiny", vocab_size=600, n_layers=1)
    ckpt = save_model_checkpoint(tmp_path / "ckpt", build_model(cfg, 0).state_dict(), cfg, sp_path, {})
    with caplog.at_level("WARNING", logger="peer.export.command"):
        export_hf(ckpt, tmp_path / "hf")
    assert any("remove_extra_whitespaces=False" in r.getMessage() for r in caplog.records)
    assert (tmp_path / "hf" / "tokenizer.model").exists()


def test_export_refuses_a_stage_checkpoint(tmp_path):
    cfg = get_preset("tiny")
    stage = build_stage(cfg, 0, 2, seed=0)
    ckpt = save_model_checkpoint(tmp_path / "ckpt", stage.state_dict(), cfg, None, {})
    with pytest.raises(CheckpointError, match="not a whole model"):
        export_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def _save_configs(root: Path, names: list[str]) -> None:
    cfg = get_preset("tiny", n_layers=1)
    for i, name in enumerate(names):
        save_model_checkpoint(
            root / name, build_model(cfg, seed=i).state_dict(), cfg, None, {"simulate": {"name": name}}
        )


def test_export_of_a_folder_with_one_configuration_exports_it(tmp_path):
    _save_configs(tmp_path / "ckpt", ["pp-compress"])
    assert resolve_checkpoint(tmp_path / "ckpt") == tmp_path / "ckpt" / "pp-compress"
    out = export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert out == tmp_path / "hf" and (out / "config.json").is_file() and (out / "model.safetensors").is_file()


def test_export_of_a_folder_with_several_configurations_lists_them(tmp_path):
    _save_configs(tmp_path / "ckpt", ["sparseloco", "adamw"])
    (tmp_path / "ckpt" / "notes").mkdir()  # not a checkpoint: not listed
    assert list_configurations(tmp_path / "ckpt") == ["adamw", "sparseloco"]
    with pytest.raises(CheckpointError, match=r"holds 2 configurations \(adamw, sparseloco\)") as err:
        export_hf(tmp_path / "ckpt", tmp_path / "hf")
    assert "meta.json" not in str(err.value) and str(tmp_path / "ckpt" / "adamw") in str(err.value)
    assert not (tmp_path / "hf").exists()


def test_export_of_a_folder_without_checkpoints_says_what_to_pass(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="not a checkpoint.*peer simulate --save"):
        export_hf(tmp_path / "empty", tmp_path / "hf")
    incomplete = tmp_path / "incomplete"
    _save_configs(tmp_path, ["incomplete"])
    (incomplete / "meta.json").unlink()  # a checkpoint missing a file is still reported as incomplete
    with pytest.raises(CheckpointError, match="incomplete"):
        export_hf(incomplete, tmp_path / "hf")

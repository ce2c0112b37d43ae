"""Unit tests for peer.core.model.decoder: shapes, presets, stage views == whole model bit for bit, init."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from peer.core.model.decoder import (
    PRESETS,
    Decoder,
    Embedding,
    ModelConfig,
    build_model,
    build_stage,
    get_preset,
    split_layers,
    split_layers_by_cost,
    stage_layers,
)
from peer.errors import ConfigError, PeerError

TINY = PRESETS["tiny"]
SEED = 7


def _batch(cfg: ModelConfig, b: int = 2, L: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (b, L), generator=g)
    targets = torch.randint(0, cfg.vocab_size, (b, L), generator=g)
    return ids, targets


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


@pytest.fixture(scope="module")
def whole_tiny():
    """Whole tiny model after one forward/backward on a fixed batch: (model, logits)."""
    torch.manual_seed(123)  # must not matter: init is per (seed, name)
    model = build_model(TINY, SEED)
    ids, targets = _batch(TINY)
    logits = model(ids)
    _loss(logits, targets).backward()
    return model, logits.detach()


# ---------------------------------------------------------------------------- shapes


def test_whole_model_shapes():
    model = build_model(TINY, SEED)
    ids, _ = _batch(TINY, b=3, L=11)
    assert model(ids).shape == (3, 11, TINY.vocab_size)
    assert model.is_whole
    assert list(model.layers.keys()) == [str(i) for i in range(TINY.n_layers)]


def test_stage_views_take_and_return_hidden_states():
    first, middle, last = (build_stage(TINY, s, 3, SEED) for s in range(3))
    ids, _ = _batch(TINY, b=2, L=5)
    h = first(ids)
    assert h.shape == (2, 5, TINY.d_model)
    assert first.head is None and first.norm is None and first.embed is not None
    assert middle.embed is None and middle.head is None
    assert middle(h).shape == (2, 5, TINY.d_model)
    assert last.embed is None and last.head is not None
    assert last(h).shape == (2, 5, TINY.vocab_size)
    with pytest.raises(TypeError):
        first(h)  # the embedding stage wants token ids


def test_attention_width_may_differ_from_d_model():
    cfg = get_preset("tiny", n_heads=2, head_dim=16)  # attn inner 32 != d 64, like the 1B preset
    model = build_model(cfg, SEED)
    assert model.layers["0"].attn.wq.weight.shape == (32, 64)
    assert model.layers["0"].attn.wo.weight.shape == (64, 32)
    ids, _ = _batch(cfg, L=8)
    assert model(ids).shape == (2, 8, cfg.vocab_size)
    assert cfg.n_params == sum(p.numel() for p in model.parameters())


def test_no_biases_and_untied_head():
    model = build_model(TINY, SEED)
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert model.head.weight.data_ptr() != model.embed.weight.data_ptr()
    assert not torch.equal(model.head.weight, model.embed.weight)


def test_causal_future_tokens_do_not_change_past_logits():
    model = build_model(TINY, SEED)
    ids, _ = _batch(TINY, b=1, L=12)
    changed = ids.clone()
    changed[0, 8:] = (changed[0, 8:] + 1) % TINY.vocab_size
    with torch.no_grad():
        a, b = model(ids), model(changed)
    assert torch.equal(a[:, :8], b[:, :8])
    assert not torch.allclose(a[:, 8:], b[:, 8:])


def test_sequence_longer_than_max_seq_len_is_rejected():
    cfg = get_preset("tiny", max_seq_len=8)
    model = build_model(cfg, SEED)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, 9, dtype=torch.long))


# ---------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_n_params_counts_every_parameter(name):
    model = build_model(PRESETS[name], 0)
    assert PRESETS[name].n_params == sum(p.numel() for p in model.parameters())


def test_paper_preset_sizes_are_plausible():
    assert 170e6 <= PRESETS["178M"].n_params <= 190e6
    assert 0.40e9 <= PRESETS["512M"].n_params <= 0.60e9
    assert 0.95e9 <= PRESETS["1B"].n_params <= 1.15e9
    one_b = PRESETS["1B"]
    assert (one_b.d_model, one_b.n_heads * one_b.head_dim) == (2048, 1024)
    for name in ("178M", "512M", "1B"):
        assert PRESETS[name].vocab_size == 32000 and PRESETS[name].max_seq_len == 2048  # the paper's context


def test_get_preset_applies_overrides_without_touching_the_preset():
    cfg = get_preset("tiny", n_layers=2, rope_theta=500.0)
    assert (cfg.n_layers, cfg.rope_theta, cfg.d_model) == (2, 500.0, 64)
    assert PRESETS["tiny"].n_layers == 4
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_config_errors_name_what_to_fix():
    with pytest.raises(ConfigError, match="tiny, small, 178M, 512M, 1B"):
        get_preset("huge")
    with pytest.raises(ConfigError, match="d_modle.*valid fields"):
        get_preset("tiny", d_modle=32)
    with pytest.raises(ConfigError, match="n_layers"):
        get_preset("tiny", n_layers=0)
    with pytest.raises(ConfigError, match="head_dim"):
        get_preset("tiny", head_dim=15)
    with pytest.raises(ConfigError, match="norm_eps"):
        get_preset("tiny", norm_eps=-1.0)
    with pytest.raises(ConfigError, match="bogus"):
        ModelConfig.from_dict({**TINY.to_dict(), "bogus": 1})
    with pytest.raises(ConfigError, match="stage 4"):
        build_stage(TINY, 4, 4, SEED)
    with pytest.raises(ConfigError, match="5 stages"):
        build_stage(TINY, 0, 5, SEED)
    assert issubclass(ConfigError, PeerError)


# ---------------------------------------------------------------------------- split_layers


@pytest.mark.parametrize(
    "n_layers,n_stages,expected",
    [
        (4, 1, [range(0, 4)]),
        (4, 2, [range(0, 2), range(2, 4)]),
        (4, 3, [range(0, 2), range(2, 3), range(3, 4)]),
        (9, 4, [range(0, 3), range(3, 5), range(5, 7), range(7, 9)]),
        (16, 16, [range(i, i + 1) for i in range(16)]),
    ],
)
def test_split_layers_contiguous_and_balanced(n_layers, n_stages, expected):
    ranges = split_layers(n_layers, n_stages)
    assert ranges == expected
    assert [i for r in ranges for i in r] == list(range(n_layers))
    sizes = [len(r) for r in ranges]
    assert max(sizes) - min(sizes) <= 1


@pytest.mark.parametrize("n_layers,n_stages", [(4, 0), (4, 5), (1, 2), (3, -1)])
def test_split_layers_impossible(n_layers, n_stages):
    with pytest.raises(ConfigError):
        split_layers(n_layers, n_stages)


def _stage_costs(cfg: ModelConfig, ranges: list[range]) -> list[int]:
    layer = 4 * cfg.d_model * cfg.attn_dim + 3 * cfg.d_model * cfg.ffn_hidden
    return [
        len(r) * layer + (cfg.vocab_size * cfg.d_model if i == len(ranges) - 1 else 0) for i, r in enumerate(ranges)
    ]


@pytest.mark.parametrize("preset", ["tiny", "small", "178M", "1B"])
@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_cost_split_covers_every_layer_and_is_never_worse_than_the_even_one(preset, n_stages):
    cfg = get_preset(preset, stage_split="cost")
    ranges = split_layers_by_cost(cfg, n_stages)
    assert [i for r in ranges for i in r] == list(range(cfg.n_layers)) and all(len(r) >= 1 for r in ranges)
    assert max(_stage_costs(cfg, ranges)) <= max(_stage_costs(cfg, split_layers(cfg.n_layers, n_stages)))
    # the largest stage is as small as any contiguous split can make it (checked by brute force at S = 2)
    if n_stages == 2:
        best = min(max(_stage_costs(cfg, [range(0, c), range(c, cfg.n_layers)])) for c in range(1, cfg.n_layers))
        assert max(_stage_costs(cfg, ranges)) == best


def test_cost_split_gives_the_head_stage_fewer_layers_and_is_chosen_by_config():
    small = get_preset("small", stage_split="cost")
    assert stage_layers(small, 2) == [range(0, 5), range(5, 8)]
    assert stage_layers(get_preset("small"), 2) == [range(0, 4), range(4, 8)]  # "even", the default
    stage1 = build_stage(small, 1, 2, seed=SEED)
    assert sorted(stage1.layers) == ["5", "6", "7"] and stage1.head is not None
    with pytest.raises(ConfigError, match="stage_split"):
        get_preset("small", stage_split="greedy")
    with pytest.raises(ConfigError):
        split_layers_by_cost(small, 9)  # more stages than layers


# ---------------------------------------------------------------------------- stage views


@pytest.mark.parametrize("n_stages", [1, 2, 3, 4])
def test_chained_stages_equal_whole_model_bit_for_bit(whole_tiny, n_stages):
    whole, whole_logits = whole_tiny
    ids, targets = _batch(TINY)
    stages = [build_stage(TINY, s, n_stages, SEED) for s in range(n_stages)]

    inputs, outputs, x = [], [], ids
    for stage in stages:
        if outputs:  # a boundary: the next stage gets a detached leaf, like over the wire
            x = x.detach().requires_grad_(True)
        inputs.append(x)
        x = stage(x)
        outputs.append(x)
    assert torch.equal(outputs[-1], whole_logits)

    _loss(outputs[-1], targets).backward()
    for s in range(n_stages - 2, -1, -1):
        outputs[s].backward(inputs[s + 1].grad)

    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            ref = whole.get_parameter(name)
            assert p.grad is not None, name
            assert torch.equal(p.grad, ref.grad), f"gradient of {name} differs"
            seen.add(name)
    assert seen == {n for n, _ in whole.named_parameters()}


def test_stage_init_identical_to_whole_model_per_name():
    whole = build_model(TINY, SEED)
    ref = whole.state_dict()
    for n_stages in (2, 4):
        keys = set()
        for s in range(n_stages):
            sd = build_stage(TINY, s, n_stages, SEED).state_dict()
            for name, t in sd.items():
                assert torch.equal(t, ref[name]), name
            keys |= set(sd)
        assert keys == set(ref)
    # The last stage of a 2-way split owns layers 2, 3, the final norm and the head.
    last = build_stage(TINY, 1, 2, SEED)
    assert set(last.layers.keys()) == {"2", "3"}
    assert "embed.weight" not in last.state_dict() and "head.weight" in last.state_dict()


def test_init_depends_on_seed_and_name_only():
    a, b, c = build_model(TINY, SEED), build_model(TINY, SEED), build_model(TINY, SEED + 1)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("norm.weight"):
            assert torch.equal(pa, torch.ones_like(pa))
        else:
            assert not torch.equal(pa, pc), name
    # Layers have distinct values: the name, not the position in a loop, seeds each tensor.
    assert not torch.equal(a.layers["0"].attn.wq.weight, a.layers["1"].attn.wq.weight)


def test_init_std_and_depth_scaled_output_projections():
    cfg = get_preset("small")
    model = build_model(cfg, SEED)
    assert model.embed.weight.std().item() == pytest.approx(cfg.init_std, rel=0.02)
    assert model.layers["0"].ffn.w1.weight.std().item() == pytest.approx(cfg.init_std, rel=0.02)
    scaled = cfg.init_std / (2 * cfg.n_layers) ** 0.5
    assert model.layers["0"].ffn.w2.weight.std().item() == pytest.approx(scaled, rel=0.02)
    assert model.layers["0"].attn.wo.weight.std().item() == pytest.approx(scaled, rel=0.05)


# ---------------------------------------------------------------------------- embedding / perp


def test_perp_buffer_adds_to_weight():
    g = torch.Generator().manual_seed(3)
    perp = torch.randn(TINY.vocab_size, TINY.d_model, generator=g) * 0.01
    ids, targets = _batch(TINY, L=9)

    with_perp = build_model(TINY, SEED)
    before = with_perp(ids).detach()
    with_perp.embed.enable_subspace(perp)
    merged = build_model(TINY, SEED)
    with torch.no_grad():
        merged.embed.weight.add_(perp)

    out = with_perp(ids)
    assert not torch.equal(out, before)
    assert torch.equal(out, merged(ids))
    assert torch.equal(with_perp.embed.full_weight(), merged.embed.weight)

    # perp is a buffer in the state dict, never a trainable parameter.
    assert "embed.perp" in with_perp.state_dict()
    assert "embed.perp" not in dict(with_perp.named_parameters())
    _loss(out, targets).backward()
    assert with_perp.embed.weight.grad is not None and with_perp.embed.perp.grad is None


def test_embedding_without_perp_and_shape_check():
    emb = Embedding(10, 4)
    torch.nn.init.normal_(emb.weight)
    ids = torch.tensor([[1, 2, 9]])
    assert emb.perp is None and "perp" not in emb.state_dict()
    assert torch.equal(emb(ids), emb.weight[ids])
    with pytest.raises(ValueError, match="shape"):
        emb.enable_subspace(torch.zeros(10, 5))


def test_decoder_rejects_a_layer_range_outside_the_model():
    with pytest.raises(ConfigError):
        Decoder(TINY, layers=range(3, 6))


def test_bfloat16_model_keeps_float32_rope_tables():
    model = build_model(TINY, SEED)
    ids, _ = _batch(TINY, L=10)
    ref = model(ids).detach()
    low = model.to(torch.bfloat16)
    out = low(ids)
    assert out.dtype == torch.bfloat16
    assert low._rope_tables(ids.device)[0].dtype == torch.float32
    assert torch.allclose(out.float(), ref, atol=0.05)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_forward_matches_cpu():
    model = build_model(TINY, SEED)
    ids, _ = _batch(TINY, L=32)
    with torch.no_grad():
        ref = model(ids)
        out = model.to("cuda")(ids.to("cuda")).cpu()
    assert torch.allclose(out, ref, atol=1e-4)

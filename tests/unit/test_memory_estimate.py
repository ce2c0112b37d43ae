"""The memory estimate (`peer.core.memory`) and the join's fit check (`peer.node.fit`).

- the per-block and head activation counts equal what autograd saves in the real modules, byte
  for byte (`saved_tensors_hooks`), in fp32 and under bf16 autocast with the weights cast once
  (`CastWeights`: their copy is `cast_bytes`, once per stage, not per micro-batch);
- the estimate moves the right way: more in flight needs more, checkpointing and bf16 need less
  activation memory but the same master weights and optimizer state; a full replica holds every
  stage's state;
- sizes parse and print; `check_fit` passes a generous `--max-memory` and refuses a tiny one with
  one line naming the remedies that fit.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from peer.config import build_config
from peer.core.memory import (
    MicroBatch,
    block_bytes,
    cast_bytes,
    estimate_replica,
    estimate_stage,
    format_bytes,
    head_bytes,
    parse_bytes,
)
from peer.core.model.decoder import Block, ModelConfig, build_stage, get_preset, rope_tables
from peer.core.model.precision import CastWeights
from peer.errors import ConfigError
from peer.node.fit import check_fit
from peer.research.plan.command import PLAN_PRESETS

CFG = ModelConfig(vocab_size=300, d_model=96, n_layers=2, n_heads=4, head_dim=32, ffn_hidden=200, max_seq_len=64)


def _saved(fn, params) -> int:
    """Bytes of the distinct storages autograd saves while `fn` runs, parameters and tables excluded."""
    skip = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip:
            seen[ptr] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def _autocast(precision: str):
    return torch.autocast("cpu", dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_block_count_is_what_autograd_saves(precision):
    b, L = 2, 48
    block = Block(CFG)
    cos, sin = rope_tables(CFG.head_dim, CFG.max_seq_len, CFG.rope_theta)
    cos, sin = cos[:L], sin[:L]  # views of the shared table, as Decoder passes them
    x = torch.randn(b, L, CFG.d_model, requires_grad=True)
    cast = CastWeights(block, precision).get()  # the stage's shared copy: `cast_bytes`, not per block call
    with _autocast(precision):
        got = _saved(
            lambda: torch.func.functional_call(block, cast, (x, cos, sin)),
            [*block.parameters(), *cast.values(), cos, sin],
        )
    assert got == block_bytes(MicroBatch(CFG, b, L, precision))
    assert sum(t.untyped_storage().nbytes() for t in cast.values()) == cast_bytes(CFG, precision, 1, False)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_head_count_is_what_autograd_saves(precision):
    from peer.core.model.chain import token_loss

    b, L = 2, 48
    stage = build_stage(CFG, 1, 2, seed=0)  # one block, the final norm, the head
    blocks_only = build_stage(CFG, 0, 2, seed=0)
    x = torch.randn(b, L, CFG.d_model, requires_grad=True)
    y = torch.randint(0, CFG.vocab_size, (b, L))
    cos, sin = stage._rope_tables(x.device)
    casts = CastWeights(stage, precision)

    def run():
        with _autocast(precision):
            out = casts.forward(x)
        token_loss(out, y)

    shared = list(casts.get().values())
    got = _saved(run, [*stage.parameters(), *blocks_only.parameters(), *shared, cos, sin])
    mb = MicroBatch(CFG, b, L, precision)
    assert got == block_bytes(mb) + head_bytes(mb)
    assert sum(t.untyped_storage().nbytes() for t in shared) == cast_bytes(CFG, precision, 1, True)


def _est(**kw):
    base = dict(microbatch_size=4, seq_len=128, in_flight=4, precision="fp32", checkpointing=False)
    return estimate_stage(get_preset("small"), kw.pop("stage", 1), 4, **{**base, **kw})


def test_estimate_grows_with_in_flight_and_shrinks_with_checkpointing_and_bf16():
    peaks = [_est(in_flight=k).peak for k in (1, 2, 4, 8)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4
    plain, ckpt, bf16 = _est(), _est(checkpointing=True), _est(precision="bf16")
    assert ckpt.activations < plain.activations / 4
    assert bf16.activations < plain.activations
    for other in (ckpt, bf16):  # float32 master weights and AdamW state whatever the mode
        assert (other.weights, other.optimizer, other.start, other.errors) == (
            plain.weights,
            plain.optimizer,
            plain.start,
            plain.errors,
        )
    assert _est(stage=3, in_flight=8).stashed == 1  # the last stage runs backward in the same call


def test_full_replica_holds_every_stage_state():
    cfg, S = get_preset("small"), 4
    kw = dict(microbatch_size=4, seq_len=128, precision="fp32", checkpointing=False)
    stages = [estimate_stage(cfg, s, S, in_flight=1, **kw) for s in range(S)]
    full = estimate_replica(cfg, S, **kw)
    for part in ("weights", "gradients", "optimizer", "start", "errors", "buffers"):
        assert getattr(full, part) == sum(getattr(s, part) for s in stages), part
    assert full.weights == 4 * cfg.n_params


def test_sizes_parse_and_print():
    assert parse_bytes("6GiB") == 6 * 2**30
    assert parse_bytes("800MB") == 800 * 10**6
    assert parse_bytes("1.5 KiB") == 1536
    assert parse_bytes("123") == 123
    for bad in ("six", "0", "5 parsecs"):
        with pytest.raises(ConfigError, match="--max-memory"):
            parse_bytes(bad, "--max-memory")
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(312 * 2**20) == "312 MiB"
    assert format_bytes(12) == "12 B"


def _run(**over):
    return build_config(
        overrides={"preset": "small", "stages": 4, "train.batch_size": 32, "train.microbatches": 8, **over}
    )


def test_fit_passes_a_generous_budget():
    need = check_fit(_run(), 1, "cpu", "fp32", False, 64 * 2**30)
    assert 0 < need.peak < 64 * 2**30 and need.stashed == 8


def test_fit_refuses_with_the_remedies_that_fit():
    cfg = _run()
    need = check_fit(cfg, 1, "cpu", "fp32", False, 2**40)
    ckpt = check_fit(cfg, 1, "cpu", "fp32", True, 2**40)
    budget = (need.peak + ckpt.peak) // 2  # checkpointing fits, the plain stage does not
    with pytest.raises(ConfigError) as err:
        check_fit(cfg, 1, "cpu", "fp32", False, budget)
    line = str(err.value)
    assert "\n" not in line and line.startswith("stage 1 of 4 of small does not fit")
    assert "--activation-checkpointing (~" in line and "the head's --in-flight" in line
    with pytest.raises(ConfigError, match="nothing here makes it fit"):
        check_fit(cfg, 1, "cpu", "fp32", False, 2**20)


def test_the_bf16_weight_copy_is_counted_once_per_stage_so_bf16_never_needs_more_than_fp32():
    one, eight = _est(precision="bf16", in_flight=1), _est(precision="bf16", in_flight=8)
    assert one.casts == eight.casts > 0 and _est(in_flight=8).casts == 0
    for name, S in (("1B", 4), ("7B", 4), ("70B", 8)):  # bf16 used to need more than fp32 here
        big = dict(microbatch_size=1, seq_len=2048, in_flight=8, checkpointing=False)
        fp32, bf16 = (estimate_stage(PLAN_PRESETS[name], 1, S, precision=p, **big).peak for p in ("fp32", "bf16"))
        assert bf16 < fp32, name

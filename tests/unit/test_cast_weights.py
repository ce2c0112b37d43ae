"""Weights cast once per inner step (`peer.core.model.precision.CastWeights`), shared by micro-batches.

- K micro-batches through the shared cast give plain autocast's outputs and `.grad` bit for bit:
  one backward each, the deferred weight gradients (`split_backward`), checkpointed blocks, bf16
  and fp16 (with a loss scale);
- the copy is made again when a parameter changes (an AdamW step, `load_state_dict`) and only
  then;
- K micro-batches in flight save one copy of the weights, not K (`saved_tensors_hooks`).
"""

from __future__ import annotations

import pytest
import torch

from peer.core.model.decoder import Decoder, ModelConfig, build_stage
from peer.core.model.precision import CastWeights, autocast, compute_dtype, matmul_weights
from peer.core.model.split_backward import input_grad_first

CFG = ModelConfig(vocab_size=300, d_model=64, n_layers=3, n_heads=4, head_dim=16, ffn_hidden=160, max_seq_len=32)
K, B, L = 4, 2, 16


def _stage(checkpointing: bool) -> Decoder:
    stage = build_stage(CFG, 1, 2, seed=3)  # blocks 2.., the final norm and the head: hidden in, logits out
    stage.activation_checkpointing = checkpointing
    return stage


def _inputs() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    return [
        (torch.randn(B, L, CFG.d_model, generator=g), torch.randint(0, CFG.vocab_size, (B, L), generator=g))
        for _ in range(K)
    ]


def _accumulate(stage: Decoder, precision: str, shared: bool, defer: bool) -> tuple[list, list, list]:
    """K micro-batches' forwards (all in flight), then their backwards in order: (outputs, input
    gradients, `.grad` per parameter). fp16's root carries a loss scale of 2¹⁶."""
    casts = CastWeights(stage, precision)
    scale = 2.0**16 if precision == "fp16" else 1.0
    roots, outs, grads_in = [], [], []
    for x, y in _inputs():
        x = x.clone().requires_grad_(True)
        with autocast("cpu", precision):
            logits = casts.forward(x) if shared else stage(x)  # (b, L, V)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        roots.append((x, loss * scale / K))
        outs.append(logits.detach())
    for x, root in roots:
        if defer:
            grad_in, weights = input_grad_first(root, None, x, stage.parameters())
            weights()
        else:
            root.backward()
            grad_in = x.grad
        grads_in.append(grad_in)
    return outs, grads_in, [p.grad for p in stage.parameters()]


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("mode", ["plain", "deferred", "checkpointed"])
def test_the_shared_cast_gives_plain_autocast_outputs_and_gradients_bit_for_bit(precision, mode):
    stage = _stage(checkpointing=mode == "checkpointed")
    twin = _stage(checkpointing=mode == "checkpointed")
    want = _accumulate(stage, precision, shared=False, defer=mode == "deferred")
    got = _accumulate(twin, precision, shared=True, defer=mode == "deferred")
    assert want[0][0].dtype == compute_dtype(precision)  # the forward really ran in the low dtype
    for a, b in zip([*want[0], *want[1], *want[2]], [*got[0], *got[1], *got[2]], strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert all(g.dtype == torch.float32 for g in got[2])  # float32 into the master weights' .grad


def test_only_what_autocast_casts_is_cast_and_fp32_casts_nothing():
    stage = build_stage(CFG, 0, 2, seed=3)  # the embedding, blocks, no head
    cast = CastWeights(stage, "bf16").get()
    assert set(cast) == set(matmul_weights(stage)) and "embed.weight" not in cast
    assert not any("norm" in name for name in cast)
    assert all(t.dtype == torch.bfloat16 and t.requires_grad for t in cast.values())
    assert CastWeights(stage, "fp32").get() == {}


def test_the_copy_is_made_again_when_a_parameter_changes_and_only_then():
    stage, other = _stage(False), build_stage(CFG, 1, 2, seed=4)
    casts = CastWeights(stage, "bf16")
    with torch.no_grad():  # made under no_grad (a validation forward), it still carries gradients
        first = casts.get()
    assert casts.get() is first and first["head.weight"].grad_fn is not None
    x, y = _inputs()[0]
    with autocast("cpu", "bf16"):
        loss = torch.nn.functional.cross_entropy(casts.forward(x).flatten(0, 1).float(), y.flatten())
    loss.backward()
    assert casts.get() is first  # a backward changes .grad, not the parameters
    torch.optim.AdamW(stage.parameters(), lr=1e-2).step()
    stepped = casts.get()
    assert stepped is not first
    assert torch.equal(stepped["head.weight"], stage.head.weight.detach().to(torch.bfloat16))
    assert not torch.equal(stepped["head.weight"], first["head.weight"])
    stage.load_state_dict(other.state_dict())
    loaded = casts.get()
    assert loaded is not stepped
    assert all(torch.equal(loaded[n], p.detach().to(torch.bfloat16)) for n, p in matmul_weights(other).items())


def _saved_bytes(stage: Decoder, shared: bool, k: int) -> int:
    """Bytes of the distinct storages autograd saves for `k` micro-batches in flight under bf16."""
    casts = CastWeights(stage, "bf16")
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    kept = []
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        for x, _ in _inputs()[:k]:
            with autocast("cpu", "bf16"):
                kept.append(casts.forward(x) if shared else stage(x))
    return sum(seen.values())


def test_micro_batches_in_flight_save_one_copy_of_the_weights_not_one_each():
    stage = _stage(False)
    copy = sum(2 * p.numel() for p in matmul_weights(stage).values())  # bf16 bytes of the matrices
    plain = [_saved_bytes(stage, False, k) for k in (1, 2, K)]
    shared = [_saved_bytes(stage, True, k) for k in (1, 2, K)]
    assert plain[0] == shared[0]  # one micro-batch: one copy either way
    assert [p - s for p, s in zip(plain, shared, strict=True)] == [0, copy, (K - 1) * copy]
    per_microbatch = shared[1] - shared[0]  # activations only: no weight copy in it
    assert shared[2] - shared[0] == (K - 1) * per_microbatch
    assert plain[1] - plain[0] == per_microbatch + copy

"""`peer.research.simulate.pool.dumps`, read back: a replica's tensors keep the layout they had (issue 34).

What workers send and a sweep checkpoint stores is read back with `pickle.loads`. A kernel may
round by where its operands sit (MKL's GEMM on Intel CPUs picks its code path by alignment), so a
tensor read back must sit as a freshly computed one does: torch's 64-byte aligned allocation, the
same strides, storage offset and shared storages. A resumed sweep whose weights came from a Python
buffer (16-byte aligned, where in 64 set by the heap's history) trained to other bits on such a
host than the uninterrupted sweep; on this test's host the bits may agree anyway, so the layout
itself is what is checked.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator

import torch

from peer.config import build_config
from peer.core.subspace.compression import make_basis
from peer.research.simulate.pool import dumps
from peer.research.simulate.replica import LocalReplica

ALIGNMENT = 64  # bytes: torch's CPU allocator (c10's gAlignment)


def _cfg():
    overrides = {"train.batch_size": 4, "train.microbatches": 2, "train.seq_len": 16, "stages": 2}
    return build_config(overrides=overrides, environ={})


def _batch(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _tensors(rep: LocalReplica) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor a replica holds that a kernel reads: weights, their gradients, AdamW's state."""
    for s, stage in enumerate(rep.stages):
        for name, p in stage.named_parameters():
            yield f"{s}.{name}", p
            if p.grad is not None:
                yield f"{s}.{name}.grad", p.grad
        for name, b in stage.named_buffers():
            yield f"{s}.{name}", b
    for o, opt in enumerate(rep.optimizers):
        for i, state in enumerate(opt.state.values()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    yield f"opt{o}.{i}.{key}", value


def _layout(t: torch.Tensor) -> tuple:
    return (t.dtype, tuple(t.shape), t.stride(), t.storage_offset(), t.data_ptr() % ALIGNMENT)


def test_a_replica_read_back_keeps_every_tensors_layout_and_trains_to_the_same_bits():
    cfg = _cfg()
    rep = LocalReplica.build(cfg, compressed=True, U=make_basis(cfg.model.d_model, cfg.k, cfg.seed))
    rep.inner_step(*_batch(cfg, 0), 0)  # AdamW state exists, gradients too
    for _ in range(3):  # a heap with a history: a Python buffer's place in 64 bytes varies
        back: LocalReplica = pickle.loads(dumps(rep))
        mine, theirs = dict(_tensors(rep)), dict(_tensors(back))
        assert mine.keys() == theirs.keys() and len(mine) > 20
        for name, t in mine.items():
            assert _layout(theirs[name]) == _layout(t), name
            assert theirs[name].data_ptr() % ALIGNMENT == 0 or t.storage_offset(), name
            assert torch.equal(theirs[name], t), name
    keys = list(back.optimizers[0].state)  # AdamW's state is keyed by the replica's own parameters
    assert all(any(k is p for p in back.stages[0].parameters()) for k in keys)
    for step in (1, 2):
        a, b = rep.inner_step(*_batch(cfg, step), step), back.inner_step(*_batch(cfg, step), step)
        assert a.loss.hex() == b.loss.hex()
    for name, t in dict(_tensors(rep)).items():
        assert torch.equal(dict(_tensors(back))[name], t), name


def test_an_empty_and_a_viewed_storage_read_back_as_they_were():
    base = torch.arange(40, dtype=torch.float32).reshape(8, 5)
    view = base[2:, 1:]  # (6, 4), storage offset 11, strides (5, 1)
    empty = torch.empty(0)
    back_base, back_view, back_empty = pickle.loads(dumps([base, view, empty]))
    assert back_view.untyped_storage().data_ptr() == back_base.untyped_storage().data_ptr()  # still shared
    assert _layout(back_view) == _layout(view) and torch.equal(back_view, view)
    assert back_base.data_ptr() % ALIGNMENT == 0 and back_empty.numel() == 0

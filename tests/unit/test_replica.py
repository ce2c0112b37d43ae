"""Replicas, the stage-peer compute path and the outer update, against in-process references.

- A pipeline of StageWorkers (what stage peers run behind gRPC) computes the same loss and the
  same gradients as a LocalReplica with in-process compressed boundaries (what the simulator runs).
- After an outer round every holder of a stage — compressed or full replica — holds bit-identical
  parameters, and every stage holds the same T⊥, with TE = T_S + T⊥ moved by exactly −η·Δ̄.
- The simulator is deterministic: the same seed gives bit-identical losses.
"""

from __future__ import annotations

import pytest
import torch

from peer.config import WIRE_DTYPES
from peer.core.model.state import stage_state, state_hash
from peer.core.sparseloco.algorithm import compress, decompress, pseudo_gradient
from peer.core.sparseloco.commit import commit_round, embedding_update, perp_decay
from peer.core.subspace.compression import make_basis, project
from peer.core.subspace.state import perp_of
from peer.node.stage.worker import StageWorker
from peer.research.simulate.replica import LocalReplica
from tests.configs import tiny_run


def _cfg(**overrides):
    return tiny_run(**overrides)


def _batch(cfg, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


@pytest.mark.parametrize("stages", [2, 3])
def test_stage_workers_match_the_in_process_compressed_replica(stages):
    cfg = _cfg(stages=stages)
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    ref = LocalReplica.build(cfg, compressed=True, U=U)
    ref.zero_grad()
    x, y = _batch(cfg)
    ref_loss = ref.accumulate(x, y).loss

    workers = [StageWorker(cfg, s) for s in range(stages)]
    dtype = WIRE_DTYPES[cfg.subspace.wire_dtype]  # bf16 by default: both sides round the boundary alike

    def wire(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype).float()

    losses = []
    for mb, (mx, my) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
        key = ("p", mb)
        hidden = workers[0].forward(key, mx.int(), None, None).hidden  # (b, L, k) on the wire
        assert hidden.shape[-1] == cfg.k
        for w in workers[1:-1]:
            hidden = w.forward(key, mx.int(), wire(hidden), None).hidden
        out = workers[-1].forward(key, mx.int(), wire(hidden), my.int())
        losses.append(out.loss)
        grad = out.grad
        for w in reversed(workers[:-1]):
            grad = w.backward(key, wire(grad))
        assert grad is None  # the head needs no gradient of its input
    assert sum(losses) / 2 == pytest.approx(ref_loss, abs=1e-6)
    for s, w in enumerate(workers):
        ref_grads = {n: p.grad for n, p in ref.stages[s].named_parameters()}
        for name, p in w.module.named_parameters():
            torch.testing.assert_close(
                p.grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
            )


def test_outer_round_leaves_every_holder_bit_identical():
    """A compressed pipeline and a full replica train differently, then apply the same round."""
    cfg = _cfg()
    pipe = [StageWorker(cfg, s, compressed=True) for s in range(2)]
    full = [StageWorker(cfg, s, compressed=False) for s in range(2)]
    te_before = pipe[0].module.embed.weight.detach() + perp_of(pipe[0].module)
    perp_before = perp_of(pipe[0].module).clone()
    # train the full replica's stages locally on one batch; the pipeline's on another
    x, y = _batch(cfg, seed=1)
    h = x
    for w in full:
        h = w.module(h)
    torch.nn.functional.cross_entropy(h.flatten(0, 1), y.flatten()).backward()
    for w in full:
        w.step(0, 0)
    x2, y2 = _batch(cfg, seed=2)
    hidden = pipe[0].forward(("p", 0), x2, None, None).hidden
    out = pipe[1].forward(("p", 0), x2, hidden, y2)
    pipe[0].backward(("p", 0), out.grad)
    for w in pipe:
        w.step(0, 0)
    # T_S of the compressed pipeline stays in Col(U); the full replica's embedding is free
    w0 = pipe[0].module.embed.weight.detach()
    torch.testing.assert_close(w0, project(w0, pipe[0].U), atol=1e-6, rtol=0)

    committed = {s: [full[s].encode_round(), pipe[s].encode_round()] for s in range(2)}
    embed_update = embedding_update([decompress(p) for p in committed[0]], cfg.sparseloco)
    for s in range(2):
        full[s].apply_round(committed[s], embed_update)
        pipe[s].apply_round(committed[s], embed_update)
        assert full[s].param_hash() == pipe[s].param_hash()
        assert full[s].outer_step == pipe[s].outer_step == 1
    perps = {w.perp_hash() for w in full + pipe}
    assert len(perps) == 1
    te_after = pipe[0].module.embed.weight.detach() + perp_of(pipe[0].module)
    # TE moves by the committed update, and T⊥ decays as AdamW decays the rest of the embedding
    decay = perp_decay(cfg.train, 0)
    torch.testing.assert_close(te_after - te_before, embed_update + (decay - 1) * perp_before, atol=1e-6, rtol=0)


def test_unsent_payload_returns_to_the_error_buffer():
    cfg = _cfg()
    w = StageWorker(cfg, 1)
    with torch.no_grad():
        for p in w.module.parameters():
            p.add_(0.01 * torch.randn_like(p))
    delta = pseudo_gradient(w.start, stage_state(w.module))
    payload = w.encode_round()
    e_after = {k: v.clone() for k, v in w.optim.errors.items()}
    w.return_unsent(payload)
    sent = decompress(payload)
    for k in delta:
        torch.testing.assert_close(w.optim.errors[k], e_after[k] + sent[k])
        torch.testing.assert_close(w.optim.errors[k], delta[k], atol=1e-6, rtol=1e-5)  # β·0 + Δ, nothing lost


def test_local_replicas_agree_after_commit_round():
    cfg = _cfg()
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    reps = [LocalReplica.build(cfg, compressed=(m == 1), U=U) for m in range(2)]
    starts = [stage_state(s) for s in reps[0].stages]
    for m, rep in enumerate(reps):
        rep.inner_step(*_batch(cfg, seed=10 + m), global_step=0)
    embed_update = None
    for s in range(cfg.stages):
        decoded = [
            decompress(compress(pseudo_gradient(starts[s], stage_state(r.stages[s])), None, cfg.sparseloco)[0])
            for r in reps
        ]
        done = commit_round([r.stages[s] for r in reps], starts[s], decoded, cfg.sparseloco, U, embed_update)
        if s == 0:
            embed_update = done.embed_update
            assert embed_update is not None
    for s in range(cfg.stages):
        a, b = (dict(r.stages[s].state_dict()) for r in reps)
        assert state_hash(a) == state_hash(b)

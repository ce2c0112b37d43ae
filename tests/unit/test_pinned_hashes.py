"""Refactors that do not change the math keep results bit-identical (torchtitan's rule).

The hashes below pin the math as of issue 10 (sign-true quantizer and payload v3, global-norm
gradient clipping across stages, T⊥ weight decay at each commit, clipped mass returned to the
sender); they are recorded with one torch thread (tests/conftest.py). If one changes, the math
changed: that must be a deliberate change of behaviour (say so in CHANGELOG.md and update the pin),
never a side effect of moving code.
"""

from __future__ import annotations

import torch

from peer.config import build_config
from peer.core.data import TokenData
from peer.core.outer import embedding_update, state_hash
from peer.core.sparseloco import decompress
from peer.node.checkpoints.model import load_model_checkpoint
from peer.node.stage_worker import StageWorker
from peer.tools.simulate import simulate

# Float kernels differ between CPUs (torch picks AVX2 or AVX-512 code paths, whose sums round in a
# different order), so each kind of machine the pins were recorded on has its own set; a run must
# match every hash of one set. A new kind of machine gets its set added deliberately (say so in the
# commit), never to paper over a change of the math on a known one.
SIMULATOR_PINS = [
    {"sparseloco": "240690f67f6f524f", "het-pp-compress": "259880e1b3e5858a"},  # issue-10 machine
    {"sparseloco": "8777c875abbe4fad", "het-pp-compress": "623d0931e665171d"},  # AMD EPYC, AVX-512
]
SWARM_ROUND_PINS = [
    {0: "5f495402c6712829", 1: "58ad86c1d285812b"},  # issue-10 machine
    {0: "e29aee03f5318b47", 1: "58ad86c1d285812b"},  # AMD EPYC, AVX-512
]


def _cfg():
    overrides = {
        "train.batch_size": 4,
        "train.microbatches": 2,
        "train.seq_len": 16,
        "train.inner_steps": 3,
        "train.outer_steps": 2,
        "stages": 2,
        # the pins were recorded with float32 boundaries; the default became bf16 afterwards, which
        # rounds the simulator's compressed boundary (a different run, not a change of this math)
        "subspace.wire_dtype": "fp32",
    }
    return build_config(overrides=overrides, environ={})


def _data(cfg) -> TokenData:
    g = torch.Generator().manual_seed(0)
    base = torch.arange(20_000) % 89
    noise = torch.randint(0, cfg.model.vocab_size, (20_000,), generator=g)
    train = torch.where(torch.rand(20_000, generator=g) < 0.1, noise, base)
    return TokenData(train=train, val=train[:2_000].clone(), tokenizer=None)


def test_a_short_simulator_run_keeps_its_parameter_hash(tmp_path):
    cfg = _cfg()
    names = list(SIMULATOR_PINS[0])
    results = simulate(cfg, _data(cfg), replicas=2, configs=names, het_fraction=0.5, save_dir=tmp_path)
    assert [r.name for r in results] == names
    got = {name: state_hash(load_model_checkpoint(tmp_path / name)[0]) for name in names}
    assert got in SIMULATOR_PINS, f"{got} (CPU {torch.backends.cpu.get_cpu_capability()}) matches no pinned set"


def _batch(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def test_a_pipeline_and_a_full_replica_commit_the_pinned_round():
    """A compressed 2-stage pipeline and a full replica each take one inner step, then commit the
    round for both stages the way peers do: the committed parameters match the pin."""
    cfg = _cfg()
    pipe = [StageWorker(cfg, s, compressed=True) for s in range(2)]
    full = [StageWorker(cfg, s, compressed=False) for s in range(2)]
    x, y = _batch(cfg, 1)
    for mb, (mx, my) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
        hidden = pipe[0].forward(("p", mb), mx.int(), None, None).hidden
        out = pipe[1].forward(("p", mb), mx.int(), hidden, my.int())
        pipe[0].backward(("p", mb), out.grad)
    for w in pipe:
        w.step(0, 0)
    x, y = _batch(cfg, 2)
    for mx, my in zip(x.chunk(2), y.chunk(2), strict=True):
        logits = full[1].module(full[0].module(mx))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), my.flatten())
        (loss / 2).backward()
    for w in full:
        w.step(0, 0)
    payloads = {s: [pipe[s].encode_round(), full[s].encode_round()] for s in range(2)}
    embed_update = embedding_update([decompress(p) for p in payloads[0]], cfg.sparseloco)
    for s in range(2):
        pipe[s].apply_round(payloads[s], embed_update)
        full[s].apply_round(payloads[s], embed_update)
    for s in range(2):
        assert pipe[s].param_hash() == full[s].param_hash()
        assert pipe[s].perp_hash() == full[s].perp_hash()
    got = {s: pipe[s].param_hash() for s in range(2)}
    assert got in SWARM_ROUND_PINS, f"{got} (CPU {torch.backends.cpu.get_cpu_capability()}) matches no pinned set"

"""`peer simulate --overlap N` (issue 36): whole simulator runs of the overlapped schedule.

The loop against a straight-line reference of the schedule (N inner steps on θ_b, θ ← θ_c + (θ − θ_b),
the rest, the next round from θ_c), to the bit; the first round's commit is the synchronous run's
(a function of the payloads at the boundary) and later ones differ; the overlapped runs learn; worker
processes and a resumed run give the in-process bits. Overlap 0 is the synchronous code path: its
pinned hashes are `test_pinned_hashes.py`'s, unchanged by this option.
"""

from __future__ import annotations

import pytest
import torch

from peer.core.model.state import stage_state
from peer.core.sparseloco.commit import perp_decay
from peer.core.subspace.compression import make_basis
from peer.core.subspace.state import perp_of, set_perp
from peer.research.bench.simulate import fingerprint
from peer.research.simulate.checkpoint import SweepCheckpoint
from peer.research.simulate.engine import SimOptions, simulate
from peer.research.simulate.loops import commit_stage, run_diloco
from peer.research.simulate.pool import batch
from peer.research.simulate.replica import LocalReplica
from peer.research.simulate.results import n_uncompressed
from peer.research.simulate.runtime import session
from tests.configs import tiny_run
from tests.corpora import pattern_corpus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
CONFIGS = ["sparseloco", "pp-compress", "het-pp-compress"]


def _cfg(**overrides):
    extra = {"sparseloco.clip_median_factor": 0.0, "sparseloco.screening": False, "train.inner_steps": 3}
    return tiny_run(**{**extra, **overrides})


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return pattern_corpus(tmp_path_factory.mktemp("corpus"), 1024, tokens=20_000, period=89, val=2_000)


def _held(rep: LocalReplica) -> list[tuple[dict[str, torch.Tensor], torch.Tensor | None]]:
    return [(stage_state(st), None if rep.U is None else perp_of(st).clone()) for st in rep.stages]


def _put(rep: LocalReplica, held: list[tuple[dict[str, torch.Tensor], torch.Tensor | None]]) -> None:
    with torch.no_grad():
        for st, (params, perp) in zip(rep.stages, held, strict=True):
            for name, p in st.named_parameters():
                p.copy_(params[name])
            if perp is not None:
                set_perp(st, perp)


def _reference(cfg, data, kind: str, M: int, N: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The overlapped schedule written out: (the train curve, replica 0's final weights)."""
    H, T, S = cfg.train.inner_steps, cfg.train.outer_steps, cfg.stages
    n_unc = n_uncompressed(kind, M, 0.5)
    U = None if kind == "sparseloco" else make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    reps = [LocalReplica.build(cfg, compressed=m >= n_unc, U=U) for m in range(M)]
    errors, pg, losses = [[None] * S for _ in range(M)], [0] * M, []
    starts, landing = [stage_state(st) for st in reps[0].stages], None
    for t in range(T):
        for h in range(H + 1):
            if landing is not None and h == N:  # round t − 1 lands: θ ← θ_c + (θ − θ_b), T⊥ ← T⊥_c
                for rep, committed, boundary in zip(reps, *landing, strict=True):
                    now = _held(rep)
                    moved = [
                        ({n: c[n] + (w[n] - b[n]) for n in w}, cp)
                        for (c, cp), (w, _), (b, _) in zip(committed, now, boundary, strict=True)
                    ]
                    _put(rep, moved)
            if h < H:
                step = t * H + h
                stats = [rep.inner_step(*batch(data, m, M, step, rep), step) for m, rep in enumerate(reps)]
                losses.append(sum(s.loss for s in stats) / M)
        boundary = [_held(rep) for rep in reps]
        update = None
        for s in range(S):
            done = commit_stage(reps, s, starts[s], errors, pg, cfg, perp_decay(cfg.train, t), update, None, t)
            update = done.embed_update if s == 0 else update
        starts = [stage_state(st) for st in reps[0].stages]
        landing = ([_held(rep) for rep in reps], boundary)
        if t + 1 < T:
            for rep, held in zip(reps, boundary, strict=True):
                _put(rep, held)
    return losses, reps[0].full_state()


@pytest.mark.parametrize(("kind", "N"), [("pp-compress", 2), ("het-pp-compress", 3), ("sparseloco", 1)])
def test_the_loop_runs_the_overlapped_schedule_to_the_bit(corpus, kind, N):
    cfg = _cfg(**{"train.outer_steps": 3})
    M = 2
    losses, weights = _reference(cfg, corpus, kind, M, N)
    torch.manual_seed(cfg.seed)
    res, rep = run_diloco(cfg, corpus, kind, SimOptions(replicas=M, overlap=N, val_tokens=160), None)
    assert [v for _, v in res.train_curve] == losses
    got = rep.full_state()
    assert all(torch.equal(got[n], weights[n]) for n in weights)
    assert res.overlap == N and res.summary()["overlap"] == N


def test_the_first_round_commits_the_synchronous_bits_and_later_rounds_differ(corpus):
    cfg = _cfg(**{"train.outer_steps": 3})
    sync = simulate(cfg, corpus, 3, CONFIGS, options=SimOptions(val_tokens=160))
    over = simulate(cfg, corpus, 3, CONFIGS, options=SimOptions(val_tokens=160, overlap=2))
    H = cfg.train.inner_steps
    for a, b in zip(sync, over, strict=True):
        assert a.train_curve[:H] == b.train_curve[:H]  # outer step 0: nothing pending
        assert a.val_curve[0] == b.val_curve[0]  # round 0: a function of the payloads at the boundary
        assert a.val_curve[1:] != b.val_curve[1:]
        assert a.pg_bytes == b.pg_bytes and a.rounds == b.rounds


@pytest.mark.parametrize("N", [2, 5])
def test_overlapped_runs_learn(corpus, N):
    cfg = _cfg(**{"train.outer_steps": 5, "train.inner_steps": 5, "train.lr": 1e-2})
    for res in simulate(cfg, corpus, 2, CONFIGS, options=SimOptions(val_tokens=320, overlap=N)):
        assert res.val_curve[-1][1] < res.val_curve[0][1] - 0.2, res.name


def _run(cfg, data, opts, **runtime):
    with session(**runtime):
        return fingerprint(simulate(cfg, data, opts.replicas, CONFIGS, options=opts))


def test_workers_give_the_in_process_bits_with_overlap(corpus):
    cfg = _cfg()
    for N in (2, cfg.train.inner_steps):  # the rebase between two jobs, and after the last one
        opts = SimOptions(replicas=3, val_tokens=160, overlap=N)
        assert _run(cfg, corpus, opts, workers=2) == _run(cfg, corpus, opts, workers=1)


class _Stop(Exception):
    pass


def test_a_run_interrupted_with_a_round_pending_resumes_to_the_same_bits(corpus, tmp_path):
    """The checkpoint after outer step 1 holds the committed round not yet landed (`DilocoRun.rebase`)."""
    cfg, opts = _cfg(**{"train.outer_steps": 4}), SimOptions(replicas=2, val_tokens=160, overlap=2)
    whole = _run(cfg, corpus, opts)
    ckpt = SweepCheckpoint(tmp_path, {"run": 1}, resume=False)
    saves, save = [0], ckpt.save

    def stop_after_two(key, state, done=False):
        save(key, state, done)
        saves[0] += 1
        if saves[0] == 2:
            raise _Stop

    ckpt.save = stop_after_two  # type: ignore[method-assign]
    with pytest.raises(_Stop):
        _run(cfg, corpus, opts, checkpoint=ckpt)
    pending = ckpt.load(next(p.stem for p in tmp_path.glob("*.ckpt")))
    assert pending is not None and pending["state"].rebase is not None
    assert _run(cfg, corpus, opts, checkpoint=SweepCheckpoint(tmp_path, {"run": 1}, resume=True)) == whole

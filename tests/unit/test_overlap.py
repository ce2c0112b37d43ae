"""Overlapped outer steps (issue 36): the rebase on tensors (`peer.core.sparseloco.overlap`) and on
replicas (`peer.research.simulate.overlap`), and the checks of `--overlap`."""

from __future__ import annotations

import pytest
import torch

from peer.core.sparseloco.algorithm import pseudo_gradient
from peer.core.sparseloco.overlap import rebase
from peer.core.subspace.compression import make_basis
from peer.core.subspace.state import perp_of
from peer.errors import ConfigError
from peer.research.simulate.overlap import PERP, Rebase, check_overlap, rebase_replicas, restore, snapshot
from peer.research.simulate.replica import LocalReplica
from tests.configs import tiny_run


def _states(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(8, 5, generator=g), "b": torch.randn(7, generator=g)}


def test_rebase_puts_the_progress_since_the_boundary_on_the_committed_state():
    committed, boundary = _states(0), _states(1)
    now = {n: v + 0.01 * torch.randn_like(v) for n, v in boundary.items()}
    out = rebase(committed, now, boundary)
    for name in now:  # the dense reference, in float64: θ_c + (θ_now − θ_b)
        ref = committed[name].double() + (now[name].double() - boundary[name].double())
        torch.testing.assert_close(out[name].double(), ref, rtol=0, atol=1e-6)
        torch.testing.assert_close(out[name] - committed[name], now[name] - boundary[name], rtol=0, atol=1e-6)
    assert all(out[n] is not now[n] and out[n] is not committed[n] for n in now)  # new tensors


def test_a_tensor_that_did_not_move_lands_on_the_committed_bits():
    committed, boundary = _states(2), _states(3)
    out = rebase(committed, {n: v.clone() for n, v in boundary.items()}, boundary)
    assert all(torch.equal(out[n], committed[n]) for n in committed)


def test_rebase_refuses_states_that_name_other_tensors():
    committed, boundary = _states(0), _states(1)
    with pytest.raises(ValueError, match="same tensors"):
        rebase(committed, {"w": boundary["w"]}, boundary)


def _replica(compressed: bool) -> LocalReplica:
    cfg = tiny_run()
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    return LocalReplica.build(cfg, compressed=compressed, U=U)


def _step(rep: LocalReplica, step: int) -> None:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, rep.cfg.model.vocab_size, (rep.cfg.train.batch_size, rep.cfg.train.seq_len + 1), generator=g)
    rep.inner_step(x[:, :-1], x[:, 1:], step)


@pytest.mark.parametrize("compressed", [True, False])
def test_a_replica_rebased_keeps_its_inner_progress_and_takes_the_committed_t_perp(compressed):
    rep = _replica(compressed)
    boundary = snapshot([rep])
    g = torch.Generator().manual_seed(5)  # a committed round: every tensor moved, T⊥ too
    committed = [[{n: v + 0.1 * torch.randn(v.shape, generator=g) for n, v in st.items()} for st in boundary[0]]]
    _step(rep, 0)
    _step(rep, 1)
    now = snapshot([rep])
    rebase_replicas([rep], Rebase(committed, boundary))
    after = snapshot([rep])
    for c, n, b, a in zip(committed[0], now[0], boundary[0], after[0], strict=True):
        assert torch.equal(a[PERP], c[PERP])  # T⊥ does not move in inner steps: the committed one, to the bit
        assert not torch.equal(n[PERP], c[PERP])
        for name in c:
            torch.testing.assert_close(a[name] - c[name], n[name] - b[name], rtol=0, atol=1e-5)
    # the next pseudo-gradient θ_start − θ holds the overlapped steps once: −(θ_now − θ_b)
    starts = Rebase(committed, boundary).starts()
    for s, st in enumerate(rep.stages):
        assert PERP not in starts[s]
        delta = pseudo_gradient(starts[s], {n: p.detach() for n, p in st.named_parameters()})
        for name, d in delta.items():
            torch.testing.assert_close(d, boundary[0][s][name] - now[0][s][name], rtol=0, atol=1e-5)


def test_restore_puts_back_parameters_and_t_perp():
    rep = _replica(True)
    kept = snapshot([rep])
    _step(rep, 0)
    perp_of(rep.stages[1]).add_(1.0)
    restore([rep], kept)
    again = snapshot([rep])
    assert all(torch.equal(again[0][s][n], kept[0][s][n]) for s in range(2) for n in kept[0][s])


@pytest.mark.parametrize(
    ("overlap", "configs", "grassmann", "match"),
    [
        (11, ["sparseloco"], False, "between 0 and --inner-steps"),
        (-1, ["sparseloco"], False, "between 0 and --inner-steps"),
        (2, ["adamw", "sparseloco"], False, "adamw average every step"),
        (2, ["pp-compress"], True, "--grassmann"),
    ],
)
def test_bad_overlaps_are_config_errors_naming_the_flag(overlap, configs, grassmann, match):
    with pytest.raises(ConfigError, match=match):
        check_overlap(overlap, 10, configs, grassmann)


def test_overlap_zero_and_h_are_allowed_everywhere_they_apply():
    check_overlap(0, 10, ["adamw", "adamw-pp-compress"], True)  # synchronous: nothing to refuse
    check_overlap(10, 10, ["sparseloco", "pp-compress", "het-pp-compress"], False)

"""The commit on every core and on a device (issue 36, part 4): the same bits however it is run.

- `codec.exact`: integer accumulators round a sum of float32 products once, to `math.fsum`'s
  value, ties to even included, on any split;
- `consensus`: the compiled screening (units over threads, integer sums) gives the numpy
  reference's partial sums bit for bit: −0.0, ties, absent voters, odd and even voter counts,
  subnormals, and a float32 overflow in a median (that slice falls back to numpy);
- `elementwise`: a multiply then an add, as numpy computes them, compiled or not, on blocks of an
  odd-sized tensor shared over 1, 2 or 4 threads;
- `StateHasher`: a state hashed while it is made (on a thread, in any order) is its `state_hash`;
- `OuterStep`: tensors taken in any order, from several threads at once, give `apply_update`'s
  state and hashes; the aggregation hands each Δ̄ over as it is final, the same bits;
- the aggregate scatters every payload a block of bands at a time (`index.scatter_add_all`);
- a whole commit gives one state at 1, 2 and 4 threads, compiled or numpy; on CUDA (when present)
  the same state as on the CPU.
Timings are not asserted here: `peer bench commit --threads 1,2,4` measures them.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from peer.core.model.state import StateHasher, state_hash
from peer.core.sparseloco import consensus, elementwise, portable
from peer.core.sparseloco.algorithm import aggregate_payloads, compress
from peer.core.sparseloco.codec import exact, index
from peer.core.sparseloco.codec import fused as pf
from peer.core.sparseloco.codec import kernels as pk
from peer.core.sparseloco.codec.format import Payload, SparseLoCoConfig
from peer.core.sparseloco.commit import commit_state, commit_summed
from peer.core.sparseloco.elementwise import copied, scaled, stepped
from peer.core.sparseloco.step import Hashing, OuterStep, apply_update
from peer.core.subspace.state import EMBED


@pytest.fixture
def compiled() -> None:
    if pk.compiled_function(exact._squares_jit) is None:
        pytest.skip("numba is not available here: only the numpy paths run")


@contextmanager
def _threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


def _bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


# ------------------------------------------------------------------ exact sums


def _fsum_of_squares(arrays: list[np.ndarray]) -> float:
    return math.fsum(np.concatenate([a[a != 0].astype(np.float64) ** 2 for a in arrays]).tolist())


def test_integer_sums_of_squares_are_fsum_exactly_ties_included(monkeypatch, compiled):
    monkeypatch.setattr(exact, "MIN_WORK", 0)
    monkeypatch.setattr(exact, "BLOCK", 1000)  # many pieces
    rng = np.random.default_rng(0)
    e = rng.integers(-149, 120, 50_000).astype(np.float64)
    wide = (rng.standard_normal(50_000) * np.exp2(e)).astype(np.float32)  # subnormals to huge
    wide[rng.random(50_000) < 0.1] = 0.0
    wide[:5] = -0.0
    tie = np.array([1.0, 2.0**-27, 2.0**-27], np.float32)  # 1 + 2^-53: halfway, to even: 1.0
    above = np.array([1.0, 2.0**-27, 2.0**-27, 2.0**-40], np.float32)  # just above halfway: up
    odd = np.array([1.0 + 2.0**-23, 2.0**-38, 2.0**-38], np.float32)  # halfway from an odd last bit: up
    for arrays in ([wide[:30_000], wide[30_000:]], [tie], [above], [odd], [np.zeros(7, np.float32)]):
        for n in (1, 3):
            with _threads(n):
                assert exact.square_sum(arrays) == _fsum_of_squares(arrays)
    assert exact.square_sum([tie]) == 1.0 and exact.square_sum([above]) > 1.0
    assert exact.square_sum([np.array([1.0, np.inf], np.float32)]) is None  # fsum decides: inf


def test_to_float_rounds_any_accumulator_once():
    rng = np.random.default_rng(1)
    limbs = rng.integers(-(2**40), 2**40, size=(50, exact.LIMBS))  # unsettled digits of either sign
    for row, got in zip(limbs, exact.to_float(limbs).tolist(), strict=True):
        total = sum(int(x) << (32 * i) for i, x in enumerate(row))
        assert got == total / (1 << exact.OFFSET)  # Python's int / int is correctly rounded


def _twice_jit(x: float) -> float:
    return _double_jit(x)


def _double_jit(x: float) -> float:
    return 2.0 * x


def _foreign_jit(x: float) -> float:
    return x


def test_a_kernel_calls_its_helpers_compiled_only_from_its_own_module(compiled, caplog):
    kernel = pk.compiled_function(_twice_jit, _double_jit)
    assert kernel is not None and kernel(3.0) == 6.0
    with caplog.at_level("WARNING"):  # a helper elsewhere could change under the kernel's disk cache
        assert pk.compiled_function(_foreign_jit, exact._squares_jit) is None
    assert "must be defined in" in caplog.text


# ------------------------------------------------------------------ the screening's sums


def _rows(rng: np.random.Generator, numel: int, n: int, density: float) -> list:
    rows: list = []
    for _ in range(n):
        k = max(1, int(numel * density))
        pos = rng.choice(numel, k, replace=False)
        vals = (rng.standard_normal(k) * np.exp2(rng.integers(-30, 10, k))).astype(np.float32)
        vals[rng.random(k) < 0.05] = 0.0
        vals[rng.random(k) < 0.05] = -0.0
        rows.append((pos, vals))
    rows[1] = None  # a voter without the tensor
    if n > 3:
        rows[3] = (rows[2][0], rows[2][1].copy())  # ties everywhere it sends
    return rows


@pytest.mark.parametrize("n", [3, 4, 7, 8])
def test_compiled_screening_sums_are_the_numpy_ones_bit_for_bit(monkeypatch, compiled, n):
    rng = np.random.default_rng(n)
    monkeypatch.setattr(consensus, "SLICE", 5000)
    monkeypatch.setattr(consensus, "UNIT", 700)  # slices of several units, the last one short
    numel = 23_456
    rows = _rows(rng, numel, n, 0.2)
    monkeypatch.setattr(consensus, "MIN_WORK", 1 << 62)
    want = consensus._tensor_partials(numel, rows)
    monkeypatch.setattr(consensus, "MIN_WORK", 0)
    monkeypatch.setattr(pf, "MIN_SPLIT_WORK", 0)
    for threads in (1, 2, 4):
        with _threads(threads):
            assert _bits(consensus._tensor_partials(numel, rows)) == _bits(want)


def test_a_median_that_overflows_float32_falls_back_to_numpy(monkeypatch, compiled):
    big = np.float32(3e38)  # the third voter's others at 5 are two of them: (low + high)·0.5 overflows
    rows = [(np.array([5, 9]), np.array([big, 1.0], np.float32)) for _ in range(2)]
    rows += [(np.array([9, 11]), np.array([2.0, 3.0], np.float32))]
    monkeypatch.setattr(consensus, "MIN_WORK", 1 << 62)
    with np.errstate(over="ignore", invalid="ignore"):
        want = consensus._tensor_partials(20, rows)
        monkeypatch.setattr(consensus, "MIN_WORK", 0)
        got = consensus._tensor_partials(20, rows)
    assert not np.isfinite(want).all()  # the reference's inf/nan, not a finite number made up
    assert _bits(got) == _bits(want)


# ------------------------------------------------------------------ elementwise steps


def test_the_elementwise_steps_are_numpys_multiply_then_add():
    gen = torch.Generator().manual_seed(2)
    start, agg = torch.randn(300, 70, generator=gen), torch.randn(300, 70, generator=gen) * 1e-3
    lr = 0.7  # not a float32: it is rounded first
    want = start.numpy() + np.float32(-lr) * agg.numpy()
    assert _bits(stepped(start, agg, lr).numpy()) == _bits(want)
    assert _bits(scaled(agg, 0.999).numpy()) == _bits(agg.numpy() * np.float32(0.999))
    assert stepped(start, agg, lr).data_ptr() not in (start.data_ptr(), agg.data_ptr())


def test_the_compiled_steps_are_the_torch_ones_on_any_split(monkeypatch, compiled):
    """The compiled passes (blocks of an odd-sized tensor taken by 1, 2 or 4 threads) give the torch
    calls' bits: subnormals, ±0.0, huge values and overflow to inf included."""
    rng = np.random.default_rng(5)
    n = 100_003  # 101 blocks of 997, the last one short
    start = (rng.standard_normal(n) * np.exp2(rng.integers(-149, 127, n))).astype(np.float32)
    agg = (rng.standard_normal(n) * np.exp2(rng.integers(-149, 127, n))).astype(np.float32)
    start[:4], agg[:4] = [0.0, -0.0, 3e38, 1e-45], [-0.0, 0.0, 3e38, -1e-45]
    s, a = torch.from_numpy(start), torch.from_numpy(agg)
    want = (_bits(stepped(s, a, 0.7).numpy()), _bits(scaled(a, 0.999).numpy()), _bits(copied(s).numpy()))
    monkeypatch.setattr(elementwise, "MIN_COMPILED", 0)
    monkeypatch.setattr(elementwise, "BLOCK", 997)
    monkeypatch.setattr(pf, "MIN_SPLIT_WORK", 0)
    for threads in (1, 2, 4):
        with _threads(threads):
            got = (_bits(stepped(s, a, 0.7).numpy()), _bits(scaled(a, 0.999).numpy()), _bits(copied(s).numpy()))
            assert got == want, threads
    assert np.isinf(stepped(s, a, -1.0).numpy()[2])  # 3e38 + 3e38 overflows alike on both paths
    grid = s.view(1, n)  # a shape other than flat: the result keeps it
    assert stepped(grid, a.view(1, n), 0.7).shape == (1, n) and copied(grid).data_ptr() != grid.data_ptr()


# ------------------------------------------------------------------ hashing while committing


@pytest.mark.parametrize("background", [True, False])
def test_a_state_hashed_as_it_is_made_is_state_hash(background):
    gen = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randn(50 * i + 1, generator=gen) for i in range(6)}
    tensors["scalar"] = torch.zeros(0)
    with StateHasher(tensors, background) as hashing:
        for name in ("t3", "t0", "scalar", "t5", "t1", "t4", "t2"):  # any order
            hashing.add(name, tensors[name])
        assert hashing.digest() == state_hash(tensors)
    with StateHasher([], background) as hashing:
        assert hashing.digest() == state_hash({})
    with StateHasher(tensors, background) as hashing:
        hashing.add("t1", tensors["t1"])
        with pytest.raises(ValueError, match="t1"):
            hashing.add("t1", tensors["t1"])  # twice
        with pytest.raises(ValueError, match="never added"):
            hashing.digest()
    # leaving the block with names missing stops the thread: nothing hangs


def test_a_tensor_that_cannot_be_hashed_fails_the_digest():
    with StateHasher(["a", "b"], background=True) as hashing:
        hashing.add("b", torch.zeros(3))
        hashing.add("a", object())  # type: ignore[arg-type]
        with pytest.raises(AttributeError):
            hashing.digest()


# ------------------------------------------------------------------ a whole commit


SHAPES = {EMBED: (300, 64), "blocks.0.w": (256, 200), "blocks.0.gain": (200,)}


def _commit_inputs() -> tuple:
    gen = torch.Generator().manual_seed(7)
    cfg = SparseLoCoConfig(topk=8, chunk=16)
    common = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    payloads = []
    for m in range(6):
        d = {n: c + 0.5 * torch.randn(c.shape, generator=gen) for n, c in common.items()}
        if m == 5:
            d = {n: -40.0 * t for n, t in d.items()}  # an attacker: clipped, then screened out
        payloads.append(Payload.from_bytes(compress(d, None, cfg)[0].to_bytes()))
    start = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    U = torch.from_numpy(portable.orthonormal_basis(64, 8, key=1)).float()
    perp = torch.randn(300, 64, generator=gen) * 1e-3
    return start, perp, payloads, cfg, U


def _state(device: str | None = None) -> tuple[str, tuple[int, ...]]:
    start, perp, payloads, cfg, U = _commit_inputs()
    done = commit_state(start, perp, payloads, cfg, U, None, 0.99, keys=[f"r{i}" for i in range(6)], device=device)
    assert (done.param_hash, done.perp_hash) == (state_hash(done.params), state_hash({"perp": done.perp}))
    return done.param_hash + done.perp_hash, done.commit.dropped


def test_one_state_at_1_2_and_4_threads_compiled_or_not(monkeypatch, compiled):
    pk.set_numba(False)
    try:
        reference = _state()
    finally:
        pk.set_numba(True)
    assert reference[1] == (5,)  # the attacker went
    monkeypatch.setattr(pf, "MIN_SPLIT_WORK", 0)  # every kernel compiled and split, however small its work
    monkeypatch.setattr(pk, "NUMBA_MIN_WORK", 0)
    monkeypatch.setattr(exact, "MIN_WORK", 0)
    monkeypatch.setattr(consensus, "MIN_WORK", 0)
    monkeypatch.setattr(consensus, "UNIT", 512)
    monkeypatch.setattr(portable, "NUMBA_MIN_ROWS", 1)
    monkeypatch.setattr(index, "BLOCK_BYTES", 1)  # the aggregate's scatter: one band per block
    monkeypatch.setattr(elementwise, "MIN_COMPILED", 0)  # the outer step's compiled passes
    monkeypatch.setattr(elementwise, "BLOCK", 333)  # on blocks that split the tensors unevenly
    for threads in (1, 2, 4):
        with _threads(threads):
            assert _state() == reference, threads


def test_the_outer_step_takes_tensors_in_any_order_from_any_thread(monkeypatch):
    """`OuterStep` fed Δ̄ a tensor at a time, in reverse name order and from 4 threads at once, makes
    `apply_update`'s state and hashes; a tensor given twice is refused."""
    start, perp, _, cfg, U = _commit_inputs()
    gen = torch.Generator().manual_seed(11)
    summed = {n: torch.randn(t.shape, generator=gen) * 1e-3 for n, t in start.items() if n != "blocks.0.gain"}
    with Hashing(start, True) as hashing:
        want = apply_update(start, perp.clone(), summed, cfg, U, None, None, hashing)
        want_hashes = hashing.digests()
    monkeypatch.setattr(pf, "MIN_SPLIT_WORK", 0)
    with _threads(4), Hashing(start, True) as hashing:
        step = OuterStep(start, perp.clone(), cfg, U, None, None, hashing)
        pf.run_each(lambda name: step.take(name, summed[name]), sorted(summed, reverse=True), [1] * len(summed))
        with pytest.raises(ValueError, match="twice"):
            step.take(EMBED, summed[EMBED])
        params, new_perp, u = step.finish()
        assert hashing.digests() == want_hashes
    assert list(params) == list(want[0]) and all(torch.equal(params[n], want[0][n]) for n in params)
    assert torch.equal(new_perp, want[1]) and torch.equal(u, want[2])
    assert torch.equal(params["blocks.0.gain"], start["blocks.0.gain"])  # not in Δ̄: θ_start, copied


def test_the_aggregate_hands_each_tensor_over_as_it_is_final(monkeypatch):
    """`aggregate_payloads(each=…)`: every tensor's Δ̄ once, in name order on one thread, the same bits
    as without; on 2 threads each tensor once, whichever thread summed it."""
    _, _, payloads, cfg, _ = _commit_inputs()
    want = {n: t.clone() for n, t in aggregate_payloads(payloads, 6, cfg.aggregation).items()}
    for threads in (1, 2):
        seen: dict[str, torch.Tensor] = {}
        order: list[str] = []

        def each(name: str, mean: torch.Tensor, order: list = order, seen: dict = seen) -> None:
            order.append(name)
            seen[name] = mean.clone()

        monkeypatch.setattr(pf, "MIN_SPLIT_WORK", 0 if threads > 1 else 1 << 62)
        with _threads(threads):
            got = aggregate_payloads(payloads, 6, cfg.aggregation, each=each)
        assert list(got) == list(want) and sorted(order) == sorted(want)
        assert order == sorted(want) or threads > 1
        assert all(_bits(seen[n].numpy()) == _bits(want[n].numpy()) == _bits(got[n].numpy()) for n in want)


@pytest.mark.parametrize("threads", [1, 2])
def test_every_commit_path_hands_back_its_states_hashes(threads):
    start, perp, _, cfg, U = _commit_inputs()
    no_embed = {n: t for n, t in start.items() if n != EMBED}
    change = {"blocks.0.w": torch.full((256, 200), 1e-3)}
    u = torch.randn(300, 64, generator=torch.Generator().manual_seed(4)) * 1e-3
    with _threads(threads):
        commits = [
            commit_state(start, perp, [], cfg, U, None, 0.99),  # an empty round
            commit_summed(start, perp, change, cfg, U, None, 0.99),  # the embedding not in Δ̄: T⊥ only decays
            commit_summed(no_embed, perp, change, cfg, U, u, 0.99),  # a later stage: T⊥ moves with stage 0
            commit_state(no_embed, None, [], cfg, None),  # no subspace
        ]
    for done in commits:
        perp_hash = state_hash({"perp": done.perp}) if done.perp is not None else state_hash({})
        assert (done.param_hash, done.perp_hash) == (state_hash(done.params), perp_hash)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_cuda_path_commits_the_cpu_state():
    assert _state("cuda") == _state()

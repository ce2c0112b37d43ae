"""Portable arithmetic (`peer.core.sparseloco.portable`): the same bits whoever computes them, and sound math.

Each compiled kernel equals its numpy twin bit for bit; the machine code of every kernel the
commit or the initial state runs holds no fused multiply-add (a CPU without FMA would round
differently); the values are what they claim to be (normal-like, orthonormal, Π, cos).
Different kernel sets and thread counts in separate processes: tests/integration/test_portable_commit.py.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from peer.core.sparseloco import portable
from peer.core.sparseloco.algorithm import clip_and_aggregate, compress
from peer.core.sparseloco.codec import fused
from peer.core.sparseloco.codec import kernels as codec_kernels
from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.portable import (
    SIGMA,
    canonical_gaussian64,
    canonical_normal,
    check_denormals,
    orthonormal_basis,
    portable_cos,
    project64,
    split64,
)


@pytest.fixture
def numpy_only():
    codec_kernels.set_numba(False)
    yield
    codec_kernels.set_numba(True)


def test_canonical_normal_is_deterministic_normal_like_and_keyed():
    a = canonical_normal(12345, (1024, 1024), 0.02)
    assert a.dtype == torch.float32 and a.shape == (1024, 1024)
    assert torch.equal(a, canonical_normal(12345, (1024, 1024), 0.02))
    assert not torch.equal(a, canonical_normal(12346, (1024, 1024), 0.02))
    z = (a / 0.02).double()
    assert abs(z.mean().item()) < 0.005 and abs(z.std().item() - 1.0) < 0.005
    kurtosis = ((z - z.mean()) ** 4).mean().item() / z.var().item() ** 2
    assert abs(kurtosis - (3 - 1.2 / portable.TERMS)) < 0.02  # Irwin–Hall(8): 3 − 0.15
    bound = portable.TERMS * 0xFFFF / 2 / SIGMA  # ±4.9σ: the sum's range
    assert z.abs().max().item() <= bound + 1e-6


def test_canonical_normal_compiled_equals_numpy(numpy_only):
    shape = (portable.NUMBA_MIN_ELEMENTS // 512 + 3, 512)  # large enough for the kernel
    plain = canonical_normal(99, shape, 0.05)
    codec_kernels.set_numba(True)
    assert torch.equal(canonical_normal(99, shape, 0.05), plain)


def test_the_basis_is_orthonormal_deterministic_and_sign_fixed():
    U = orthonormal_basis(96, 12, key=5)
    assert np.abs(U.T @ U - np.eye(12)).max() < 1e-14
    assert np.array_equal(U, orthonormal_basis(96, 12, key=5))
    G = canonical_gaussian64(5, 96 * 12).reshape(96, 12)
    R = U.T @ G
    assert np.all(np.diag(R) > 0) and np.abs(np.tril(R, -1)).max() < 1e-12  # G = U·R, R upper, diag > 0


def test_projection_compiled_equals_numpy_and_is_pi(numpy_only):
    U = torch.from_numpy(orthonormal_basis(64, 8, key=3)).float()
    gen = torch.Generator().manual_seed(0)
    X = torch.randn(portable.NUMBA_MIN_ROWS + 5, 64, generator=gen)
    X[X.abs() < 1.0] = 0.0  # sparse rows and zero terms, as a committed change has
    X[3] = 0.0
    plain = project64(X, U)
    codec_kernels.set_numba(True)
    compiled = project64(X, U)
    assert compiled.tobytes() == plain.tobytes()
    reference = (X.double() @ U.double()) @ U.double().T
    assert np.abs(compiled - reference.numpy()).max() < 1e-12
    assert np.all(compiled[3] == 0) and not np.signbit(compiled[3]).any()  # +0.0, never −0.0


def test_the_fused_split_equals_numpy_on_any_thread_count(numpy_only):
    """split64 (Π a row at a time, fused with T_S + p and T⊥ + (u − p)) gives the numpy twin's bits,
    however its rows are shared over the threads."""
    U = torch.from_numpy(orthonormal_basis(64, 8, key=4)).float()
    gen = torch.Generator().manual_seed(1)
    u, w, perp = (torch.randn(portable.NUMBA_MIN_ROWS + 9, 64, generator=gen) for _ in range(3))
    u[u.abs() < 1.0] = 0.0
    w[0, :4] = -0.0  # −0.0 + (+0.0) is +0.0: zero rows and signs as the numpy path gives them
    u[7] = 0.0
    w_plain, p_plain = split64(u, U, w, perp)
    p_only = split64(u, U, None, perp)[1]
    codec_kernels.set_numba(True)
    saved, threads = fused.MIN_SPLIT_WORK, torch.get_num_threads()
    try:
        fused.MIN_SPLIT_WORK = 0
        for n in (1, 2, 4):
            torch.set_num_threads(n)
            w_new, p_new = split64(u, U, w, perp)
            assert w_new.dtype == p_new.dtype == torch.float32
            assert torch.equal(w_new.view(torch.int32), w_plain.view(torch.int32))
            assert torch.equal(p_new.view(torch.int32), p_plain.view(torch.int32))
            assert torch.equal(split64(u, U, None, perp)[1].view(torch.int32), p_only.view(torch.int32))
    finally:
        fused.MIN_SPLIT_WORK = saved
        torch.set_num_threads(threads)
    p64 = project64(u, U)
    assert torch.equal(w_plain, torch.from_numpy(w.double().numpy() + p64).float())  # rounded once


def test_portable_cos_is_cos_with_exact_ends():
    assert portable_cos(0.0) == 1.0 and portable_cos(math.pi) == -1.0
    xs = [i * math.pi / 997 for i in range(998)]
    assert max(abs(portable_cos(x) - math.cos(x)) for x in xs) < 1e-15
    with pytest.raises(ValueError):
        portable_cos(4.0)


def test_a_process_that_flushes_subnormals_is_refused():
    check_denormals()
    if not torch.set_flush_denormal(True):
        pytest.skip("this CPU cannot flush subnormals")
    try:
        with pytest.raises(RuntimeError, match="subnormal"):
            check_denormals()
    finally:
        torch.set_flush_denormal(False)
    check_denormals()


def _fma_count(fn, signature, helpers=(), **flags) -> int:
    """FMA instructions in `fn` compiled afresh for `signature` (numba's on-disk cache returns no
    machine code to inspect, and caching does not change the code generated); `helpers` are bound
    and inlined as `codec_kernels.compiled_function` binds them."""
    import types

    import numba

    target = fn
    if helpers:
        inline = numba.njit(nogil=True, inline="always", **flags)
        scope = {**fn.__globals__, **{h.__name__: inline(h) for h in helpers}}
        target = types.FunctionType(fn.__code__, scope, fn.__name__)
    fresh = numba.njit(nogil=True, **flags)(target)
    fresh.compile(signature)
    code = fresh.inspect_asm(signature).lower()
    return sum(code.count(op) for op in ("vfmadd", "vfmsub", "vfnmadd", "vfnmsub"))


def test_no_kernel_of_the_commit_or_the_initial_state_contracts_into_fma():
    from peer.core.sparseloco import consensus, elementwise
    from peer.core.sparseloco.codec import exact

    U = torch.from_numpy(orthonormal_basis(64, 8, key=3)).float()
    X = torch.randn(portable.NUMBA_MIN_ROWS, 64)
    split64(X, U, X, X)  # compiles the kernels the commit uses (the fused split's signature first)
    project64(X, U)
    canonical_normal(1, (portable.NUMBA_MIN_ELEMENTS,), 1.0)
    payload, _ = compress({"w": torch.randn(2048, 1024)}, None, SparseLoCoConfig())  # exact.MIN_WORK values
    payload2, _ = compress({"w": torch.randn(2048, 1024)}, None, SparseLoCoConfig())
    clip_and_aggregate([payload, payload2, payload], 2.0)  # the norms and the decode-and-aggregate scatter
    rows = [(np.arange(0, 4096, 3 + j), np.ones(len(range(0, 4096, 3 + j)), np.float32)) for j in range(5)]
    consensus._tensor_partials(1 << 20, rows)  # the screening's kernels
    big = torch.ones(elementwise.MIN_COMPILED)
    elementwise.stepped(big, big, 0.5), elementwise.scaled(big, 0.5), elementwise.copied(big)  # the outer step's
    compiled = codec_kernels.compiled(1 << 20)
    helpers = {consensus._partials_jit: (consensus._medians_jit, consensus._add_products_jit)}
    kernels = {
        fn: codec_kernels.compiled_function(fn, *helpers.get(fn, ()))
        for fn in (
            portable._project_jit,
            portable._normal_jit,
            exact._squares_jit,
            consensus._count_jit,
            consensus._place_jit,
            consensus._partials_jit,
            elementwise._step_jit,
            elementwise._scale_jit,
            elementwise._copy_jit,
        )
    }
    if compiled is None or any(k is None for k in kernels.values()):
        pytest.skip("numba is not available here: the numpy twins run (no FMA by construction)")
    kernels[fused._walk_jit] = compiled.walk
    for fn, kernel in kernels.items():
        assert kernel.signatures, f"{fn.__name__} was not compiled"
        for signature in kernel.signatures:
            assert _fma_count(fn, signature, helpers.get(fn, ())) == 0, fn.__name__
    # the check sees FMA where LLVM may form it (on a CPU that has FMA): it can fail
    import llvmlite.binding as llvm

    if llvm.get_host_cpu_features().get("fma"):
        sig = kernels[portable._project_jit].signatures[0]
        assert _fma_count(portable._project_jit, sig, fastmath={"contract"}) > 0

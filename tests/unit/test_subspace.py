"""Unit tests of peer.core.subspace.compression against plain dense references (tiny shapes, CPU)."""

from __future__ import annotations

import pytest
import torch

from peer.config import WIRE_DTYPES
from peer.core.sparseloco.portable import canonical_gaussian64
from peer.core.subspace.compression import (
    basis_hash,
    basis_key,
    compress_activations,
    compress_grad,
    compressed_boundary,
    embedding_outer_update,
    expand_activations,
    expand_grad,
    k_from_ratio,
    make_basis,
    perp_outer_update,
    project,
    project_,
    split_embedding,
)
from peer.errors import ConfigError
from peer.net.transport import ForwardReply, ForwardRequest, codec
from peer.net.transport import peer_pb2 as pb

D, K, V, B, L = 16, 4, 11, 2, 5


def _gen(seed: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def _setup(seed: int = 0, dtype=torch.float64):
    g = _gen(seed)
    U = make_basis(D, K, seed=7, dtype=dtype)
    TE = torch.randn(V, D, generator=g, dtype=dtype)
    w, perp = split_embedding(TE, U)
    tokens = torch.randint(0, V, (B, L), generator=g)
    return g, U, TE, w, perp, tokens


# --- basis ------------------------------------------------------------------------------------


def test_basis_is_orthonormal_with_shape_and_dtype():
    U = make_basis(D, K, seed=3)
    assert U.shape == (D, K) and U.dtype == torch.float32
    assert torch.allclose(U.T @ U, torch.eye(K), atol=1e-6)
    U64 = make_basis(64, 64, seed=3, dtype=torch.float64)
    assert torch.allclose(U64.T @ U64, torch.eye(64, dtype=torch.float64), atol=1e-12)


def test_basis_deterministic_per_seed():
    a, b, c = make_basis(D, K, seed=5), make_basis(D, K, seed=5), make_basis(D, K, seed=6)
    assert torch.equal(a, b)
    assert basis_hash(a) == basis_hash(b)
    assert not torch.equal(a, c)
    assert basis_hash(a) != basis_hash(c)
    h = basis_hash(a)
    assert len(h) == 16 and int(h, 16) >= 0
    # the hash is of the float32 bytes: a float64 basis hashes like its float32 cast
    assert basis_hash(make_basis(D, K, seed=5, dtype=torch.float64)) == h


def test_basis_sign_convention_diag_r_positive():
    U = make_basis(D, K, seed=11, dtype=torch.float64)
    G = torch.from_numpy(canonical_gaussian64(basis_key(D, K, 11), D * K).reshape(D, K))  # make_basis's draw
    R = U.T @ G  # G = U R with R upper triangular
    assert torch.all(torch.diagonal(R) > 0)
    assert torch.allclose(torch.tril(R, diagonal=-1), torch.zeros(K, K, dtype=torch.float64), atol=1e-10)
    assert torch.allclose(U @ R, G, atol=1e-10)


@pytest.mark.parametrize("d,k", [(8, 0), (8, 9), (8, -1)])
def test_basis_rejects_bad_k(d, k):
    with pytest.raises(ConfigError):
        make_basis(d, k, seed=0)


@pytest.mark.parametrize(
    "d,ratio,k",
    [
        (1024, "1/8", 128),
        (1024, 0.125, 128),
        (1000, "1/3", 333),
        (10, "1/4", 3),
        (10, 0.25, 3),
        (16, 1, 16),
        (16, "1", 16),
        (7, "1/7", 1),
        (7, 0.1, 1),  # 0.7 channels round to 1; below half a channel is an error (test_experiments)
        (64, " 1/16 ", 4),
        (64, "0.5", 32),
    ],
)
def test_k_from_ratio(d, ratio, k):
    assert k_from_ratio(d, ratio) == k


@pytest.mark.parametrize(
    "ratio", ["abc", "1/0", "", "0", 0, -0.5, 1.5, "3/2", float("nan"), float("inf"), True, None, "1/200", 0.001]
)
def test_k_from_ratio_rejects_nonsense(ratio):
    with pytest.raises(ConfigError):
        k_from_ratio(64, ratio)


# --- embedding split and projection ------------------------------------------------------------


def test_split_embedding():
    _, U, TE, w, perp, _ = _setup()
    assert torch.allclose(project(w, U), w, atol=1e-12)  # w in Col(U)
    assert torch.allclose(perp @ U, torch.zeros(V, K, dtype=torch.float64), atol=1e-12)  # perp ⟂ U
    assert torch.allclose(w + perp, TE, atol=1e-12)


def test_project_in_place():
    g, U, *_ = _setup()
    p = torch.randn(V, D, generator=g, dtype=torch.float64, requires_grad=True)
    expected = p.detach() @ U @ U.T
    out = project_(p, U)
    assert out is p
    assert torch.allclose(p.detach(), expected, atol=1e-12)
    assert torch.allclose(p.detach() @ U @ U.T, p.detach(), atol=1e-12)


# --- boundary ----------------------------------------------------------------------------------


def test_round_trip_exact_in_subspace():
    g, U, _, _, perp, tokens = _setup()
    Z = torch.randn(B, L, K, generator=g, dtype=torch.float64)
    X = perp[tokens] + Z @ U.T  # (b, L, d)
    Xt = compress_activations(X, tokens, perp, U)
    assert Xt.shape == (B, L, K)
    assert torch.allclose(Xt, Z, atol=1e-12)
    assert torch.allclose(expand_activations(Xt, tokens, perp, U), X, atol=1e-12)


def test_round_trip_float32_tolerance():
    g = _gen(1)
    U = make_basis(D, K, seed=2)
    _, perp = split_embedding(torch.randn(V, D, generator=g), U)
    tokens = torch.randint(0, V, (B, L), generator=g)
    X = perp[tokens] + torch.randn(B, L, K, generator=g) @ U.T
    X_hat = expand_activations(compress_activations(X, tokens, perp, U), tokens, perp, U)
    assert X_hat.dtype == torch.float32
    assert torch.allclose(X_hat, X, atol=1e-5)


def test_lossy_for_generic_x_loses_out_of_subspace_part():
    g, U, _, _, perp, tokens = _setup()
    X = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    X_hat = expand_activations(compress_activations(X, tokens, perp, U), tokens, perp, U)
    R = X - perp[tokens]
    out_of_subspace = R - R @ U @ U.T
    assert out_of_subspace.norm() > 0.1
    assert not torch.allclose(X_hat, X, atol=1e-3)
    assert torch.allclose(X - X_hat, out_of_subspace, atol=1e-12)


def test_int32_tokens_match_int64_and_float_tokens_rejected():
    g, U, _, _, perp, tokens = _setup()
    X = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    t32 = tokens.to(torch.int32)
    a = compress_activations(X, tokens, perp, U)
    b = compress_activations(X, t32, perp, U)
    assert torch.equal(a, b)
    assert torch.equal(expand_activations(a, tokens, perp, U), expand_activations(b, t32, perp, U))
    assert torch.equal(compressed_boundary(X, t32, perp, U), compressed_boundary(X, tokens, perp, U))
    with pytest.raises(TypeError):
        compress_activations(X, tokens.to(torch.float32), perp, U)


def test_shape_mismatch_raises():
    g, U, _, _, perp, tokens = _setup()
    X = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    with pytest.raises(ValueError):
        compress_activations(X, tokens[:, :-1], perp, U)
    with pytest.raises(ValueError):
        compress_activations(X[..., :-1], tokens, perp[:, :-1], U)
    with pytest.raises(ValueError):
        expand_activations(torch.zeros(B, L, K + 1, dtype=torch.float64), tokens, perp, U)


def test_grad_compress_expand():
    g, U, *_ = _setup()
    G = torch.randn(B, L, D, generator=g, dtype=torch.float64)
    Gt = compress_grad(G, U)
    assert Gt.shape == (B, L, K)
    assert torch.allclose(expand_grad(Gt, U), G @ U @ U.T, atol=1e-12)


def test_compressed_boundary_forward_and_backward_match_explicit_projection():
    g, U, _, _, perp, tokens = _setup()
    X = torch.randn(B, L, D, generator=g, dtype=torch.float64, requires_grad=True)
    perp_p = perp.clone().requires_grad_(True)
    W = torch.randn(B, L, D, generator=g, dtype=torch.float64)  # a random downstream loss weight

    out = compressed_boundary(X, tokens, perp_p, U)
    ref = (X - perp[tokens]) @ U @ U.T + perp[tokens]
    assert torch.allclose(out, ref, atol=1e-12)
    assert torch.equal(
        out.detach(), expand_activations(compress_activations(X.detach(), tokens, perp, U), tokens, perp, U)
    )

    (gx, gperp) = torch.autograd.grad((out * W).sum(), [X, perp_p], allow_unused=True)
    (gx_ref,) = torch.autograd.grad((ref * W).sum(), [X])
    assert gperp is None  # T⊥ is a buffer: no gradient crosses into it
    assert torch.allclose(gx, gx_ref, atol=1e-12)
    assert torch.allclose(gx, expand_grad(compress_grad(W, U), U), atol=1e-12)
    assert not torch.allclose(gx, W, atol=1e-3)  # the gradient really is compressed


def test_compressed_boundary_gradcheck():
    g, U, _, _, perp, tokens = _setup()
    X = torch.randn(1, 3, D, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: compressed_boundary(x, tokens[:1, :3], perp, U), (X,))


# --- outer update ------------------------------------------------------------------------------


def test_embedding_outer_update_keeps_w_in_subspace_and_moves_te_by_update():
    g, U, TE, w, perp, _ = _setup()
    update = torch.randn(V, D, generator=g, dtype=torch.float64)
    w_new, perp_new = embedding_outer_update(w, perp, update, U)
    assert torch.allclose(project(w_new, U), w_new, atol=1e-12)
    assert torch.allclose(perp_new @ U, torch.zeros(V, K, dtype=torch.float64), atol=1e-12)
    assert torch.allclose((w_new + perp_new) - (w + perp), update, atol=1e-12)
    assert not torch.allclose(perp_new, perp, atol=1e-3)  # a generic update does move T⊥


def test_embedding_outer_update_float32():
    g = _gen(4)
    U = make_basis(D, K, seed=1)
    w, perp = split_embedding(torch.randn(V, D, generator=g), U)
    update = 1e-2 * torch.randn(V, D, generator=g)
    w_new, perp_new = embedding_outer_update(w, perp, update, U)
    assert w_new.dtype == perp_new.dtype == torch.float32
    assert torch.allclose((w_new + perp_new) - (w + perp), update, atol=1e-6)
    assert torch.allclose(project(w_new, U), w_new, atol=1e-5)


def test_perp_outer_update_bit_identical_to_embedding_outer_update():
    for dtype in (torch.float32, torch.float64):
        g = _gen(9)
        U = make_basis(D, K, seed=2, dtype=dtype)
        w, perp = split_embedding(torch.randn(V, D, generator=g, dtype=dtype), U)
        update = torch.randn(V, D, generator=g, dtype=dtype)
        _, perp_a = embedding_outer_update(w, perp, update, U)
        perp_b = perp_outer_update(perp.clone(), update.clone(), U)
        assert torch.equal(perp_a, perp_b)


def test_update_inside_subspace_leaves_perp_unchanged():
    g, U, _, w, perp, _ = _setup()
    update = torch.randn(V, K, generator=g, dtype=torch.float64) @ U.T  # in Col(U)
    w_new, perp_new = embedding_outer_update(w, perp, update, U)
    assert torch.allclose(perp_new, perp, atol=1e-12)
    assert torch.allclose(w_new, w + update, atol=1e-12)


def test_outer_update_rejects_shape_mismatch():
    _, U, _, w, perp, _ = _setup()
    with pytest.raises(ValueError):
        embedding_outer_update(w, perp, torch.zeros(V + 1, D, dtype=torch.float64), U)


@pytest.mark.parametrize("wire", ["bf16", "fp16"])
def test_compressed_boundary_rounds_like_the_wire(wire):
    """The simulator's boundary (`wire` = subspace.wire_dtype) is what the codec does to X̃ and ∇X̃."""
    g, U, _, _, perp, tokens = _setup(dtype=torch.float32)
    X = torch.randn(B, L, D, generator=g, requires_grad=True)
    W = torch.randn(B, L, D, generator=g)
    out = compressed_boundary(X, tokens, perp, U, WIRE_DTYPES[wire])
    (gx,) = torch.autograd.grad((out * W).sum(), [X])

    Xt = compress_activations(X.detach(), tokens, perp, U)
    sent = ForwardRequest("p", 0, 0, 0, 1, tokens.int(), Xt)
    got = codec.from_bytes(pb.ForwardRequest, codec.to_bytes(sent, wire)).hidden.float()
    assert not torch.equal(got, Xt)  # the wire really rounds
    assert torch.equal(out.detach(), expand_activations(got, tokens, perp, U))
    back = codec.from_bytes(pb.ForwardReply, codec.to_bytes(ForwardReply(loss=0.0, grad=compress_grad(W, U)), wire))
    assert torch.equal(gx, expand_grad(back.grad.float(), U))

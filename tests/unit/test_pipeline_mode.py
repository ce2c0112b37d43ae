"""Compression by the link (`peer.node.pipeline.mode`): the head's rule, row by row, and a stage's
uncompressed calls, which are a full replica's math.

The rule is `peer plan --recommend`'s first one: uncompressed when the uncompressed pipeline's
utilisation, compute / max(compute, message / bandwidth), reaches the target. A stage worker serves
calls of both modes on one state; a chain of uncompressed calls is a full replica's inner step bit
for bit (the same ops in the same order: the boundary is the tensor itself, fp32, and the input
gradient is what autograd would pass on through one graph).
"""

from __future__ import annotations

import pytest
import torch

from peer.cli.join_setup import join_role
from peer.config import build_config
from peer.core.model.chain import global_grad_norm
from peer.core.model.state import stage_state, state_hash
from peer.core.subspace.compression import make_basis
from peer.errors import ConfigError
from peer.net.ratelimit import MBIT
from peer.net.transport import codec
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.messages import ForwardRequest
from peer.node.pipeline.mode import (
    HOLD_READINGS,
    MIN_WIRE_S,
    RECOVERED,
    HeldBandwidth,
    LinkFigures,
    check_policy,
    choose_mode,
    held_bandwidth,
    measured_bandwidth,
    message_bytes,
    utilisation,
)
from peer.node.replica.data_parallel import chain_loss, chain_step
from peer.node.stage.worker import StageWorker
from peer.research.plan.command import PlanInputs, plan_rows
from peer.research.simulate.replica import LocalReplica

TARGET = 0.95


def _figures(compute_ms: float | None, mbps: float | None) -> LinkFigures:
    bw = None if mbps is None else mbps * MBIT
    return LinkFigures(None if compute_ms is None else compute_ms / 1e3, bw, 0.001, "caps" if bw else "none")


@pytest.mark.parametrize(
    ("policy", "compute_ms", "mbps", "compressed"),
    [
        ("always", 10.0, None, True),  # forced, whatever the links
        ("never", 10.0, 1.0, False),
        ("auto", None, None, True),  # nothing measured yet: the safe mode, measured
        ("auto", 10.0, None, False),  # no cap and nothing measured slows the link: uncompressed
        ("auto", 10.0, 1000.0, False),  # 1 Gbit/s: 32 KiB in 0.3 ms ≪ 10 ms
        ("auto", 10.0, 10.0, True),  # 10 Mbit/s: 32 KiB in 27 ms > 10 ms of compute
        ("auto", 100.0, 10.0, False),  # slow compute hides the same link
    ],
)
def test_the_mode_follows_the_policy_and_the_measured_links(policy, compute_ms, mbps, compressed):
    msg = 32 * 1024
    decision = choose_mode(policy, _figures(compute_ms, mbps), msg, TARGET)
    assert decision.compressed is compressed, decision
    assert decision.mode == ("compressed" if compressed else "uncompressed")
    if policy == "auto" and compute_ms is not None:  # the utilisation the decision rests on, said
        assert decision.util_uncompressed == pytest.approx(
            utilisation(compute_ms / 1e3, msg, _figures(0, mbps).bandwidth_bps)
        )


def test_the_target_is_reached_at_equality_and_one_stage_has_nothing_to_compress():
    msg, bw = 1_000_000, 1e8  # 10 ms per message
    at = choose_mode("auto", LinkFigures(0.0095, bw, 0.0, "caps"), msg, TARGET)  # 9.5 / 10 = 0.95
    assert not at.compressed and at.util_uncompressed == pytest.approx(0.95)
    below = choose_mode("auto", LinkFigures(0.0094, bw, 0.0, "caps"), msg, TARGET)
    assert below.compressed
    assert not choose_mode("auto", None, msg, TARGET).compressed


def test_the_rule_is_the_planners_utilisation_of_an_uncompressed_inner_step():
    """`peer plan`'s inner step is H·m·max(compute, message); with a round and commit of ~0 its
    utilisation is ours, computed from its own message size."""
    inputs = PlanInputs(preset="tiny", stages=2, inner_steps=10, replicas=1, wire_dtype="fp32", flops=1e9)
    for mbps in (1.0, 10.0, 1000.0):
        row = plan_rows(inputs, [mbps])[0]
        msg = row["boundary_bytes_uncompressed"] // 2  # (forward + backward) ≈ 2 messages of one boundary
        inner = row["inner_s_uncompressed"] / (inputs.inner_steps * inputs.microbatches)
        ours = utilisation(row["compute_s_per_microbatch"], msg, mbps * MBIT)
        assert ours == pytest.approx(row["compute_s_per_microbatch"] / inner, rel=0.02)


def test_message_bytes_match_the_encoded_uncompressed_request():
    cfg = build_config(
        overrides={"train.batch_size": 8, "train.microbatches": 2, "train.seq_len": 32, "subspace.wire_dtype": "fp32"},
        environ={},
    )
    b, L, d = 4, 32, cfg.model.d_model
    tokens = torch.zeros(b, L, dtype=torch.int32)
    request = ForwardRequest("p", 0, 0, 0, 1, tokens, torch.zeros(b, L, d), targets=tokens, compressed=False)
    encoded = len(codec.to_bytes(request, "fp32"))
    assert message_bytes(cfg, d) <= encoded <= message_bytes(cfg, d) + 256  # framing and small fields only
    back = codec.from_bytes(pb.ForwardRequest, codec.to_bytes(request, "fp32"))
    assert back.compressed is False  # the flag crosses the wire (absent: compressed, an older head's call)
    assert codec.from_bytes(
        pb.ForwardRequest, codec.to_bytes(ForwardRequest("p", 0, 0, 0, 1, tokens, torch.zeros(b, L, cfg.k)))
    ).compressed


def test_measured_bandwidth_is_the_hop_over_its_wire_time():
    assert measured_bandwidth(300_000, 0.031, 0.001) == pytest.approx(1e7)
    assert measured_bandwidth(2_700, 0.006, 0.001) is None  # a call's own costs on a loaded core, not the link's
    assert measured_bandwidth(2_700, 0.020, 0.001) is None  # under MIN_WIRE_S of wire: no bound
    assert measured_bandwidth(100_000, None, 0.001) is None


def test_an_unknown_policy_names_the_flag():
    assert check_policy("never") == "never"
    with pytest.raises(ConfigError, match="--compression"):
        check_policy("sometimes")


def _cfg():
    return build_config(
        overrides={
            "stages": 2,
            "train.batch_size": 4,
            "train.microbatches": 2,
            "train.seq_len": 16,
            "train.inner_steps": 2,
        },
        environ={},
    )


def _batch(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def _pipeline_step(head: StageWorker, last: StageWorker, h: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """One inner step as the head runs it, the calls made in-process (`compressed` per call)."""
    n, total = head.cfg.train.microbatches, 0.0
    for mb, (mx, my) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
        key = ("p", mb)
        hidden = head.forward(key, mx, None, None).hidden
        out = last.forward(key, mx, hidden, my, compressed=head.boundary_compressed)
        head.backward(key, out.grad)
        total += out.loss / n
    norm = global_grad_norm([head.grad_sq_norm(), last.grad_sq_norm()])
    last.step(0, h, norm)
    head.step(0, h, norm)
    return total


def test_an_uncompressed_pipeline_step_is_a_full_replicas_bit_for_bit():
    cfg = _cfg()
    head, last = StageWorker(cfg, 0), StageWorker(cfg, 1)  # a head and a stage peer: built compressed
    head.boundary_compressed = False  # the head's choice for this outer step
    full = [StageWorker(cfg, 0, compressed=False), StageWorker(cfg, 1, compressed=False)]
    forward = lambda mx, my: (chain_loss(full, mx, my), 0)  # noqa: E731 - the full replica's micro-batch forward
    for h in range(cfg.train.inner_steps):
        x, y = _batch(cfg, h)
        assert _pipeline_step(head, last, h, x, y) == chain_step(full, forward, 0, h, x, y)
    for ours, theirs in ((head, full[0]), (last, full[1])):
        assert state_hash(stage_state(ours.module)) == state_hash(stage_state(theirs.module))


def test_one_stage_worker_serves_both_modes_and_a_gradient_keeps_its_forwards_mode():
    cfg = _cfg()
    head, last = StageWorker(cfg, 0), StageWorker(cfg, 1)
    x, y = _batch(cfg, 0)
    mx, my = x[:2], y[:2]
    compressed = head.evaluate(mx, None, None, compressed=True).hidden
    full = head.evaluate(mx, None, None, compressed=False).hidden
    assert compressed.shape[-1] == cfg.k and full.shape[-1] == cfg.model.d_model
    out_c = last.forward(("p", 0), mx, compressed, my, compressed=True)
    out_u = last.forward(("q", 0), mx, full, my, compressed=False)
    assert out_c.grad.shape[-1] == cfg.k and out_u.grad.shape[-1] == cfg.model.d_model
    assert out_c.loss != out_u.loss  # the compressed boundary drops X − T⊥[x] outside Col(U)

    head.forward(("p", 1), mx, None, None, compressed=False)
    with pytest.raises(ValueError, match="same mode"):
        head.backward(("p", 1), out_c.grad, compressed=True)


def test_compression_is_a_heads_flag():
    assert join_role(0, False, "cpu", "fp32", "never") == "head"
    with pytest.raises(ConfigError, match="--stage 0"):
        join_role(1, False, "cpu", "fp32", "always")
    with pytest.raises(ConfigError, match="--compression"):
        join_role(0, False, "cpu", "fp32", "sometimes")
    assert join_role(None, True, "cpu", "fp32") == "full"  # auto, the default, goes with any role


def test_the_simulators_uncompressed_replica_is_what_an_uncompressed_pipeline_computes():
    """`peer simulate`'s het-pp-compress counts its uncompressed replicas as full replicas (exact
    boundaries); the swarm's uncompressed pipeline is the same on an fp32 wire (bf16, the default,
    rounds its (b, L, d) boundaries as the compressed ones are rounded)."""
    cfg = _cfg()
    x, y = _batch(cfg, 3)
    ref = LocalReplica.build(cfg, compressed=False, U=make_basis(cfg.model.d_model, cfg.k, cfg.seed))
    ref.zero_grad()
    ref_loss = ref.accumulate(x, y).loss
    head, last = StageWorker(cfg, 0), StageWorker(cfg, 1)
    head.boundary_compressed = False
    n, loss = cfg.train.microbatches, 0.0
    for mb, (mx, my) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
        out = last.forward(("p", mb), mx, head.forward(("p", mb), mx, None, None).hidden, my, compressed=False)
        head.backward(("p", mb), out.grad)
        loss += out.loss / n
    assert loss == pytest.approx(ref_loss, abs=1e-6)
    for s, w in enumerate((head, last)):
        ref_grads = {name: p.grad for name, p in ref.stages[s].named_parameters()}
        for name, p in w.module.named_parameters():
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7)


def test_the_target_is_a_manifest_setting_checked_and_fingerprinted_when_not_the_default():
    base = build_config(environ={})
    assert base.subspace.uncompressed_min_util == TARGET
    lower = build_config(overrides={"subspace.uncompressed_min_util": 0.9}, environ={})
    assert lower.fingerprint() != base.fingerprint()  # every peer of a run agrees on it
    with pytest.raises(ConfigError, match="subspace.uncompressed_min_util"):
        build_config(overrides={"subspace.uncompressed_min_util": 1.5}, environ={})


def test_a_bandwidth_is_held_through_readings_too_fast_to_tell_until_the_link_shows_it_healed():
    """ci43: a compressed head on a 10 Mbit/s link read one outer step's 36 KiB hop as too fast to
    tell and ran the next uncompressed on the slow link; the measured figure now holds."""
    hop = 36 * 1024
    slow = measured_bandwidth(hop, 0.029 + 0.001, 0.001)  # 29 ms on the wire: ~10 Mbit/s
    assert slow is not None and 9.5 < slow * 8 / 1e6 < 10.5
    fast = measured_bandwidth(hop, 0.015, 0.001)  # 14 ms: under MIN_WIRE_S, bounds nothing
    assert fast is None
    floor = hop / MIN_WIRE_S
    assert floor < RECOVERED * slow  # the floor of a small hop cannot tell 10 Mbit/s from a healed link
    held = held_bandwidth(slow, floor, None)
    assert held == HeldBandwidth(slow)
    for i in range(1, HOLD_READINGS + 1):  # held through HOLD_READINGS readings too fast to tell
        held = held_bandwidth(fast, floor, held)
        assert held == HeldBandwidth(slow, i)
    assert held_bandwidth(fast, floor, held) is None  # then let go: an uncompressed step measures again
    # an outer step with no call read nothing and keeps the figure as it was
    assert held_bandwidth(None, None, HeldBandwidth(slow, 1)) == HeldBandwidth(slow, 1)
    # a floor at RECOVERED times the held figure is evidence of a faster link: let go at once
    assert held_bandwidth(None, RECOVERED * slow, HeldBandwidth(slow)) is None
    # a new reading replaces the held one and starts its count over
    assert held_bandwidth(2 * slow, floor, HeldBandwidth(slow, 2)) == HeldBandwidth(2 * slow)
    # nothing bounded yet: a hop too fast to tell bounds nothing
    assert held_bandwidth(None, floor, None) is None
    decision = choose_mode("auto", LinkFigures(0.02, slow, 0.001, "measured"), 132 * 1024, TARGET)
    assert decision.compressed  # the held figure keeps the pipeline compressed

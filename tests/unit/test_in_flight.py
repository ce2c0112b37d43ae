"""The head's auto in-flight window (`train.in_flight = 0`) against round trip, bandwidth caps and compute.

K = S + SLACK + round((S − 1) · (rtt + serialization) / compute per micro-batch), bounded by the
micro-batches and the stash limit (`peer.node.pipeline.schedule.choose_in_flight`); the serialization is
one hop's boundary and gradient at the slowest cap of the chain (`serialization_s`, `hop_bytes`).
"""

from __future__ import annotations

import pytest
import torch

from peer.config import build_config
from peer.net.ratelimit import MBIT
from peer.net.transport import codec
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.messages import ForwardReply, ForwardRequest
from peer.node.pipeline.schedule import (
    MAX_STASH,
    MIN_COMPUTE_S,
    RTT_PER_EXTRA_S,
    SLACK,
    choose_in_flight,
    hop_bytes,
    network_per_hop,
    serialization_s,
)


def test_without_caps_or_measured_compute_the_rule_is_the_round_trip_rule():
    for rtt in (0.0, 0.0005, 0.01, 0.05, 0.2):
        for stages in (2, 3, 4):
            old = max(1, min(16, stages + SLACK + round(rtt * (stages - 1) / RTT_PER_EXTRA_S)))
            assert choose_in_flight(0, stages, 16, rtt) == old


def test_k_grows_with_the_round_trip_and_the_serialization_and_shrinks_with_compute():
    ks = [choose_in_flight(0, 3, 64, rtt, compute_s=0.02) for rtt in (0.0, 0.01, 0.02, 0.05, 0.1)]
    assert ks == sorted(ks) and ks[0] == 3 + SLACK and ks[-1] == 3 + SLACK + 10
    # a capped link: the serialization adds to each hop like latency does
    assert choose_in_flight(0, 2, 64, 0.01, serialize_s=0.03, compute_s=0.02) == 2 + SLACK + 2
    assert choose_in_flight(0, 2, 64, 0.04, compute_s=0.02) == choose_in_flight(0, 2, 64, 0.01, 0.03, 0.02)
    slow, fast = (choose_in_flight(0, 4, 64, 0.02, 0.02, c) for c in (0.08, 0.01))
    assert slow == 4 + SLACK + 2 and fast == 4 + SLACK + 12  # 3 hops × 40 ms over 80 ms or 10 ms of compute
    # a measured compute time far below the floor counts as the floor
    assert choose_in_flight(0, 2, 64, 0.02, compute_s=1e-6) == 2 + SLACK + round(0.02 / MIN_COMPUTE_S)


def test_k_is_bounded_by_the_micro_batches_and_the_stash_limit_and_a_configured_k_wins():
    assert choose_in_flight(0, 2, 8, 10.0) == 8
    assert choose_in_flight(0, 2, 1000, 10.0) == MAX_STASH
    assert choose_in_flight(0, 2, 1000, 10.0, stash_limit=6) == 6
    assert choose_in_flight(0, 1, 8, 10.0) == 1  # one stage: no hop to cover
    assert choose_in_flight(3, 2, 8, 10.0, serialize_s=5.0) == 3
    assert choose_in_flight(12, 2, 8, 0.0) == 8


def test_serialization_is_one_hops_bytes_at_the_slowest_cap():
    assert serialization_s(1_000_000, [None, 0, None]) == 0.0
    assert serialization_s(1_000_000, [100.0, None, 8.0, 50.0]) == pytest.approx(1_000_000 / (8 * MBIT))
    assert serialization_s(0, [1.0]) == 0.0


def test_hop_bytes_match_the_encoded_boundary_and_gradient():
    cfg = build_config(overrides={"train.batch_size": 8, "train.microbatches": 2, "train.seq_len": 32}, environ={})
    b, L = 4, 32
    tokens = torch.zeros(b, L, dtype=torch.int32)
    hidden = torch.zeros(b, L, cfg.k)
    request = ForwardRequest("p", 0, 0, 0, 1, tokens, hidden, targets=tokens, window=2)
    reply = ForwardReply(loss=1.0, grad=hidden)
    wire = cfg.subspace.wire_dtype  # bf16 by default
    encoded = len(codec.to_bytes(request, wire)) + len(codec.to_bytes(reply, wire))
    assert hop_bytes(cfg) <= encoded <= hop_bytes(cfg) + 512  # framing and small fields only


def test_a_capped_home_link_needs_more_micro_batches_in_flight():
    """The tiny preset at 4 micro-batches of 8×128 tokens: on a 10 Mbit/s cap one hop's boundary
    and gradient take tens of ms, so K grows past S + SLACK where the uncapped link keeps it."""
    cfg = build_config(overrides={"train.batch_size": 32, "train.microbatches": 4, "train.seq_len": 128}, environ={})
    ser = serialization_s(hop_bytes(cfg), [10.0])
    assert ser > 0.02
    uncapped = choose_in_flight(0, 2, 16, 0.002, 0.0, compute_s=0.02)
    capped = choose_in_flight(0, 2, 16, 0.002, ser, compute_s=0.02)
    assert uncapped == 2 + SLACK and capped > uncapped


def test_the_measured_hop_is_the_median_network_part_of_the_calls():
    # a token bucket lets the first message through free; the median is what the link sustains
    assert network_per_hop([0.002, 0.052, 0.050, 0.055]) == pytest.approx(0.051)
    assert network_per_hop([0.01]) == 0.01
    # a 10 Mbit/s link the caps do not report: 52 ms per hop over 67 ms of compute is one more in flight
    assert choose_in_flight(0, 2, 8, network_per_hop([0.052, 0.053]), compute_s=0.067) == 2 + SLACK + 1


def test_a_reply_carries_the_time_the_stage_held_the_request():
    reply = ForwardReply(loss=1.0, grad=torch.zeros(2, 4, 8), served_s=0.125)
    assert codec.from_bytes(pb.ForwardReply, codec.to_bytes(reply)).served_s == 0.125
    assert codec.from_bytes(pb.ForwardReply, codec.to_bytes(ForwardReply(loss=1.0))).served_s is None  # an older peer

"""The head's choice of micro-batches in flight and the wire fields of the pipelined schedule."""

from __future__ import annotations

import threading

import pytest
import torch

from peer.config import build_config
from peer.net.transport import codec
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.messages import ForwardReply, ForwardRequest
from peer.node.pipeline.schedule import SLACK, choose_in_flight, with_in_flight
from peer.node.pipeline.step import _Aborted, _ForwardTurns


def test_in_flight_defaults_to_the_stages_plus_slack_and_grows_with_the_round_trip():
    assert choose_in_flight(0, stages=2, microbatches=8, rtt_s=0.0005) == 2 + SLACK
    assert choose_in_flight(0, stages=4, microbatches=8, rtt_s=0.0) == 4 + SLACK
    assert choose_in_flight(0, stages=2, microbatches=8, rtt_s=0.05) == 4 + SLACK
    assert choose_in_flight(0, stages=4, microbatches=8, rtt_s=0.05) == 8  # capped by the micro-batches
    assert choose_in_flight(3, stages=2, microbatches=8, rtt_s=1.0) == 3  # configured wins
    assert choose_in_flight(0, stages=2, microbatches=1, rtt_s=0.0) == 1
    assert choose_in_flight(0, stages=1, microbatches=8, rtt_s=0.0) == 1  # one stage: nothing to overlap


def test_the_local_window_wins_over_the_config_and_leaves_the_fingerprint(monkeypatch):
    monkeypatch.setenv("PEER_TRAIN__IN_FLIGHT", "7")  # no side channel: only SessionOptions.in_flight counts
    cfg = build_config(overrides={"train.in_flight": 2}, environ={})
    assert with_in_flight(cfg, None) is cfg
    mine = with_in_flight(cfg, 5)
    assert (mine.train.in_flight, cfg.train.in_flight) == (5, 2)
    assert mine.fingerprint() == cfg.fingerprint()  # a head's own choice, not the run's
    assert with_in_flight(cfg, -3).train.in_flight == 0  # `--in-flight -3` reads as auto, as before


def test_streamed_fields_round_trip():
    tokens = torch.zeros(2, 4, dtype=torch.int32)
    hidden = torch.randn(2, 4, 8)
    req = ForwardRequest("p", 3, 1, 2, 1, tokens, hidden, targets=tokens, attempt=2, route=("10.0.0.2:5",), window=4)
    back = codec.from_bytes(pb.ForwardRequest, codec.to_bytes(req))
    assert (back.attempt, back.route, back.window) == (2, ("10.0.0.2:5",), 4)
    reply = ForwardReply(loss=1.5, grad=hidden, sq_norms=(1.0, 2.0))
    assert codec.from_bytes(pb.ForwardReply, codec.to_bytes(reply)).sq_norms == (1.0, 2.0)


def test_stage_zero_forwards_run_in_micro_batch_order_whatever_thread_starts_first():
    turns, entered, lock = _ForwardTurns(threading.Event()), [], threading.Lock()
    arrived = {mb: threading.Event() for mb in range(8)}

    def forward(mb: int) -> None:
        arrived[mb].set()
        turns.wait(mb)
        with lock:
            entered.append(mb)
        turns.done(mb)

    later = [threading.Thread(target=forward, args=(mb,)) for mb in (5, 3, 7, 6, 1, 4, 2)]
    for th in later:  # every later micro-batch is on its way before micro-batch 0 starts
        th.start()
    assert all(arrived[mb].wait(5) for mb in (5, 3, 7, 6, 1, 4, 2))
    assert entered == []  # none may run its forward before micro-batch 0 has
    first = threading.Thread(target=forward, args=(0,))
    first.start()
    for th in [first, *later]:
        th.join(5)
    assert entered == list(range(8))


def test_a_failed_attempt_releases_the_forwards_still_waiting():
    abort = threading.Event()
    turns, failed, arrived = _ForwardTurns(abort), [], threading.Event()

    def forward(mb: int) -> None:
        arrived.set()
        try:
            turns.wait(mb)  # micro-batches 0-2 never run: only the abort can end this wait
        except _Aborted:
            failed.append(mb)

    waiting = threading.Thread(target=forward, args=(3,))
    waiting.start()
    assert arrived.wait(5)
    abort.set()
    waiting.join(5)
    assert not waiting.is_alive() and failed == [3]  # ended by the abort, not by returning
    with pytest.raises(_Aborted):
        turns.wait(0)  # nothing new starts once the attempt failed

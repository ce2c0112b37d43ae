"""A stage's optimizer step overtaken by the next inner step's micro-batches (peer.node.stage.worker).

With micro-batches in flight the head sends each inner step's `step` without waiting for its answer
(`StepExecutor._step`), so on a stage peer the next inner step's first forwards can arrive before
the step. They must wait for it rather than drop the complete step's gradients: the stage ends
bit-identical to one that got every step first. A step that never arrives costs only that step.
"""

from __future__ import annotations

import threading

import pytest
import torch

from peer.config import build_config
from peer.core.model.state import stage_state, state_hash
from peer.net.transport.errors import Refusal, RefusalKind
from peer.node.pipeline.failures import Action, from_refusal
from peer.node.stage.epoch_gate import StaleMicrobatch
from peer.node.stage.worker import StageWorker
from tests.unit.test_stage_checkpoint import SMALL  # the tiny model of the stage-worker tests

MB = 2  # micro-batches per inner step


def _cfg(rpc_timeout_s: float = 30.0):
    return build_config(
        overrides={
            "stages": 2,
            "train.batch_size": 4,
            "train.microbatches": MB,
            "train.seq_len": 16,
            "train.inner_steps": 4,
            **SMALL,
            "swarm.rpc_timeout_s": rpc_timeout_s,
        },
        environ={},
    )


def _inputs(cfg, h: int, mb: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * h + mb)
    b, L = cfg.train.batch_size // MB, cfg.train.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, L), generator=g)
    hidden = torch.randn(b, L, cfg.k, generator=g)
    return tokens, hidden, torch.randint(0, cfg.model.vocab_size, (b, L), generator=g)


def _forward(worker: StageWorker, h: int, mb: int) -> float:
    tokens, hidden, targets = _inputs(worker.cfg, h, mb)
    out = worker.forward(("p", mb), tokens, hidden, targets, epoch=(h, 0), window=4)
    assert out.loss is not None
    return out.loss


def _hash(worker: StageWorker) -> str:
    with worker.lock:
        return state_hash(stage_state(worker.module))


def test_the_next_inner_steps_micro_batches_wait_for_the_step_and_end_bit_identical():
    cfg = _cfg()
    ordered, overtaken = StageWorker(cfg, 1), StageWorker(cfg, 1)
    for h in range(2):  # the step arrives first
        for mb in range(MB):
            _forward(ordered, h, mb)
        ordered.step(0, h, None)

    for mb in range(MB):
        _forward(overtaken, 0, mb)
    started, done = threading.Event(), threading.Event()
    losses: list[float] = []

    def next_step_first_microbatch() -> None:
        started.set()
        losses.append(_forward(overtaken, 1, 0))
        done.set()

    thread = threading.Thread(target=next_step_first_microbatch)
    thread.start()
    started.wait()
    assert not done.wait(0.5), "the next inner step ran before the step of the complete one"
    overtaken.step(0, 0, None)  # the step arrives late
    assert done.wait(10)
    thread.join()
    _forward(overtaken, 1, 1)
    overtaken.step(0, 1, None)
    assert _hash(overtaken) == _hash(ordered)


def test_a_step_that_never_arrives_is_dropped_and_the_micro_batch_refused_then_replayed():
    cfg = _cfg(rpc_timeout_s=0.5)
    worker, reference = StageWorker(cfg, 1), StageWorker(cfg, 1)
    for mb in range(MB):
        _forward(worker, 0, mb)
    with pytest.raises(ValueError, match="was never stepped"):
        _forward(worker, 1, 0)
    # the head replays inner step 1 (attempt 1); the lost step's gradients are gone
    for mb in range(MB):
        tokens, hidden, targets = _inputs(cfg, 1, mb)
        worker.forward(("p", mb), tokens, hidden, targets, epoch=(1, 1), window=4)
        tokens, hidden, targets = _inputs(cfg, 1, mb)
        reference.forward(("p", mb), tokens, hidden, targets, epoch=(1, 1), window=4)
    worker.step(0, 1, None)
    reference.step(0, 1, None)
    assert _hash(worker) == _hash(reference)  # as if inner step 0 never ran here


def test_a_stage_ahead_for_an_earlier_head_process_names_its_inner_step_in_the_refusal():
    """A head restarted with the same key begins its outer step again at inner step 0. A stage that ran
    later inner steps for the earlier process refuses it as stale, naming the epoch it runs; the head
    decides on that typed refusal (`peer.node.pipeline.failures`) and replaces the peer instead of
    replaying into it forever. The head's own attempt numbers grow from the clock, never from 0 again."""
    worker = StageWorker(_cfg(), 1, compressed=True)
    tokens, hidden, targets = _inputs(worker.cfg, 2, 0)
    worker.forward(("p", 0), tokens, hidden, targets, epoch=(2, 5), window=4)  # the earlier process
    with pytest.raises(StaleMicrobatch) as refused:
        worker.forward(("p", 0), tokens, hidden, targets, epoch=(0, 10**12), window=4)  # the restarted one
    assert (refused.value.stage, refused.value.epoch) == (1, (0, 2, 5))
    t, h, attempt = refused.value.epoch
    refusal = Refusal(RefusalKind.STALE, refused.value.stage, outer_step=t, inner_step=h, attempt=attempt)
    assert from_refusal(refusal, t=0, h=0, reason="stale").action is Action.REPLACE
    assert from_refusal(refusal, t=0, h=2, reason="stale").action is Action.REPLAY  # not ahead: replay
    # a later attempt of the same inner step is never refused: the replay restarts it on the stage
    assert worker.forward(("p", 0), tokens, hidden, targets, epoch=(2, 10**12), window=4).loss is not None


def test_a_head_paused_mid_outer_step_admits_its_own_restart_at_inner_step_0():
    """A head that pauses at inner step 2 starts the outer step over at inner step 0 with a new attempt;
    its own stage 0 must take it (before, the gate kept (t, 2, …) and refused every restart as stale:
    the head retried forever). A stage that did not restart still refuses it, as above. (The gate is
    the same at every stage; stage 1's takes the test's compressed inputs.)"""
    head = StageWorker(_cfg(), 1, compressed=True)
    tokens, hidden, targets = _inputs(head.cfg, 2, 0)
    head.forward(("p", 0), tokens, hidden, targets, epoch=(2, 5), window=4)
    with pytest.raises(StaleMicrobatch):
        head.forward(("p", 0), tokens, hidden, targets, epoch=(0, 6), window=4)
    head.restart_outer_step()  # `_Head.pause`
    assert head.forward(("p", 0), tokens, hidden, targets, epoch=(0, 6), window=4).loss is not None
    assert head.gate.epoch == (head.train_step, 0, 6)

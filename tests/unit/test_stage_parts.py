"""The parts of one stage's holder, each on its own: the epoch gate (peer.node.stage.epoch_gate), the
optimizers (peer.node.stage.optimizer), the round ledger (peer.node.stage.ledger) and θ_start's
hash cache (peer.node.stage.state.StartCache)."""

from __future__ import annotations

import threading

import pytest
import torch

from peer.core.model.decoder import build_stage
from peer.core.model.state import state_hash
from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.clip import ClipStats
from peer.core.sparseloco.codec.format import SparseLoCoConfig
from peer.core.sparseloco.commit import NO_CLIP, Committed, RoundCommit
from peer.node.round.bans import NONE, Bans
from peer.node.round.claims import Link
from peer.node.stage.commit import Outcome
from peer.node.stage.epoch_gate import EpochGate, StaleMicrobatch
from peer.node.stage.ledger import HISTORY, RoundLedger
from peer.node.stage.optimizer import StageOptimizer
from peer.node.stage.state import StartCache
from tests.unit.test_step_overtaken import _cfg


def _gate(timeout_s: float = 5.0, microbatches: int = 2) -> tuple[EpochGate, list[int]]:
    resets: list[int] = []
    lock = threading.RLock()
    gate: EpochGate

    def reset() -> None:  # the worker's reset_step: forget the gradients, then reset the gate
        resets.append(1)
        gate.reset()

    gate = EpochGate(lock, 1, microbatches, timeout_s, reset)
    return gate, resets


def test_gate_enters_epochs_in_order_and_refuses_stale_ones():
    gate, resets = _gate()
    with gate._turn:
        gate.admit(0, (0, 0, 0), window=0, turn=False)
        assert gate.epoch == (0, 0, 0) and len(resets) == 1 and gate.generation == 1
        gate.admit(1, (0, 0, 1), window=0, turn=False)  # a replay of the inner step: starts it over
        assert gate.epoch == (0, 0, 1) and len(resets) == 2 and gate.generation == 2
        with pytest.raises(StaleMicrobatch) as stale:
            gate.admit(0, (0, 0, 0), window=0, turn=False)
        assert stale.value.epoch == (0, 0, 1)  # typed: the refusal carries the epoch the stage runs
        gate.forget()  # a loaded state: nothing of it is stale
        gate.admit(0, (0, 0, 0), window=0, turn=False)
        assert gate.epoch == (0, 0, 0)


def test_gate_keeps_micro_batch_order_of_gradient_accumulation():
    gate, _ = _gate()
    order: list[int] = []
    with gate._turn:
        gate.admit(0, (0, 0, 0), window=0, turn=True)

    def second() -> None:
        with gate._turn:
            gate.admit(1, (0, 0, 0), window=0, turn=True)  # waits (lock released) for micro-batch 0
            order.append(1)
            gate.accumulated()

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(0.2)
    assert thread.is_alive() and order == []  # micro-batch 1 waits for its turn
    with gate._turn:
        order.append(0)
        gate.accumulated()
    thread.join(5)
    assert order == [0, 1] and gate.applied == 2


def test_gate_gives_up_after_its_timeout_and_when_a_reset_supersedes_the_wait():
    gate, _ = _gate(timeout_s=0.05)
    with gate._turn:
        gate.admit(0, (0, 0, 0), window=0, turn=True)
        with pytest.raises(ValueError, match="waited too long"):
            gate.admit(1, (0, 0, 0), window=0, turn=True)
    gate, _ = _gate(timeout_s=5.0)
    with gate._turn:
        gate.admit(0, (0, 0, 0), window=0, turn=True)
    failed: list[str] = []

    def waiter() -> None:
        with gate._turn:
            try:
                gate.admit(1, (0, 0, 0), window=0, turn=True)
            except ValueError as exc:
                failed.append(str(exc))

    thread = threading.Thread(target=waiter)
    thread.start()
    thread.join(0.2)
    with gate._turn:
        gate.reset()  # the gradients were dropped (a replay): the waiter's turn never comes
    thread.join(5)
    assert len(failed) == 1 and "superseded" in failed[0]


def test_stage_optimizer_state_round_trip_and_a_bad_state_leaves_it_as_it_was():
    cfg = _cfg()
    module = build_stage(cfg.model, 1, cfg.stages, cfg.seed)
    optim = StageOptimizer(module, cfg.train, SparseLoCoConfig(quant_bits=0))
    for p in module.parameters():
        p.grad = torch.ones_like(p)
    optim.step(0, None, None)
    delta = {n: torch.full_like(p, 0.5) for n, p in module.named_parameters()}
    payload = optim.encode(delta)
    assert optim.errors is not None and payload.entries
    copy = optim.loaded(optim.state_dict(), stage=1)
    assert copy is not optim and copy.errors is not None and optim.errors is not None
    for name, e in optim.errors.items():
        assert torch.equal(copy.errors[name], e)
    assert copy.state_dict()["optimizer"]["state"].keys() == optim.state_dict()["optimizer"]["state"].keys()
    before = {n: e.clone() for n, e in optim.errors.items()}
    optim.feed_back(delta)
    optim.feed_back(delta, -1.0)
    assert all(torch.equal(optim.errors[n], before[n]) for n in before)
    bad = optim.state_dict()
    bad["optimizer"] = {**bad["optimizer"], "param_groups": list(reversed(bad["optimizer"]["param_groups"]))}
    with pytest.raises(ValueError, match="parameter groups"):
        optim.loaded(bad, stage=1)
    assert all(torch.equal(optim.errors[n], before[n]) for n in before)  # unchanged
    fresh = optim.loaded({}, stage=1)
    assert fresh.errors is None and not fresh.adamw.state


def _outcome(t: int, replicas: tuple[str, ...], bans: Bans = NONE) -> Outcome:
    clip = ClipStats(1, (1.0,) * len(replicas), 1.0, 3.0, (None,) * len(replicas))
    done = Committed({}, None, RoundCommit(clip))
    return Outcome(t, done, bans, replicas, replicas[:1], f"p{t}", f"q{t}")


def test_round_ledger_keeps_a_commits_records_and_the_last_history_rounds():
    ledger = RoundLedger()
    assert ledger.bans == NONE and ledger.link is None and ledger.last_clip is NO_CLIP
    payload, _ = compress({"w": torch.ones(4, 4)}, None, SparseLoCoConfig(quant_bits=0))
    for t in range(HISTORY + 3):
        ledger.last_contribution = ("me", payload)  # our payload waits for its round
        out = _outcome(t, ("a" * 16, "b" * 16))
        ledger.committed(out, Link(t, f"s{t}", out.state, ()))
    assert sorted(ledger.history) == list(range(3, HISTORY + 3))
    assert ledger.link is not None and ledger.link.t == HISTORY + 2
    assert ledger.last_committed == ["a" * 16, "b" * 16] and ledger.last_dropped == ["a" * 16]
    assert ledger.last_clip.max_ratio == 3.0 and ledger.last_contribution is None
    link = Link(7, "x", "y", (("c" * 16, "d" * 16),))
    ledger.adopted(NONE, link)
    assert ledger.history == {7: link} and ledger.prev is None and ledger.last_committed == ["c" * 16]
    ledger.adopted(NONE, None)
    assert ledger.history == {} and ledger.link is None and ledger.last_committed == []


def test_start_cache_hashes_once_per_state_and_keeps_start_in_float32_on_the_cpu():
    calls: list[int] = []
    perp = torch.ones(3)

    def perp_of() -> torch.Tensor:
        calls.append(1)
        return perp

    cache = StartCache({"w": torch.ones(2, dtype=torch.float64)})
    assert cache.start["w"].dtype == torch.float32
    first = cache.hashes(0, perp_of)
    assert first == (state_hash(cache.start), state_hash({"perp": perp}))
    assert cache.hashes(0, perp_of) == first and len(calls) == 1  # cached
    assert cache.hashes(1, perp_of) == first and len(calls) == 2  # another outer step: computed again
    cache.set({"w": torch.zeros(2)})
    assert cache.hashes(1, perp_of) != first and len(calls) == 3
    cache.known(2, ("h", "k"))  # a commit computed them
    assert cache.hashes(2, perp_of) == ("h", "k") and len(calls) == 3

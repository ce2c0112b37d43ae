"""Overlapped outer steps on one stage (`peer.node.stage.ahead`, `StageState.begin_overlap`).

A holder trained ahead commits the same state as a synchronous twin (the committed state is a
function of the payloads alone), its local parameters end at θ_start(t + 1) + the progress made since
the boundary, it trains the outer step after the committed one, and a round that does not commit
drops that progress.
"""

from __future__ import annotations

import threading

import torch

from peer.config import build_config
from peer.node.round.contribution import Contribution
from peer.node.stage.ahead import Ahead
from peer.node.stage.worker import StageWorker

SMALL = {"train.batch_size": 4, "train.microbatches": 2, "train.seq_len": 16, "stages": 2}


def _worker(stage: int = 0) -> StageWorker:
    return StageWorker(build_config(overrides=SMALL, environ={}), stage)


def _nudge(w: StageWorker, seed: int, scale: float = 1e-2) -> dict[str, torch.Tensor]:
    """Move the local parameters as inner steps would; the move by name."""
    g = torch.Generator().manual_seed(seed)
    moves = {}
    with torch.no_grad():
        for n, p in w.module.named_parameters():
            moves[n] = torch.randn(p.shape, generator=g) * scale
            p.add_(moves[n])
    return moves


def _others(stage: int) -> list[Contribution]:
    out = []
    for i in range(2):
        w = _worker(stage)
        _nudge(w, 10 + i)
        out.append(w.contribution(f"r{i + 1}"))
    return out


def test_rebase_keeps_the_progress_since_the_boundary():
    module = torch.nn.Linear(3, 2)
    ahead = Ahead(module, training=1)
    base = {n: p.detach().clone() for n, p in module.named_parameters()}
    with torch.no_grad():
        module.weight.add_(0.5)
    committed = {n: torch.full_like(p, 2.0) for n, p in base.items()}
    ahead.rebase(module, committed)
    assert torch.allclose(module.weight, committed["weight"] + 0.5)
    assert torch.allclose(module.bias, committed["bias"])
    assert torch.equal(ahead.base["weight"], committed["weight"])


def test_a_stage_trained_ahead_commits_the_synchronous_state_and_keeps_its_progress():
    sync, ahead = _worker(), _worker()
    for w in (sync, ahead):
        _nudge(w, 1)
    others = _others(0)
    mine_sync, mine_ahead = sync.contribution("r0"), ahead.contribution("r0")
    assert mine_sync.data == mine_ahead.data
    ahead.begin_overlap()
    assert (ahead.outer_step, ahead.train_step) == (0, 1)
    progress = _nudge(ahead, 2)  # inner steps of outer step 1 while round 0 is in flight
    sync.commit_round([mine_sync, *others], None)
    ahead.commit_round([mine_ahead, *others], None)
    assert ahead.state_id() == sync.state_id()
    assert ahead.end_overlap()
    assert (ahead.outer_step, ahead.train_step) == (1, 1)
    for n, p in ahead.module.named_parameters():
        assert torch.allclose(p, sync.start[n] + progress[n], atol=1e-6), n
    for n, e in ahead.optim.errors.items():
        assert torch.equal(e, sync.optim.errors[n]), n


def test_a_round_that_does_not_commit_drops_the_progress_made_ahead():
    w = _worker(1)
    _nudge(w, 1)
    w.contribution("r0")
    w.begin_overlap()
    _nudge(w, 2)
    assert not w.end_overlap()  # round 0 did not commit here
    assert (w.outer_step, w.train_step) == (0, 0)
    for n, p in w.module.named_parameters():
        assert torch.equal(p.detach(), w.start[n]), n


def test_a_state_dict_taken_ahead_is_a_copy():
    w = _worker(1)
    w.begin_overlap()
    state = w.state_dict()
    _nudge(w, 3)
    name, p = next(iter(w.module.named_parameters()))
    assert not torch.equal(state["params"][name], p.detach())


def test_the_state_id_is_read_without_the_lock_and_never_stale():
    """The round's threads read the state id while the trainer holds the stage lock through an inner
    step: the answer comes without the lock, and a commit or a loaded state changes it at once."""
    import threading

    from peer.node.stage.initial import canonical_state

    w = _worker(0)
    before = w.state_id()
    answered: list[str] = []
    with w.lock:  # the trainer, mid inner step, on another thread's view
        reader = threading.Thread(target=lambda: answered.append(w.state_id()))
        reader.start()
        reader.join(timeout=5)
        assert not reader.is_alive() and answered == [before]
    _nudge(w, 1)
    w.commit_round([w.contribution("r0"), *_others(0)], None)
    after = w.state_id()
    assert after != before and w.param_hash() != _worker(0).param_hash()
    start, perp = canonical_state(w.cfg, 0)
    w.load_state_dict({"outer_step": 0, "start": start, "perp": perp})
    assert w.state_id() == before


class _Watched(threading.Condition):
    """The stage's `settled` condition, telling when a thread waits on it (the lock released)."""

    def __init__(self, lock: threading.RLock) -> None:
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def test_a_commit_waiting_for_a_pending_micro_batch_never_leaves_stale_ids():
    """Trained ahead, a commit waits for the pipeline's pending micro-batch (the lock released): a
    record refresh reading the state id meanwhile must not leave the old ids published after the
    commit (a head then claimed, recorded and linked its next round from the state before)."""
    sync, w = _worker(), _worker()
    for x in (sync, w):
        _nudge(x, 1)
    others = _others(0)
    mine_sync, mine = sync.contribution("r0"), w.contribution("r0")
    sync.commit_round([mine_sync, *others], None)
    w.begin_overlap()
    w.settled = watched = _Watched(w.lock)
    tokens = torch.zeros(2, 16, dtype=torch.long)
    w.forward(("pipeline", 0), tokens, None, None)  # outer step 1's micro-batch, its graph pending
    before = w.state_id()
    committer = threading.Thread(target=lambda: w.commit_round([mine, *others], None))
    committer.start()
    assert watched.waiting.wait(timeout=30)  # the commit waits for the micro-batch, the lock released
    assert w.state_id() == before  # a reader meanwhile: the state before the commit
    w.drop_pending()
    committer.join(timeout=30)
    assert not committer.is_alive() and w.outer_step == 1
    assert (w.state_id(), w.param_hash()) == (sync.state_id(), sync.param_hash())
    assert w.ledger.link is not None and w.ledger.link.state == sync.state_id()
    assert w.end_overlap()
    for x in (sync, w):  # the next round, from the committed state: its link says so
        x.commit_round(others, None)
    assert w.ledger.link.prev == sync.ledger.link.prev
    assert w.state_id() == sync.state_id()

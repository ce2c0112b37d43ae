"""Joining by replay (peer.node.round.replay, docs/protocol.md "Joining by replay"), row by row.

The history is real (tests/replay_helpers.py: real payloads, real portable commits on the tiny
preset); the DHT and the payload servers are in-memory tables of what holders publish, so each
decision is shown alone (the real DHT and gRPC path: tests/integration/test_join_replay.py).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from peer.core.sparseloco.codec.format import Payload
from peer.errors import NetworkError
from peer.net.records import Announcement, ReplicaRecord, StageRecord
from peer.net.transport.messages import StateReply
from peer.node.presence import Presence
from peer.node.round.claims import Link, entry
from peer.node.round.context import RoundContext
from peer.node.round.payloads import PayloadStore, payload_id
from peer.node.round.refusals import Refusals
from peer.node.round.replay import Replayer, SkipDead, candidates, chain_record, parse_chain
from peer.node.round.resync import Resync
from peer.node.round.verify import SetFetcher
from peer.node.stage.worker import StageWorker
from tests.replay_helpers import History, replay_config
from tests.round_helpers import own

pytestmark = pytest.mark.timeout(120)

CFG = replay_config()


class Board:
    """What holders published: payload announcements and `chain.{t}.{s}` links, in memory."""

    def __init__(self, history: History) -> None:
        self.announcements: dict[tuple[int, int], dict[str, dict]] = {}
        self.holders: dict[str, dict] = {}  # stage records (one stage)
        self.attest: dict[str, dict] = {}  # attesters' records of the stage (`peer.bootstrap.attester`)
        self.chain: dict[tuple[int, int], dict[str, dict]] = {}
        for (t, s, rid), data in history.payloads.items():
            ann = {"sha256": payload_id(data), "size": len(data), "address": f"{rid}:1", "replica": rid}
            self.announcements.setdefault((t, s), {})[rid] = ann

    def link(self, holder: str, link: Link, stage: int) -> None:
        self.chain.setdefault((link.t, stage), {})[holder] = chain_record(link)

    def get_payloads(self, t, stage):
        return {p: Announcement.parse(r) for p, r in self.announcements.get((t, stage), {}).items()}

    def get_replicas(self):
        return {}

    def get_stage_peers(self, stage, kind="stage"):
        return {p: StageRecord.parse(r) for p, r in (self.holders if kind == "stage" else self.attest).items()}

    def get_rounds(self, wanted):
        return [self.get_round(k, t, s, p) if k == "chain" else self.get_payloads(t, s) for k, t, s, p in wanted]

    def get_round(self, kind, t, stage, parse):
        assert kind == "chain"
        out = {p: parse(r) for p, r in self.chain.get((t, stage), {}).items()}
        return {p: v for p, v in out.items() if v is not None}


class Servers:
    """Each replica serves its own payloads (`get_payload`), at "<replica>:1"; counts requests."""

    def __init__(self, history: History) -> None:
        self.history, self.calls = history, 0
        self.states: dict[str, StageWorker] = {}  # address → the worker whose state it serves

    def get(self, address):
        servers = self

        class Client:
            def get_payload(self, req, timeout_s):
                servers.calls += 1
                data = servers.history.payloads.get((req.outer_step, req.stage, address.split(":")[0]))
                if data is None:
                    raise NetworkError(f"{address} does not hold it")
                return data

            def get_state(self, req):
                w = servers.states[address]
                return StateReply(w.outer_step, {"bans": w.ledger.bans.to_record()}, w.snapshot())

        return Client()


@pytest.fixture(scope="module")
def history() -> History:
    h = History(CFG)
    h.run(4)
    return h


def _replayer(board: Board, history: History, refusals: Refusals) -> Replayer:
    servers = Servers(history)
    return Replayer(CFG, board, lambda reads: SetFetcher(reads, servers, PayloadStore(), "joiner", 1.0), refusals)


def _honest(board: Board, history: History, holders=("H1", "H2")) -> None:
    for (_t, s), link in history.links.items():
        for h in holders:
            board.link(h, link, s)


def _negated(stage: int) -> str:
    """The state id of the initial state with every parameter negated: the colluders' forgery."""
    w = StageWorker(CFG, stage)
    state = w.state_dict()
    negated = {n: -v for n, v in state["start"].items()}
    w.load_state_dict({**state, "start": negated, "params": negated})
    return w.state_id()


# ------------------------------------------------------------------ the initial state
def test_the_initial_state_is_recomputed_never_voted_on():
    a, b = StageWorker(CFG, 1), StageWorker(CFG, 1)
    assert a.initial_state_id == b.initial_state_id == a.state_id() and a.verified
    state = a.state_dict()
    a.load_state_dict({**state, "start": {n: -v for n, v in state["start"].items()}})
    assert a.state_id() != a.initial_state_id and not a.verified  # a loaded state is not a checked one
    a.reset_initial()
    assert a.state_id() == a.initial_state_id and a.verified and a.outer_step == 0


# ------------------------------------------------------------------ candidates: the canonical order
def _link(state: str, n: int, t: int = 0, prev: str = "p", embed: int | None = None) -> Link:
    entries = tuple(entry(f"R{i:015d}", f"{i:032x}") for i in range(n))
    return Link(t, prev, state, entries, None if embed is None else entries[:embed])


def test_candidates_most_payloads_first_then_the_smallest_state_and_each_link_once():
    links = {"a": _link("s9", 3), "b": _link("s1", 2), "c": _link("s9", 3), "d": _link("s0", 2)}
    got = candidates(links, 0, "p")
    assert [(c.link.state, c.holders) for c in got] == [("s9", ("a", "c")), ("s0", ("d",)), ("s1", ("b",))]


def test_candidates_only_from_our_state_of_that_round_and_never_a_refused_holder():
    links = {"a": _link("s1", 2, prev="other"), "b": _link("s2", 2, t=1), "c": _link("s3", 2), "d": _link("s0", 5)}
    assert [c.link.state for c in candidates(links, 0, "p", refused={"d"})] == ["s3"]


def test_candidates_of_a_later_stage_moved_their_perp_by_a_set_stage_0_linked():
    good, other = _link("s1", 3, embed=3), _link("s0", 3, embed=2)
    assert [c.link.state for c in candidates({"a": good, "b": other}, 0, "p", embed_sets={good.embed})] == ["s1"]


def test_a_chain_record_reads_back_as_its_link():
    link = _link("s1", 2, t=4, embed=1)
    assert parse_chain(chain_record(link)) == link
    assert parse_chain({"link": {"t": -1}, "state": "x"}) is None and parse_chain("junk") is None


# ------------------------------------------------------------------ replay
@pytest.mark.parametrize("stage", [0, 1])
def test_a_joiner_replays_the_honest_history_and_refuses_three_forgers(history, stage):
    board, refusals = Board(history), Refusals()
    _honest(board, history)
    honest0 = history.links[(0, stage)]
    # the honest set with another state, first among links of that set (the smallest state id)
    forged = Link(0, honest0.prev, "0" * 16, honest0.entries, honest0.embed)
    # the negated initial state, with more payloads: first in the canonical order, one never announced
    padded = Link(0, honest0.prev, _negated(stage), (*honest0.entries, entry("Made" * 10, "ab" * 16)), honest0.embed)
    board.link("F1", forged, stage)
    board.link("F2", forged, stage)
    board.link("F3", padded, stage)
    joiner = StageWorker(CFG, stage)
    done = _replayer(board, history, refusals).run(joiner, 3)
    assert done.stopped == "" and done.rounds == 3 and joiner.outer_step == 3
    assert joiner.state_id() == history.links[(2, stage)].state
    assert refusals.peers() == {"F1", "F2", "F3"}
    assert done.bytes > 0 and joiner.verified
    assert sorted(joiner.ledger.history) == [0, 1, 2]  # it serves the chain it checked from now on


def test_a_branch_nobody_went_on_from_loses_to_the_one_the_swarm_continued(history):
    """Round 1's full set (first by the canonical order) was linked only by a holder that then left;
    the swarm went on from round 1's one-payload set: the replay follows the swarm, not the dead end."""
    board, refusals = Board(history), Refusals()
    board.link("H1", history.links[(0, 0)], 0)
    board.link("Gone", history.links[(1, 0)], 0)  # genuine, the most payloads, and no link goes on from it
    branch = StageWorker(CFG, 0)
    _replayer(board, history, refusals).run(branch, 1)
    for t, replicas in ((1, history.replicas[:1]), (2, history.replicas)):
        sent = [own(r, history.payloads[(t, 0, r)]) for r in replicas]
        branch.advance(branch.replay(sent, None), sent, None)
        assert branch.ledger.link is not None
        board.link("H1", branch.ledger.link, 0)
    joiner = StageWorker(CFG, 0)
    done = _replayer(board, history, refusals).run(joiner, 3)
    assert done.stopped == "" and joiner.outer_step == 3 and joiner.state_id() == branch.state_id()
    assert not refusals.peers()  # the dead end was genuine: passed over, not refused


def test_no_link_from_our_state_stops_with_a_reason_and_keeps_what_was_checked(history):
    board = Board(history)
    board.link("H1", history.links[(0, 0)], 0)  # round 1 is not published (beyond the window)
    joiner = StageWorker(CFG, 0)
    done = _replayer(board, history, Refusals()).run(joiner, 3)
    assert done.rounds == 1 and joiner.outer_step == 1 and "round 1: no holder published a link" in done.stopped


def test_a_link_whose_payloads_nobody_serves_is_left_not_refused(history):
    board, refusals = Board(history), Refusals()
    _honest(board, history, holders=("H1",))
    history_missing = History.__new__(History)
    history_missing.payloads = {}
    servers = Servers(history_missing)
    fetcher = lambda reads: SetFetcher(reads, servers, PayloadStore(), "joiner", 1.0)  # noqa: E731
    joiner = StageWorker(CFG, 0)
    done = Replayer(CFG, board, fetcher, refusals).run(joiner, 3)
    assert done.rounds == 0 and "not available" in done.stopped and not refusals.peers()
    assert joiner.state_id() == joiner.initial_state_id


def test_a_payload_whose_contributors_left_is_fetched_from_a_holder_that_kept_it(history):
    class Keeper:  # every announced address is gone; a stage holder ("keeper:1") kept what it fetched
        def get(self, address):
            class Client:
                def get_payload(self, req, timeout_s):
                    if address != "keeper:1":
                        raise NetworkError(f"{address} is gone")
                    return history.payloads[(req.outer_step, req.stage, req.sender)]

            return Client()

    board = Board(history)
    _honest(board, history, holders=("H1",))
    board.holders = {"Keeper": {"outer_step": 3, "state_id": "0" * 16, "address": "keeper:1"}}
    for holders, rounds in ((False, 0), (True, 3)):
        fetcher = lambda reads, h=holders: SetFetcher(reads, Keeper(), PayloadStore(), "joiner", 1.0, holders=h)  # noqa: E731
        joiner = StageWorker(CFG, 0)
        done = Replayer(CFG, board, fetcher, Refusals()).run(joiner, 3)
        assert done.rounds == rounds and joiner.outer_step == rounds, done.stopped


def test_replaying_keeps_our_error_buffer(history):
    board = Board(history)
    _honest(board, history)
    joiner = StageWorker(CFG, 0)
    joiner.optim.errors = {n: torch.ones_like(v) for n, v in joiner.start.items()}
    _replayer(board, history, Refusals()).run(joiner, 3)
    assert joiner.state_id() == history.links[(2, 0)].state
    assert all(bool((e == 1).all()) for e in joiner.optim.errors.values())  # `fresh_optimizer` empties it
    joiner.fresh_optimizer()
    assert joiner.optim.errors is None


# ------------------------------------------------------------------ Resync.sync_state
class Quiet:
    def log(self, *a, **k):
        pass


def _resync(board: Board, history: History, replicas: dict, cfg=CFG, servers=None, attesters=()) -> Resync:
    board.get_replicas = lambda: {p: ReplicaRecord.parse(r) for p, r in replicas.items()}  # type: ignore[method-assign]
    me = Presence("joiner", "full")
    clients = servers or Servers(history)
    ctx = RoundContext(cfg, board, clients, PayloadStore(), me, Refusals(), Quiet(), lambda: None)  # type: ignore[arg-type]
    return Resync(ctx, None, attesters)  # type: ignore[arg-type]


def _board_with_all(history: History) -> Board:
    board = Board(history)
    _honest(board, history)
    return board


def test_at_outer_step_0_the_state_is_recomputed_whatever_a_majority_claims(history):
    board = Board(history)
    resync = _resync(board, history, {f"F{i}": {"kind": "full", "outer_step": 0} for i in range(3)})
    worker = StageWorker(CFG, 0)
    state = worker.state_dict()
    negated = {n: -v for n, v in state["start"].items()}
    worker.load_state_dict({"outer_step": 0, "start": negated, "perp": state["perp"]})  # e.g. an old download
    assert resync.sync_state(worker, "test", vote=True, wait_s=0)
    assert worker.state_id() == worker.initial_state_id and worker.verified and resync.count == 1
    assert not resync.sync_state(worker, "test", vote=True, wait_s=0)  # nothing to do: no download, no vote


def test_sync_state_replays_to_the_clock_or_says_why_it_cannot(history):
    board = Board(history)
    resync = _resync(board, history, {f"R{i}": {"kind": "full", "outer_step": 3} for i in range(3)})
    worker = StageWorker(CFG, 1)
    with pytest.raises(NetworkError, match="cannot verify the swarm's state.*no holder published a link"):
        resync.sync_state(worker, "late join", wait_s=0)
    _honest(board, history)
    assert resync.sync_state(worker, "late join", wait_s=0)
    assert worker.outer_step == 4 and worker.state_id() == history.state(1)  # the clock + 1 is believed


def test_sync_state_until_replays_to_exactly_that_outer_step(history):
    """`peer export --initial-peers` replays each stage to the majority's step, not the clock's."""
    board = _board_with_all(history)
    resync = _resync(board, history, {f"R{i}": {"kind": "full", "outer_step": 4} for i in range(3)})
    worker = StageWorker(CFG, 0)
    assert resync.sync_state(worker, "export", wait_s=0, until=2)
    assert worker.outer_step == 2 and worker.state_id() == history.links[(1, 0)].state and worker.verified
    assert not resync.sync_state(worker, "export", wait_s=0, until=2)  # there already: nothing replayed


def test_a_holder_whose_commit_was_overtaken_goes_back_one_round_and_replays_on(history):
    board = Board(history)
    _honest(board, history)
    resync = _resync(board, history, {f"R{i}": {"kind": "full", "outer_step": 4} for i in range(3)})
    worker = StageWorker(CFG, 0)
    _replayer(board, history, Refusals()).run(worker, 2)
    alone = history.payloads[(2, 0, history.replicas[0])]
    worker.apply_round([Payload.from_bytes(alone)], None, history.replicas[:1])  # round 2 committed alone
    assert worker.outer_step == 3 and worker.state_id() != history.links[(2, 0)].state and worker.verified
    assert resync.sync_state(worker, "round 2 committed elsewhere", keep_errors=True, wait_s=0)
    assert worker.outer_step == 4 and worker.state_id() == history.state(0)


def test_a_holder_whose_lone_commits_the_swarm_never_took_starts_over_from_the_initial_state(history):
    """Its last two rounds it committed alone (a partition, a freeze), publishing their links: the only link
    from the state its last round started from is its own, back to where it is. Going back one round
    replayed that link on every try (`peer bench chaos`: a stage peer stuck 270 s); back there once, it
    replays the swarm's history from the initial state on the next try."""
    board = Board(history)
    _honest(board, history)
    resync = _resync(board, history, {f"R{i}": {"kind": "full", "outer_step": 4} for i in range(3)})
    worker = StageWorker(CFG, 0)
    _replayer(board, history, Refusals()).run(worker, 1)
    rid = history.replicas[0]
    for t in (1, 2):
        prev, alone = worker.state_id(), history.payloads[(t, 0, rid)]
        worker.apply_round([Payload.from_bytes(alone)], None, [rid])
        board.link("me", Link(t, prev, worker.state_id(), (entry(rid, payload_id(alone)),)), 0)
    assert worker.outer_step == 3 and worker.state_id() != history.links[(2, 0)].state and worker.verified
    board.holders = {"H1": {"outer_step": 4, "state_id": history.state(0), "address": "H1:1"}}  # the stage went on
    assert resync.sync_state(worker, "round 3 committed elsewhere", keep_errors=True, wait_s=5)
    assert worker.outer_step == 4 and worker.state_id() == history.state(0)


def test_an_outvoted_holder_past_the_window_goes_back_one_round_not_to_the_initial_state(history):
    """Round 0's links outlive its payloads (links live `history_ttl_s`, payloads `swarm.history_rounds`
    rounds): a holder outvoted on its last round once reset to the initial state because round 0's
    links were still published, and its replay stopped at round 0 (`peer bench chaos`: a stage at outer
    step 0 in its records for seconds). Past the window — judged by its own step too, since a replica
    re-syncing pulls the clock (the others' lower median) down to 0 — it goes back to the state its last
    round started from and replays the majority's link from there."""
    cfg = replay_config(history_rounds=3)  # the clock (4) is past the window
    board = Board(history)
    _honest(board, history)
    expired = History.__new__(History)  # round 0's payloads left every holder's window
    expired.payloads = {k: v for k, v in history.payloads.items() if k[0] >= 1}
    gone = Servers(expired)
    # the clock is the others' lower median: a replica re-syncing from the initial state shows outer step 0
    replicas = {"R0": {"kind": "full", "outer_step": 4}, "R1": {"kind": "full", "outer_step": 0}}
    resync = _resync(board, history, replicas, cfg, gone)
    worker = StageWorker(CFG, 0)
    _replayer(board, history, Refusals()).run(worker, 3)
    alone = history.payloads[(3, 0, history.replicas[0])]
    worker.apply_round([Payload.from_bytes(alone)], None, history.replicas[:1])  # round 3 committed alone
    assert worker.outer_step == 4 and worker.state_id() != history.state(0) and worker.verified
    assert resync.clock() == 0  # the clock alone would say round 0 is still in the window
    replayer = Replayer(cfg, board, resync._fetcher, Refusals())
    resync._start(worker, replayer, vote=True, clock=resync.clock(), keep_errors=True, reason="outvoted")
    assert worker.outer_step == 3 and worker.verified  # back one round, not at the initial state
    assert resync.sync_state(worker, "outvoted", keep_errors=True, until=4, wait_s=0)
    assert worker.outer_step == 4 and worker.state_id() == history.state(0)
    assert resync.replayed[-1].rounds == 1  # round 3 again, from its start: nothing before it was asked for


def test_an_outvoted_holder_whose_replay_ends_on_its_own_state_keeps_taking_part(history):
    """`peer bench chaos`: a full replica outvoted on stage 1 went back a round and replayed to the very
    state it held (its own link is the canonical one); bumping its `joined_at` past the round it had
    already sent made the others stop expecting its payload, and it refused them as censors."""
    cfg = replay_config(history_rounds=3)  # past the window: an outvoted holder goes back one round
    board = Board(history)
    _honest(board, history)
    resync = _resync(board, history, {"R0": {"kind": "full", "outer_step": 4}}, cfg)
    worker = StageWorker(CFG, 0)
    _replayer(board, history, Refusals()).run(worker, 4)
    held = worker.state_id()
    assert worker.outer_step == 4 and held == history.state(0) and worker.verified
    lone = StageWorker(CFG, 0)  # another set of round 3 from the same state: a's payload alone
    _replayer(board, history, Refusals()).run(lone, 3)
    alone = history.payloads[(3, 0, history.replicas[0])]
    lone.apply_round([Payload.from_bytes(alone)], None, history.replicas[:1])
    board.link("L", lone.ledger.link, 0)
    resync.me.joined_at = 2
    assert resync.sync_state(worker, "outvoted", keep_errors=True, vote=True, wait_s=0)  # back a round, replayed
    assert worker.outer_step == 4 and worker.state_id() == held  # the canonical link of round 3 is ours
    assert resync.me.joined_at == 2  # it took part in round 4 as it was: still expected there


ATTESTER = "Qm" + "A" * 44


def test_past_the_window_a_joiner_takes_only_an_attesters_state_and_replays_on(history):
    cfg = replay_config()
    attested = dataclasses.replace(cfg, swarm=dataclasses.replace(cfg.swarm, attesters=(ATTESTER,)))
    board = Board(history)
    board.link("H1", history.links[(3, 0)], 0)  # only round 3 is still in the window
    honest_at_3 = StageWorker(CFG, 0)
    _replayer(_board_with_all(history), history, Refusals()).run(honest_at_3, 3)
    forged = {"outer_step": 3, "state_id": "f" * 16, "address": "F1:1"}
    board.holders = {
        "F1": forged,
        "F2": forged,
        "F3": forged,  # a majority, not an attester
        ATTESTER: {"outer_step": 3, "state_id": honest_at_3.state_id(), "address": "att:1"},
    }
    servers = Servers(history)
    servers.states = {"att:1": honest_at_3, "F1:1": StageWorker(CFG, 0)}
    replicas = {f"R{i}": {"kind": "full", "outer_step": 4} for i in range(3)}
    plain = _resync(board, history, replicas, servers=servers)
    with pytest.raises(NetworkError, match="round 0: no holder published a link"):
        plain.sync_state(StageWorker(CFG, 0), "late join", wait_s=0)  # no attester named: it waits
    resync = _resync(board, history, replicas, cfg=attested, servers=servers)
    joiner = StageWorker(CFG, 0)
    assert resync.sync_state(joiner, "late join", wait_s=0)
    assert joiner.outer_step == 4 and joiner.state_id() == history.state(0) and joiner.verified


def test_the_manifests_signer_attests_by_default_in_a_record_of_its_own(history):
    board = Board(history)
    board.link("H1", history.links[(3, 0)], 0)  # only round 3 is still in the window
    at_3 = StageWorker(CFG, 0)
    _replayer(_board_with_all(history), history, Refusals()).run(at_3, 3)
    record = {"outer_step": 3, "state_id": at_3.state_id(), "address": "att:1", "role": "attester", "state": "ready"}
    board.attest = {ATTESTER: record}
    board.holders = {"F1": {"outer_step": 3, "state_id": "f" * 16, "address": "F1:1"}}
    servers = Servers(history)
    servers.states = {"att:1": at_3, "F1:1": StageWorker(CFG, 0)}
    replicas = {f"R{i}": {"kind": "full", "outer_step": 4} for i in range(3)}
    with pytest.raises(NetworkError, match="round 0: no holder published a link"):  # not the signer's: not trusted
        _resync(board, history, replicas, servers=servers, attesters=("Qm" + "B" * 44,)).sync_state(
            StageWorker(CFG, 0), "late join", wait_s=0
        )
    joiner = StageWorker(CFG, 0)
    assert _resync(board, history, replicas, servers=servers, attesters=(ATTESTER,)).sync_state(
        joiner, "late join", wait_s=0
    )
    assert joiner.outer_step == 4 and joiner.state_id() == history.state(0) and joiner.verified


def test_after_an_attested_start_a_joiner_never_flips_back_to_the_initial_state(history):
    """Round 0's links outlive its payloads: the replay from the initial state fails, the attester's
    state at 3 is loaded; round 3 is not linked yet. The joiner keeps the attested state (and says why
    it cannot go on) instead of going back to the initial state, whose rounds it already failed."""
    board = Board(history)
    for t in (0, 1, 2):
        board.link("H1", history.links[(t, 0)], 0)
    at_3 = StageWorker(CFG, 0)
    _replayer(_board_with_all(history), history, Refusals()).run(at_3, 3)
    board.attest = {ATTESTER: {"outer_step": 3, "state_id": at_3.state_id(), "address": "att:1", "state": "ready"}}
    board.holders = {"H1": {"outer_step": 5, "state_id": "a" * 16, "address": "H1:1"}}  # the stage is past 3

    class OnlyState(Servers):  # no payload of any round is served any more; the attested state is
        def get(self, address):
            client = super().get(address)

            def gone(req, timeout_s):
                raise NetworkError(f"{address} no longer holds round {req.outer_step}")

            client.get_payload = gone
            return client

    servers = OnlyState(history)
    servers.states = {"att:1": at_3}
    replicas = {f"R{i}": {"kind": "full", "outer_step": 5} for i in range(3)}
    resync = _resync(board, history, replicas, servers=servers, attesters=(ATTESTER,))
    joiner = StageWorker(CFG, 0)
    with pytest.raises(NetworkError, match="round 3: no holder published a link"):
        resync.sync_state(joiner, "late join", wait_s=0.5)
    assert joiner.outer_step == 3 and joiner.state_id() == at_3.state_id() and joiner.verified


def test_an_address_that_did_not_answer_is_not_asked_again_in_the_same_replay(history):
    class Gone:
        def __init__(self):
            self.calls = 0

        def get(self, address):
            pool = self

            class Client:
                def get_payload(self, req, timeout_s):
                    pool.calls += 1
                    raise NetworkError(f"{address} unreachable")

            return Client()

    gone = Gone()
    skip = SkipDead(gone)
    for _ in range(3):
        with pytest.raises(NetworkError):
            skip.get("a:1").get_payload(None, timeout_s=1.0)
    assert gone.calls == 1 and skip.dead == {"a:1"}

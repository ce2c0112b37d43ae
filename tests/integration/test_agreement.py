"""Each transition of the round protocol (docs/protocol.md), on records alone: no DHT, no network.

`round_view` is fed records as the DHT reader parses them; `gather_round` runs against an in-memory table of records and
payloads standing in for what a poll reads (the real DHT and gRPC path is
tests/integration/test_round_hash.py and the swarm tests), so every test shows one transition and
ends in milliseconds (only the deadline tests wait, about 1 s).
"""

from __future__ import annotations

import threading

import pytest
import torch

from peer.config import build_config
from peer.core.sparseloco.algorithm import compress
from peer.errors import NetworkError
from peer.net.dht import dht_time
from peer.net.records import Announcement, ReplicaRecord, StageRecord
from peer.node.round.agreement import fenced_by, fresh, round_view
from peer.node.round.claims import entry
from peer.node.round.gather import gather_round
from peer.node.round.payloads import payload_id
from peer.node.round.refusals import Refusals
from peer.node.round.result import RoundInputs
from peer.node.round.timings import RoundTimings
from tests.round_helpers import own, round_context

pytestmark = pytest.mark.timeout(60)

CFG = build_config(environ={})
SHAPES = {"layers.2.attn.wq.weight": (64, 64)}
FAST = RoundTimings(10, poll_s=0.02)


def _payload(seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    delta = {n: torch.randn(s, generator=gen) * 1e-2 for n, s in SHAPES.items()}
    return compress(delta, None, CFG.sparseloco)[0].to_bytes()


def _replica(kind: str = "full", t: int = 0, **extra) -> dict:
    return {"kind": kind, "outer_step": t, "joined_at": 0, **extra}


def _parse(kind, records: dict[str, dict]) -> dict:
    """Published records as the DHT reader hands them over (each parsed once, none malformed here)."""
    out = {p: kind.parse(r) for p, r in records.items()}
    assert None not in out.values(), records
    return out


def _view(t, stage, payloads, stage0, replicas, holders, me="me", inc=""):
    """`round_view` of published records."""
    anns, anns0 = _parse(Announcement, payloads), _parse(Announcement, stage0)
    return round_view(t, stage, anns, anns0, _parse(ReplicaRecord, replicas), _parse(StageRecord, holders), me, inc)


# ------------------------------------------------------------------ round_view: who counts
def test_incarnations_make_earlier_announcements_stale():
    holders = {"p": StageRecord(inc="new")}
    assert fresh("p", Announcement(inc="new"), holders, {}, "me", "mine")
    assert not fresh("p", Announcement(inc="old"), holders, {}, "me", "mine")  # p restarted with the same key
    assert not fresh("me", Announcement(inc="old"), {}, {}, "me", "mine")  # our own dead incarnation
    assert fresh("me", Announcement(inc="mine"), {}, {}, "me", "mine")
    assert fresh("gone", Announcement(inc="x"), {}, {}, "me", "mine")  # no record now: not provably stale


def test_heads_round_announcement_binds_the_replacement_not_the_record():
    replicas = {"h": _replica("pipeline", pipeline_peers={"1": "next"})}  # the record moved on to t + 1
    stage0 = {"h": {"replica": "h", "peers": {"1": "repl"}}}
    payloads = {"repl": {"replica": "h"}, "next": {"replica": "h"}}
    view = _view(0, 1, payloads, stage0, replicas, {"repl": {"outer_step": 0}}, "me", "")
    assert {s: rid for s, (rid, _) in view.bound.items()} == {"repl": "h"}
    assert ("next", "h", "unbound") in view.ignored
    assert view.expected == {"h"}


def test_before_the_head_announces_its_record_binds_provisionally():
    replicas = {"h": _replica("pipeline", pipeline_peers={"1": "p"})}
    view = _view(0, 1, {"p": {"replica": "h"}}, {}, replicas, {}, "me", "")
    assert "p" in view.bound and view.expected == {"h"}


def test_a_head_whose_bound_peer_died_without_announcing_is_dropped_for_everyone():
    replicas = {"h": _replica("pipeline", t=1), "f": _replica()}
    stage0 = {"h": {"replica": "h", "peers": {"1": "dead"}}}
    view = _view(0, 1, {"f": {}}, stage0, replicas, {"f": {"outer_step": 0}}, "me", "")
    assert view.dropped == {"h"} and view.expected == {"f"}
    alive = _view(0, 1, {"f": {}}, stage0, replicas, {"dead": {"outer_step": 0}}, "me", "")
    assert alive.expected == {"h", "f"} and not alive.dropped  # alive and at t: it will announce
    # still committing the round before (overlapped rounds; its record lags): it will announce too
    replicas["h"] = _replica("pipeline", t=2)
    lagging = _view(2, 1, {"f": {}}, stage0, replicas, {"dead": {"outer_step": 1}}, "me", "")
    assert lagging.expected == {"h", "f"} and not lagging.dropped
    moved_on = _view(2, 1, {"f": {}}, stage0, replicas, {"dead": {"outer_step": 3}}, "me", "")
    assert moved_on.dropped == {"h"}  # past the round without announcing it: it never will
    # further behind (a peer the head took while it caught up: the head trained outer step 2 through it,
    # its record lags the rounds it is committing): it will announce too (chaos: a holder closed without it)
    catching_up = _view(2, 1, {"f": {}}, stage0, replicas, {"dead": {"outer_step": 0}}, "me", "")
    assert catching_up.expected == {"h", "f"} and not catching_up.dropped


# ------------------------------------------------------------------ gather_round: when it closes
class FakeDHT:
    """The records a gather polls, and a count of its polls to synchronise on (no sleeps)."""

    def __init__(self, me: str) -> None:
        self.peer_id = me
        self.replicas: dict[str, dict] = {}
        self.holders: dict[str, dict] = {}
        self.payloads: dict[tuple[int, int], dict[str, dict]] = {}
        self.polls = 0
        self._polled = threading.Condition()

    def get_replicas(self):  # the first read of every poll (`read_round`)
        with self._polled:
            self.polls += 1
            self._polled.notify_all()
        return _parse(ReplicaRecord, self.replicas)

    def polled(self, n: int) -> bool:
        """Whether the gather polls `n` more times: True means it has not closed the round by then
        (a decision changes only when records do). False after a generous deadline: it stopped."""
        with self._polled:
            target = self.polls + n
            return self._polled.wait_for(lambda: self.polls >= target, timeout=10)

    def get_stage_peers(self, stage, keep_left=False):
        holders = _parse(StageRecord, self.holders)
        return {p: r for p, r in holders.items() if keep_left or not r.left}

    def get_payloads(self, t, stage):
        return _parse(Announcement, self.payloads.get((t, stage), {}))

    def announce_payload(self, t, stage, record, ttl_s):
        self.payloads.setdefault((t, stage), {})[self.peer_id] = dict(record)


class FakeClients:
    def __init__(self, served: dict[str, bytes]) -> None:
        self.served = served

    def get(self, address):
        served = self.served

        class Client:
            def get_payload(self, req, timeout_s):
                if address not in served:
                    raise NetworkError(f"{address} unreachable")
                return served[address]

        return Client()


class Store:
    def put(self, *a):
        pass

    def put_fetched(self, *a):
        pass

    def get(self, *a):
        return None

    def mine(self, *a):
        return None

    def fetched(self, *a):
        return None


PREV = "s0"  # our state id at outer step 0: the state the claims below committed round 0 from


def _gather(dht, clients, own=None, timeout_s=5.0, grace_s=0.3, refusals=None, established=()):
    ctx = round_context(dht, clients, Store(), address="me:1", refusals=refusals)
    timings = RoundTimings(timeout_s, grace_s=grace_s, poll_s=0.02)
    return gather_round(ctx, 0, 1, timings, RoundInputs(own=own, prev=PREV, established=established))


def _claim(*items: tuple[str, bytes], prev: str = PREV, state: str = "s1", t: int = 0) -> dict:
    """A holder's record after committing round t: outer step t + 1, its state id and link."""
    link = {"t": t, "prev": prev, "set": [list(entry(rid, payload_id(data))) for rid, data in items]}
    return {"outer_step": t + 1, "state_id": state, "link": link}


def _other(dht: FakeDHT, clients: FakeClients, pid: str, data: bytes, **rec) -> None:
    clients.served[f"{pid}:1"] = data
    ann = {"sha256": payload_id(data), "address": f"{pid}:1", "replica": pid, **rec}
    dht.payloads.setdefault((0, 1), {})[pid] = ann


def test_commit_once_every_expected_payload_is_held():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica()}
    _other(dht, clients, "o", _payload(1))
    result = _gather(dht, clients, own=own("me", _payload(2)))
    assert result.replicas == ["me", "o"] and not result.timed_out and not result.behind


def test_a_holder_one_round_behind_still_counts_as_gathering_for_the_lone_guard():
    def gathering(rec: dict) -> bool:
        return _view(5, 0, {}, {}, {}, {"h": rec}, "me", "").others_gathering

    assert gathering({"outer_step": 5}) and gathering({"outer_step": 4})  # at t, or about to reach it
    assert not gathering({"outer_step": 3})  # two behind: it re-syncs, it will not send round 5
    assert not gathering({"outer_step": 4, "state": "syncing"})
    assert not gathering({"outer_step": 5, "role": "spare"})  # a hot spare only observes the round
    assert gathering({"outer_step": 5, "role": "trainer"})
    # a full replica that re-synced past round 5 (it joined at 6) never sends it: not waited for
    late = _view(5, 0, {}, {}, {"h": _replica(t=5, joined_at=6)}, {"h": {"outer_step": 5}}, "me", "")
    assert not late.others_gathering
    on_time = _view(5, 0, {}, {}, {"h": _replica(t=5, joined_at=5)}, {"h": {"outer_step": 5}}, "me", "")
    assert on_time.others_gathering


def test_no_lone_commit_while_another_holder_gathers_then_follow_its_set():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica()}
    dht.holders = {"o": {"outer_step": 0}}  # another holder of the stage, still at t
    done: list = []
    th = threading.Thread(target=lambda: done.append(_gather(dht, clients, own=own("me", _payload(2)))))
    th.start()
    assert dht.polled(5) and th.is_alive()  # our own payload alone: we do not commit while o gathers
    dht.holders = {"o": _claim(("me", _payload(2)))}  # o committed {our payload} from our state
    th.join(5)
    assert done and done[0].replicas == ["me"] and done[0].followed is not None and done[0].followed.peer == "o"


def test_one_claim_of_a_set_we_cannot_fetch_is_set_aside_not_followed_into_a_resync():
    # one unchecked claim never sends a holder behind: we close our own set at the deadline
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "gone": _replica()}
    _other(dht, clients, "gone", _payload(1))
    clients.served.clear()  # announced, then gone: nobody serves its payload
    dht.holders = {"o": _claim(("gone", _payload(1)), ("me", _payload(2)))}
    refusals = Refusals()
    result = _gather(dht, clients, own=own("me", _payload(2)), timeout_s=1.5, refusals=refusals)
    assert not result.behind and result.followed is None and result.replicas == ["me"] and result.timed_out
    assert "o" not in refusals  # genuine but unavailable: no blame


def test_a_set_most_holders_committed_that_we_cannot_fetch_means_resync_not_waiting():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "gone": _replica()}
    _other(dht, clients, "gone", _payload(1))
    clients.served.clear()
    both = _claim(("gone", _payload(1)), ("me", _payload(2)))
    dht.holders = {"o": both, "p": both}  # two of the three holders: a strict majority, we included
    result = _gather(dht, clients, own=own("me", _payload(2)), timeout_s=30, refusals=Refusals())
    assert result.behind


def test_a_set_naming_payloads_no_replica_announced_gets_its_claimer_refused():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica()}
    _other(dht, clients, "o", _payload(1))
    padded = [("o", _payload(1)), ("me", _payload(2))] + [(f"made-up-{i}", _payload(10 + i)) for i in range(8)]
    dht.holders = {"o": _claim(*padded)}
    refusals = Refusals()
    result = _gather(dht, clients, own=own("me", _payload(2)), timeout_s=30, refusals=refusals)
    assert "o" in refusals  # its set names replicas that never announced: a forged claim
    assert result.followed is None and result.replicas == ["me", "o"] and not result.behind


def test_a_claim_from_another_state_is_not_followed():
    # o committed round 0 from a state that is not ours: we could not check its result, so we do not
    # take its set; our own gather closes as usual (the canonical-state check runs after the commit)
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica()}
    _other(dht, clients, "o", _payload(1))
    dht.holders = {"o": _claim(("o", _payload(1)), prev="elsewhere")}
    result = _gather(dht, clients, own=own("me", _payload(2)), timeout_s=30)
    assert result.followed is None and result.replicas == ["me", "o"]


def test_behind_two_rounds_returns_at_once():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica(t=2)}  # the swarm's clock: two rounds past us
    dht.holders = {"o": {"outer_step": 2, "state_id": "s2"}}
    assert _gather(dht, clients, own=own("me", _payload(2)), timeout_s=30).behind


def test_a_lone_holder_claiming_rounds_ahead_of_the_swarm_is_not_believed():
    # x claims outer step 7 while every replica's record is at 0: no re-sync to its state
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica()}
    _other(dht, clients, "o", _payload(1))
    dht.holders = {"x": {"outer_step": 7, "state_id": "forged"}}
    result = _gather(dht, clients, own=own("me", _payload(2)), timeout_s=30)
    assert not result.behind and result.replicas == ["me", "o"]


def test_a_sender_that_left_after_announcing_is_dropped_not_waited_for():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica()}
    _other(dht, clients, "o", _payload(1))
    clients.served.clear()
    del dht.replicas["o"]  # o's records expired, its announcement did not
    result = _gather(dht, clients, own=own("me", _payload(2)), timeout_s=30)
    assert result.replicas == ["me"] and result.rejected == ["o"] and not result.timed_out


def test_our_own_earlier_incarnations_announcement_is_never_fetched():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(inc="now")}
    dht.payloads[(0, 1)] = {"me": {"sha256": "x", "address": "old:1", "replica": "me", "inc": "before"}}
    result = gather_round(
        round_context(dht, clients, inc="now"), 0, 1, RoundTimings(30, poll_s=0.02), RoundInputs()
    )  # an observer (catch-up)
    assert result.replicas == [] and not result.timed_out


def test_the_deadline_ends_every_wait():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "slow": _replica()}
    result = _gather(dht, clients, own=own("me", _payload(2)), timeout_s=1.0)
    assert result.timed_out and result.replicas == ["me"]


def test_the_first_round_waits_for_the_start_up_quorum_before_closing():
    # at start-up a replica whose records are not visible yet cannot count as gathering: round 0
    # stays open until `swarm.min_replicas` payloads are held (or the deadline), never a lone commit
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica()}  # the other replica has not published anything yet
    done: list = []

    def run() -> None:
        done.append(
            gather_round(
                round_context(dht, clients, Store()), 0, 1, FAST, RoundInputs(own("me", _payload(2)), quorum=2)
            )
        )

    th = threading.Thread(target=run)
    th.start()
    assert dht.polled(5) and th.is_alive()  # expected = {me} is complete, but one payload is below the quorum of 2
    dht.replicas["o"] = _replica()
    _other(dht, clients, "o", _payload(1))
    th.join(5)
    assert done and done[0].replicas == ["me", "o"] and not done[0].timed_out
    del dht.replicas["o"]  # o left: at t = 1 our payload alone closes the round
    later = gather_round(
        round_context(dht, clients, Store()), 1, 1, FAST, RoundInputs(own("me", _payload(3)), quorum=2)
    )
    assert later.replicas == ["me"] and not later.timed_out  # the quorum holds only for round 0


def test_a_holder_seen_gathering_whose_records_expired_is_waited_for_until_the_deadline():
    # a stopped process's records expire while it is frozen: our payload alone must not close the
    # round it may still send to; only the deadline (or its payload, or its commit) ends the wait
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica()}
    dht.holders = {"o": {"outer_step": 0}}
    done: list = []
    th = threading.Thread(target=lambda: done.append(_gather(dht, clients, own=own("me", _payload(2)), timeout_s=2.0)))
    th.start()
    assert dht.polled(2)  # o seen gathering
    dht.holders = {}  # o's records expired
    assert dht.polled(5) and th.is_alive()  # o was seen gathering: no lone close
    th.join(5)
    assert done and done[0].timed_out and done[0].replicas == ["me"]


def _gathering_beside_o() -> tuple:
    """Our lone gather of round 0 (in a thread, 30 s deadline) while holder o is seen gathering it."""
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica()}
    dht.holders = {"o": {"outer_step": 0}}
    done: list = []
    th = threading.Thread(target=lambda: done.append(_gather(dht, clients, own=own("me", _payload(2)), timeout_s=30)))
    th.start()
    assert dht.polled(2)  # o seen gathering
    return dht, done, th


def test_a_holder_seen_gathering_that_came_back_past_the_round_is_no_longer_waited_for():
    # o was gathering, then restarted (same key) and re-synced past round 0: its live records say it
    # will not send round 0, so our payload alone closes the round instead of waiting out the deadline
    dht, done, th = _gathering_beside_o()
    assert th.is_alive()  # o is expected and gathering
    dht.replicas["o"] = _replica(t=0, joined_at=1)  # the new process: state downloaded at 0, sends from 1
    th.join(5)
    assert done and done[0].replicas == ["me"] and not done[0].timed_out


def test_a_holder_seen_gathering_that_came_back_past_the_round_is_followed_not_dropped():
    # o committed round 0 and restarted from that checkpoint (its records at 1): it may hold a set
    # with our payload, so a lone close waits for its commit to show (→ FOLLOW), not the new records
    dht, done, th = _gathering_beside_o()
    dht.replicas["o"] = _replica(t=1, joined_at=1)
    dht.holders = {"o": {"outer_step": 1}}  # the restarted process, its committed set not published yet
    assert dht.polled(5) and th.is_alive()
    dht.holders = {"o": _claim(("me", _payload(2)))}
    th.join(5)
    assert done and done[0].followed is not None and done[0].replicas == ["me"] and not done[0].timed_out


def test_a_hot_spare_does_not_hold_a_lone_contributor_until_the_deadline():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica()}
    dht.holders = {"s": {"outer_step": 0, "role": "spare"}}  # an unclaimed stage peer at t
    result = _gather(dht, clients, own=own("me", _payload(2)), timeout_s=30)
    assert result.replicas == ["me"] and not result.timed_out


def _observing_a_beside_o(timeout_s: float = 5.0) -> tuple:
    """Our gather of round 0 as an observer (in a thread) while contributor o still gathers it and a's
    payload, the one expected, is held."""
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"a": _replica()}
    dht.holders = {"o": {"outer_step": 0}}  # a contributor of the stage, still gathering
    _other(dht, clients, "a", _payload(1))
    done: list = []
    th = threading.Thread(target=lambda: done.append(_gather(dht, clients, own=None, timeout_s=timeout_s)))
    th.start()
    return dht, done, th


def test_an_observer_follows_a_contributors_commit_instead_of_closing_its_own_set():
    dht, done, th = _observing_a_beside_o()
    assert dht.polled(5) and th.is_alive()  # every expected payload is held, but an observer does not decide the set
    dht.holders = {"o": _claim(("a", _payload(1)))}
    th.join(5)
    assert done and done[0].replicas == ["a"] and done[0].followed is not None and not done[0].timed_out


def test_an_observer_whose_state_no_commit_starts_from_closes_its_complete_set_instead_of_the_deadline():
    # `peer bench chaos` (CI, seed 5): a full replica catching up round 127 as an observer held stage 1
    # at a state whose T⊥ the others had rebased already; their commits of round 127 came from theirs,
    # none could be followed, and it waited to its deadline: 8 s late for round 128, whose head then
    # closed without its payload
    dht, done, th = _observing_a_beside_o(timeout_s=30)
    assert dht.polled(5) and th.is_alive()  # every expected payload held: an observer still waits for a commit
    dht.holders = {"o": _claim(("a", _payload(1)), prev="rebased")}  # committed, from another state than ours
    assert dht.polled(20) and th.is_alive()  # a commit from our state may still appear: not at once
    th.join(10)
    assert done and done[0].replicas == ["a"] and done[0].followed is None and not done[0].timed_out


def test_an_observer_holding_nothing_waits_for_a_resyncing_replica_instead_of_closing_round_t_empty():
    # `peer bench chaos` (seed 6): a head catching up round 126 as an observer saw the full replica's
    # records at its replay's outer step (not expected, not gathering) and closed the round empty before
    # the full replica announced; the full replica then refused it as a censor of its payload
    dht, clients = FakeDHT("me"), FakeClients({})
    # f re-syncing: its records at the replay's step, joined past t (it re-synced to t), yet it sends t
    dht.replicas = {"me": _replica(t=5), "f": _replica(t=0, joined_at=6)}
    done: list = []
    th = threading.Thread(
        target=lambda: done.append(
            gather_round(round_context(dht, clients, Store()), 5, 1, FAST, RoundInputs(prev="s5"))
        )
    )
    th.start()
    assert dht.polled(5) and th.is_alive()  # nothing held, nothing dropped, f lives: no empty close
    data = _payload(1)
    clients.served["f:1"] = data
    dht.replicas["f"] = _replica(t=5)
    dht.payloads[(5, 1)] = {"f": {"sha256": payload_id(data), "address": "f:1", "replica": "f"}}
    th.join(5)
    assert done and done[0].replicas == ["f"] and not done[0].timed_out  # every expected payload held: its set


def test_a_holder_that_left_gracefully_is_not_waited_for():
    # SIGTERM: its records become {"state": "left"}; unlike a frozen peer it will not come back to t
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica()}
    dht.holders = {"o": {"outer_step": 0}}
    done: list = []
    th = threading.Thread(target=lambda: done.append(_gather(dht, clients, own=own("me", _payload(2)), timeout_s=20)))
    th.start()
    assert dht.polled(5) and th.is_alive()
    dht.holders = {"o": {"state": "left"}}
    th.join(5)
    assert done and done[0].replicas == ["me"] and not done[0].timed_out


# ------------------------------------------------------------------ deadline fence
def test_only_an_earlier_closer_near_its_deadline_fences_us():
    view = _view(
        0, 1, {"a": {"replica": "a", "closes": 100.0}, "z": {"replica": "z", "closes": 100.0}}, {}, {}, {}, "me", ""
    )
    assert fenced_by(view, "me", 105.0, now=99.0, margin_s=2.0) == {"a", "z"}  # both close before us
    assert fenced_by(view, "me", 105.0, now=97.0, margin_s=2.0) == set()  # they have time to fetch ours
    assert fenced_by(view, "me", 105.0, now=102.5, margin_s=2.0) == set()  # no commit by now: they are gone
    assert fenced_by(view, "me", 100.0, now=99.0, margin_s=2.0) == {"a"}  # a tie: the smaller peer id closes first
    assert fenced_by(view, "me", 95.0, now=99.0, margin_s=2.0) == set()  # we close first: we never wait
    assert fenced_by(view, "me", None, now=99.0, margin_s=2.0) == set()  # an observer follows anyway


def test_a_set_closing_at_an_earlier_closers_deadline_without_our_payload_is_not_followed():
    # o closes at its deadline with what it holds, not our payload: its commit is worse than ours by
    # the canonical order, so we close the larger set after the fence; o is not blamed (a deadline)
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica()}
    dht.holders = {"o": {"outer_step": 0}}
    _other(dht, clients, "o", _payload(1), closes=dht_time() + 0.2)
    done: list = []
    refusals = Refusals()
    gather = lambda: done.append(_gather(dht, clients, own=own("me", _payload(2)), grace_s=1.0, refusals=refusals))  # noqa: E731
    th = threading.Thread(target=gather)
    th.start()
    assert dht.polled(5) and th.is_alive()  # both payloads held, but o's deadline is near: its commit decides
    dht.holders = {"o": _claim(("o", _payload(1)))}  # o closed without ours
    th.join(5)
    assert done and done[0].replicas == ["me", "o"] and done[0].followed is None and not done[0].behind
    assert "o" not in refusals


def test_a_set_closing_at_an_earlier_closers_deadline_with_our_payload_is_followed():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica(), "late": _replica()}
    dht.holders = {"o": {"outer_step": 0}}
    _other(dht, clients, "o", _payload(1), closes=dht_time() + 0.2)
    done: list = []
    th = threading.Thread(target=lambda: done.append(_gather(dht, clients, own=own("me", _payload(2)), grace_s=1.0)))
    th.start()
    assert dht.polled(5) and th.is_alive()  # "late" has not announced: the set is not complete
    dht.holders = {"o": _claim(("o", _payload(1)), ("me", _payload(2)))}  # o closed at its deadline
    th.join(5)
    assert done and done[0].replicas == ["me", "o"] and done[0].followed is not None


def test_a_claim_leaving_out_our_payload_before_any_deadline_is_refused_and_not_followed():
    # a censor: the true commit of the round's set minus our payload, claimed as soon as all announced
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica()}
    _other(dht, clients, "o", _payload(1), closes=dht_time() + 30)
    dht.holders = {"c": _claim(("o", _payload(1)))}
    refusals = Refusals()
    result = _gather(dht, clients, own("me", _payload(2)), 30, 0.3, refusals, established=["me", "o"])
    assert "c" in refusals and "before the round's earliest deadline" in refusals._reasons["c"]
    assert result.followed is None and result.replicas == ["me", "o"] and not result.timed_out


def test_a_claim_leaving_out_a_payload_not_fetched_yet_waits_for_it():
    # an announced payload we have not fetched yet is not given up for a claim without it
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica()}
    _other(dht, clients, "o", _payload(1))
    served = clients.served.pop("o:1")  # announced; not reachable for a moment
    dht.holders = {"c": _claim(("me", _payload(2)))}
    done: list = []
    th = threading.Thread(target=lambda: done.append(_gather(dht, clients, own=own("me", _payload(2)), timeout_s=30)))
    th.start()
    assert dht.polled(5) and th.is_alive()  # not followed while o's payload may still come
    clients.served["o:1"] = served
    th.join(10)
    assert done and done[0].replicas == ["me", "o"] and done[0].followed is None


def test_the_fence_ends_at_the_earlier_closers_deadline_plus_the_grace():
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica()}
    dht.holders = {"o": {"outer_step": 0}}
    _other(dht, clients, "o", _payload(1), closes=dht_time() + 0.1)
    result = _gather(dht, clients, own=own("me", _payload(2)), grace_s=0.5)
    assert result.replicas == ["me", "o"] and not result.timed_out and result.wall_s >= 0.4


# ------------------------------------------------------------------ a freeze mid-round
class SlowClients(FakeClients):
    """Serves like FakeClients; a fetch from `slow` first runs `during` (the world moves on) and
    takes `delay_s`, as if this process had been frozen (SIGSTOP, a stalled machine) mid-round."""

    def __init__(self, served: dict[str, bytes], slow: str, delay_s: float, during) -> None:
        super().__init__(served)
        self.slow, self.delay_s, self.during = slow, delay_s, during

    def get(self, address):
        inner = super().get(address)
        outer = self

        class Client:
            def get_payload(self, req, timeout_s):
                if address == outer.slow and outer.delay_s:
                    outer.during()
                    threading.Event().wait(outer.delay_s)
                    outer.delay_s = 0.0
                return inner.get_payload(req, timeout_s)

        return Client()


def test_a_holder_frozen_past_the_deadline_rereads_and_never_takes_a_set_without_its_payload():
    # we read the round (o gathering), then froze past our deadline while o committed {o} without
    # us; on waking, the view we would close on is stale: we read again, see o's commit, and do not
    # take it (it leaves out our payload): we close the larger set, which the canonical order puts
    # first (o switches to it after the round); o is not blamed (it closed at its deadline)
    dht = FakeDHT("me")
    dht.replicas = {"me": _replica(), "o": _replica()}
    dht.holders = {"o": {"outer_step": 0}}

    def o_commits() -> None:
        dht.holders = {"o": _claim(("o", _payload(1)))}

    clients = SlowClients({}, "o:1", 1.5, o_commits)
    _other(dht, clients, "o", _payload(1))
    refusals = Refusals()
    result = _gather(dht, clients, own=own("me", _payload(2)), timeout_s=1.0, refusals=refusals)
    assert result.followed is None and result.replicas == ["me", "o"] and "o" not in refusals


def test_a_claim_leaving_out_a_sender_whose_records_lapsed_is_no_proof_of_censorship():
    # o's records lapsed for a moment (a frozen process): an honest holder may have given its payload
    # up, so a claim without it is not followed, but its holder is not refused either
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica(), "late": _replica()}  # "late" keeps the round open
    _other(dht, clients, "o", _payload(1), closes=dht_time() + 30)
    refusals = Refusals()
    done: list = []
    gather = lambda: done.append(_gather(dht, clients, own("me", _payload(2)), 30, 0.3, refusals, ["me", "o"]))  # noqa: E731
    th = threading.Thread(target=gather)
    th.start()
    assert dht.polled(3)
    dht.replicas = {"me": _replica(), "late": _replica()}  # o's records lapse...
    assert dht.polled(3)
    dht.replicas = {"me": _replica(), "o": _replica(), "late": _replica()}  # ...and come back
    dht.holders = {"c": _claim(("me", _payload(2)))}  # a claim without o, well before any deadline
    assert dht.polled(5) and th.is_alive() and "c" not in refusals
    dht.replicas = {"me": _replica(), "o": _replica()}  # "late" leaves: the round is complete
    th.join(10)
    assert done and done[0].followed is None and done[0].replicas == ["me", "o"] and "c" not in refusals


def test_a_claim_leaving_out_a_payload_whose_head_left_is_no_proof_of_censorship():
    # p speaks for head h in stage 1; h leaves (SIGTERM: its records go) while p lives on, so nothing
    # binds the payload we validated and an honest holder leaves it out: a claim without it, well
    # before any deadline, is no proof of censorship (chaos seed 5: a spare refused every holder)
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "late": _replica(), "h": _replica("pipeline", pipeline_peers={"1": "p"})}
    dht.holders = {"p": {"outer_step": 0}}
    clients.served["p:1"] = _payload(3)
    dht.payloads[(0, 1)] = {"p": {"sha256": payload_id(_payload(3)), "address": "p:1", "replica": "h"}}
    refusals = Refusals()
    done: list = []
    gather = lambda: done.append(_gather(dht, clients, own("me", _payload(2)), 30, 0.3, refusals, ["me", "h"]))  # noqa: E731
    th = threading.Thread(target=gather)
    th.start()
    assert dht.polled(3) and th.is_alive()  # h's payload held; "late" awaited
    del dht.replicas["h"]  # h left gracefully: its replica record is gone, p still serves stage 1
    dht.holders = {"p": {"outer_step": 0}, "c": _claim(("me", _payload(2)))}
    assert dht.polled(5) and "c" not in refusals
    del dht.replicas["late"]
    th.join(10)
    assert done and "h" not in done[0].replicas and "c" not in refusals


def test_a_payload_whose_head_left_before_announcing_is_left_out_of_our_set():
    # p's payload speaks for head h only through h's replica record (h has not announced stage 0):
    # once h is gone nothing binds it, and no replay could prove it genuine, so our set leaves it out
    dht, clients = FakeDHT("me"), FakeClients({})
    dht.replicas = {"me": _replica(), "o": _replica(), "h": _replica("pipeline", pipeline_peers={"1": "p"})}
    clients.served["p:1"] = _payload(3)
    dht.payloads[(0, 1)] = {"p": {"sha256": payload_id(_payload(3)), "address": "p:1", "replica": "h"}}
    done: list = []
    th = threading.Thread(target=lambda: done.append(_gather(dht, clients, own=own("me", _payload(2)), timeout_s=30)))
    th.start()
    assert dht.polled(3) and th.is_alive()  # h's payload held; o's awaited
    del dht.replicas["h"]  # h was killed before it announced round 0: its record expired
    _other(dht, clients, "o", _payload(1))
    th.join(10)
    assert done and done[0].replicas == ["me", "o"] and "h" in done[0].rejected and not done[0].timed_out

"""The close decision of a gather (`peer.node.round.agreement.close_decision`), row by row.

Each row is one poll as a gather sees it (`Poll`) and the one outcome it must lead to; the rows
name the rule of docs/protocol.md (GATHER, FOLLOW, RESYNC, the holds, fresh reads) they pin.
"""

from __future__ import annotations

import pytest

from peer.node.round.agreement import Close, Poll, close_decision

ROWS = [
    # (why, poll, outcome)
    ("nothing settled yet: poll again", Poll(fresh=True), Close.WAIT),
    ("a stale view decides nothing: read again at once", Poll(fresh=False), Close.REREAD),
    ("every expected payload held, rejected or dropped", Poll(fresh=True, complete=True), Close.COMPLETE),
    ("complete on a stale view: read again first", Poll(fresh=False, complete=True), Close.REREAD),
    ("our payload alone while a holder seen gathering may be frozen", Poll(True, complete=True, lone=True), Close.WAIT),
    ("an observer while a contributor is around", Poll(True, complete=True, follower=True), Close.WAIT),
    ("round 0 below the start-up quorum", Poll(True, complete=True, short=True), Close.WAIT),
    ("a payload just lost may be in a commit about to appear", Poll(True, complete=True, settling=True), Close.WAIT),
    ("an earlier closer's deadline is near: its commit decides", Poll(True, complete=True, fenced=True), Close.WAIT),
    ("the deadline closes the set with what is held", Poll(fresh=True, past_deadline=True), Close.DEADLINE),
    ("the deadline holds for the lone guard too", Poll(True, past_deadline=True, lone=True), Close.DEADLINE),
    ("woke past the deadline: read the round again before closing it", Poll(False, past_deadline=True), Close.REREAD),
    ("the fence outlasts our own deadline", Poll(True, past_deadline=True, fenced=True), Close.WAIT),
    ("a claim from our state, its set held: take it", Poll(True, following=True, follow_held=True), Close.FOLLOWED),
    ("a followed set is taken even on a stale view", Poll(False, following=True, follow_held=True), Close.FOLLOWED),
    ("a followed set still being fetched", Poll(True, following=True), Close.WAIT),
    ("a followed set not fetched within the grace", Poll(True, following=True, follow_expired=True), Close.BEHIND),
    ("following ignores completeness", Poll(True, following=True, complete=True), Close.WAIT),
    ("following, past the deadline: close with what is held", Poll(True, True, following=True), Close.DEADLINE),
    ("the swarm two rounds on: re-sync, never commit", Poll(True, complete=True, closed_elsewhere=True), Close.BEHIND),
    (
        "closed elsewhere beats a held followed set",
        Poll(True, closed_elsewhere=True, following=True, follow_held=True),
        Close.BEHIND,
    ),
]


@pytest.mark.parametrize(("why", "poll", "outcome"), ROWS, ids=[row[0] for row in ROWS])
def test_close_decision(why: str, poll: Poll, outcome: Close) -> None:
    assert close_decision(poll) is outcome, why


def test_every_outcome_is_reachable() -> None:
    assert {row[2] for row in ROWS} == set(Close)

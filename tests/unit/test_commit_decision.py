"""The commit decision of a gathered round (`peer.node.round.agreement.commit_decision`), row by row.

Each row is what the late checks of `Rounds.commit_jobs` found (`Late`) and the one outcome it must
lead to; the rows name the rule of docs/protocol.md (RESYNC, RECONCILE, the frozen apply) they pin.
"""

from __future__ import annotations

import pytest

from peer.node.round.agreement import Commit, Late, commit_decision

ROWS = [
    # (why, late, outcome)
    ("nothing found: apply and publish", Late(), Commit.APPLY),
    ("a re-sync before applying moved us: the round is the others'", Late(moved=True), Commit.LEAVE),
    ("moved wins over every later check", Late(moved=True, failed=True, frozen=True), Commit.LEAVE),
    ("the swarm closed the round a round ago (a freeze): re-sync", Late(closed_elsewhere=True), Commit.RESYNC),
    ("a round closed elsewhere or a ranges round not complete here", Late(failed=True), Commit.RESYNC),
    ("stage 0's set is gone and nobody is ahead: T⊥ unchanged", Late(embed_lost=True), Commit.APPLY_WITHOUT_EMBED),
    (
        "stage 0's set is gone and a majority is ahead: sync to it",
        Late(embed_lost=True, stage_ahead=True),
        Commit.RESYNC,
    ),
    ("a holder ahead alone decides nothing", Late(stage_ahead=True), Commit.APPLY),
    ("our own round failed: re-sync even without stage 0's set", Late(failed=True, embed_lost=True), Commit.RESYNC),
    ("applied, then overtaken while frozen: never published", Late(frozen=True), Commit.WITHDRAW),
    ("overtaken while applying with T⊥ unchanged: withdrawn too", Late(embed_lost=True, frozen=True), Commit.WITHDRAW),
]


@pytest.mark.parametrize(("why", "late", "outcome"), ROWS, ids=[row[0] for row in ROWS])
def test_commit_decision(why: str, late: Late, outcome: Commit) -> None:
    assert commit_decision(late) is outcome, why


def test_every_outcome_is_reachable() -> None:
    assert {row[2] for row in ROWS} == set(Commit)

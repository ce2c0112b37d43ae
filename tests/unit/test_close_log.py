"""A set of our own closed with fewer payloads than the holders seen gathering, or with one payload, says why
in one line (`peer.node.round.views.log_short_close`): what the round expected, dropped and bound, who was
seen, and the records read."""

from __future__ import annotations

import logging

from peer.net.records import Announcement, ReplicaRecord, StageRecord
from peer.node.round.agreement import RoundView
from peer.node.round.views import log_short_close

OWN, OTHER, THIRD = "a" * 40, "b" * 40, "c" * 40


def _view() -> RoundView:
    view = RoundView(expected={OWN}, dropped={THIRD}, gathering={"peer-b-" + "0" * 30})
    view.bound["peer-a-" + "0" * 30] = (OWN, Announcement())
    return view


def test_a_close_with_fewer_payloads_than_holders_seen_names_the_view(caplog):
    with caplog.at_level(logging.INFO, logger="peer.node.round.views"):
        log_short_close(_view(), [OWN], ["peer-a-" + "0" * 30], t=90, stage=1)
    [line] = [r.getMessage() for r in caplog.records]
    assert line.startswith("round 90 stage 1: closing with 1 payload(s) (aaaaaaaaaaaa) of 2 holders seen gathering")
    assert "expected aaaaaaaaaaaa" in line and "dropped cccccccccccc" in line
    assert "bound peer-a-00000>aaaaaaaaaaaa" in line and "peer-b-00000" in line


def test_a_close_with_a_payload_per_holder_seen_says_nothing(caplog):
    with caplog.at_level(logging.INFO, logger="peer.node.round.views"):
        log_short_close(_view(), [OWN, OTHER], ["peer-a-" + "0" * 30], t=3, stage=0)
    assert caplog.records == []


def test_a_close_with_one_payload_names_the_records_read(caplog):
    view = RoundView(
        expected={OWN},
        replicas={"QmHead00" + "x" * 38: ReplicaRecord(kind="pipeline", outer_step=107, joined_at=109)},
        holders={"QmStage0" + "y" * 38: StageRecord(role="spare", outer_step=109)},
    )
    with caplog.at_level(logging.INFO, logger="peer.node.round.views"):
        log_short_close(view, [OWN], [], t=109, stage=1)
    [line] = [r.getMessage() for r in caplog.records]
    assert "closing with 1 payload(s) (aaaaaaaaaaaa) of 0 holders seen gathering" in line
    assert line.endswith("records QmHead00:pipeline@107+109 QmStage0:spare@109")

"""The head's one decision on a failed pipeline call (`peer.node.pipeline.failures.classify`), row by row.

The decision comes from the typed refusal a peer sends with its status (`Refusal`), never from the
message: rewording a message changes nothing. A peer that sends no refusal (an older build) is
classified by its status code alone. The refusal's wire form (`peer.net.transport.trailers`)
survives a round trip and rejects what is not one.
"""

from __future__ import annotations

import pytest

from peer.errors import NetworkError, PeerError
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.errors import NotFoundError, Refusal, RefusalKind, RemoteError, TransportError
from peer.net.transport.trailers import (
    MAX_REFUSAL_BYTES,
    REFUSAL_KEY,
    from_pb,
    refusal_from_metadata,
    to_pb,
    trailing_metadata,
)
from peer.node.pipeline.failures import (
    Action,
    Failure,
    NoReadyPeer,
    PipelineBehind,
    StageFailed,
    classify,
)
from peer.node.service import hop_error

S, T, H = 4, 5, 2  # stages; the head is at outer step T, inner step H


def _remote(refusal: Refusal | None, code: str = "FAILED_PRECONDITION", message: str = "refused") -> RemoteError:
    return RemoteError(f"peer 10.0.0.2:5 forward: {code}: {message}", code=code, refusal=refusal)


REFUSALS = [  # (refusal, called stage, expected action, expected stage)
    (Refusal(RefusalKind.BUSY, 1, outer_step=T), 1, Action.WAIT, 1),
    (Refusal(RefusalKind.BUSY, 1, outer_step=T - 1), 1, Action.WAIT, 1),  # still finishing an earlier round
    (Refusal(RefusalKind.BUSY, 1, outer_step=T + 1), 1, Action.BEHIND, 1),  # committed round T without us
    (Refusal(RefusalKind.BUSY, 3, outer_step=T), 1, Action.WAIT, 3),  # a hop further down was busy
    (Refusal(RefusalKind.CLAIMED, 1), 1, Action.REPLACE, 1),
    (Refusal(RefusalKind.CLAIMED, 2), 1, Action.REPLACE, 2),
    (Refusal(RefusalKind.LOST, 2), 2, Action.REPLACE, 2),
    (Refusal(RefusalKind.NETWORK, 3), 1, Action.REPLACE, 3),
    (Refusal(RefusalKind.REMOTE, 2), 1, Action.REPLAY, 2),
    (Refusal(RefusalKind.STALE, 2, outer_step=T, inner_step=H + 1, attempt=7), 1, Action.REPLACE, 2),  # ran ahead
    (Refusal(RefusalKind.STALE, 2, outer_step=T + 1, inner_step=0, attempt=7), 1, Action.REPLACE, 2),
    (Refusal(RefusalKind.STALE, 2, outer_step=T, inner_step=H, attempt=7), 1, Action.REPLAY, 2),  # a newer attempt
    (Refusal(RefusalKind.STALE, 1, outer_step=T, inner_step=H - 1, attempt=7), 1, Action.REPLAY, 1),
]


@pytest.mark.parametrize(("refusal", "called", "action", "stage"), REFUSALS)
def test_a_typed_refusal_decides(refusal, called, action, stage):
    for code in ("FAILED_PRECONDITION", "ABORTED", "INVALID_ARGUMENT", "NOT_FOUND"):  # the code does not matter
        failure = classify(_remote(refusal, code), called, S, T, H)
        assert failure is not None and (failure.action, failure.stage) == (action, stage), code


@pytest.mark.parametrize(("refusal", "called", "action", "stage"), REFUSALS)
def test_rewording_a_refusal_message_does_not_change_its_decision(refusal, called, action, stage):
    wordings = [
        "refused",
        "",
        "stage 1 peer is claimed by pipeline abc this round",  # the old texts, on any refusal
        "stage 2 is finishing outer round 99; retry shortly",
        "micro-batch 0 of (0, 0, 1) is stale: stage 3 runs (99, 99, 1)",
        "hop to stage 3 [network] failed: unavailable",
        "Die Stufe ist beschäftigt",
    ]
    decisions = {(f.action, f.stage) for w in wordings if (f := classify(_remote(refusal, message=w), called, S, T, H))}
    assert decisions == {(action, stage)}


def test_a_refusal_naming_a_stage_before_the_one_called_or_past_the_last_is_not_believed():
    for stage in (0, 1, S):  # called stage 2: a refusal can only name 2 .. S-1
        failure = classify(_remote(Refusal(RefusalKind.CLAIMED, stage)), 2, S, T, H)
        assert failure == Failure(Action.WAIT, 2, failure.reason)  # the code's decision, about the called stage


@pytest.mark.parametrize(
    ("code", "action"),
    [
        ("FAILED_PRECONDITION", Action.WAIT),  # an older peer's busy (or claimed: it cannot say which)
        ("NOT_FOUND", Action.REPLACE),
        ("ABORTED", Action.REPLAY),  # an older peer's failed hop: which stage failed is unknown
        ("INVALID_ARGUMENT", Action.REPLAY),
        ("INTERNAL", Action.REPLAY),
    ],
)
def test_without_a_refusal_the_status_code_decides_about_the_called_stage(code, action):
    failure = classify(_remote(None, code, "stage 1 peer is claimed by pipeline abc this round"), 2, S, T, H)
    assert failure is not None and (failure.action, failure.stage) == (action, 2)


def test_errors_without_a_status():
    assert classify(NotFoundError("gone", code="NOT_FOUND"), 1, S, T, H).action is Action.REPLACE
    assert classify(NetworkError("no answer within 30.0s"), 2, S, T, H) == Failure(
        Action.REPLACE, 2, "no answer within 30.0s"
    )
    for local in (TransportError("malformed reply"), PeerError("no activations"), ValueError("x"), KeyError("k")):
        assert classify(local, 1, S, T, H).action is Action.REPLAY
    decided = Failure(Action.REPLACE, 3, "hop")
    assert classify(StageFailed(decided), 1, S, T, H) is decided
    # not a replay: no peer to claim, the head is behind, or a bug
    for exc in (NoReadyPeer("no ready peer"), PipelineBehind("behind"), RuntimeError("bug"), TypeError("bug")):
        assert classify(exc, 1, S, T, H) is None


def test_the_wire_form_round_trips_and_rejects_what_is_not_a_refusal():
    refusal = Refusal(RefusalKind.STALE, 2, outer_step=3, inner_step=4, attempt=1_700_000_000_000)
    assert refusal_from_metadata(trailing_metadata(refusal)) == refusal
    assert from_pb(to_pb(Refusal(RefusalKind.BUSY, 1, outer_step=9))) == Refusal(RefusalKind.BUSY, 1, outer_step=9)
    assert refusal_from_metadata(None) is None
    assert refusal_from_metadata([("other-bin", to_pb(refusal).SerializeToString())]) is None
    assert refusal_from_metadata([(REFUSAL_KEY, b"\xff\xff\xff")]) is None  # not a message
    assert refusal_from_metadata([(REFUSAL_KEY, b"\x00" * (MAX_REFUSAL_BYTES + 1))]) is None
    unknown = pb.Refusal(stage=1)
    unknown.kind = 42  # type: ignore[assignment]  # a kind of a later build
    assert from_pb(unknown) is None
    assert from_pb(pb.Refusal(kind=pb.Refusal.BUSY, stage=-1)) is None
    assert from_pb(pb.Refusal(stage=1)) is None  # no kind
    for kind in RefusalKind:  # the numbers are the proto's
        assert pb.Refusal.Kind.Name(int(kind)) == ("KIND_UNSPECIFIED" if kind is RefusalKind.UNSPECIFIED else kind.name)


def test_a_stage_answers_a_failed_hop_with_a_refusal_naming_the_stage_that_failed():
    """`PeerService._hop`: a deeper refusal passes through; without one the error's kind decides."""
    deeper = Refusal(RefusalKind.CLAIMED, 3)
    assert hop_error(_remote(deeper, "ABORTED"), 2).refusal == deeper
    earlier = _remote(Refusal(RefusalKind.LOST, 1), "INVALID_ARGUMENT")  # names a stage before the one called
    assert hop_error(earlier, 2).refusal == Refusal(RefusalKind.REMOTE, 2)
    assert hop_error(NotFoundError("gone", code="NOT_FOUND"), 2).refusal == Refusal(RefusalKind.LOST, 2)
    assert hop_error(NetworkError("no answer"), 2).refusal == Refusal(RefusalKind.NETWORK, 2)
    assert hop_error(_remote(None, "FAILED_PRECONDITION"), 2).refusal == Refusal(RefusalKind.BUSY, 2)
    assert hop_error(_remote(None, "INVALID_ARGUMENT"), 2).refusal == Refusal(RefusalKind.REMOTE, 2)
    assert hop_error(PeerError("no loss"), 2).refusal == Refusal(RefusalKind.REMOTE, 2)
    assert "hop to stage 3 [claimed] failed" in str(hop_error(_remote(deeper, "ABORTED"), 2))  # for people

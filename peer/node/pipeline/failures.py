"""The one decision on a failed pipeline call: wait, replace the stage's peer, replay, or re-sync.

Every failure of an inner step (a call into a stage, a hop further down a streamed route, stage
0's own compute) goes through `classify`, which returns a `Failure`: what to do and about which
stage. It reads the typed `Refusal` a peer sent with its status (`peer.net.transport.errors`),
never the message: the message is for logs. A peer that sent no refusal (an older build) is
classified by its status code alone: NOT_FOUND replaces it, FAILED_PRECONDITION waits (it was
busy), anything else replays. The routing applies the decision (`Routing.on_failure`), the
step's one replay loop acts on it (`peer.node.pipeline.step`).

| failure | action |
| --- | --- |
| BUSY at an outer step after this one | BEHIND: drop the peer, re-sync the head |
| BUSY otherwise | WAIT: retry the same peer shortly (not a failed attempt) |
| CLAIMED, LOST, NETWORK; NOT_FOUND or an unreachable peer | REPLACE: drop the peer, replay |
| STALE, the stage ran later inner steps of this outer step | REPLACE (an earlier process of this head moved it on) |
| STALE otherwise, REMOTE, a malformed reply, stage 0's own error | REPLAY with the same peers |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from peer.errors import NetworkError, PeerError
from peer.net.transport.errors import Refusal, RefusalKind, RemoteError


class Action(enum.Enum):
    WAIT = "wait"  # the stage is between rounds: try again shortly; not a failed attempt
    REPLACE = "replace"  # drop the stage's peer, claim another, replay the inner step
    REPLAY = "replay"  # replay the inner step with the same peers
    BEHIND = "behind"  # the stage's peer is past this outer step: this head missed a round


@dataclass(frozen=True)
class Failure:
    """What to do after a failure, about which `stage`; `reason` is the message, for logs only."""

    action: Action
    stage: int
    reason: str


class PipelineBehind(NetworkError):
    """The stage peers moved on to a later outer step: the head must re-sync before training."""


class NoReadyPeer(NetworkError):
    """A stage has no ready peer to claim within `swarm.claim_timeout_s`: the head pauses."""


class StageFailed(PeerError):
    """A call of this inner step failed; carries the decision (`failure`)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.reason)
        self.failure = failure


def classify(exc: BaseException, called: int, stages: int, t: int, h: int) -> Failure | None:
    """The decision on `exc`, raised by a call into stage `called` during inner step h of outer
    step t (stages: S). None for an exception that ends the inner step without a replay (no peer
    to claim, the head is behind) or is no pipeline failure (a bug): re-raise it."""
    if isinstance(exc, StageFailed):
        return exc.failure
    if isinstance(exc, (PipelineBehind, NoReadyPeer)):
        return None
    if isinstance(exc, RemoteError):
        refusal = exc.refusal
        if refusal is not None and called <= refusal.stage < stages:  # no stage before the one called
            return from_refusal(refusal, t, h, str(exc))
        return _from_code(exc.code, called, str(exc))
    if isinstance(exc, NetworkError):
        return Failure(Action.REPLACE, called, str(exc))
    if isinstance(exc, (PeerError, KeyError, ValueError)):  # malformed replies, stage 0's own refusals
        return Failure(Action.REPLAY, called, str(exc))
    return None


def from_refusal(refusal: Refusal, t: int, h: int, reason: str) -> Failure:
    """The decision on a typed refusal of (or a failed hop into) `refusal.stage`."""
    kind, stage = refusal.kind, refusal.stage
    if kind is RefusalKind.BUSY:
        return Failure(Action.BEHIND if refusal.outer_step > t else Action.WAIT, stage, reason)
    if kind in (RefusalKind.CLAIMED, RefusalKind.LOST, RefusalKind.NETWORK):
        return Failure(Action.REPLACE, stage, reason)
    if kind is RefusalKind.STALE and (refusal.outer_step, refusal.inner_step) > (t, h):
        # the peer ran later inner steps of this outer step, for an earlier process of this
        # pipeline (a restarted head): its weights moved on, it cannot serve this one again
        return Failure(Action.REPLACE, stage, reason)
    return Failure(Action.REPLAY, stage, reason)


def _from_code(code: str, called: int, reason: str) -> Failure:
    """A refusal without a typed reason (an older peer): its status code decides."""
    if code == "NOT_FOUND":
        return Failure(Action.REPLACE, called, reason)
    if code == "FAILED_PRECONDITION":
        return Failure(Action.WAIT, called, reason)
    return Failure(Action.REPLAY, called, reason)

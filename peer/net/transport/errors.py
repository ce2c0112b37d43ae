"""Errors of the gRPC data plane, all `peer.errors.PeerError` subclasses, and typed refusals.

Server side, a handler signals an expected failure by raising a PeerError; the server maps it to
a gRPC status (`status_for`): TransportError -> INVALID_ARGUMENT, NotFoundError -> NOT_FOUND,
HopError (a stage-to-stage hop failed) -> ABORTED, any other PeerError -> FAILED_PRECONDITION.
Client side, the status comes back as the matching class
(`RemoteError` for the rest), with the peer address and method in the message. Timeouts and
unreachable peers are `peer.errors.NetworkError`.

Refusals: a pipeline refusal (busy, claimed, lost, stale, a failed hop) carries a `Refusal`, a
typed reason with its numbers (protos/peer.proto `Refusal`). The server sends it in the status's
trailing metadata, the client puts it on the `RemoteError` it raises; the caller decides on it and
never on the message, which is for people and logs.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from peer.errors import NetworkError, PeerError

__all__ = [
    "HopError",
    "NetworkError",
    "NotFoundError",
    "Refusal",
    "RefusalKind",
    "Refused",
    "RemoteError",
    "TransportError",
]


class RefusalKind(enum.IntEnum):
    """Why a stage refused a pipeline call; the numbers are `peer.v1.Refusal.Kind`'s."""

    UNSPECIFIED = 0  # no typed reason (an older peer, or one this build does not know)
    BUSY = 1  # between rounds or at another outer step: retry shortly
    CLAIMED = 2  # serves another pipeline this outer step
    LOST = 3  # does not serve the stage (any more), or is leaving the run
    STALE = 4  # the micro-batch's epoch is older than the one the stage runs
    NETWORK = 5  # a hop: the next stage's peer was unreachable or did not answer in time
    REMOTE = 6  # a hop: the next stage refused the request for another reason


@dataclass(frozen=True)
class Refusal:
    """A typed refusal: `kind`, the `stage` whose peer refused or failed, and for BUSY the outer step
    that stage is at, for STALE the (outer step, inner step, attempt) it runs (-1: not given)."""

    kind: RefusalKind
    stage: int
    outer_step: int = -1
    inner_step: int = -1
    attempt: int = -1


class TransportError(PeerError):
    """A message on the wire is malformed, too large or fails validation.

    `refusal`: the typed reason, when a handler refuses a micro-batch it cannot run (a stale one).
    """

    def __init__(self, message: str, *, refusal: Refusal | None = None):
        super().__init__(message)
        self.refusal = refusal


class RemoteError(TransportError):
    """The remote peer answered a call with an error status.

    Attributes: `address` of the peer, `method` called, `code` (gRPC status name, e.g.
    "FAILED_PRECONDITION"), `refusal` (the typed reason the peer sent with it, or None).
    """

    def __init__(
        self, message: str, *, address: str = "", method: str = "", code: str = "", refusal: Refusal | None = None
    ):
        super().__init__(message, refusal=refusal)
        self.address = address
        self.method = method
        self.code = code


class NotFoundError(RemoteError):
    """The requested object (payload, artefact, stage, state) is not held by the peer.

    Handlers raise it to answer NOT_FOUND; clients receive it when the peer answered so, e.g.
    while polling for a payload that has not been published yet.
    """


class Refused(PeerError):
    """A valid pipeline request this peer will not run now, for the typed `refusal` (answered as
    FAILED_PRECONDITION with the refusal in the trailing metadata)."""

    def __init__(self, refusal: Refusal, message: str):
        super().__init__(message)
        self.refusal = refusal


class HopError(PeerError):
    """A stage could not stream a micro-batch on to stage `refusal.stage` (answered as ABORTED).

    The refusal's kind says why: NETWORK (unreachable or timed out), LOST (the peer no longer
    serves the stage), CLAIMED (it serves another pipeline), BUSY (between rounds), STALE, REMOTE
    (it refused the request). A hop failure reported through several stages reaches the head with
    the refusal of the stage that failed.
    """

    def __init__(self, refusal: Refusal, detail: str):
        super().__init__(f"hop to stage {refusal.stage} [{refusal.kind.name.lower()}] failed: {detail}")
        self.refusal = refusal

"""Errors of the gRPC data plane, all `peer.errors.PeerError` subclasses.

Server side, a handler signals an expected failure by raising a PeerError; the server maps it to
a gRPC status (`status_for`): TransportError -> INVALID_ARGUMENT, NotFoundError -> NOT_FOUND,
HopError (a stage-to-stage hop failed) -> ABORTED, any other PeerError -> FAILED_PRECONDITION.
Client side, the status comes back as the matching class
(`RemoteError` for the rest), with the peer address and method in the message. Timeouts and
unreachable peers are `peer.errors.NetworkError`.
"""

from __future__ import annotations

import re

from peer.errors import NetworkError, PeerError

__all__ = ["HopError", "NetworkError", "NotFoundError", "RemoteError", "TransportError"]


class TransportError(PeerError):
    """A message on the wire is malformed, too large or fails validation."""


class RemoteError(TransportError):
    """The remote peer answered a call with an error status.

    Attributes: `address` of the peer, `method` called, `code` (gRPC status name, e.g.
    "FAILED_PRECONDITION").
    """

    def __init__(self, message: str, *, address: str = "", method: str = "", code: str = ""):
        super().__init__(message)
        self.address = address
        self.method = method
        self.code = code


class NotFoundError(RemoteError):
    """The requested object (payload, artefact, stage, state) is not held by the peer.

    Handlers raise it to answer NOT_FOUND; clients receive it when the peer answered so, e.g.
    while polling for a payload that has not been published yet.
    """


_HOP = re.compile(r"hop to stage (\d+) \[(\w+)\]")


class HopError(PeerError):
    """A stage could not stream a micro-batch on to stage `stage` (answered as ABORTED).

    `kind`: "network" (unreachable or timed out), "lost" (the peer no longer serves the stage),
    "claimed" (it serves another pipeline), "busy" (between rounds), "remote" (it refused the
    request). The message names the failed stage, so a hop failure reported through several stages
    reaches the head unchanged (`HopError.parse`).
    """

    def __init__(self, stage: int, kind: str, detail: str):
        super().__init__(f"hop to stage {stage} [{kind}] failed: {detail}")
        self.stage, self.kind = stage, kind

    @staticmethod
    def parse(message: str) -> tuple[int, str] | None:
        """(failed stage, kind) named in an ABORTED status's details, or None."""
        found = _HOP.search(message)
        return None if found is None else (int(found.group(1)), found.group(2))

"""The channel every PeerClient dials: routes, admission proofs and upload/download caps.

Addresses: "host:port" dials the peer; "PEERID@host:port" reaches the peer PEERID that cannot be
dialled through the peer at host:port that holds its reverse stream (a relay, or a peer it works
with): the call goes there with metadata `peer-target: PEERID` (`peer.net.transport.reverse`).
When a server of this process holds PEERID's reverse stream itself (`register_local`), the call
goes to that server instead, whatever host the address names ("reverse" connectivity).

Every call carries the caller's `Outbound`: its admission proof (`auth.Credentials`, built by
the session or bootstrap from the manifest; None in an open swarm) and its link buckets
(`peer.net.ratelimit.Link`, one per peer process, shared with its server): requests are uploads,
replies downloads; round payloads, state and artefacts go at LOW priority, pipeline traffic HIGH.
Both are values handed to each client; nothing here is process-wide but the local routes below.

Invariants: the interceptor never changes a message; Tunnel calls (reverse streams, dial-back)
are not throttled here (the bytes they carry are throttled by the server that runs the call).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import grpc

from peer.net.ratelimit import HIGH, LOW, Link, TokenBucket
from peer.net.transport import auth

TARGET_KEY = "peer-target"
TUNNEL_PREFIX = "/peer.v1.Tunnel/"
LOW_METHODS = frozenset({"/peer.v1.Peer/GetPayload", "/peer.v1.Peer/GetState", "/peer.v1.Peer/GetArtifact"})
_NOWHERE = "unix:/nonexistent/peer-has-no-route"  # a routed address with no hub: fails fast, UNAVAILABLE

_local: dict[str, str] = {}  # target peer id -> address of a server of this process holding its stream
_local_lock = threading.Lock()


@dataclass(frozen=True)
class Outbound:
    """What every call a peer makes carries: its admission proof (None: an open swarm, or a caller
    outside the swarm) and the link buckets it passes (a peer's caps cover all its clients)."""

    credentials: auth.Credentials | None = None
    link: Link = field(default_factory=Link)


def priority(method: str) -> int:
    """Round payloads, state and artefacts yield to pipeline traffic."""
    return LOW if method in LOW_METHODS else HIGH


def split_route(address: str) -> tuple[str | None, str]:
    """("PEERID", "host:port") for "PEERID@host:port"; (None, address) for a plain address."""
    if "@" in address:
        target, _, hub = address.partition("@")
        return target, hub
    return None, address


def register_local(target: str, address: str) -> None:
    """A server of this process at `address` holds `target`'s reverse stream."""
    with _local_lock:
        _local[target] = address


def unregister_local(target: str, address: str) -> None:
    with _local_lock:
        if _local.get(target) == address:
            del _local[target]


def local_route(target: str) -> str | None:
    with _local_lock:
        return _local.get(target)


class _Details(NamedTuple):
    method: str
    timeout: float | None
    metadata: Sequence[tuple[str, str]] | None
    credentials: grpc.CallCredentials | None
    wait_for_ready: bool | None
    compression: grpc.Compression | None


class _Throttled:
    """A streaming call whose replies pass the download bucket; everything else is the call's."""

    def __init__(self, call: Any, bucket: TokenBucket, prio: int) -> None:
        self._call, self._bucket, self._prio = call, bucket, prio

    def __iter__(self) -> _Throttled:
        return self

    def __next__(self) -> Any:
        item = next(self._call)
        self._bucket.acquire(item.ByteSize(), self._prio)
        return item

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class _Outgoing(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[misc]  # grpc ships its interceptor bases untyped
    grpc.UnaryStreamClientInterceptor,  # type: ignore[misc]  # grpc ships its interceptor bases untyped
    grpc.StreamUnaryClientInterceptor,  # type: ignore[misc]  # grpc ships its interceptor bases untyped
    grpc.StreamStreamClientInterceptor,  # type: ignore[misc]  # grpc ships its interceptor bases untyped
):
    """Adds the route and the proof to every call; throttles its messages."""

    def __init__(self, target: str | None, outbound: Outbound) -> None:
        self.target, self.link, self.credentials = target, outbound.link, outbound.credentials

    def _details(self, details: Any) -> _Details:
        metadata = list(details.metadata or ())
        credentials = self.credentials
        if credentials is not None:
            metadata += credentials.metadata(details.method)
        if self.target is not None:
            metadata.append((TARGET_KEY, self.target))
        return _Details(
            details.method, details.timeout, metadata, details.credentials, details.wait_for_ready, details.compression
        )

    def _throttled(self, method: str) -> bool:
        return not method.startswith(TUNNEL_PREFIX)

    def _up(self, method: str, requests: Iterator[Any]) -> Iterator[Any]:
        if not self._throttled(method):
            return requests
        return self.link.throttle(requests, self.link.up, priority(method), lambda m: int(m.ByteSize()))

    def _down(self, method: str, call: Any) -> Any:
        return _Throttled(call, self.link.down, priority(method)) if self._throttled(method) else call

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        if self._throttled(details.method):
            self.link.up.acquire(int(request.ByteSize()), priority(details.method))
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        if self._throttled(details.method):
            self.link.up.acquire(int(request.ByteSize()), priority(details.method))
        return self._down(details.method, continuation(self._details(details), request))

    def intercept_stream_unary(self, continuation: Callable[..., Any], details: Any, requests: Iterator[Any]) -> Any:
        return continuation(self._details(details), self._up(details.method, requests))

    def intercept_stream_stream(self, continuation: Callable[..., Any], details: Any, requests: Iterator[Any]) -> Any:
        return self._down(details.method, continuation(self._details(details), self._up(details.method, requests)))


def open_channel(
    address: str, options: Sequence[tuple[str, Any]] = (), outbound: Outbound | None = None
) -> grpc.Channel:
    """An insecure channel to `address` (plain or routed, see the module docstring) that adds
    `outbound`'s credentials and the route to every call and throttles it by `outbound.link`
    (default: no proof, an uncapped link of its own)."""
    target, hub = split_route(address)
    if target is not None:
        hub = local_route(target) or (hub if hub not in ("", "-") else _NOWHERE)
    channel = grpc.insecure_channel(hub, options=list(options))
    return grpc.intercept_channel(channel, _Outgoing(target, outbound or Outbound()))

"""The server side of connectivity: one gRPC interceptor in front of a peer's data plane.

`Gate` runs on every incoming call before grpcio hands a single request byte to a handler:
1. admission (`auth.Verifier`): a call without a valid proof ends with UNAUTHENTICATED, counted;
2. Tunnel calls (`peer.net.transport.reverse`): reverse streams and the reachability dial-back;
3. calls for another peer (metadata `peer-target`): forwarded over that peer's reverse stream;
4. everything else goes to the PeerServer's own handler, with its request messages through the
   download bucket and its reply messages through the upload bucket (the peer's `peer.net.ratelimit.Link`),
   and Peer.Info's JSON gains a "net" entry (`Gate.net_info`: connectivity, caps, auth failures).

Invariants: the Gate never parses a Peer request (raw bytes pass through untouched); a rejected
call reads nothing; counters only grow.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from typing import Any

import grpc

from peer.net.ratelimit import Link
from peer.net.transport import auth, dialer, reverse
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.dialer import Outbound

log = logging.getLogger(__name__)

INFO_METHOD = "/peer.v1.Peer/Info"
_FACTORIES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _refuse(kind: tuple[bool, bool], code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of `kind` that ends the call with `code` without reading its request."""

    def behaviour(request: Any, context: grpc.ServicerContext) -> Any:
        context.abort(code, details)

    return _FACTORIES[kind](behaviour)


class Gate(grpc.ServerInterceptor):  # type: ignore[misc]  # grpc ships ServerInterceptor untyped
    """Admission, reverse streams, forwarding and caps for one PeerServer (see module docstring)."""

    def __init__(
        self,
        peer_id: str,
        verifier: auth.Verifier | None = None,
        relay: bool = False,
        link: Link | None = None,
        net_info: Callable[[], dict[str, Any]] | None = None,
        outbound: Outbound | None = None,
    ) -> None:
        """`outbound`: the proof and link of this peer's own calls (dial-backs); `link` (default:
        `outbound`'s, else an uncapped one) throttles what this server receives and sends."""
        self.peer_id = peer_id
        self.verifier = verifier or auth.Verifier("open")
        outbound = outbound or Outbound(link=link or Link())
        self.link = link or outbound.link
        self.hub = reverse.TunnelHub(peer_id, relay=relay, link=self.link, outbound=outbound)
        self._net_info = net_info

    def bind(self, address: str) -> None:
        """This server listens at `address` (host:port; 0.0.0.0 becomes 127.0.0.1 for own calls)."""
        host, _, port = address.rpartition(":")
        self.hub.local_address = f"{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}"

    def net_info(self) -> dict[str, Any]:
        extra = self._net_info() if self._net_info is not None else {}
        return {
            "auth_failures": self.verifier.failure_count(),
            "relay": self.hub.relay,
            "reverse_streams_held": self.hub.held(),
            **self.link.snapshot(),
            **extra,
        }

    def intercept_service(self, continuation: Callable[[Any], Any], details: Any) -> Any:
        method = str(details.method)
        metadata = tuple((str(k), v if isinstance(v, str) else "") for k, v in (details.invocation_metadata or ()))
        md = dict(metadata)
        kind = reverse.method_kind(method)
        caller, why = self.verifier.check(method, md)
        if why is not None:
            log.info("refused %s: %s", method, why)
            return _refuse(kind or (method == reverse.REVERSE_METHOD,) * 2, grpc.StatusCode.UNAUTHENTICATED, why)
        if method == reverse.REVERSE_METHOD:

            def serve_reverse(frames: Iterator[pb.Frame], context: grpc.ServicerContext) -> Iterator[pb.Frame]:
                yield from self.hub.reverse(caller, frames, context)

            return grpc.stream_stream_rpc_method_handler(
                serve_reverse, request_deserializer=pb.Frame.FromString, response_serializer=pb.Frame.SerializeToString
            )
        if method == reverse.DIAL_BACK_METHOD:
            return grpc.unary_unary_rpc_method_handler(
                self.hub.dial_back,
                request_deserializer=pb.DialBackRequest.FromString,
                response_serializer=pb.DialBackReply.SerializeToString,
            )
        target = md.get(dialer.TARGET_KEY)
        if target and target != self.peer_id and kind is not None:
            return self._forwarding(method, kind, target, caller, metadata)
        handler = continuation(details)
        if handler is None or kind is None:
            return handler
        return self._throttled(handler, method, kind)

    def _forwarding(
        self,
        method: str,
        kind: tuple[bool, bool],
        target: str,
        caller: str | None,
        metadata: tuple[tuple[str, str], ...],
    ) -> grpc.RpcMethodHandler:
        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[bytes]:
            yield from self.hub.forward(method, target, caller, metadata, request, context)

        def unary(request: Any, context: grpc.ServicerContext) -> bytes:
            replies = list(self.hub.forward(method, target, caller, metadata, request, context))
            if len(replies) != 1:
                context.abort(grpc.StatusCode.INTERNAL, f"{method} over a reverse stream gave {len(replies)} replies")
            return replies[0]

        return _FACTORIES[kind](stream if kind[1] else unary)

    def _throttled(self, handler: Any, method: str, kind: tuple[bool, bool]) -> grpc.RpcMethodHandler:
        prio, link = dialer.priority(method), self.link
        inner = handler.stream_stream or handler.stream_unary or handler.unary_stream or handler.unary_unary

        def size(message: Any) -> int:
            return len(message) if isinstance(message, (bytes, bytearray)) else int(message.ByteSize())

        def take_in(request: Any) -> Any:
            if kind[0]:
                return link.throttle(request, link.down, prio, size)
            link.down.acquire(size(request), prio)
            return request

        def stream(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            yield from link.throttle(inner(take_in(request), context), link.up, prio, size)

        def unary(request: Any, context: grpc.ServicerContext) -> Any:
            reply = inner(take_in(request), context)
            if method == INFO_METHOD and isinstance(reply, pb.InfoReply):
                reply = pb.InfoReply(json=json.dumps({**json.loads(reply.json), "net": self.net_info()}))
            link.up.acquire(size(reply), prio)
            return reply

        return _FACTORIES[kind](
            stream if kind[1] else unary,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

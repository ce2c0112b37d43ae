"""PeerServer: serves a `PeerHandler` over gRPC (service `peer.v1.Peer`, protos/peer.proto).

The gRPC server runs in its own threads (a pool of `max_workers` handler threads); the caller
keeps a synchronous object with `.port`, `.address` and `stop(grace_s)`. Each RPC reassembles and
validates the request (framing + codec), calls the handler, encodes and streams the reply.
The service is registered with raw-bytes request handlers (built from the proto's service
descriptor, not `peer_pb2_grpc.add_PeerServicer_to_server`), so the codec, not grpcio, parses
every request: bytes that are not the method's protobuf type are INVALID_ARGUMENT and one INFO
line, never grpcio's INTERNAL with a logged traceback (a hostile peer cannot flood the log).

Invariants: every handler call is wrapped, so a bad request or a failing handler ends only that
RPC, never the server: validation failures -> INVALID_ARGUMENT, `NotFoundError` -> NOT_FOUND,
`HopError` -> ABORTED, other `PeerError` -> FAILED_PRECONDITION, anything else -> INTERNAL with
the traceback logged; an error that carries a typed `Refusal` sends it in the trailing metadata.
A `FileSlice` answer to get_artifact (a dataset shard) is streamed from its file one chunk at a
time (`blobs.file_chunks`); a file that cannot be read to its promised end ends the call with DATA_LOSS.
No request larger than `max_message_bytes` is ever buffered. `stop()` waits for in-flight handler
calls (bounded by the grace period) and shuts every thread the server started down.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import Message as PbMessage

from peer.errors import NetworkError, PeerError
from peer.net.transport import blobs, codec, framing, tensors
from peer.net.transport import peer_pb2 as pb
from peer.net.transport import peer_pb2_grpc as pb_grpc
from peer.net.transport.errors import HopError, NotFoundError, Refusal, Refused, TransportError
from peer.net.transport.handler import HANDLER_METHODS, PeerHandler
from peer.net.transport.messages import BackwardReply, FileSlice, ForwardReply, RangesReply, StateReply, StepReply
from peer.net.transport.tensors import WireLimits
from peer.net.transport.trailers import trailing_metadata

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
T = TypeVar("T")


def format_address(host: str, port: int) -> str:
    """host:port, with IPv6 hosts in brackets."""
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    """End the RPC with `code` and `details` (grpc's `abort` raises; grpc ships no types to say so)."""
    context.abort(code, details)
    raise AssertionError("grpc.ServicerContext.abort returned")  # never reached


def _refuse(context: grpc.ServicerContext, code: grpc.StatusCode, exc: PeerError, refusal: Refusal | None) -> NoReturn:
    """End the RPC with `code`, the message of `exc` and, when given, its typed refusal in the
    trailing metadata (`peer.net.transport.trailers`)."""
    if refusal is not None:
        context.set_trailing_metadata(trailing_metadata(refusal))
    _abort(context, code, str(exc))


class _Servicer(pb_grpc.PeerServicer):
    """Adapts gRPC calls to the synchronous handler; counts in-flight handler calls for stop()."""

    def __init__(self, handler: PeerHandler, limits: WireLimits, wire_dtype: str) -> None:
        self._handler = handler
        self._limits = limits
        self._wire_dtype = wire_dtype
        self._idle = threading.Condition()
        self._in_flight = 0

    # ------------------------------------------------------------------ RPCs
    # Requests arrive as raw bytes (see `_method_handlers`); replies are protobuf messages.
    def Forward(self, request_iterator: Iterable[bytes], context: grpc.ServicerContext) -> Iterator[pb.Chunk]:
        late: list[Callable[[], tuple[float, ...]]] = []
        yield from self._streamed(context, "forward", request_iterator, pb.ForwardRequest, ForwardReply, late)
        if late:  # `defer_norms`: Σ‖g‖² as a second reply, once the stage's weight gradients are done
            yield from framing.split(self._run(context, "forward", lambda: codec.late_norms_to_bytes(late[0]())))

    def Backward(self, request_iterator: Iterable[bytes], context: grpc.ServicerContext) -> Iterator[pb.Chunk]:
        yield from self._streamed(context, "backward", request_iterator, pb.BackwardRequest, BackwardReply)

    def Step(self, request: bytes, context: grpc.ServicerContext) -> PbMessage:
        def call() -> PbMessage:
            step = self._handler.step(codec.from_bytes(pb.StepRequest, request, self._limits))
            return self._encode(step, StepReply, "step")

        return self._run(context, "step", call)

    def GetPayload(self, request: bytes, context: grpc.ServicerContext) -> Iterator[pb.Chunk]:
        def call() -> bytes:
            reply = self._handler.get_payload(codec.from_bytes(pb.PayloadRequest, request, self._limits))
            if isinstance(reply, RangesReply):  # a ranges round's parts or shards travel as a Blob's bytes
                reply = codec.to_bytes(reply)
            data: bytes = self._encode(reply, bytes, "get_payload").SerializeToString()
            return data

        yield from framing.split(self._run(context, "get_payload", call))

    def GetState(self, request: bytes, context: grpc.ServicerContext) -> Iterator[pb.Chunk]:
        yield from self._unary_streamed(context, "get_state", request, pb.StateRequest, StateReply)

    def GetArtifact(self, request: bytes, context: grpc.ServicerContext) -> Iterator[pb.Chunk]:
        reply = self._run(context, "get_artifact", lambda: self._artifact(request))
        if not isinstance(reply, FileSlice):
            yield from framing.split(reply)
            return
        try:  # streamed from disk, one chunk at a time (peer.net.transport.blobs)
            yield from blobs.file_chunks(reply.path, reply.offset, reply.size)
        except OSError as exc:  # the file went away or shrank under us: no last chunk was sent
            log.warning("get_artifact from %s: cannot read %s: %s", context.peer(), reply.path, exc)
            _abort(context, grpc.StatusCode.DATA_LOSS, f"get_artifact: this peer cannot read the artefact ({exc})")

    def _artifact(self, request: bytes) -> bytes | FileSlice:
        """The handler's artefact: protobuf bytes of a Blob held in memory, or a file to stream."""
        reply = self._handler.get_artifact(codec.from_bytes(pb.ArtifactRequest, request, self._limits))
        if isinstance(reply, FileSlice):
            return reply
        data: bytes = self._encode(reply, bytes, "get_artifact").SerializeToString()
        return data

    def Info(self, request: bytes, context: grpc.ServicerContext) -> PbMessage:
        def call() -> PbMessage:
            codec.parse(pb.InfoRequest, request, self._limits)  # carries nothing, but must be one
            return self._encode(self._handler.info(), dict, "info")

        return self._run(context, "info", call)

    # --------------------------------------------------------------- helpers
    def _streamed(
        self,
        context: grpc.ServicerContext,
        method: str,
        request_iterator: Iterable[bytes],
        request_type: type[PbMessage],
        reply_type: type,
        late: list[Callable[[], tuple[float, ...]]] | None = None,
    ) -> Iterator[pb.Chunk]:
        """late: receives a ForwardReply's `late` (to send after this reply) when it has one."""

        def call() -> bytes:
            chunks = (codec.parse(pb.Chunk, data, self._limits) for data in request_iterator)
            raw = framing.join(chunks, self._limits.max_message_bytes, request_type.__name__)
            request = codec.from_bytes(request_type, raw, self._limits)
            reply = getattr(self._handler, method)(request)
            if late is not None and isinstance(reply, ForwardReply) and reply.late is not None:
                late.append(reply.late)
            data: bytes = self._encode(reply, reply_type, method).SerializeToString()
            return data

        yield from framing.split(self._run(context, method, call))

    def _unary_streamed(
        self,
        context: grpc.ServicerContext,
        method: str,
        request: bytes,
        request_type: type[PbMessage],
        reply_type: type,
    ) -> Iterator[pb.Chunk]:
        def call() -> bytes:
            reply = getattr(self._handler, method)(codec.from_bytes(request_type, request, self._limits))
            data: bytes = self._encode(reply, reply_type, method).SerializeToString()
            return data

        yield from framing.split(self._run(context, method, call))

    def _encode(self, reply: Any, reply_type: type, method: str) -> PbMessage:
        if reply_type is bytes and isinstance(reply, (bytearray, memoryview)):
            reply = bytes(reply)
        if not isinstance(reply, reply_type):
            raise TypeError(f"handler.{method} returned {type(reply).__name__}, expected {reply_type.__name__}")
        if isinstance(reply, ForwardReply):
            codec.check_forward_reply(reply)
        return codec.encode(reply, self._wire_dtype)

    def _run(self, context: grpc.ServicerContext, method: str, fn: Callable[[], T]) -> T:
        with self._idle:
            self._in_flight += 1
        try:
            return fn()
        except grpc.RpcError:  # the request stream broke: client deadline, cancel or disconnect
            self._cancelled(context, method)
        except NotFoundError as exc:
            _refuse(context, grpc.StatusCode.NOT_FOUND, exc, exc.refusal)
        except TransportError as exc:
            if not context.is_active():  # a cancelled upload can also look like a truncated stream
                self._cancelled(context, method)
            log.info("rejected %s from %s: %s", method, context.peer(), exc)
            _refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc, exc.refusal)
        except HopError as exc:
            _refuse(context, grpc.StatusCode.ABORTED, exc, exc.refusal)
        except Refused as exc:
            _refuse(context, grpc.StatusCode.FAILED_PRECONDITION, exc, exc.refusal)
        except PeerError as exc:
            _abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except Exception as exc:
            log.exception("handler.%s failed on a request from %s", method, context.peer())
            details = f"{method} failed inside the peer ({type(exc).__name__}: {exc}); see that peer's log"
            _abort(context, grpc.StatusCode.INTERNAL, details)
        finally:
            with self._idle:
                self._in_flight -= 1
                self._idle.notify_all()

    @staticmethod
    def _cancelled(context: grpc.ServicerContext, method: str) -> NoReturn:
        log.info("%s from %s ended by the client before the request arrived", method, context.peer())
        _abort(context, grpc.StatusCode.CANCELLED, f"{method} request stream ended by the client")

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no handler call is running; False if some still run after `timeout_s`."""
        with self._idle:
            return self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)


_HANDLER_KINDS = {  # (client streaming, server streaming) -> grpc handler factory
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _method_handlers(servicer: _Servicer) -> tuple[str, dict[str, grpc.RpcMethodHandler]]:
    """The service name and one handler per RPC of protos/peer.proto's `Peer` service.

    Like the generated `add_PeerServicer_to_server`, except that the request deserializer is None:
    the servicer receives the request bytes and parses them with the codec itself.
    """
    service = pb.DESCRIPTOR.services_by_name["Peer"]
    handlers = {}
    for method in service.methods:
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        reply_type = getattr(pb, method.output_type.name)
        handlers[method.name] = kind(
            getattr(servicer, method.name), request_deserializer=None, response_serializer=reply_type.SerializeToString
        )
    return service.full_name, handlers


class PeerServer:
    """A running gRPC server for one peer's data plane.

    `max_message_bytes` bounds one reassembled request; `vocab_size` (when known) makes the codec
    reject token ids outside [0, vocab_size); `wire_dtype` ("fp32", "bf16", "fp16") is the dtype
    of the boundary tensors this server sends back.
    """

    def __init__(
        self,
        handler: PeerHandler,
        host: str = "127.0.0.1",
        port: int = 0,
        max_workers: int = 32,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        vocab_size: int | None = None,
        wire_dtype: str = "fp32",
        interceptors: Iterable[grpc.ServerInterceptor] = (),  # e.g. peer.net.transport.gate.Gate
    ) -> None:
        missing = [m for m in HANDLER_METHODS if not callable(getattr(handler, m, None))]
        if missing:
            raise TypeError(f"{type(handler).__name__} does not implement PeerHandler: missing {', '.join(missing)}")
        tensors.wire_dtype(wire_dtype)  # ConfigError early on a bad setting
        self._host = host
        self._limits = WireLimits(max_message_bytes=max_message_bytes, vocab_size=vocab_size)
        self._servicer = _Servicer(handler, self._limits, wire_dtype)
        self._executor = ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="peer-grpc")
        options = [
            ("grpc.max_receive_message_length", framing.GRPC_MESSAGE_LIMIT),
            ("grpc.max_send_message_length", framing.GRPC_MESSAGE_LIMIT),
            ("grpc.so_reuseport", 0),  # a busy port is an error, not a silently shared one
        ]
        self._server = grpc.server(self._executor, options=options, interceptors=list(interceptors))
        service, handlers = _method_handlers(self._servicer)
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
        self._server.add_registered_method_handlers(service, handlers)
        bind = format_address(host, port)
        try:
            self._port: int = self._server.add_insecure_port(bind)
        except RuntimeError as exc:
            self._executor.shutdown(wait=False)
            raise NetworkError(f"cannot listen on {bind} ({exc}); choose a free port or another host") from None
        if self._port == 0:
            self._executor.shutdown(wait=False)
            raise NetworkError(f"cannot listen on {bind}; choose a free port or another host")
        self._server.start()
        self._stopped = False
        log.info("peer data plane listening on %s", self.address)

    @property
    def port(self) -> int:
        return self._port

    @property
    def address(self) -> str:
        return format_address(self._host, self._port)

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop accepting calls, let running ones finish for up to `grace_s`, then cancel them."""
        if self._stopped:
            return
        self._stopped = True
        t0 = time.monotonic()
        self._server.stop(grace_s).wait(grace_s + 5.0)
        idle = self._servicer.wait_idle(max(0.0, grace_s - (time.monotonic() - t0)) + 1.0)
        if not idle:
            log.warning(
                "peer server %s stopped with handler calls still running; they finish in the background", self.address
            )
        self._executor.shutdown(wait=idle, cancel_futures=True)
        log.info("peer data plane on %s stopped", self.address)

    def __enter__(self) -> PeerServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

"""PeerClient: synchronous calls to one peer's data plane (service `peer.v1.Peer`).

One method per RPC, taking and returning `peer.net.transport.messages` dataclasses. Every call has a
deadline (`timeout_s`, per call overridable) covering all its attempts. Only idempotent reads
(get_payload, get_state, get_artifact, info) are retried, and only on UNAVAILABLE, at most
`retries` times with exponential backoff inside the deadline; forward/backward/step are never
retried here (the pipeline decides whether to replay them on another peer).

Errors: timeouts and unreachable peers -> `NetworkError`; a status answered by the peer ->
`RemoteError` (`NotFoundError` for NOT_FOUND); a malformed or invalid reply -> `TransportError`.
Each message names the peer address and the method.

Byte counters (`stats()`): protobuf bytes handed to / received from gRPC per method, chunk framing
included, i.e. for a streamed message `framing.framed_size(codec.encoded_size(msg))`.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any, BinaryIO, TypeVar

import grpc

from peer.errors import NetworkError
from peer.net import prometheus
from peer.net.transport import blobs, codec, dialer, framing, tensors
from peer.net.transport import peer_pb2 as pb
from peer.net.transport import peer_pb2_grpc as pb_grpc
from peer.net.transport.errors import NotFoundError, RemoteError, TransportError
from peer.net.transport.messages import (
    ArtifactRequest,
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    PayloadRequest,
    RangesReply,
    StateReply,
    StateRequest,
    StepReply,
    StepRequest,
)
from peer.net.transport.tensors import WireLimits
from peer.net.transport.trailers import refusal_from_metadata

log = logging.getLogger(__name__)

DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
T = TypeVar("T")
_NETWORK_CODES = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)


class PeerClient:
    """Calls to the peer at `address` ("host:port").

    `max_message_bytes` bounds one reassembled reply; `wire_dtype` ("fp32", "bf16", "fp16") is the
    dtype of boundary tensors this client sends; `vocab_size` is passed to reply validation.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.2,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        wire_dtype: str = "fp32",
        vocab_size: int | None = None,
        outbound: dialer.Outbound | None = None,
    ) -> None:
        tensors.wire_dtype(wire_dtype)  # ConfigError early on a bad setting
        self.address = address
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.wire_dtype = wire_dtype
        self._limits = WireLimits(max_message_bytes=max_message_bytes, vocab_size=vocab_size)
        self._channel = dialer.open_channel(  # routes, admission proofs, caps: peer.net.transport.dialer
            address,
            options=[
                ("grpc.max_receive_message_length", framing.GRPC_MESSAGE_LIMIT),
                ("grpc.max_send_message_length", framing.GRPC_MESSAGE_LIMIT),
            ],
            outbound=outbound,
        )
        self._stub = pb_grpc.PeerStub(self._channel)  # type: ignore[no-untyped-call]  # generated, unannotated
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._sent: Counter[str] = Counter()
        self._received: Counter[str] = Counter()
        self._calls: Counter[str] = Counter()
        self._retried: Counter[str] = Counter()
        self._failed: Counter[str] = Counter()

    # ------------------------------------------------------------------ RPCs
    def forward(self, request: ForwardRequest, timeout_s: float | None = None) -> ForwardReply:
        reply: ForwardReply
        if request.defer_norms:
            reply = self._forward_deferred(request, timeout_s)
        else:
            reply = self._streamed("forward", self._stub.Forward, request, pb.ForwardReply, timeout_s)
        try:
            codec.check_forward_reply(reply, request)
        except TransportError as exc:
            self._fail("forward", str(exc))
        return reply

    def backward(self, request: BackwardRequest, timeout_s: float | None = None) -> BackwardReply:
        reply: BackwardReply = self._streamed("backward", self._stub.Backward, request, pb.BackwardReply, timeout_s)
        if reply.grad is not None and tuple(reply.grad.shape[:2]) != tuple(request.grad.shape[:2]):
            shape = list(reply.grad.shape)
            self._fail("backward", f"invalid BackwardReply.grad: shape {shape} does not match the sent (b, L)")
        return reply

    def step(self, request: StepRequest, timeout_s: float | None = None) -> StepReply:
        reply: StepReply = self._unary("step", self._stub.Step, request, timeout_s, idempotent=False)
        return reply

    def get_payload(self, request: PayloadRequest, timeout_s: float | None = None) -> bytes:
        payload: bytes = self._unary_streamed("get_payload", self._stub.GetPayload, request, pb.Blob, timeout_s)
        return payload

    def get_ranges(self, request: PayloadRequest, timeout_s: float | None = None) -> RangesReply:
        """Parts or shards of a ranges round (a PART or SHARD `request`): the Blob's bytes, decoded."""
        data = self.get_payload(request, timeout_s)
        try:
            reply: RangesReply = codec.from_bytes(pb.RangesReply, data, self._limits)
        except TransportError as exc:
            self._fail("get_payload", str(exc))
        return reply

    def get_state(self, request: StateRequest, timeout_s: float | None = None) -> StateReply:
        reply: StateReply = self._unary_streamed("get_state", self._stub.GetState, request, pb.StateReply, timeout_s)
        return reply

    def get_artifact(self, request: ArtifactRequest, timeout_s: float | None = None) -> bytes:
        artifact: bytes = self._unary_streamed("get_artifact", self._stub.GetArtifact, request, pb.Blob, timeout_s)
        return artifact

    def get_artifact_into(
        self, request: ArtifactRequest, sink: BinaryIO, size: int, timeout_s: float | None = None
    ) -> int:
        """Stream the `size` bytes of an artefact from `request.offset` on into `sink` as they arrive
        (never held whole; peer.net.transport.blobs); returns the bytes written. Not retried: what
        reached `sink` stays there, and the caller resumes from it. TransportError when the peer
        sends another size than `size`."""
        method = "get_artifact"
        msg = self._check(lambda: codec.encode(request, self.wire_dtype), method)

        def attempt(timeout: float) -> int:
            self._count(self._sent, method, msg.ByteSize())
            call = self._stub.GetArtifact(msg, timeout=timeout)
            try:
                return blobs.write_blob(self._counted_in(method, call), sink, size)
            except TransportError:
                call.cancel()
                raise

        written: int = self._call(method, attempt, timeout_s, idempotent=False)
        return written

    def info(self, timeout_s: float | None = None) -> dict[str, Any]:
        info: dict[str, Any] = self._unary("info", self._stub.Info, pb.InfoRequest(), timeout_s, idempotent=True)
        return info

    # ----------------------------------------------------------- bookkeeping
    def stats(self) -> dict[str, dict[str, int]]:
        """Snapshot of per-method counters: bytes_sent, bytes_received, calls, retries, failures."""
        with self._lock:
            return {
                "bytes_sent": dict(self._sent),
                "bytes_received": dict(self._received),
                "calls": dict(self._calls),
                "retries": dict(self._retried),
                "failures": dict(self._failed),
            }

    @property
    def bytes_sent(self) -> dict[str, int]:
        return self.stats()["bytes_sent"]

    @property
    def bytes_received(self) -> dict[str, int]:
        return self.stats()["bytes_received"]

    def close(self) -> None:
        """Cancel running calls and release the channel; later calls raise NetworkError."""
        self._closed.set()
        self._channel.close()

    def __enter__(self) -> PeerClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --------------------------------------------------------------- helpers
    def _count(self, counter: Counter[str], method: str, n: int) -> None:
        with self._lock:
            counter[method] += n

    def _counted_out(self, method: str, chunks: Iterable[pb.Chunk]) -> Iterator[pb.Chunk]:
        for chunk in chunks:
            n = framing.chunk_size(len(chunk.data), chunk.last)
            self._count(self._sent, method, n)
            prometheus.count_bytes(method, self.address, sent=n)
            yield chunk

    def _counted_in(self, method: str, chunks: Iterable[pb.Chunk]) -> Iterator[pb.Chunk]:
        for chunk in chunks:
            n = framing.chunk_size(len(chunk.data), chunk.last)
            self._count(self._received, method, n)
            prometheus.count_bytes(method, self.address, received=n)
            yield chunk

    def _streamed(
        self, method: str, rpc: Callable[..., Any], request: Any, reply_type: type, timeout_s: float | None
    ) -> Any:
        data = self._check(lambda: codec.to_bytes(request, self.wire_dtype), method)

        def attempt(timeout: float) -> Any:
            call = rpc(self._counted_out(method, framing.split(data)), timeout=timeout)
            return self._receive(method, call, reply_type)

        return self._call(method, attempt, timeout_s, idempotent=False)

    def _forward_deferred(self, request: ForwardRequest, timeout_s: float | None) -> ForwardReply:
        """A `defer_norms` forward: the reply as soon as it arrives, with `late` reading the Σ‖g‖²
        the stage sends after it on the same stream (a peer that put them in the reply sends none)."""
        method = "forward"
        data = self._check(lambda: codec.to_bytes(request, self.wire_dtype), method)

        def attempt(timeout: float) -> ForwardReply:
            call = self._stub.Forward(self._counted_out(method, framing.split(data)), timeout=timeout)
            chunks = self._counted_in(method, call)
            reply: ForwardReply = self._receive(method, call, pb.ForwardReply, chunks)
            if reply.sq_norms or reply.grad_sq_norm is not None or reply.loss is None:
                call.cancel()
                return reply
            return dataclasses.replace(reply, late=lambda: self._late_norms(chunks, call, timeout))

        return self._call(method, attempt, timeout_s, idempotent=False)

    def _late_norms(self, chunks: Iterator[pb.Chunk], call: Any, timeout: float) -> tuple[float, ...]:
        """The second reply of a `defer_norms` forward (Σ‖g‖² only), within the call's deadline."""
        try:
            raw = framing.join(chunks, self._limits.max_message_bytes, "ForwardReply after the answer")
            return codec.late_norms_from_bytes(raw, self._limits)
        except grpc.RpcError as exc:
            self._count(self._failed, "forward", 1)
            raise self._error("forward", exc, timeout) from None
        except TransportError as exc:
            self._count(self._failed, "forward", 1)
            call.cancel()
            raise TransportError(f"peer {self.address} forward: Σ‖g‖² after the reply: {exc}") from None

    def _unary_streamed(
        self, method: str, rpc: Callable[..., Any], request: Any, reply_type: type, timeout_s: float | None
    ) -> Any:
        msg = self._check(lambda: codec.encode(request, self.wire_dtype), method)

        def attempt(timeout: float) -> Any:
            self._count(self._sent, method, msg.ByteSize())
            return self._receive(method, rpc(msg, timeout=timeout), reply_type)

        return self._call(method, attempt, timeout_s, idempotent=True)

    def _unary(
        self, method: str, rpc: Callable[..., Any], request: Any, timeout_s: float | None, idempotent: bool
    ) -> Any:
        if isinstance(request, pb.InfoRequest):
            msg = request
        else:
            msg = self._check(lambda: codec.encode(request, self.wire_dtype), method)

        def attempt(timeout: float) -> Any:
            self._count(self._sent, method, msg.ByteSize())
            reply = rpc(msg, timeout=timeout)
            self._count(self._received, method, reply.ByteSize())
            return codec.decode(reply, self._limits)

        return self._call(method, attempt, timeout_s, idempotent=idempotent)

    def _receive(self, method: str, call: Any, reply_type: type, chunks: Iterator[pb.Chunk] | None = None) -> Any:
        """One reply from `call`, read from `chunks` (its counted stream; made here when None)."""
        try:
            what = f"{reply_type.__name__} reply"
            chunks = self._counted_in(method, call) if chunks is None else chunks
            raw = framing.join(chunks, self._limits.max_message_bytes, what)
        except TransportError:
            call.cancel()
            raise
        return codec.from_bytes(reply_type, raw, self._limits)

    def _call(self, method: str, attempt: Callable[[float], T], timeout_s: float | None, idempotent: bool) -> T:
        """`_attempt_call`, its latency and outcome observed for `peer join --metrics-port`."""
        started, ok = time.monotonic(), False
        try:
            out = self._attempt_call(method, attempt, timeout_s, idempotent)
            ok = True
            return out
        finally:
            prometheus.observe_rpc(method, time.monotonic() - started, ok)

    def _attempt_call(self, method: str, attempt: Callable[[float], T], timeout_s: float | None, idempotent: bool) -> T:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        self._count(self._calls, method, 1)
        n_retries = 0
        while True:
            if self._closed.is_set():
                self._count(self._failed, method, 1)
                raise NetworkError(f"peer {self.address} {method}: the client was closed")
            try:
                return attempt(max(0.0, deadline - time.monotonic()))
            except grpc.RpcError as exc:
                code = exc.code()
                delay = self.backoff_s * (2**n_retries)
                if (
                    idempotent
                    and code == grpc.StatusCode.UNAVAILABLE
                    and n_retries < self.retries
                    and time.monotonic() + delay < deadline
                ):
                    n_retries += 1
                    self._count(self._retried, method, 1)
                    log.info(
                        "peer %s %s unavailable (%s); retry %d/%d in %.2fs",
                        self.address,
                        method,
                        exc.details(),
                        n_retries,
                        self.retries,
                        delay,
                    )
                    self._closed.wait(delay)
                    continue
                self._count(self._failed, method, 1)
                raise self._error(method, exc, timeout) from None
            except TransportError as exc:
                self._count(self._failed, method, 1)
                if isinstance(exc, RemoteError):
                    raise
                raise TransportError(f"peer {self.address} {method}: {exc}") from None

    def _error(self, method: str, exc: grpc.RpcError, timeout: float) -> Exception:
        """The PeerError for a failed call: NetworkError for the network's codes, else RemoteError
        (NotFoundError) with the typed refusal the peer sent in the trailing metadata, if any."""
        code, details = exc.code(), exc.details() or ""
        where = f"peer {self.address} {method}"
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return NetworkError(f"{where}: no answer within {timeout:.1f}s; the peer is overloaded or unreachable")
        if code in _NETWORK_CODES:
            return NetworkError(
                f"{where}: {code.name.lower()} ({details}); check that the peer is running and reachable"
            )
        cls = NotFoundError if code == grpc.StatusCode.NOT_FOUND else RemoteError
        trailers = exc.trailing_metadata() if isinstance(exc, grpc.Call) else None
        return cls(
            f"{where}: {code.name}: {details}",
            address=self.address,
            method=method,
            code=code.name,
            refusal=refusal_from_metadata(trailers),
        )

    def _check(self, fn: Callable[[], T], method: str) -> T:
        """Run a local encode/decode step, naming the peer and method in a TransportError."""
        try:
            return fn()
        except TransportError as exc:
            raise TransportError(f"peer {self.address} {method}: {exc}") from None

    def _fail(self, method: str, message: str) -> None:
        self._count(self._failed, method, 1)
        raise TransportError(f"peer {self.address} {method}: {message}")

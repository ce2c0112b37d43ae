"""Reverse streams: serving calls for a peer that cannot be dialled, over a stream it opened.

The hidden peer N runs a `ReverseLink` to a peer X that can be dialled: one long `Tunnel.Reverse`
call (protos/peer.proto). X's `TunnelHub` keeps it under N's peer id. A call for N reaches X with
metadata `peer-target: N` (`peer.net.transport.dialer`); X's hub sends its Frames down the stream;
N's link replays the call against N's own server on its local address, so N's admission check,
caps and validation apply to it exactly as to a direct call, and streams the reply's Frames back;
the last Frame carries the status and its typed refusal, if any (`peer.net.transport.trailers`),
which X answers to the caller. X forwards calls of other peers only when it offers relaying
(`relay=True`, `--relay`, counted against its relay byte cap); without that only X's own calls
use the stream ("reverse" connectivity).

`TunnelHub.dial_back` answers the reachability check: it dials the address a joining peer
announces (Peer.Info, short deadline) and says whether it answered and as whom.

Invariants: every wait has a deadline (a call's own, `KEEPALIVE_S` between frames of an idle
stream, 3× that before a silent stream is dropped); a closed stream fails its calls in flight with
UNAVAILABLE; queues are bounded, so a slow hidden peer slows its callers instead of filling memory;
a second stream from the same peer id replaces the first.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, NoReturn

import grpc

from peer.errors import PeerError
from peer.net.ratelimit import Link
from peer.net.transport import dialer
from peer.net.transport import peer_pb2 as pb
from peer.net.transport.trailers import REFUSAL_KEY, refusal_pb_from_metadata

log = logging.getLogger(__name__)

REVERSE_METHOD = "/peer.v1.Tunnel/Reverse"
DIAL_BACK_METHOD = "/peer.v1.Tunnel/DialBack"
KEEPALIVE_S = 5.0
DIAL_BACKS = 4  # reachability checks a peer runs at once
_QUEUE = 64  # frames buffered per direction
_PEER_METHODS = {f"/peer.v1.Peer/{m.name}": m for m in pb.DESCRIPTOR.services_by_name["Peer"].methods}
_CODES = {code.value[0]: code for code in grpc.StatusCode}
_DROP_KEYS = (dialer.TARGET_KEY, "user-agent", ":authority")


def method_kind(method: str) -> tuple[bool, bool] | None:
    """(client streaming, server streaming) of a Peer method; None for any other name."""
    m = _PEER_METHODS.get(method)
    return None if m is None else (m.client_streaming, m.server_streaming)


class _Stream:
    """Hub side of one hidden peer's stream: frames out, one reply queue per call in flight."""

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.out: queue.Queue[pb.Frame | None] = queue.Queue(maxsize=_QUEUE)
        self.calls: dict[int, queue.Queue[pb.Frame | None]] = {}
        self.closed = threading.Event()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def open_call(self) -> tuple[int, queue.Queue[pb.Frame | None]]:
        with self._lock:
            call = next(self._ids)
            self.calls[call] = queue.Queue(maxsize=_QUEUE)
            return call, self.calls[call]

    def end_call(self, call: int) -> None:
        with self._lock:
            self.calls.pop(call, None)

    def send(self, frame: pb.Frame, timeout_s: float | None) -> None:
        if self.closed.is_set():
            raise PeerError(f"the reverse stream of {self.peer_id[:12]} is closed")
        try:
            self.out.put(frame, timeout=timeout_s)
        except queue.Full:
            raise PeerError(f"the reverse stream of {self.peer_id[:12]} is not draining") from None

    def dispatch(self, frame: pb.Frame) -> None:
        with self._lock:
            q = self.calls.get(frame.call)
        if q is not None:
            q.put(frame)

    def close(self) -> None:
        self.closed.set()
        with self._lock:
            calls = list(self.calls.values())
        for q in [*calls]:
            q.put(None)
        with contextlib.suppress(queue.Full):
            self.out.put_nowait(None)


def _abort(context: grpc.ServicerContext, code: grpc.StatusCode, details: str) -> NoReturn:
    context.abort(code, details)
    raise AssertionError("grpc.ServicerContext.abort returned")  # never reached


def _host_of(peer: str) -> str:
    """'ipv4:1.2.3.4:5678' -> '1.2.3.4'; 'ipv6:[::1]:5' -> '::1'."""
    rest = peer.split(":", 1)[1] if ":" in peer else peer
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")


class TunnelHub:
    """The dialled side: holds hidden peers' streams and forwards calls over them."""

    def __init__(
        self, peer_id: str, relay: bool = False, link: Link | None = None, outbound: dialer.Outbound | None = None
    ) -> None:
        """`outbound`: this peer's proof and link for the dial-backs it makes."""
        self.peer_id, self.relay = peer_id, relay
        self.link = link or (outbound.link if outbound else Link())
        self.outbound = outbound or dialer.Outbound(link=self.link)
        self.local_address = ""  # this server's own address, set once it listens
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()
        self._dials = threading.BoundedSemaphore(DIAL_BACKS)
        self.forwarded = 0  # calls forwarded over a stream
        self.relayed_for_others = 0

    def held(self) -> list[str]:
        with self._lock:
            return sorted(self._streams)

    # ------------------------------------------------------------------ the stream itself
    def reverse(
        self, caller: str | None, frames: Iterator[pb.Frame], context: grpc.ServicerContext
    ) -> Iterator[pb.Frame]:
        if not caller:
            _abort(context, grpc.StatusCode.INVALID_ARGUMENT, "a reverse stream needs the caller's peer-id metadata")
            return
        stream = _Stream(caller)
        with self._lock:
            old, self._streams[caller] = self._streams.get(caller), stream
        if old is not None:
            old.close()
        if self.local_address:
            dialer.register_local(caller, self.local_address)
        log.info("peer %s serves its calls over a reverse stream to this peer", caller[:12])

        def read() -> None:
            try:
                for frame in frames:
                    if frame.call:
                        stream.dispatch(frame)
            except grpc.RpcError:
                pass
            finally:
                stream.close()

        threading.Thread(target=read, name=f"reverse-{caller[:8]}", daemon=True).start()
        context.add_callback(stream.close)
        try:
            while not stream.closed.is_set():
                try:
                    frame = stream.out.get(timeout=KEEPALIVE_S)
                except queue.Empty:
                    frame = pb.Frame(call=0)
                if frame is None:
                    return
                yield frame
        finally:
            stream.close()
            with self._lock:
                if self._streams.get(caller) is stream:
                    del self._streams[caller]
                    dialer.unregister_local(caller, self.local_address)
            log.info("reverse stream of %s closed", caller[:12])

    # ------------------------------------------------------------------ calls for a hidden peer
    def forward(
        self,
        method: str,
        target: str,
        caller: str | None,
        metadata: tuple[tuple[str, str], ...],
        request: Any,
        context: grpc.ServicerContext,
    ) -> Iterator[bytes]:
        """Run one call of `method` on `target` over its stream; yields the reply messages."""
        kind = method_kind(method)
        with self._lock:
            stream = self._streams.get(target)
        if kind is None:
            _abort(context, grpc.StatusCode.UNIMPLEMENTED, f"{method} cannot be forwarded")
        if stream is None:
            _abort(
                context,
                grpc.StatusCode.UNAVAILABLE,
                f"peer {target[:12]} keeps no reverse stream to this peer; ask it again later",
            )
        assert kind is not None and stream is not None
        for_other = caller != self.peer_id
        if for_other and not self.relay:
            _abort(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                f"this peer does not relay for others (caller {str(caller)[:12]}); peer {target[:12]} needs a relay",
            )
        self.forwarded += 1
        self.relayed_for_others += int(for_other)
        remaining = context.time_remaining()
        deadline = time.monotonic() + (remaining if remaining is not None else 3600.0)
        call, replies = stream.open_call()
        md = [pb.Metadatum(key=k, value=v) for k, v in metadata if k not in _DROP_KEYS and not k.startswith("grpc-")]
        bucket = self.link.relay if for_other else None
        done = threading.Event()

        def cancel() -> None:
            if not done.is_set():
                with contextlib.suppress(PeerError):
                    stream.send(pb.Frame(call=call, cancel=True), timeout_s=1.0)

        context.add_callback(cancel)
        try:
            stream.send(
                pb.Frame(call=call, method=method, metadata=md, timeout_s=max(0.0, deadline - time.monotonic())), 5.0
            )
            items = request if kind[0] else iter((request,))
            pump = threading.Thread(
                target=self._pump, args=(stream, call, items, bucket, deadline), name="reverse-pump", daemon=True
            )
            pump.start()
            while True:
                try:
                    frame = replies.get(timeout=max(0.01, deadline - time.monotonic()))
                except queue.Empty:
                    _abort(context, grpc.StatusCode.DEADLINE_EXCEEDED, f"peer {target[:12]} did not answer in time")
                if frame is None:
                    _abort(context, grpc.StatusCode.UNAVAILABLE, f"the reverse stream of {target[:12]} closed")
                if frame.data:
                    if bucket is not None:
                        bucket.acquire(len(frame.data))
                    yield frame.data
                if frame.end:
                    if frame.code:
                        if frame.HasField("refusal"):  # the hidden peer's typed refusal, passed on unchanged
                            context.set_trailing_metadata(((REFUSAL_KEY, frame.refusal.SerializeToString()),))
                        _abort(context, _CODES.get(frame.code, grpc.StatusCode.UNKNOWN), frame.details)
                    return
        finally:
            done.set()
            stream.end_call(call)

    @staticmethod
    def _pump(stream: _Stream, call: int, items: Iterator[bytes], bucket: Any, deadline: float) -> None:
        try:
            for data in items:
                if bucket is not None:
                    bucket.acquire(len(data))
                stream.send(pb.Frame(call=call, data=data), max(0.01, deadline - time.monotonic()))
            stream.send(pb.Frame(call=call, end=True), max(0.01, deadline - time.monotonic()))
        except (PeerError, grpc.RpcError) as exc:
            log.debug("forwarding call %d to %s stopped: %s", call, stream.peer_id[:12], exc)

    # ------------------------------------------------------------------ reachability
    def dial_back(
        self, request: pb.DialBackRequest, context: grpc.ServicerContext, timeout_s: float = 5.0
    ) -> pb.DialBackReply:
        """Dial `request.address` (Peer.Info) and say whether it answered and as whom."""
        from peer.net.transport.client import PeerClient  # the client module imports the dialer
        from peer.net.transport.errors import RemoteError

        seen = _host_of(context.peer())
        address = request.address
        if "@" in address or ":" not in address or len(address) > 300:
            return pb.DialBackReply(ok=False, detail=f"{address!r} is not host:port", seen_host=seen, relay=self.relay)
        if not self._dials.acquire(timeout=timeout_s):  # a few at a time: no scanning through this peer
            _abort(
                context, grpc.StatusCode.RESOURCE_EXHAUSTED, "too many reachability checks at once; ask another peer"
            )
        try:
            try:
                with PeerClient(address, timeout_s=timeout_s, retries=0, outbound=self.outbound) as client:
                    info = client.info()
                return pb.DialBackReply(ok=True, peer_id=str(info.get("peer_id", "")), seen_host=seen, relay=self.relay)
            except RemoteError as exc:  # it answered (e.g. UNAUTHENTICATED for this dialler): reachable
                return pb.DialBackReply(ok=True, detail=str(exc), seen_host=seen, relay=self.relay)
            except PeerError as exc:
                return pb.DialBackReply(ok=False, detail=str(exc), seen_host=seen, relay=self.relay)
        finally:
            self._dials.release()


def ask_dial_back(
    hub_address: str, my_address: str, timeout_s: float = 20.0, outbound: dialer.Outbound | None = None
) -> pb.DialBackReply:
    """Ask the peer at `hub_address` to dial `my_address`; `PeerError` if it cannot be asked."""
    with dialer.open_channel(hub_address, outbound=outbound) as channel:
        rpc = channel.unary_unary(
            DIAL_BACK_METHOD,
            request_serializer=pb.DialBackRequest.SerializeToString,
            response_deserializer=pb.DialBackReply.FromString,
        )
        try:
            reply: pb.DialBackReply = rpc(pb.DialBackRequest(address=my_address), timeout=timeout_s)
        except grpc.RpcError as exc:
            raise PeerError(
                f"{hub_address} could not run the reachability check: {exc.code().name} {exc.details()}"
            ) from None
        return reply


class ReverseLink:
    """The hidden side: keeps one reverse stream to `hub_address` open and serves calls over it
    by replaying them against this peer's own server at `local_address`."""

    def __init__(
        self,
        hub_address: str,
        local_address: str,
        on_change: Callable[[], None] | None = None,
        outbound: dialer.Outbound | None = None,
    ) -> None:
        self.hub_address, self.local_address = hub_address, local_address
        self.outbound = outbound
        self.on_change = on_change
        self.connected = threading.Event()
        self.served = 0
        self.last_error = ""
        self._stop = threading.Event()
        self._call: Any = None
        self._local = grpc.insecure_channel(local_address)
        self._thread = threading.Thread(target=self._run, name=f"reverse-link-{hub_address}", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        call = self._call
        if call is not None:
            call.cancel()
        self._thread.join(timeout=5.0)
        self._local.close()

    def _set_connected(self, up: bool) -> None:
        if up != self.connected.is_set():
            (self.connected.set if up else self.connected.clear)()
            if self.on_change is not None:
                self.on_change()

    def _run(self) -> None:
        backoff = 0.5
        while not self._stop.is_set():
            try:
                self._session()
                backoff = 0.5
            except Exception as exc:  # noqa: BLE001 - any failure ends this stream; the loop reconnects
                self.last_error = str(exc)
                log.debug("reverse stream to %s ended: %s", self.hub_address, exc)
            self._set_connected(False)
            self._stop.wait(backoff)
            backoff = min(backoff * 2, 10.0)

    def _session(self) -> None:
        out: queue.Queue[pb.Frame | None] = queue.Queue(maxsize=_QUEUE)
        calls: dict[int, queue.Queue[pb.Frame | None]] = {}
        last_seen = [time.monotonic()]

        def outgoing() -> Iterator[pb.Frame]:
            yield pb.Frame(call=0)
            while not self._stop.is_set():
                try:
                    frame = out.get(timeout=KEEPALIVE_S)
                except queue.Empty:
                    frame = pb.Frame(call=0)
                if frame is None:
                    return
                yield frame

        with dialer.open_channel(self.hub_address, outbound=self.outbound) as channel:
            rpc = channel.stream_stream(
                REVERSE_METHOD, request_serializer=pb.Frame.SerializeToString, response_deserializer=pb.Frame.FromString
            )
            self._call = call = rpc(outgoing())

            def watchdog() -> None:  # a silent hub (dead link, lost NAT mapping) is dropped
                while not self._stop.wait(KEEPALIVE_S) and call.is_active():
                    if time.monotonic() - last_seen[0] > 3 * KEEPALIVE_S:
                        call.cancel()
                        return

            threading.Thread(target=watchdog, name="reverse-watchdog", daemon=True).start()
            try:
                for frame in call:
                    last_seen[0] = time.monotonic()
                    self._set_connected(True)
                    if not frame.call:
                        continue
                    if frame.method:
                        q: queue.Queue[pb.Frame | None] = queue.Queue(maxsize=_QUEUE)
                        calls[frame.call] = q
                        threading.Thread(
                            target=self._serve, args=(frame, q, out, calls), name="reverse-call", daemon=True
                        ).start()
                    elif frame.call in calls:
                        calls[frame.call].put(frame)
            finally:
                for q in list(calls.values()):
                    q.put(None)
                with contextlib.suppress(queue.Full):
                    out.put_nowait(None)

    def _serve(
        self,
        first: pb.Frame,
        inbox: queue.Queue[pb.Frame | None],
        out: queue.Queue[pb.Frame | None],
        calls: dict[int, queue.Queue[pb.Frame | None]],
    ) -> None:
        """Replay one call against this peer's own server; send its replies and status back."""
        call_id, kind = first.call, method_kind(first.method)
        timeout = first.timeout_s or None
        metadata = tuple((m.key, m.value) for m in first.metadata)
        local_call: list[Any] = [None]

        def requests() -> Iterator[bytes]:
            while True:
                frame = inbox.get(timeout=timeout or 3600.0)
                if frame is None or frame.cancel:
                    if local_call[0] is not None:
                        local_call[0].cancel()
                    return
                if frame.data:
                    yield frame.data
                if frame.end:
                    return

        def send(frame: pb.Frame) -> None:
            out.put(frame, timeout=timeout or 3600.0)

        try:
            if kind is None:
                raise _Status(grpc.StatusCode.UNIMPLEMENTED, f"{first.method} is not a Peer method")
            client_streaming, server_streaming = kind
            name = first.method
            if client_streaming:
                request: Any = requests()
            else:
                request = next(requests(), b"")
            factory = {
                (False, False): self._local.unary_unary,
                (False, True): self._local.unary_stream,
                (True, False): self._local.stream_unary,
                (True, True): self._local.stream_stream,
            }[(client_streaming, server_streaming)]
            rpc = factory(name, request_serializer=None, response_deserializer=None)
            if server_streaming:
                local_call[0] = rpc(request, timeout=timeout, metadata=metadata)
                for data in local_call[0]:
                    send(pb.Frame(call=call_id, data=data))
            else:
                send(pb.Frame(call=call_id, data=rpc(request, timeout=timeout, metadata=metadata)))
            send(pb.Frame(call=call_id, end=True))
            self.served += 1
        except grpc.RpcError as exc:
            code = exc.code() or grpc.StatusCode.UNKNOWN
            refusal = refusal_pb_from_metadata(exc.trailing_metadata() if isinstance(exc, grpc.Call) else None)
            send(pb.Frame(call=call_id, end=True, code=code.value[0], details=exc.details() or "", refusal=refusal))
        except _Status as exc:
            send(pb.Frame(call=call_id, end=True, code=exc.code.value[0], details=exc.details))
        except queue.Full:
            log.debug("reverse call %d: the stream stopped draining", call_id)
        finally:
            calls.pop(call_id, None)


class _Status(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details

"""A real PeerServer on 127.0.0.1:0 and a real PeerClient: every RPC, errors, deadlines, limits."""

from __future__ import annotations

import logging
import threading

import grpc
import pytest
import torch

from peer.errors import NetworkError, PeerError
from peer.net.transport import (
    ArtifactRequest,
    BackwardReply,
    BackwardRequest,
    ForwardReply,
    ForwardRequest,
    NotFoundError,
    PayloadRequest,
    PeerClient,
    PeerServer,
    RemoteError,
    StateReply,
    StateRequest,
    StepReply,
    StepRequest,
    TransportError,
    encoded_size,
    framed_size,
)
from peer.net.transport import peer_pb2 as pb
from peer.net.transport import peer_pb2_grpc as pb_grpc
from peer.net.transport.framing import CHUNK_BYTES

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

VOCAB = 64
PAYLOAD = bytes(range(256)) * (3 * CHUNK_BYTES // 256)  # 3 MiB: four chunks with the framing


class ToyStage:
    """Stages 1 and 2 of a toy pipeline: x -> 2x; the last stage (targets given) answers loss and grad 3x."""

    def __init__(self):
        self.release = threading.Event()  # lets a "slow" forward finish
        self.slow_entered = threading.Event()
        self.slow_answered = threading.Event()  # a "slow" forward returned (only after `release`)
        self.steps: list[StepRequest] = []
        self.state = {"w": torch.randn(512, 600, generator=torch.Generator().manual_seed(0))}  # 1.2 MB

    def forward(self, req: ForwardRequest) -> ForwardReply:
        if req.pipeline_id == "slow":
            self.slow_entered.set()
            self.release.wait(30)
            self.slow_answered.set()
        if req.pipeline_id == "boom":
            raise RuntimeError("simulated bug")
        if req.stage not in (1, 2):
            raise PeerError(f"this peer holds stages 1 and 2, not {req.stage}")
        x = req.hidden.float()
        if req.targets is not None:
            return ForwardReply(loss=float(x.square().mean()), grad=3 * x if req.train else None)
        return ForwardReply(hidden=2 * x)

    def backward(self, req: BackwardRequest) -> BackwardReply:
        return BackwardReply(grad=2 * req.grad.float())

    def step(self, req: StepRequest) -> StepReply:
        self.steps.append(req)
        return StepReply(ok=True, message=f"stepped {req.outer_step}.{req.inner_step}")

    def get_payload(self, req: PayloadRequest) -> bytes:
        if (req.outer_step, req.stage, req.sender) != (4, 1, "alice"):
            raise NotFoundError(f"no payload of {req.sender} for round {req.outer_step} stage {req.stage} yet")
        return PAYLOAD

    def get_state(self, req: StateRequest) -> StateReply:
        return StateReply(outer_step=4, meta={"stage": req.stage}, tensors=self.state)

    def get_artifact(self, req: ArtifactRequest) -> bytes:
        if req.name != "tokenizer.model":
            raise NotFoundError(f"no artefact {req.name!r} here")
        return b"spm-model-bytes"

    def info(self) -> dict:
        return {"stages": [1, 2], "state": "ready"}


@pytest.fixture
def toy():
    handler = ToyStage()
    server = PeerServer(handler, host="127.0.0.1", port=0, max_message_bytes=2 * CHUNK_BYTES, vocab_size=VOCAB)
    yield server, handler
    handler.release.set()
    server.stop(grace_s=1.0)


def _request(stage=1, b=2, L=5, k=8, targets=False, pipeline_id="p0", train=True) -> ForwardRequest:
    g = torch.Generator().manual_seed(stage)
    return ForwardRequest(
        pipeline_id=pipeline_id,
        microbatch=0,
        outer_step=4,
        inner_step=2,
        stage=stage,
        tokens=torch.randint(0, VOCAB, (b, L), generator=g),
        hidden=torch.randn(b, L, k, generator=g),
        targets=torch.randint(0, VOCAB, (b, L), generator=g) if targets else None,
        train=train,
    )


def test_every_rpc_round_trips(toy):
    server, handler = toy
    assert server.port > 0 and server.address == f"127.0.0.1:{server.port}"
    with PeerClient(server.address, timeout_s=10) as client:
        req = _request()
        reply = client.forward(req)
        assert reply.loss is None and torch.equal(reply.hidden, 2 * req.hidden)

        last = _request(stage=2, targets=True)
        reply = client.forward(last)
        assert reply.hidden is None and reply.loss == pytest.approx(float(last.hidden.square().mean()))
        assert torch.equal(reply.grad, 3 * last.hidden)
        assert client.forward(_request(stage=2, targets=True, train=False)).grad is None

        g = torch.randn(2, 5, 8)
        assert torch.equal(client.backward(BackwardRequest("p0", 0, 4, 2, 1, grad=g)).grad, 2 * g)

        step = client.step(StepRequest("p0", 4, 2, n_microbatches=3, tokens=30))
        assert step.ok and step.message == "stepped 4.2" and handler.steps[-1].tokens == 30

        assert client.get_payload(PayloadRequest(outer_step=4, stage=1, sender="alice")) == PAYLOAD
        state = client.get_state(StateRequest(stage=1))
        assert state.outer_step == 4 and state.meta == {"stage": 1}
        assert torch.equal(state.tensors["w"], handler.state["w"])
        assert client.get_artifact(ArtifactRequest("tokenizer.model")) == b"spm-model-bytes"
        assert client.info() == {"stages": [1, 2], "state": "ready"}

        # Counters are the exact framed protobuf sizes, payload chunked into 1 MiB pieces.
        stats = client.stats()
        assert stats["bytes_received"]["get_payload"] == framed_size(encoded_size(PAYLOAD))
        assert framed_size(encoded_size(PAYLOAD)) > 3 * CHUNK_BYTES
        assert stats["bytes_sent"]["backward"] == framed_size(encoded_size(BackwardRequest("p0", 0, 4, 2, 1, grad=g)))
        assert stats["calls"]["forward"] == 3 and not stats["failures"]


def test_bf16_wire_dtype_halves_the_boundary_bytes(toy):
    server, _ = toy
    req = _request(b=4, L=16, k=32)
    with PeerClient(server.address, wire_dtype="fp32") as c32, PeerClient(server.address, wire_dtype="bf16") as c16:
        r32, r16 = c32.forward(req), c16.forward(req)
        assert torch.equal(r32.hidden, 2 * req.hidden)
        assert torch.equal(r16.hidden, 2 * req.hidden.to(torch.bfloat16).float())  # server replies in fp32
        sent32, sent16 = c32.bytes_sent["forward"], c16.bytes_sent["forward"]
    assert sent16 == framed_size(encoded_size(req, "bf16"))
    assert abs((sent32 - sent16) - req.hidden.numel() * 2) <= 4


def test_handler_errors_become_statuses_and_the_server_keeps_serving(toy):
    server, _ = toy
    with PeerClient(server.address, timeout_s=10) as client:
        with pytest.raises(RemoteError, match="not 3") as err:
            client.forward(_request(stage=3))
        assert err.value.code == "FAILED_PRECONDITION"
        assert server.address in str(err.value) and "forward" in str(err.value)
        with pytest.raises(NotFoundError, match="round 5"):
            client.get_payload(PayloadRequest(outer_step=5, stage=1, sender="alice"))
        with pytest.raises(RemoteError, match="simulated bug") as err:
            client.forward(_request(pipeline_id="boom"))
        assert err.value.code == "INTERNAL"
        with pytest.raises(RemoteError, match="outside") as err:  # token id >= vocab, rejected by the codec
            bad = _request()
            bad.tokens[0, 0] = VOCAB
            client.forward(bad)
        assert err.value.code == "INVALID_ARGUMENT"
        assert client.stats()["failures"]["forward"] == 3
        assert client.info()["state"] == "ready"


def test_deadline_is_honoured(toy):
    server, handler = toy
    with PeerClient(server.address, timeout_s=0.5) as client:
        with pytest.raises(NetworkError, match="no answer within 0.5s"):
            client.forward(_request(pipeline_id="slow"))
        assert handler.slow_entered.is_set()  # the call reached the handler ...
        assert not handler.slow_answered.is_set()  # ... and the client stopped waiting before any answer
        handler.release.set()
        assert client.info(timeout_s=5)["state"] == "ready"


def test_garbage_and_oversized_streams_are_rejected(toy):
    server, _ = toy
    with grpc.insecure_channel(server.address) as channel:
        stub = pb_grpc.PeerStub(channel)

        def status(chunks) -> grpc.StatusCode:
            with pytest.raises(grpc.RpcError) as err:
                list(stub.Forward(iter(chunks), timeout=10))
            return err.value.code()

        assert status([pb.Chunk(data=b"\xff\xfe garbage", last=True)]) == grpc.StatusCode.INVALID_ARGUMENT
        assert status([pb.Chunk(data=b"\x0a\x02p0", last=False)]) == grpc.StatusCode.INVALID_ARGUMENT  # no last chunk
        assert status([]) == grpc.StatusCode.INVALID_ARGUMENT
        too_many = (pb.Chunk(data=bytes(CHUNK_BYTES), last=False) for _ in range(10))
        assert status(too_many) == grpc.StatusCode.INVALID_ARGUMENT  # over the 2 MiB message limit
        assert status([pb.Chunk(data=bytes(4 * CHUNK_BYTES), last=True)]) == grpc.StatusCode.RESOURCE_EXHAUSTED

    with PeerClient(server.address, timeout_s=10) as client:
        with pytest.raises(RemoteError, match="larger than the 2097152-byte message limit"):
            client.forward(_request(b=4, L=256, k=512))  # 2 MiB of fp32 hidden + tokens
        assert torch.equal(client.forward(_request()).hidden, 2 * _request().hidden)

    with PeerClient(server.address, timeout_s=10, max_message_bytes=CHUNK_BYTES) as small:
        with pytest.raises(TransportError, match="larger than"):
            small.get_payload(PayloadRequest(outer_step=4, stage=1, sender="alice"))
        assert small.info()["state"] == "ready"


def test_unreachable_peer_retries_only_idempotent_calls():
    probe = PeerServer(ToyStage(), port=0)
    address = probe.address
    probe.stop(grace_s=0)
    with PeerClient(address, timeout_s=5, retries=2, backoff_s=0.01) as client:
        with pytest.raises(NetworkError, match=f"peer {address} info"):
            client.info()
        with pytest.raises(NetworkError, match=f"peer {address} forward"):
            client.forward(_request())
        stats = client.stats()
    assert stats["retries"] == {"info": 2}
    assert stats["failures"] == {"info": 1, "forward": 1}


def test_stop_leaves_no_threads():
    before = set(threading.enumerate())
    handler = ToyStage()
    server = PeerServer(handler, port=0, max_workers=4)
    with PeerClient(server.address, timeout_s=10) as client:
        assert client.get_payload(PayloadRequest(outer_step=4, stage=1, sender="alice")) == PAYLOAD
        client.forward(_request())
    server.stop(grace_s=1.0)
    server.stop()  # idempotent
    leftover = [t for t in threading.enumerate() if t not in before]
    for t in leftover:
        t.join(timeout=5)
    assert [t.name for t in leftover if t.is_alive()] == []


def test_stop_with_a_call_in_flight_is_bounded_and_the_client_gets_a_network_error():
    handler = ToyStage()
    server = PeerServer(handler, port=0)
    outcome: dict[str, BaseException] = {}
    done = threading.Event()

    def call():
        try:
            with PeerClient(server.address, timeout_s=20) as client:
                client.forward(_request(pipeline_id="slow"))
        except BaseException as exc:  # noqa: BLE001 - recorded and asserted below
            outcome["error"] = exc
        finally:
            done.set()

    caller = threading.Thread(target=call)
    caller.start()
    assert handler.slow_entered.wait(10)
    server.stop(grace_s=0.2)
    assert not handler.slow_answered.is_set()  # stop did not wait for the call in flight (it waits 30 s)
    assert done.wait(10)
    assert isinstance(outcome.get("error"), NetworkError)
    handler.release.set()
    caller.join(10)


def test_a_busy_port_is_an_error():
    first = PeerServer(ToyStage(), port=0)
    try:
        with pytest.raises(NetworkError, match=f"cannot listen on 127.0.0.1:{first.port}"):
            PeerServer(ToyStage(), port=first.port)
    finally:
        first.stop(grace_s=0)


def test_a_client_that_stalls_mid_upload_is_cut_off_quietly(toy, caplog):
    server, _ = toy
    gate = threading.Event()

    def stalled():
        yield pb.Chunk(data=b"\x0a\x02p0", last=False)
        gate.wait(10)

    caplog.set_level("INFO", logger="peer.net.transport.server")
    with grpc.insecure_channel(server.address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            list(pb_grpc.PeerStub(channel).Forward(stalled(), timeout=0.3))
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    gate.set()
    with PeerClient(server.address, timeout_s=10) as client:
        assert client.info()["state"] == "ready"
    server.stop(grace_s=1.0)  # waits for the servicer, so its log record is in
    # Depending on timing gRPC reports the cut-off upload as a cancellation or as a truncated stream;
    # either way it is one INFO line, never a logged traceback.
    assert any("forward from" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]
    assert [r.getMessage() for r in caplog.records if r.levelno >= 30] == []


def test_bytes_that_are_not_the_request_type_are_invalid_argument_and_one_info_line(toy, caplog):
    """grpcio would answer INTERNAL and log an ERROR traceback per request; the codec parses instead."""
    server, _ = toy
    garbage = b"\xff" + b"\x01" * 9  # field number 0x7f.., wire type 7: never valid protobuf
    caplog.set_level("INFO")
    with grpc.insecure_channel(server.address) as channel:
        calls = {
            "Step": lambda: channel.unary_unary("/peer.v1.Peer/Step")(garbage, timeout=10),
            "Info": lambda: channel.unary_unary("/peer.v1.Peer/Info")(garbage, timeout=10),
            **{
                m: lambda m=m: list(channel.unary_stream(f"/peer.v1.Peer/{m}")(garbage, timeout=10))
                for m in ("GetPayload", "GetState", "GetArtifact")
            },
            **{
                m: lambda m=m: list(channel.stream_stream(f"/peer.v1.Peer/{m}")(iter([garbage]), timeout=10))
                for m in ("Forward", "Backward")
            },
        }
        for method, call in calls.items():
            with pytest.raises(grpc.RpcError) as err:
                call()
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (method, err.value.details())
            assert "not a parseable protobuf message" in err.value.details(), method
    with PeerClient(server.address, timeout_s=10) as client:
        assert client.info()["state"] == "ready"
    server.stop(grace_s=1.0)
    rejected = [r for r in caplog.records if r.name == "peer.net.transport.server" and "rejected" in r.getMessage()]
    assert len(rejected) == len(calls) and all(r.levelno == logging.INFO for r in rejected)
    assert [r.getMessage()[:120] for r in caplog.records if r.levelno >= logging.WARNING] == []

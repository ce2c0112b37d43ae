"""The authenticated data plane: a real PeerServer with its Gate on 127.0.0.1, real gRPC calls.

Every method of the Peer and Tunnel services is called without a proof, with a stale one, with a
forged one and with one for another method: each is UNAUTHENTICATED and counted, and the request
(garbage bytes here) is never parsed. Valid proofs get every method through a PeerClient.
"""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest
import torch

from peer.errors import PeerError
from peer.net.transport import (
    ArtifactRequest,
    BackwardRequest,
    PayloadRequest,
    PeerClient,
    PeerServer,
    StateRequest,
    StepRequest,
    auth,
)
from peer.net.transport.dialer import Outbound
from peer.net.transport.gate import Gate
from tests.integration.test_transport import ToyStage, _request

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SECRET = b"correct horse battery staple 0123"
METHODS = {  # full name -> (client streaming, server streaming)
    "/peer.v1.Peer/Forward": (True, True),
    "/peer.v1.Peer/Backward": (True, True),
    "/peer.v1.Peer/Step": (False, False),
    "/peer.v1.Peer/GetPayload": (False, True),
    "/peer.v1.Peer/GetState": (False, True),
    "/peer.v1.Peer/GetArtifact": (False, True),
    "/peer.v1.Peer/Info": (False, False),
    "/peer.v1.Tunnel/Reverse": (True, True),
    "/peer.v1.Tunnel/DialBack": (False, False),
}


def _raw_call(address: str, method: str, metadata: tuple[tuple[str, str], ...]) -> grpc.StatusCode:
    """Call `method` with garbage request bytes; the status code it ends with."""
    client_streaming, server_streaming = METHODS[method]
    with grpc.insecure_channel(address) as channel:
        factory = {
            (False, False): channel.unary_unary,
            (False, True): channel.unary_stream,
            (True, False): channel.stream_unary,
            (True, True): channel.stream_stream,
        }[(client_streaming, server_streaming)]
        rpc = factory(method, request_serializer=None, response_deserializer=None)
        request = iter([b"\xff\xfe not a protobuf"]) if client_streaming else b"\xff\xfe not a protobuf"
        try:
            reply = rpc(request, timeout=10, metadata=metadata)
            if server_streaming:
                list(reply)
        except grpc.RpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


def _serve(verifier: auth.Verifier) -> tuple[PeerServer, Gate, ToyStage]:
    toy = ToyStage()
    gate = Gate("server-peer", verifier=verifier)
    server = PeerServer(toy, vocab_size=64, interceptors=[gate])
    gate.bind(server.address)
    return server, gate, toy


def _bad_proofs(good: auth.Credentials, method: str, wrong: auth.Credentials) -> dict[str, tuple[tuple[str, str], ...]]:
    pairs = dict(good.metadata(method))
    stale_ts = str(int((time.time() - 3600) * 1000))
    stale = auth.Credentials(
        good.mode, good.peer_id, secret=SECRET, key=getattr(good, "_key", None), clock=lambda: time.time() - 3600
    )
    other = "/peer.v1.Peer/Info" if method != "/peer.v1.Peer/Info" else "/peer.v1.Peer/Step"
    return {
        "missing": (),
        "stale": stale.metadata(method),
        "stale-ts-swapped-in": tuple({**pairs, auth.TS_KEY: stale_ts}.items()),
        "forged": wrong.metadata(method),
        "other-method": good.metadata(other),
    }


def test_secret_swarm_refuses_every_method_without_a_valid_proof():
    server, gate, toy = _serve(auth.Verifier("secret", secret=SECRET))
    good = auth.Credentials("secret", "caller-peer", secret=SECRET)
    wrong = auth.Credentials("secret", "caller-peer", secret=b"not the swarm secret at all!!")
    refused = 0
    try:
        for method in METHODS:
            for why, metadata in _bad_proofs(good, method, wrong).items():
                code = _raw_call(server.address, method, metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED, (method, why, code)
                refused += 1
            # a valid proof gets past the gate: the garbage request is now parsed and rejected
            code = _raw_call(server.address, method, good.metadata(method))
            assert code != grpc.StatusCode.UNAUTHENTICATED, method
        assert toy.steps == []
        assert gate.verifier.failure_count() == refused
        assert set(gate.verifier.failures) == {"missing", "stale", "forged"}
        with PeerClient(server.address, timeout_s=10, outbound=Outbound(good)) as client:
            info = client.info()
        assert info["net"]["auth_failures"] == refused
    finally:
        server.stop()


def test_secret_swarm_serves_every_method_to_an_admitted_client():
    server, gate, toy = _serve(auth.Verifier("secret", secret=SECRET))
    admitted = Outbound(auth.Credentials("secret", "caller-peer", secret=SECRET))
    try:
        with PeerClient(server.address, timeout_s=10, vocab_size=64, outbound=admitted) as client:
            fwd = client.forward(_request(stage=1))
            assert fwd.hidden is not None
            back = client.backward(BackwardRequest("p0", 0, 0, 0, 1, torch.ones(2, 5, 8)))
            assert back.grad is not None
            assert client.step(StepRequest("p0", 0, 0, 1, 10)).ok
            assert len(client.get_payload(PayloadRequest(4, 1, "alice"))) > 0
            assert client.get_state(StateRequest(1)).tensors
            assert client.get_artifact(ArtifactRequest("tokenizer.model")) == b"spm-model-bytes"
            assert client.info()["net"]["auth_failures"] == 0
        assert len(toy.steps) == 1
        # the proof travels with the client that was given it, never as process-wide state
        with PeerClient(server.address, timeout_s=10, retries=0) as stranger, pytest.raises(PeerError):
            stranger.step(StepRequest("p0", 0, 0, 1, 10))
        assert len(toy.steps) == 1
    finally:
        server.stop()


def _key(tmp_path: Path, name: str):
    from peer.net.identity import load_identity_key, make_identity

    path = tmp_path / f"{name}.key"
    make_identity(path)
    key = load_identity_key(path)
    from peer.net.identity import peer_id_of

    return key, peer_id_of(key.get_public_key())


def test_allowlist_swarm_checks_the_callers_signature_and_listing(tmp_path):
    listed_key, listed_id = _key(tmp_path, "listed")
    stranger_key, stranger_id = _key(tmp_path, "stranger")
    server, gate, toy = _serve(auth.Verifier("allowlist", allowlist=frozenset({listed_id})))
    good = auth.Credentials("allowlist", listed_id, key=listed_key)
    stranger = auth.Credentials("allowlist", stranger_id, key=stranger_key)
    impostor = auth.Credentials("allowlist", listed_id, key=stranger_key)  # claims the listed id
    try:
        for method in METHODS:
            for metadata in (
                (),
                stranger.metadata(method),
                impostor.metadata(method),
                good.metadata("/peer.v1.Peer/Other"),
                tuple({**dict(good.metadata(method)), auth.TS_KEY: str(int(time.time() * 1000) - 3_600_000)}.items()),
            ):
                assert _raw_call(server.address, method, metadata) == grpc.StatusCode.UNAUTHENTICATED, method
            assert _raw_call(server.address, method, good.metadata(method)) != grpc.StatusCode.UNAUTHENTICATED
        assert set(gate.verifier.failures) == {"missing", "unlisted", "forged", "stale"}
        with PeerClient(server.address, timeout_s=10, vocab_size=64, outbound=Outbound(good)) as client:
            assert client.step(StepRequest("p0", 0, 0, 1, 10)).ok
            assert client.info()["net"]["auth_failures"] == 5 * len(METHODS)
    finally:
        server.stop()


def test_open_swarm_asks_for_no_proof():
    server, gate, toy = _serve(auth.Verifier("open"))
    try:
        with PeerClient(server.address, timeout_s=10) as client:
            assert client.step(StepRequest("p0", 0, 0, 1, 10)).ok
            assert client.info()["net"]["auth_failures"] == 0
    finally:
        server.stop()

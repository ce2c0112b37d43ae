"""Typed refusals on the wire: real `PeerService`s of a 3-stage tiny run on 127.0.0.1, real gRPC.

Each refusal a head decides on (busy, claimed, lost, stale, a failed hop) reaches the caller as a
`Refusal` on its `RemoteError`, carried in the status's trailing metadata: directly, through a
stage-to-stage hop (the refusal of the stage that failed, ABORTED), and from a peer that serves
over a reverse stream (the refusal travels in the last Frame and the hub answers it unchanged).
The status codes and messages stay what they were. A head decides on them: it replaces a
stage peer another pipeline claimed, and replays a refused inner step at most
`swarm.inner_step_replays` times.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from peer.config import build_config
from peer.errors import NetworkError
from peer.net.pool import ClientPool
from peer.net.records import StageRecord
from peer.net.transport import auth, dialer
from peer.net.transport.client import PeerClient
from peer.net.transport.errors import NotFoundError, Refusal, RefusalKind, RemoteError, TransportError
from peer.net.transport.gate import Gate
from peer.net.transport.messages import ForwardRequest
from peer.net.transport.reverse import ReverseLink
from peer.net.transport.server import PeerServer
from peer.node.pipeline.driver import PipelineDriver
from peer.node.pipeline.failures import Action, classify
from peer.node.round.payloads import PayloadStore
from peer.node.service import PeerService
from peer.node.stage.worker import StageWorker
from peer.research.bench.pipeline_peers import batches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

B, L = 2, 8
A, OTHER = "pipeline-a", "pipeline-b"


@pytest.fixture(scope="module")
def cfg():
    overrides = {"stages": 3, "train.batch_size": 4, "train.microbatches": 2, "train.seq_len": L}
    return build_config(overrides=overrides, environ={})


def _serve(cfg, service: PeerService, **kw) -> PeerServer:
    return PeerServer(service, host="127.0.0.1", port=0, vocab_size=cfg.model.vocab_size, **kw)


@pytest.fixture
def stages(cfg) -> Iterator[dict[int, PeerServer]]:
    servers = {
        s: _serve(cfg, PeerService(cfg, {s: StageWorker(cfg, s)}, PayloadStore(), f"stage-{s}", "stage"))
        for s in (1, 2)
    }
    yield servers
    for server in servers.values():
        server.stop(grace_s=0.5)


def _forward(cfg, stage: int, pipeline: str, t: int = 0, h: int = 0, attempt: int = 0, route=(), window=0):
    g = torch.Generator().manual_seed(stage)
    tokens = torch.randint(0, cfg.model.vocab_size, (B, L), generator=g, dtype=torch.int32)
    last = stage == cfg.stages - 1 or bool(route)
    return ForwardRequest(
        pipeline, 0, t, h, stage, tokens, torch.randn(B, L, cfg.k, generator=g) * 0.1,
        targets=tokens if last else None, attempt=attempt, route=tuple(route), window=window or len(route) and 4,
    )  # fmt: skip


def _refused(call) -> RemoteError:
    with pytest.raises(RemoteError) as err:
        call()
    return err.value


def test_each_refusal_reaches_the_caller_typed(cfg, stages):
    c1, c2 = (PeerClient(stages[s].address, timeout_s=30, wire_dtype=cfg.subspace.wire_dtype) for s in (1, 2))
    try:
        assert c2.forward(_forward(cfg, 2, A, h=2, attempt=5, window=4)).loss is not None  # A claims stage 2
        claimed = _refused(lambda: c2.forward(_forward(cfg, 2, OTHER)))
        assert claimed.code == "FAILED_PRECONDITION" and claimed.refusal == Refusal(RefusalKind.CLAIMED, 2)
        assert "claimed by pipeline" in str(claimed)  # the message stays, for people

        busy = _refused(lambda: c2.forward(_forward(cfg, 2, A, t=1)))
        assert busy.code == "FAILED_PRECONDITION" and busy.refusal == Refusal(RefusalKind.BUSY, 2, outer_step=0)

        lost = _refused(lambda: c1.forward(_forward(cfg, 2, A)))  # stage 1's peer holds no stage 2
        assert isinstance(lost, NotFoundError) and lost.refusal == Refusal(RefusalKind.LOST, 2)

        stale = _refused(lambda: c2.forward(_forward(cfg, 2, A, h=0, attempt=10**12, window=4)))
        assert stale.code == "INVALID_ARGUMENT"
        assert stale.refusal == Refusal(RefusalKind.STALE, 2, outer_step=0, inner_step=2, attempt=5)
        assert classify(stale, 2, cfg.stages, 0, 0).action is Action.REPLACE  # it ran ahead for this pipeline

        # OTHER streams through stage 1 to stage 2, which A holds: the hop names stage 2
        hop = _refused(lambda: c1.forward(_forward(cfg, 1, OTHER, route=[stages[2].address])))
        assert hop.code == "ABORTED" and hop.refusal == Refusal(RefusalKind.CLAIMED, 2)
        failure = classify(hop, 1, cfg.stages, 0, 0)
        assert failure is not None and (failure.action, failure.stage) == (Action.REPLACE, 2)
    finally:
        c1.close()
        c2.close()


def test_a_hop_to_an_unreachable_stage_is_a_network_refusal_naming_it(cfg, stages):
    with PeerClient(stages[1].address, timeout_s=30, wire_dtype=cfg.subspace.wire_dtype) as c1:
        hop = _refused(lambda: c1.forward(_forward(cfg, 1, A, route=["127.0.0.1:1"])))
    assert hop.code == "ABORTED" and hop.refusal == Refusal(RefusalKind.NETWORK, 2)


def test_a_refusal_crosses_a_reverse_stream_unchanged(cfg, stages):
    """Stage 2 serves over a reverse stream to a hub (as behind NAT): the caller dials the hub with
    the route `stage-2@hub` and gets stage 2's typed refusal."""
    hub_service = PeerService(cfg, {}, PayloadStore(), "hub", "head")
    gate = Gate("hub", relay=True)
    hub = _serve(cfg, hub_service, interceptors=[gate])
    gate.bind(hub.address)
    hidden = dialer.Outbound(credentials=auth.Credentials("open", "stage-2"))  # the hidden peer's id on its stream
    link = ReverseLink(hub.address, stages[2].address, outbound=hidden)
    try:
        assert link.connected.wait(20), link.last_error
        with PeerClient(f"stage-2@{hub.address}", timeout_s=30, wire_dtype=cfg.subspace.wire_dtype) as client:
            assert client.forward(_forward(cfg, 2, A)).loss is not None  # served over the stream, claimed by A
            claimed = _refused(lambda: client.forward(_forward(cfg, 2, OTHER)))
            busy = _refused(lambda: client.forward(_forward(cfg, 2, A, t=3)))
        assert claimed.code == "FAILED_PRECONDITION" and claimed.refusal == Refusal(RefusalKind.CLAIMED, 2)
        assert busy.refusal == Refusal(RefusalKind.BUSY, 2, outer_step=0)
        assert gate.hub.forwarded >= 3
    finally:
        link.close()
        hub.stop(grace_s=0.5)


class _Records:
    """Stage records naming the given peers of stage 1 (one trainer each, at outer step 0)."""

    def __init__(self, peers: dict[str, str]) -> None:
        self.peers = peers

    def get_stage_peers(self, stage: int) -> dict[str, StageRecord]:
        if stage != 1:
            return {}
        return {pid: StageRecord(address=a, role="trainer", outer_step=0) for pid, a in self.peers.items()}


def _two_stages(**overrides):
    base = {"stages": 2, "train.batch_size": 4, "train.microbatches": 2, "train.seq_len": L, "swarm.rpc_timeout_s": 30}
    return build_config(overrides={**base, **overrides}, environ={})


@pytest.mark.parametrize("in_flight", [1, 2])
def test_the_head_replaces_a_peer_another_pipeline_claimed_and_replays(in_flight):
    """Stage 1 has two peers; another pipeline holds the first the head picks. Its CLAIMED refusal
    drops it and the inner step runs on the other, in either schedule."""
    cfg = _two_stages(**{"train.in_flight": in_flight})
    servers = {
        pid: _serve(cfg, PeerService(cfg, {1: StageWorker(cfg, 1)}, PayloadStore(), pid, "stage"))
        for pid in ("stage-1-a", "stage-1-b")
    }
    clients = ClientPool(cfg.swarm.rpc_timeout_s, cfg.subspace.wire_dtype)
    try:
        taken = clients.get(servers["stage-1-a"].address).forward(_forward(cfg, 1, OTHER))
        assert taken.loss is not None  # OTHER claimed stage-1-a
        records = _Records({pid: s.address for pid, s in servers.items()})
        driver = PipelineDriver(cfg, A, StageWorker(cfg, 0), records, clients, threading.Event())
        x, y = batches(cfg, 1)[0]
        loss = driver.inner_step(0, 0, x, y)
        assert 0 < loss < 20 and driver.in_flight == in_flight
        assert driver.peers[1][0] == "stage-1-b" and driver.routing.excluded == {"stage-1-a"}
    finally:
        clients.close()
        for server in servers.values():
            server.stop(grace_s=0.5)


class _AlwaysRefuses(PeerService):
    """A stage 1 that refuses every micro-batch as malformed (a REPLAY each time), counting them."""

    forwards = 0

    def forward(self, request: ForwardRequest):
        self.forwards += 1
        raise TransportError("stage 1 cannot run this micro-batch: refused by the test")


def test_an_inner_step_is_replayed_at_most_swarm_inner_step_replays_times():
    cfg = _two_stages(**{"train.in_flight": 1, "swarm.inner_step_replays": 2})
    service = _AlwaysRefuses(cfg, {1: StageWorker(cfg, 1)}, PayloadStore(), "stage-1", "stage")
    server = _serve(cfg, service)
    clients = ClientPool(cfg.swarm.rpc_timeout_s, cfg.subspace.wire_dtype)
    try:
        records = _Records({"stage-1": server.address})
        driver = PipelineDriver(cfg, A, StageWorker(cfg, 0), records, clients, threading.Event())
        x, y = batches(cfg, 1)[0]
        with pytest.raises(NetworkError, match="failed 3 times"):
            driver.inner_step(0, 0, x, y)
        assert service.forwards == 3  # the first try and two replays, each ending at micro-batch 0
        assert driver.peers[1][0] == "stage-1"  # a refused request is replayed, the peer kept
    finally:
        clients.close()
        server.stop(grace_s=0.5)

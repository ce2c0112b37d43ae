"""The head's auto in-flight window follows a capped link: a real stage-1 server on 127.0.0.1.

The head (`PipelineDriver` over the bench's fixed stage map, `peer.research.bench.pipeline_peers.head_driver`)
picks K before every inner step from the measured round trip, the caps its stage peer reports in
`info` ("net", `peer join --max-upload-mbps/--max-download-mbps`), stage 0's measured compute per
micro-batch and the network part of its streamed calls (call time less the time stage 1 held the
request, `ForwardReply.served_s`). Uncapped on loopback K starts at S + SLACK; behind a 1 Mbit/s stage link
one hop's boundary and gradient take ~75 ms, so K grows (bounded by the micro-batches) while inner
steps run through it (bit-identity across K is tests/integration/test_pipeline_schedule.py). The
head's record shows K (`PeerService.schedule` → the stage record's "in_flight").
"""

from __future__ import annotations

import math
import time

import pytest

from peer.config import build_config
from peer.net.pool import ClientPool
from peer.net.ratelimit import Link, LinkCaps
from peer.net.transport.gate import Gate
from peer.net.transport.server import PeerServer
from peer.node.pipeline.schedule import SLACK, hop_bytes, serialization_s
from peer.node.round.payloads import PayloadStore
from peer.node.service import PeerService
from peer.node.stage.worker import StageWorker
from peer.research.bench.pipeline_peers import batches, head_driver

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _cfg():
    overrides = {
        "train.batch_size": 16,
        "train.microbatches": 8,
        "train.seq_len": 64,
        "train.in_flight": 0,
        "swarm.rpc_timeout_s": 60,
        "subspace.wire_dtype": "fp32",  # a 10 KB hop: > 50 ms through the 1 Mbit/s cap
    }
    return build_config(overrides=overrides, environ={})


def _stage1(cfg, caps: LinkCaps) -> tuple[PeerServer, str]:
    service = PeerService(cfg, {1: StageWorker(cfg, 1)}, PayloadStore(), "stage-1", "stage")
    gate = Gate("stage-1", link=Link(caps))  # its own link: a home peer with its own caps
    server = PeerServer(
        service,
        host="127.0.0.1",
        port=0,
        vocab_size=cfg.model.vocab_size,
        interceptors=[gate],
        wire_dtype=cfg.subspace.wire_dtype,
    )
    gate.bind(server.address)
    return server, server.address


def _shown(service: PeerService):
    def show(schedule: dict) -> None:
        service.schedule = schedule

    return show


def test_k_grows_behind_a_capped_stage_link_and_is_re_evaluated_every_inner_step():
    cfg = _cfg()
    ks: dict[str, list[int]] = {}
    network: dict[str, float] = {}
    for name, caps in (("uncapped", LinkCaps()), ("capped", LinkCaps(upload_mbps=1.0, download_mbps=1.0))):
        server, address = _stage1(cfg, caps)
        clients = ClientPool(cfg.swarm.rpc_timeout_s, cfg.subspace.wire_dtype)
        head = PeerService(cfg, {}, PayloadStore(), "bench-head", "head")
        try:
            driver = head_driver(cfg, {1: address}, StageWorker(cfg, 0), clients, on_schedule=_shown(head))
            losses = []
            for h, (x, y) in enumerate(batches(cfg, 2)):
                losses.append(driver.inner_step(0, h, x, y))
                ks.setdefault(name, []).append(driver.in_flight)
            assert all(0 < loss < 20 for loss in losses)
            step = driver.links
            # three probes at first, then one more per inner step in a background thread: wait for it
            deadline = time.monotonic() + 30
            while address in step._probing and time.monotonic() < deadline:
                time.sleep(0.01)
            assert len(step._rtt[address]) == 3 + 1
            assert step._compute_s is not None and step._compute_s > 0  # measured after the first step
            assert step.caps(address) == ((1.0, 1.0) if name == "capped" else (None, None))
            assert head.schedule["in_flight"] == driver.in_flight
            # the hop time measured from the streamed calls, less the time stage 1 held each
            assert step._network_s is not None
            network[name] = step._network_s
        finally:
            clients.close()
            server.stop(grace_s=0.5)
    assert ks["uncapped"][0] == 2 + SLACK  # before anything is measured: K = S + SLACK on a fast link
    # a measurement, not a guess: how long loopback takes belongs in `peer bench pipeline`, not here
    assert all(math.isfinite(v) and v >= 0 for v in network.values()), network
    assert ks["uncapped"][0] < ks["capped"][0], ks
    assert serialization_s(hop_bytes(cfg), [1.0]) > 0.05
    assert all(k > 2 + SLACK for k in ks["capped"]) and max(ks["capped"]) <= cfg.train.microbatches, ks

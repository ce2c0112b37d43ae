"""Outer rounds reject bad payloads: real hivemind DHT nodes and PeerServers on 127.0.0.1.

Three replicas take part in round (t, s): A and C are honest, B is not. B either serves bytes that
differ from the sha256 it announced, or announces the right hash of bytes that are no SparseLoCo
payload. The honest replicas skip B's payload with a warning and commit the same honest set, in
the same (replica id) order, with the bytes each of them contributed.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from peer.config import build_config
from peer.dht import SwarmDHT
from peer.rounds import ClientPool, PayloadStore, RoundResult, gather_round, sha256
from peer.service import PeerService
from peer.sparseloco import Payload, PayloadError, compress
from peer.transport.server import PeerServer

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROUND_TIMEOUT_S = 4.0
SHAPES = {"layers.2.attn.wq.weight": (64, 64), "layers.2.attn_norm.weight": (64,)}


@dataclass
class Node:
    dht: SwarmDHT
    store: PayloadStore
    clients: ClientPool
    server: PeerServer | None = None

    @property
    def id(self) -> str:
        return self.dht.peer_id

    @property
    def address(self) -> str:
        return self.server.address


def _payload(seed: int, cfg) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    delta = {name: torch.randn(shape, generator=gen) * 1e-2 for name, shape in SHAPES.items()}
    return compress(delta, None, cfg.sparseloco)[0].to_bytes()


@pytest.fixture
def three_replicas(reap_children):
    cfg = build_config()
    nodes: list[Node] = []
    try:
        # Every DHT node first: hivemind forks, and no gRPC thread may exist when it does.
        first = SwarmDHT()
        nodes.append(Node(first, PayloadStore(), ClientPool(timeout_s=5.0)))
        for _ in range(2):
            nodes.append(Node(SwarmDHT(initial_peers=first.visible_maddrs()), PayloadStore(), ClientPool(timeout_s=5.0)))
        for i, node in enumerate(nodes):
            node.dht.set_run("round-hash-test", cfg.stages)
            node.server = PeerServer(PeerService(cfg, {}, node.store, node.id, "full"), host="127.0.0.1", port=0)
            node.dht.announce_replica({"address": node.address, "kind": "full", "outer_step": 0, "shard": i,
                                       "joined_at": 0, "loss": None, "tokens_per_s": 0.0}, ttl_s=60)
        yield cfg, nodes
    finally:
        for node in nodes:
            if node.server is not None:
                node.server.stop(grace_s=0.5)
            node.clients.close()
            node.dht.shutdown()


def _honest_round(cfg, honest: list[Node], t: int, stage: int) -> list[RoundResult]:
    n = sum(torch.Size(s).numel() for s in SHAPES.values())

    def validate(data: bytes) -> None:
        Payload.from_bytes(data, max_elements=n, cfg=cfg.sparseloco)

    def run(i_node: tuple[int, Node]) -> RoundResult:
        i, node = i_node
        return gather_round(node.dht, node.clients, t, stage, ROUND_TIMEOUT_S, own=(node.id, _payload(10 + i, cfg)),
                            store=node.store, address=node.address, validate=validate, poll_s=0.1, ttl_s=60)

    with ThreadPoolExecutor(max_workers=len(honest)) as pool:
        return list(pool.map(run, enumerate(honest)))


def _check_committed(results: list[RoundResult], honest: list[Node], cfg, bad: Node) -> None:
    want = sorted((node.id, _payload(10 + i, cfg)) for i, node in enumerate(honest))
    for result in results:
        assert bad.id not in result.replicas
        assert result.replicas == [rid for rid, _ in want]  # the honest set, in replica-id order
        assert result.payloads == [data for _, data in want]
        assert result.expected == 3  # B is a live replica: skipped, not forgotten
        assert result.wall_s < ROUND_TIMEOUT_S + 5


def test_payload_that_does_not_match_its_announced_hash_is_skipped(three_replicas, caplog):
    cfg, (a, b, c) = three_replicas
    caplog.set_level(logging.WARNING, logger="peer.rounds")
    announced, served = _payload(99, cfg), _payload(98, cfg)
    Payload.from_bytes(served, cfg=cfg.sparseloco)  # a well-formed payload: only the hash gives it away
    b.store.put(0, 0, served)
    b.dht.announce_payload(0, 0, {"sha256": sha256(announced), "size": len(announced), "address": b.address,
                                  "replica": b.id}, ttl_s=60)

    results = _honest_round(cfg, [a, c], t=0, stage=0)

    _check_committed(results, [a, c], cfg, bad=b)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    hash_warnings = [m for m in warnings if "does not match its announced sha256" in m and b.id[:12] in m]
    assert len(hash_warnings) == 2, warnings  # one per honest replica, and B's payload is fetched once each


def test_malformed_payload_with_a_valid_hash_is_rejected_by_validation(three_replicas, caplog):
    cfg, (a, b, c) = three_replicas
    caplog.set_level(logging.WARNING, logger="peer.rounds")
    garbage = bytearray(_payload(97, cfg))
    garbage[4] = 9  # unsupported format version
    garbage = bytes(garbage)
    with pytest.raises(PayloadError):
        Payload.from_bytes(garbage)
    b.store.put(0, 1, garbage)
    b.dht.announce_payload(0, 1, {"sha256": sha256(garbage), "size": len(garbage), "address": b.address,
                                  "replica": b.id}, ttl_s=60)

    results = _honest_round(cfg, [a, c], t=0, stage=1)

    _check_committed(results, [a, c], cfg, bad=b)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    rejected = [m for m in warnings if "invalid SparseLoCo payload" in m and b.id[:12] in m]
    assert len(rejected) == 2, warnings

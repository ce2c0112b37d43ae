"""Outer rounds reject bad payloads: real hivemind DHT nodes and PeerServers on 127.0.0.1.

Three replicas take part in round (t, s): A and C are honest, B is not. B either serves bytes that
differ from the sha256 it announced, announces the right hash of bytes that are no SparseLoCo
payload, sends a payload whose tensors do not fit the stage, or announces a well-formed payload in
A's name. The honest replicas skip B's payload with a warning (the forged one is not even
fetched), commit the same honest set, in the same (replica id) order, with the bytes each of them
contributed, and do not wait for the round's deadline because of B. A stage peer that a head's
replica record lists in "pipeline_peers" does contribute in that head's name.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
import torch

from peer.config import build_config
from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.format import Payload, PayloadError
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.transport.server import PeerServer
from peer.node.round.gather import gather_round
from peer.node.round.payloads import PayloadStore, payload_id, payload_validator, sha256
from peer.node.round.result import RoundInputs, RoundResult
from peer.node.round.timings import RoundTimings
from peer.node.service import PeerService
from tests.round_helpers import own as own_of
from tests.round_helpers import round_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROUND_TIMEOUT_S = 8.0  # a round that has to wait for it failed: every round here closes well before
TIMINGS = RoundTimings(ROUND_TIMEOUT_S, poll_s=0.1, ttl_s=60)
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


def _payload(seed: int, cfg, shapes=SHAPES) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    delta = {name: torch.randn(shape, generator=gen) * 1e-2 for name, shape in shapes.items()}
    return compress(delta, None, cfg.sparseloco)[0].to_bytes()


def _announce(node: Node, t: int, stage: int, data: bytes, replica: str, announced: bytes | None = None) -> None:
    """Serve `data` for round (t, stage) and announce it (with the id of `announced`) for `replica`; bytes
    that are no payload have no id: they are announced under their plain sha256."""
    node.store.put(t, stage, data)
    try:
        announced_id = payload_id(announced or data)
    except PayloadError:
        announced_id = sha256(announced or data)
    node.dht.announce_payload(
        t,
        stage,
        {"sha256": announced_id, "size": len(data), "address": node.address, "replica": replica},
        ttl_s=60,
    )


def _replica_record(node: Node, i: int, **extra) -> dict:
    return {
        "address": node.address,
        "kind": "full",
        "outer_step": 0,
        "shard": i,
        "joined_at": 0,
        "loss": None,
        "tokens_per_s": 0.0,
        **extra,
    }


@pytest.fixture
def three_replicas(reap_children):
    cfg = build_config()
    nodes: list[Node] = []
    try:
        # Every DHT node first: hivemind forks, and no gRPC thread may exist when it does.
        first = SwarmDHT()
        nodes.append(Node(first, PayloadStore(), ClientPool(timeout_s=5.0)))
        for _ in range(2):
            dht = SwarmDHT(initial_peers=first.visible_maddrs())
            nodes.append(Node(dht, PayloadStore(), ClientPool(timeout_s=5.0)))
        for i, node in enumerate(nodes):
            node.dht.set_run("round-hash-test", cfg.stages)
            node.server = PeerServer(PeerService(cfg, {}, node.store, node.id, "full"), host="127.0.0.1", port=0)
            node.dht.announce_replica(_replica_record(node, i), ttl_s=60)
        yield cfg, nodes
    finally:
        for node in nodes:
            if node.server is not None:
                node.server.stop(grace_s=0.5)
            node.clients.close()
            node.dht.shutdown()


def _gather(cfg, node: Node, t: int, stage: int, own: tuple[str, bytes] | None, delay_s: float = 0.0) -> RoundResult:
    time.sleep(delay_s)  # a slower replica: the others poll before it announces
    validate = payload_validator(SHAPES, cfg.sparseloco)  # as Rounds._validator builds it
    mine = own_of(*own) if own is not None else None
    ctx = round_context(node.dht, node.clients, node.store, node.address)
    return gather_round(ctx, t, stage, TIMINGS, RoundInputs(mine, validate))


def _honest_round(
    cfg, honest: list[Node], t: int, stage: int, delay_s: dict[str, float] | None = None
) -> list[RoundResult]:
    def run(i_node: tuple[int, Node]) -> RoundResult:
        i, node = i_node
        return _gather(cfg, node, t, stage, (node.id, _payload(10 + i, cfg)), (delay_s or {}).get(node.id, 0.0))

    with ThreadPoolExecutor(max_workers=len(honest)) as pool:
        return list(pool.map(run, enumerate(honest)))


def _check_committed(results: list[RoundResult], honest: list[Node], cfg, bad: Node, expected: int = 3) -> None:
    want = sorted((node.id, _payload(10 + i, cfg)) for i, node in enumerate(honest))
    for result in results:
        assert bad.id not in result.replicas
        assert result.replicas == [rid for rid, _ in want]  # the honest set, in replica-id order
        assert result.payloads == [data for _, data in want]
        assert result.expected == expected  # a live B is skipped, not forgotten
        # B's rejected payload does not hold the round open until its deadline
        assert not result.timed_out, result.wall_s


def test_payload_that_does_not_match_its_announced_hash_is_skipped(three_replicas, caplog):
    cfg, (a, b, c) = three_replicas
    caplog.set_level(logging.WARNING, logger="peer.node.round.rounds")
    announced, served = _payload(99, cfg), _payload(98, cfg)
    Payload.from_bytes(served, cfg=cfg.sparseloco)  # a well-formed payload: only the hash gives it away
    _announce(b, 0, 0, served, b.id, announced=announced)

    results = _honest_round(cfg, [a, c], t=0, stage=0)

    _check_committed(results, [a, c], cfg, bad=b)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    hash_warnings = [m for m in warnings if "does not match its announced id" in m and b.id[:12] in m]
    assert len(hash_warnings) == 2, warnings  # one per honest replica, and B's payload is fetched once each


def test_malformed_payload_with_a_valid_hash_is_rejected_by_validation(three_replicas, caplog):
    cfg, (a, b, c) = three_replicas
    caplog.set_level(logging.WARNING, logger="peer.node.round.rounds")
    garbage = bytearray(_payload(97, cfg))
    garbage[4] = 9  # unsupported format version
    garbage = bytes(garbage)
    with pytest.raises(PayloadError):
        Payload.from_bytes(garbage)
    _announce(b, 0, 1, garbage, b.id)

    results = _honest_round(cfg, [a, c], t=0, stage=1)

    _check_committed(results, [a, c], cfg, bad=b)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    rejected = [m for m in warnings if "invalid SparseLoCo payload" in m and b.id[:12] in m]
    assert len(rejected) == 2, warnings


@pytest.mark.parametrize(
    "shapes",
    [
        {"layers.2.attn.wq.weight": (1,), "layers.2.attn_norm.weight": (64,)},  # would broadcast over the matrix
        {"layers.2.attn.wq.weight": (64, 32), "layers.2.attn_norm.weight": (64,)},  # would crash apply_round
        {"layers.9.attn.wq.weight": (64, 64)},  # not a parameter of this stage
    ],
    ids=["broadcasting (1,)", "wrong shape", "foreign name"],
)
def test_well_formed_payload_that_does_not_fit_the_stage_is_rejected(three_replicas, caplog, shapes):
    cfg, (a, b, c) = three_replicas
    caplog.set_level(logging.WARNING, logger="peer.node.round.rounds")
    misfit = _payload(95, cfg, shapes)
    Payload.from_bytes(misfit, cfg=cfg.sparseloco)  # a valid SparseLoCo payload: only its tensors are wrong
    _announce(b, 0, 1, misfit, b.id)

    results = _honest_round(cfg, [a, c], t=0, stage=1)

    _check_committed(results, [a, c], cfg, bad=b)
    assert all(r.rejected == [b.id] for r in results)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len([m for m in warnings if "not a parameter of this stage" in m or "has shape" in m]) == 2, warnings


def test_payload_announced_in_another_replicas_name_is_ignored(three_replicas, caplog):
    cfg, (a, b, c) = three_replicas
    caplog.set_level(logging.WARNING, logger="peer.node.round.rounds")
    b.dht.withdraw_replica()  # B is not a replica, and A's record lists no stage peer
    forged = _payload(94, cfg)  # well formed, right hash: only the binding gives it away
    _announce(b, 0, 0, forged, a.id)

    # A is slow: C polls while B's announcement is the only one in A's name
    results = _honest_round(cfg, [a, c], t=0, stage=0, delay_s={a.id: 1.0})

    _check_committed(results, [a, c], cfg, bad=b, expected=2)
    a_result, c_result = results
    assert c_result.bytes_fetched == len(_payload(10, cfg))  # A's real payload only: the forged one never fetched
    assert a_result.bytes_fetched == len(_payload(11, cfg))
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    ignored = [m for m in warnings if f"ignoring the announcement of {b.id[:12]}" in m]
    assert len(ignored) == 2, warnings  # once per honest replica, not once per poll


def test_stage_peer_listed_in_the_heads_record_contributes_in_its_name(three_replicas):
    """A is a pipeline head whose stage-1 peer is B (no replica itself); C is a full replica."""
    cfg, (a, b, c) = three_replicas
    b.dht.withdraw_replica()
    a.dht.announce_replica(_replica_record(a, 0, kind="pipeline", pipeline_peers={"1": b.id}), ttl_s=60)
    from_b, from_c = _payload(20, cfg), _payload(21, cfg)

    with ThreadPoolExecutor(max_workers=3) as pool:
        futures = [
            pool.submit(_gather, cfg, b, 0, 1, (a.id, from_b)),  # B in A's name
            pool.submit(_gather, cfg, c, 0, 1, (c.id, from_c)),
            pool.submit(_gather, cfg, a, 0, 1, None),
        ]  # the head observes stage 1's round
        results = [f.result() for f in futures]

    want = sorted([(a.id, from_b), (c.id, from_c)])
    for result in results:
        assert result.replicas == [rid for rid, _ in want] and result.payloads == [data for _, data in want]
        assert result.expected == 2 and not result.timed_out


def test_a_payload_whose_sender_died_is_served_by_a_holder_that_fetched_it(three_replicas):
    """A sends, B fetches it and commits, A's process dies: C still commits A's payload, from B."""
    from peer.net.transport.errors import NotFoundError
    from peer.net.transport.messages import PayloadRequest

    cfg, (a, b, c) = three_replicas
    t, stage = 3, 1
    a_data, c_data = _payload(1, cfg), _payload(3, cfg)
    _announce(a, t, stage, a_data, a.id)
    _announce(c, t, stage, c_data, c.id)
    first = _gather(cfg, b, t, stage, (b.id, _payload(2, cfg)))
    assert sorted(first.replicas) == sorted([a.id, b.id, c.id]) and not first.timed_out
    a.server.stop(grace_s=0.2)  # A is gone (its records have not expired yet)
    a.server = None
    b.clients.close()
    ctx = round_context(c.dht, c.clients, c.store, c.address)
    inputs = RoundInputs(own_of(c.id, c_data), payload_validator(SHAPES, cfg.sparseloco))
    second = gather_round(ctx, t, stage, TIMINGS, inputs)
    assert second.replicas == first.replicas and second.payloads == first.payloads  # the same set, same bytes
    assert not second.timed_out
    # a holder asked for a sender's payload it never fetched says so; it never answers with its own
    with pytest.raises(NotFoundError):
        c.clients.get(b.address).get_payload(PayloadRequest(t, stage, "QmNobodyFetchedThis"), timeout_s=2.0)

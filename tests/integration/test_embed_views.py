"""A later stage's holder reads stage 0's round as embedding views: real hivemind DHT nodes and
PeerServers on 127.0.0.1 (docs/protocol.md, "Embedding views").

A holder of stage 1 observes stage 0's round for its T⊥ (u reads each payload's embedding entry and
norm alone: the outlier screening, on as by default, screens the embedding apart). It fetches each
stage-0 payload's view — a third of the payload at the tiny preset — from the sender or, once the
sender is gone, from a stage-0 holder that
fetched the payload whole; it computes the same u, bit for bit, as stage 0's holders commit from
the whole payloads. A view that does not prove its announced id is refused; a payload whose view
proves a lying index (its whole does not hash to that id, so every stage-0 holder rejected it) is
fetched whole once a claim leaves it out, rejected, and the claim followed.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
import torch

from peer.config import build_config
from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.clip import payload_norm
from peer.core.sparseloco.codec.format import HEADER_NBYTES, Payload
from peer.core.sparseloco.codec.sections import DOMAIN, VIEW_MAGIC, payload_id, sections, view_bytes
from peer.core.sparseloco.commit import commit_state
from peer.core.subspace.state import EMBED
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.transport.server import PeerServer
from peer.node.round.claims import Link, entry
from peer.node.round.fetcher import relay_wait_s
from peer.node.round.gather import gather_round
from peer.node.round.payloads import PayloadStore, view_validator
from peer.node.round.recheck import linked_stage0
from peer.node.round.refusals import Refusals
from peer.node.round.replay import chain_record, parse_chain
from peer.node.round.result import RoundInputs, RoundResult
from peer.node.round.timings import RoundTimings
from peer.node.service import PeerService
from peer.node.stage.embed import stage0_change
from peer.node.stage.state import StageState
from tests.round_helpers import own as own_of
from tests.round_helpers import round_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TIMINGS = RoundTimings(8.0, poll_s=0.1, ttl_s=60)
CFG = build_config(environ={})
SHAPES0 = stage_shapes(CFG.model, 0, CFG.stages)


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
        assert self.server is not None
        return self.server.address


class Lying(PayloadStore):
    """A dishonest sender's store (fault injection): it serves `view` for every view asked of it."""

    def __init__(self, view: bytes) -> None:
        super().__init__()
        self.lie = view

    def view(self, t: int, stage: int, sender: str | None = None) -> bytes | None:
        return self.lie


def _payload(seed: int, scale: float) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    delta = {name: torch.randn(shape, generator=gen) * scale for name, shape in SHAPES0.items()}
    return compress(delta, None, CFG.sparseloco)[0].to_bytes()


def _record(node: Node) -> dict:
    return {"address": node.address, "kind": "full", "outer_step": 0, "joined_at": 0}


@contextmanager
def _peers(stores: list[PayloadStore], run: str, kind: str) -> Iterator[list[Node]]:
    """A real DHT node, client pool and PeerServer on 127.0.0.1 per store, all in `run`; stopped after."""
    nodes: list[Node] = []
    try:
        first = SwarmDHT()  # every DHT node first: hivemind forks, and no gRPC thread may exist then
        nodes.append(Node(first, stores[0], ClientPool(timeout_s=5.0)))
        for store in stores[1:]:
            nodes.append(Node(SwarmDHT(initial_peers=first.visible_maddrs()), store, ClientPool(timeout_s=5.0)))
        for node in nodes:
            node.dht.set_run(run, CFG.stages)
            node.server = PeerServer(PeerService(CFG, {}, node.store, node.id, kind), host="127.0.0.1", port=0)
        yield nodes
    finally:
        for node in nodes:
            if node.server is not None:
                node.server.stop(grace_s=0.5)
            node.clients.close()
            node.dht.shutdown()


@pytest.fixture
def swarm(reap_children):
    """Four peers: A and B contribute to stage 0, D is the dishonest one, C holds stage 1 (observes)."""
    with _peers([PayloadStore(), PayloadStore(), PayloadStore(), Lying(b"")], "embed-views-test", "full") as nodes:
        yield nodes


def _announce(node: Node, data: bytes, announced: str | None = None) -> None:
    node.store.put(0, 0, data)
    record = {"sha256": announced or payload_id(data), "size": len(data), "address": node.address, "replica": node.id}
    node.dht.announce_payload(0, 0, record, ttl_s=60)
    node.dht.announce_replica(_record(node), ttl_s=60)


def _observe(node: Node, refusals: Refusals | None = None) -> RoundResult:
    """Stage 0's round as a holder of stage 1 reads it (`round_reading`: views)."""
    ctx = round_context(node.dht, node.clients, node.store, node.address, refusals=refusals, cfg=CFG)
    return gather_round(ctx, 0, 0, TIMINGS, RoundInputs(validate=view_validator(SHAPES0, CFG.sparseloco)))


def _bits(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.int32)


def test_an_observer_fetches_only_the_views_and_computes_u_with_stage_0s_bits(swarm):
    a, b, c, _ = swarm
    from_a, from_b = _payload(1, 1e-2), _payload(2, 5e-2)  # B's norm is past twice the median: clipped
    _announce(a, from_a)
    _announce(b, from_b)
    # B, a holder of stage 0, gathers the round whole (it fetches A's payload); then A is gone
    held = gather_round(
        round_context(b.dht, b.clients, b.store, b.address, cfg=CFG),
        0,
        0,
        TIMINGS,
        RoundInputs(own=own_of(b.id, from_b)),
    )
    assert sorted(held.replicas) == sorted([a.id, b.id]) and not any(x.view for x in held.contributions)
    a.server.stop(grace_s=0.2)  # A's view now comes from B, made of the whole payload B fetched
    a.server = None

    seen = _observe(c)

    assert seen.replicas == held.replicas and not seen.timed_out
    assert all(x.view for x in seen.contributions)
    views = [view_bytes(x.data, x.payload) for x in held.contributions]
    assert [x.data for x in seen.contributions] == views
    assert seen.bytes_fetched == sum(map(len, views)) < sum(len(x.data) for x in held.contributions) / 2
    assert c.clients.bytes_received()["get_payload"] < sum(len(x.data) for x in held.contributions) / 2
    whole = stage0_change(CFG, held.contributions)
    assert np.array_equal(_bits(stage0_change(CFG, seen.contributions)), _bits(whole))
    start = {name: torch.zeros(shape) for name, shape in SHAPES0.items()}
    parsed = [x.payload for x in held.contributions]
    committed = commit_state(start, None, parsed, CFG.sparseloco, None, keys=held.replicas)
    assert committed.commit.clip.n_clipped == 1  # u's bits depend on the whole payloads' norms
    assert np.array_equal(_bits(whole), _bits(committed.commit.embed_update))


def test_an_observer_that_lost_the_round_moves_t_perp_by_the_set_stage_0s_links_name(swarm):
    """Stage 0's holders went on past round 0 before the observer C read their claims: C reads the
    set from their links (`chain.0.0`: A and B link {A, B}, dishonest D links {B}), fetches its views
    (A is gone: B serves A's) and gets u with the bits B committed (`Rounds._linked_embed`)."""
    a, b, c, d = swarm
    from_a, from_b = _payload(21, 1e-2), _payload(22, 5e-2)
    _announce(a, from_a)
    _announce(b, from_b)
    ctx = round_context(b.dht, b.clients, b.store, b.address, cfg=CFG)
    held = gather_round(ctx, 0, 0, TIMINGS, RoundInputs(own=own_of(b.id, from_b)))
    both = tuple(x.entry for x in held.contributions)
    assert len(both) == 2
    for node, entries in ((a, both), (b, both), (d, both[1:])):
        node.dht.announce_round("chain", 0, 0, chain_record(Link(0, "s0", "s1", entries)), ttl_s=60)
    a.server.stop(grace_s=0.2)
    a.server = None
    links = c.dht.get_round("chain", 0, 0, parse_chain)
    assert len(links) == 3
    observer = cast(StageState, SimpleNamespace(stage=1))  # `round_reading` reads only the observer's stage

    got = linked_stage0(CFG, c.dht, c.clients, c.store, c.id, observer, links, 0, refused=set())

    assert got is not None and got[1] == list(both)
    assert np.array_equal(_bits(got[0]), _bits(stage0_change(CFG, held.contributions)))
    assert c.clients.bytes_received()["get_payload"] < sum(len(x.data) for x in held.contributions) / 2  # views
    assert linked_stage0(CFG, c.dht, c.clients, c.store, c.id, observer, links, 0, refused={a.id}) is None


def test_a_view_that_does_not_prove_its_announced_id_is_refused(swarm, caplog):
    a, _, c, d = swarm
    caplog.set_level(logging.WARNING)
    from_a, from_d = _payload(3, 1e-2), _payload(4, 1e-2)
    tampered = bytearray(view_bytes(from_d, Payload.from_bytes(from_d)))
    tampered[-1] ^= 0x01  # one code bit of D's embedding
    assert isinstance(d.store, Lying)
    d.store.lie = bytes(tampered)
    _announce(a, from_a)
    _announce(d, from_d)

    seen = _observe(c)

    assert seen.replicas == [a.id] and seen.rejected == [d.id] and not seen.timed_out
    refused = [r.getMessage() for r in caplog.records if "does not match its announced id" in r.getMessage()]
    assert refused and all(d.id[:12] in m for m in refused)


def test_a_view_of_a_lying_index_is_checked_whole_once_a_claim_leaves_it_out(swarm, caplog):
    caplog.set_level(logging.WARNING)
    a, b, c, d = swarm
    from_a, from_b, from_d = _payload(6, 1e-2), _payload(7, 1e-2), _payload(8, 1.0)
    _announce(a, from_a)
    _announce(b, from_b)
    # D hashes an index claiming less than its true norm (its payload would escape the clip) and
    # serves a view that proves that id; its whole payload hashes to another id: stage 0 rejects it
    whole = Payload.from_bytes(from_d)
    cut = sections(from_d, whole)
    embed_norm = payload_norm(Payload([e for e in whole.entries if e.name == EMBED], 64, 32, 2))
    assert embed_norm < cut.norm  # the lie stays above the entry's own norm: the view alone cannot tell
    position = struct.unpack("<I", cut.index[HEADER_NBYTES : HEADER_NBYTES + 4])[0]
    index = cut.index[:HEADER_NBYTES] + struct.pack("<Id", position, (embed_norm + cut.norm) / 2)
    rest = hashlib.sha256(cut.rest).digest()
    sha = hashlib.sha256
    lying_id = sha(DOMAIN + sha(index).digest() + sha(cut.embed).digest() + rest).hexdigest()
    assert isinstance(d.store, Lying)
    d.store.lie = VIEW_MAGIC + index + rest + cut.embed
    _announce(d, from_d, announced=lying_id)
    # B, a holder of stage 0, committed round 0 without D: its claim names A and B
    link = {
        "t": 0,
        "prev": "s0",
        "set": [list(entry(r, payload_id(x))) for r, x in sorted([(a.id, from_a), (b.id, from_b)])],
    }
    b.dht.announce_stage(0, {"address": b.address, "outer_step": 1, "state_id": "s1", "link": link}, ttl_s=60)

    refusals = Refusals()
    seen = _observe(c, refusals)

    assert seen.followed is not None and seen.followed.peer == b.id
    assert seen.replicas == sorted([a.id, b.id]) and d.id in seen.rejected
    assert all(x.view for x in seen.contributions)
    checked = [r.getMessage() for r in caplog.records if "whose view held" in r.getMessage()]
    assert len(checked) == 1 and d.id[:12] in checked[0] and "announced id" in checked[0]  # fetched whole once
    assert not refusals.peers()  # B's claim left out an invalid payload: no censor


class ViewsOnly(PayloadStore):
    """A sender gone from the swarm but for one last answer (fault injection): it still serves its
    payload's view, and a request for the whole payload finds nobody there (it times out; no record
    of the sender is in the DHT any more)."""

    def __init__(self) -> None:
        super().__init__()
        self.gone = threading.Event()  # set at the end of the test: the hung requests return

    def get(self, t: int, stage: int, sender: str | None = None) -> bytes | None:
        self.gone.wait(timeout=30.0)  # past any fetch's timeout (a gather's rpc_s: at most 3 s)
        return None


def test_a_view_whose_whole_nobody_serves_after_its_sender_left_is_given_up_and_the_claim_followed(caplog):
    """A's payload reached the observer C as a view; A has left (no record), nobody serves it whole,
    and B, the holder of stage 0, committed without it: C gives the view up and commits B's set, as a
    holder that fetches stage 0 whole drops a payload it could not fetch before its sender left (else
    C's T⊥ would move by another u than stage 0's: `peer bench chaos`)."""
    caplog.set_level(logging.WARNING)
    nodes: list[Node] = []
    try:
        first = SwarmDHT()
        nodes.append(Node(first, ViewsOnly(), ClientPool(timeout_s=5.0)))
        for _ in range(2):
            nodes.append(
                Node(SwarmDHT(initial_peers=first.visible_maddrs()), PayloadStore(), ClientPool(timeout_s=5.0))
            )
        for node in nodes:
            node.dht.set_run("embed-views-lost-test", CFG.stages)
            node.server = PeerServer(PeerService(CFG, {}, node.store, node.id, "full"), host="127.0.0.1", port=0)
        a, b, c = nodes
        from_a, from_b = _payload(11, 1e-2), _payload(12, 1e-2)
        a.store.put(0, 0, from_a)  # its announcement only: A published no replica record (it left)
        record = {"sha256": payload_id(from_a), "size": len(from_a), "address": a.address, "replica": a.id}
        a.dht.announce_payload(0, 0, record, ttl_s=60)
        _announce(b, from_b)
        link = {"t": 0, "prev": "s0", "set": [list(entry(b.id, payload_id(from_b)))]}
        b.dht.announce_stage(0, {"address": b.address, "outer_step": 1, "state_id": "s1", "link": link}, ttl_s=60)

        seen = _observe(c)

        assert seen.followed is not None and seen.followed.peer == b.id
        assert seen.replicas == [b.id] and a.id in seen.rejected and not seen.timed_out
        given_up = [r.getMessage() for r in caplog.records if "giving up the view" in r.getMessage()]
        assert len(given_up) == 1 and a.id[:12] in given_up[0]
    finally:
        if nodes and isinstance(nodes[0].store, ViewsOnly):
            nodes[0].store.gone.set()
        for node in nodes:
            if node.server is not None:
                node.server.stop(grace_s=0.5)
            node.clients.close()
            node.dht.shutdown()


class Counting(PayloadStore):
    """A real store that counts the views it served (`PeerService.get_payload` asks it for each)."""

    def __init__(self) -> None:
        super().__init__()
        self.served = 0

    def view(self, t: int, stage: int, sender: str | None = None) -> bytes | None:
        made = super().view(t, stage, sender)
        self.served += made is not None
        return made


@pytest.fixture
def relays(reap_children):
    """A and B send stage 0; C and F hold stage 1 (announcers of round (0, 1)); D holds stage 1 and
    serves a wrong view for everything; E holds stage 2 and reads stage 0's views through stage 1's."""
    stores = [Counting(), Counting(), Counting(), Counting(), Lying(b"wrong"), PayloadStore()]
    with _peers(stores, "embed-relay-test", "stage") as nodes:
        yield nodes


def _announce_stage1(node: Node, seed: int) -> None:
    """`node` contributes to round (0, 1), so it is one of the relays a holder of stage 2 asks."""
    data = _payload(seed, 1e-2)  # any payload: only its announcement (who, where) matters to the relay
    node.store.put(0, 1, data)
    record = {"sha256": payload_id(data), "size": len(data), "address": node.address, "replica": node.id}
    node.dht.announce_payload(0, 1, record, ttl_s=60)


def _observe_stage2(node: Node) -> RoundResult:
    """Stage 0's round as a holder of stage 2 reads it (`round_reading`: views, stage 1's holders first)."""
    ctx = round_context(node.dht, node.clients, node.store, node.address, cfg=CFG)
    reading = view_validator(SHAPES0, CFG.sparseloco, relay=1)
    return gather_round(ctx, 0, 0, TIMINGS, RoundInputs(validate=reading))


def test_a_holder_of_stage_2_reads_stage_0s_views_from_stage_1s_holders_not_from_stage_0(relays):
    """Stage 0's senders serve each view once, to the holder of stage 1; the holder of stage 2 gets
    the same bytes from it (docs/protocol.md, "Embedding views": relays)."""
    a, b, c, f, _, e = relays
    _announce(a, from_a := _payload(31, 1e-2))
    _announce(b, _payload(32, 5e-2))
    _announce_stage1(c, 33)
    _announce_stage1(f, 34)  # a relay that never observed stage 0: it answers "not here"
    by_c = _observe(c)
    assert all(isinstance(n.store, Counting) for n in (a, b, c, f))
    assert (a.store.served, b.store.served) == (1, 1)

    seen = _observe_stage2(e)

    assert seen.replicas == by_c.replicas == sorted([a.id, b.id]) and not seen.timed_out
    assert [x.data for x in seen.contributions] == [x.data for x in by_c.contributions]
    assert all(x.view for x in seen.contributions)
    assert (a.store.served, b.store.served) == (1, 1)  # stage 0 served nothing more
    assert c.store.served == 2 and f.store.served == 0  # both views relayed by C
    assert np.array_equal(_bits(stage0_change(CFG, seen.contributions)), _bits(stage0_change(CFG, by_c.contributions)))
    assert e.store.view(0, 0, a.id) == view_bytes(from_a, Payload.from_bytes(from_a))  # relayed on in turn


def test_views_no_relay_holds_come_from_their_senders_once_the_wait_is_over(relays, caplog):
    """Stage 1's holders are F, which never fetched the views, and D, which serves wrong bytes: the
    holder of stage 2 asks them until the wait (`relay_wait_s`) is over, then the senders."""
    caplog.set_level(logging.WARNING)
    a, b, _, f, d, e = relays
    _announce(a, from_a := _payload(41, 1e-2))
    _announce(b, from_b := _payload(42, 1e-2))
    _announce_stage1(f, 43)
    _announce_stage1(d, 44)

    seen = _observe_stage2(e)

    assert seen.replicas == sorted([a.id, b.id]) and not seen.timed_out
    assert sorted(x.data for x in seen.contributions) == sorted(
        view_bytes(x, Payload.from_bytes(x)) for x in (from_a, from_b)
    )
    assert isinstance(a.store, Counting) and isinstance(b.store, Counting)
    assert (a.store.served, b.store.served) == (1, 1)
    wrong = [r.getMessage() for r in caplog.records if "served a wrong view" in r.getMessage()]
    assert wrong and all(d.id[:12] in m for m in wrong)
    assert seen.wall_s >= relay_wait_s(TIMINGS.deadline_s)  # the senders were asked only after the wait

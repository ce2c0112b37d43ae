"""A sender announces one payload per round, over a real hivemind DHT on 127.0.0.1.

A holder that re-syncs while its round t is in flight redoes outer step t and encodes another
payload; a peer restarted with its identity (`--resume`) may redo a round its killed process
announced. Either would replace its announcement of round t (one record per sender), and a set the
other holders committed from the first payload would then name a payload "no replica announced":
an honest claimer refused as a forger (a chaos run found both). Here:
- a second gather of round t in the same process contributes the first payload again, and the
  DHT's announcement still carries it;
- a new process with the same identity observes round t instead of announcing over the record of
  its killed process, and contributes to a round that process never announced.
"""

from __future__ import annotations

import pytest
import torch

from peer.config import build_config
from peer.core.sparseloco.algorithm import compress
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.transport.server import PeerServer
from peer.node.presence import Presence
from peer.node.round.gather import gather_round
from peer.node.round.payloads import PayloadStore, announce, first_payload, payload_validator
from peer.node.round.result import RoundInputs
from peer.node.round.timings import RoundTimings
from peer.node.service import PeerService
from tests.round_helpers import own, round_context

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

CFG = build_config(environ={})
SHAPES = {"layers.2.attn.wq.weight": (64, 64)}
TIMINGS = RoundTimings(8.0, poll_s=0.1, ttl_s=60)
T, STAGE = 7, 1


def _payload(seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    delta = {n: torch.randn(s, generator=gen) * 1e-2 for n, s in SHAPES.items()}
    return compress(delta, None, CFG.sparseloco)[0].to_bytes()


def _announced(dht: SwarmDHT, t: int = T) -> str | None:
    ann = dht.get_payloads(t, STAGE).get(dht.peer_id)
    return None if ann is None else ann.sha256


def test_a_second_gather_of_a_round_sends_the_first_payload_again(tmp_path):
    dht = SwarmDHT()
    dht.set_run("one-payload", CFG.stages)
    store, clients = PayloadStore(), ClientPool(timeout_s=5.0)
    server = PeerServer(PeerService(CFG, {}, store, dht.peer_id, "full"), host="127.0.0.1", port=0)
    try:
        record = {"address": server.address, "kind": "full", "outer_step": T, "joined_at": 0}
        dht.announce_replica(record, ttl_s=60)
        ctx = round_context(dht, clients, store, server.address, inc="one", cfg=CFG)
        validate = payload_validator(SHAPES, CFG.sparseloco)
        first, redone = own(dht.peer_id, _payload(1)), own(dht.peer_id, _payload(2))
        assert first.sha256 != redone.sha256
        a = gather_round(ctx, T, STAGE, TIMINGS, RoundInputs(first, validate))
        assert [c.sha256 for c in a.contributions] == [first.sha256]
        # a re-sync made this holder redo outer step T: its gather of round T runs again with another payload
        b = gather_round(ctx, T, STAGE, TIMINGS, RoundInputs(redone, validate))
        assert [c.sha256 for c in b.contributions] == [first.sha256]  # the payload the others may have committed
        assert _announced(dht) == first.sha256
        assert store.mine(T, STAGE).sha256 == first.sha256
    finally:
        server.stop(grace_s=0.5)
        clients.close()
        dht.shutdown()


def test_a_restarted_peer_observes_the_round_its_killed_process_announced(tmp_path):
    key = tmp_path / "identity.key"
    anchor = SwarmDHT()  # keeps the records while the peer restarts
    killed = SwarmDHT(initial_peers=anchor.visible_maddrs(), identity_path=key)
    peer_id = killed.peer_id
    killed.set_run("one-payload", CFG.stages)
    restarted = None
    try:
        store = PayloadStore()
        announced = own(peer_id, _payload(1))
        first = Presence(peer_id, "full", incarnation="one")
        assert first_payload(killed, store, first, T, STAGE, announced) is announced  # nothing announced yet
        announce(killed, T, STAGE, announced, store, "127.0.0.1:1", "one", None, 8.0, 60)
        killed.shutdown()

        restarted = SwarmDHT(initial_peers=anchor.visible_maddrs(), identity_path=key)
        assert restarted.peer_id == peer_id
        restarted.set_run("one-payload", CFG.stages)
        store, me = PayloadStore(), Presence(peer_id, "full", incarnation="two", joined_at=T)  # resumed at T
        redone = own(peer_id, _payload(2))
        assert _announced(restarted) == announced.sha256
        assert first_payload(restarted, store, me, T, STAGE, redone) is None  # observe round T
        assert _announced(restarted) == announced.sha256  # the record its process made is left in place
        assert me.joined_at == T + 1  # its next record: not expected in round T
        same = own(peer_id, _payload(1))
        assert first_payload(restarted, store, me, T, STAGE, same) is same  # that very payload: nothing replaced
        later = own(peer_id, _payload(3))
        assert first_payload(restarted, store, me, T + 1, STAGE, later) is later  # a round it never announced
    finally:
        if restarted is not None:
            restarted.shutdown()
        anchor.shutdown()


def test_a_holder_far_behind_the_swarm_announces_nothing_for_the_round_it_left():
    """A holder still at round T while the swarm is at T + 5 observes T (its gather re-syncs at once):
    a record made now would outlive the round's own and keep an expiring round looking young."""
    ahead = SwarmDHT()
    ahead.set_run("one-payload", CFG.stages)
    behind = SwarmDHT(initial_peers=ahead.visible_maddrs())
    behind.set_run("one-payload", CFG.stages)
    try:
        record = {"address": "127.0.0.1:1", "kind": "full", "outer_step": T + 5, "joined_at": 0}
        ahead.announce_replica(record, ttl_s=60)
        me, store = Presence(behind.peer_id, "full", joined_at=0), PayloadStore()
        late = own(behind.peer_id, _payload(4))
        assert first_payload(behind, store, me, T, STAGE, late) is None
        assert _announced(behind) is None and store.mine(T, STAGE) is None
        assert first_payload(behind, store, me, T + 4, STAGE, late) is late  # one round behind: not closed yet
    finally:
        behind.shutdown()
        ahead.shutdown()

"""A late joiner verifies instead of counting (issue 34): real hivemind DHT nodes, real gRPC on
127.0.0.1, the peers' own `Records` / `Resync` / `Replayer` code.

Stage 0 of the tiny run is held by five identities. Two honest holders A and B committed
`ROUNDS` rounds (real payloads, real portable commits: tests/replay_helpers.py), announce their
payloads, serve them and publish their links through their records thread. Three colluders F1–F3
claim the initial state negated at the same outer step — a strict majority of the stage's holders,
which the old rule (`peer.node.round.claims.majority`) would have downloaded — and publish false links:
F1 and F2 the honest set of every round with another state, F3 a set padded with a payload nobody
announced. A late joiner J replays the rounds from the canonical initial state: it ends on the
honest holders' state id, refuses the three colluders, and never downloads a state.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from peer.config import history_ttl_s
from peer.net.dht import SwarmDHT
from peer.net.transport.server import PeerServer
from peer.node.round.claims import Link, entry, majority, parse_claims
from peer.node.round.payloads import payload_id
from peer.node.round.replay import chain_record
from peer.node.service import PeerService
from peer.node.session import Session, SessionOptions
from peer.node.stage.worker import StageWorker
from tests.replay_helpers import History, replay_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

ROUNDS = 6
STAGE = 0


def _session(dht: SwarmDHT, cfg, root: Path, name: str) -> Session:
    return Session(SessionOptions(initial_peers=(), data_dir=root / name), dht, {}, cfg, role="full", stage=None)


def _negated_state(cfg) -> str:
    w = StageWorker(cfg, STAGE)
    negated = {n: -v for n, v in w.state_dict()["start"].items()}
    w.load_state_dict({"outer_step": ROUNDS, "start": negated, "perp": w.state_dict()["perp"]})
    return w.state_id()


def test_a_late_joiner_replays_the_honest_history_while_three_of_five_holders_claim_a_forgery(tmp_path, reap_children):
    cfg = replay_config(history_rounds=ROUNDS + 2)
    dhts: list[SwarmDHT] = []
    sessions: list[Session] = []
    try:
        dhts.append(SwarmDHT())
        dhts += [SwarmDHT(initial_peers=dhts[0].visible_maddrs()) for _ in range(5)]
        for dht in dhts:
            dht.set_run("join-test", cfg.stages)
        a_dht, b_dht, *forgers, j_dht = dhts
        history = History(cfg, replicas=(a_dht.peer_id, b_dht.peer_id))
        history.run(ROUNDS)
        ttl = history_ttl_s(cfg.swarm)
        for dht in (a_dht, b_dht):  # the honest holders: serve, announce, publish (records thread)
            session = _session(dht, cfg, tmp_path, dht.peer_id[-6:])
            sessions.append(session)
            worker = history.workers[(dht.peer_id, STAGE)]
            session.service = PeerService(cfg, {STAGE: worker}, session.store, session.peer_id, "full")
            session.server = PeerServer(session.service, host="127.0.0.1", port=0)
            session.me.address = session.server.address
            for t in range(ROUNDS):
                data = history.payloads[(t, STAGE, dht.peer_id)]
                session.store.put(t, STAGE, data)
                address = session.me.address
                ann = {"sha256": payload_id(data), "size": len(data), "address": address, "replica": dht.peer_id}
                dht.announce_payload(t, STAGE, ann, ttl_s=ttl)
            session.records.announce(
                lambda s=session, w=worker: s.records.stage(w, role="trainer"),
                lambda s=session, w=worker: s.records.replica("full", w.outer_step, 0, None, 0.0),
            )
        forged_state = _negated_state(cfg)
        for i, dht in enumerate(forgers):  # three colluders: the majority, and false links
            dht.announce_stage(STAGE, {"outer_step": ROUNDS, "state_id": forged_state, "address": ""}, ttl_s=ttl)
            replica = {"kind": "full", "outer_step": ROUNDS, "shard": 1 + i, "joined_at": 0, "address": ""}
            dht.announce_replica({**replica, "loss": None, "tokens_per_s": 0.0}, ttl_s=ttl)
            for t in range(ROUNDS):
                honest = history.links[(t, STAGE)]
                if i < 2:
                    link = Link(t, honest.prev, f"{i:016x}", honest.entries)
                else:
                    link = Link(t, honest.prev, forged_state, (*honest.entries, entry("Made" * 10, "ab" * 16)))
                dht.announce_round("chain", t, STAGE, chain_record(link), ttl)

        joiner = _session(j_dht, cfg, tmp_path, "joiner")
        sessions.append(joiner)
        claims = parse_claims(j_dht.get_stage_peers(STAGE), j_dht.peer_id)
        deadline = time.monotonic() + 30
        while len(claims) < 5 and time.monotonic() < deadline:  # the records thread's first publish
            time.sleep(0.2)
            claims = parse_claims(j_dht.get_stage_peers(STAGE), j_dht.peer_id)
        win = majority(claims.values(), ROUNDS)
        assert win is not None and win.state == forged_state  # what counting identities would adopt

        worker = StageWorker(cfg, STAGE)
        started = time.perf_counter()
        joiner.resync.late_join(worker)
        took = time.perf_counter() - started
        done = joiner.resync.replayed[-1]
        print(f"replayed {done.rounds} rounds of stage {STAGE} in {took:.2f} s, {done.bytes} payload bytes")
        assert worker.outer_step == ROUNDS and worker.state_id() == history.state(STAGE) != forged_state
        assert joiner.resync.refusals.peers() == {d.peer_id for d in forgers}
        assert worker.verified and joiner.resync.count == 1 and worker.optim.errors is None
        assert joiner.me.joined_at == ROUNDS + 1  # contributes from the next round
    finally:
        for session in sessions:
            session.close()
        for dht in dhts:
            if all(dht is not s.dht for s in sessions):
                dht.shutdown()

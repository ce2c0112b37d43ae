"""A repeated outlier is banned: real hivemind DHT nodes, real gRPC on 127.0.0.1, the peers' own
`Rounds` / `Resync` / `Records` code (peer.node.round.bans, issue 12 item 5).

Stage 1 is held by two honest full replicas A and B; X announces a poisoned payload (its own Δ̂ ×
−1e4) in every round and never gathers (an attacker does not run our code). Rounds 0–2: screening
drops X on both holders, and after the third drop both ban it. Rounds 3–4: neither fetches X's
payload (bytes fetched = the other honest payload only; X is logged as banned) and both commit {A,
B} with the same hashes. Before round 4 a late holder C replays rounds 0–3 from the initial state
over the links and payloads they keep (it computes the bans itself) and then follows round 4's
committed set as an observer (the bans come with the set): it fetches only A's and B's payloads and
ends bit-identical, bans included.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from peer.config import build_config
from peer.core.sparseloco.algorithm import compress, decompress
from peer.core.sparseloco.codec.format import Payload
from peer.net.dht import SwarmDHT
from peer.net.transport.server import PeerServer
from peer.node.round.contribution import encoded
from peer.node.round.payloads import PayloadStore, payload_id
from peer.node.round.result import RoundResult
from peer.node.service import PeerService
from peer.node.session import Session, SessionOptions
from peer.node.stage.worker import StageWorker

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STAGE = 1


@dataclass
class Holder:
    session: Session
    worker: StageWorker

    @property
    def id(self) -> str:
        return self.session.peer_id


def _cfg():
    cfg = build_config(environ={})
    swarm = dataclasses.replace(cfg.swarm, rpc_timeout_s=5.0, round_timeout_s=30.0, ban_after=3, ban_rounds=10)
    return dataclasses.replace(cfg, swarm=swarm)


def _shapes(worker: StageWorker) -> dict[str, tuple[int, ...]]:
    """The stage's small tensors: a payload may carry a subset of the parameters (screening stays fast)."""
    return {name: tuple(v.shape) for name, v in sorted(worker.start.items()) if v.numel() <= 4096}


def _honest(shapes, cfg, t: int, i: int) -> Payload:
    g = torch.Generator().manual_seed(100 * t + i)
    return compress({n: torch.randn(s, generator=g) * 1e-2 for n, s in shapes.items()}, None, cfg.sparseloco)[0]


def _holder(dht: SwarmDHT, cfg, root: Path, name: str, shard: int, serve: bool = True) -> Holder:
    opts = SessionOptions(initial_peers=(), data_dir=root / name)
    session = Session(opts, dht, {}, cfg, role="full", stage=None)
    worker = StageWorker(cfg, STAGE)
    if serve:
        session.service = PeerService(cfg, {STAGE: worker}, session.store, session.peer_id, "full")
        session.server = PeerServer(session.service, host="127.0.0.1", port=0)
        session.me.address = session.server.address
        session.records.announce(
            lambda: session.records.stage(worker, role="trainer"),
            lambda: session.records.replica("full", worker.outer_step, shard, None, 0.0),
        )
    return Holder(session, worker)


@pytest.fixture
def swarm(tmp_path, reap_children):
    cfg = _cfg()
    dhts: list[SwarmDHT] = []
    holders: list[Holder] = []
    attacker: PeerServer | None = None
    try:
        # every DHT node first: hivemind forks, and no gRPC thread may exist when it does
        dhts.append(SwarmDHT())
        dhts += [SwarmDHT(initial_peers=dhts[0].visible_maddrs()) for _ in range(3)]
        for dht in dhts:
            dht.set_run("ban-test", cfg.stages)
        a, b = (_holder(dhts[i], cfg, tmp_path, name, i) for i, name in enumerate("ab"))
        holders += [a, b]
        store = PayloadStore()
        attacker = PeerServer(PeerService(cfg, {}, store, dhts[2].peer_id, "full"), host="127.0.0.1", port=0)
        holders.append(_holder(dhts[3], cfg, tmp_path, "c", 3, serve=False))  # the late holder
        yield cfg, a, b, (dhts[2], store, attacker), holders[2]
    finally:
        for h in holders:
            h.session.close()  # its records, server, clients and DHT node
        if attacker is not None:
            attacker.stop(grace_s=0.5)
        for dht in dhts:
            if all(dht is not h.session.dht for h in holders):
                dht.shutdown()


def _attack(x, cfg, t: int, honest: Payload) -> int:
    """X's round t: announce its own Δ̂ × −1e4 (well-formed, huge) and keep its replica record at t."""
    dht, store, server = x
    poison = compress({n: v * -1e4 for n, v in decompress(honest).items()}, None, cfg.sparseloco)[0].to_bytes()
    store.put(t, STAGE, poison)
    record = {"sha256": payload_id(poison), "size": len(poison), "address": server.address, "replica": dht.peer_id}
    dht.announce_payload(t, STAGE, record, ttl_s=60)
    replica = {"address": server.address, "kind": "full", "outer_step": t, "shard": 2, "joined_at": 0}
    dht.announce_replica({**replica, "loss": None, "tokens_per_s": 0.0}, ttl_s=60)
    return len(poison)


def _round(h: Holder, t: int, payload: Payload | None, stop: threading.Event) -> RoundResult:
    """One holder's round through its session's own code: gather (contributing when `payload`), commit, record."""
    rounds = h.session.rounds
    own = encoded(h.id, payload) if payload is not None else None
    result = rounds.gather(h.worker, t, h.id if payload is not None else None, stop, payload=own)
    assert rounds.commit({STAGE: h.worker}, {STAGE: result})
    rounds.record(t, {STAGE: (h.worker, result.participants)}, None, None, result.wall_s)
    return result


def _state(h: Holder) -> tuple[int, str, str, dict]:
    w = h.worker
    return w.outer_step, w.param_hash(), w.perp_hash(), w.ledger.bans.to_record()


def test_a_replica_dropped_three_rounds_in_a_row_is_no_longer_fetched_and_holders_agree(swarm, caplog):
    caplog.set_level(logging.INFO)
    cfg, a, b, x, c = swarm
    x_id = x[0].peer_id
    shapes = _shapes(a.worker)
    stop = threading.Event()
    with ThreadPoolExecutor(max_workers=3) as pool:
        for t in range(5):
            pa, pb = _honest(shapes, cfg, t, 0), _honest(shapes, cfg, t, 1)
            _attack(x, cfg, t, pa)
            if t == 4:  # C replays rounds 0-3 (their state, with its bans), then follows round 4
                c.session.resync.sync_state(c.worker, "late join")
                assert _state(c) == _state(a) == _state(b)
            jobs = [pool.submit(_round, a, t, pa, stop), pool.submit(_round, b, t, pb, stop)]
            observer = pool.submit(_round, c, t, None, stop) if t == 4 else None
            ra, rb = (j.result(timeout=120) for j in jobs)
            assert _state(a) == _state(b), t  # identical commits, hashes and bans every round
            assert not ra.timed_out and not rb.timed_out
            if t < 3:  # screened out, still fetched
                assert ra.replicas == rb.replicas == sorted([a.id, b.id, x_id])
                assert a.worker.ledger.last_dropped == b.worker.ledger.last_dropped == [x_id]
                assert (x_id[:16] in a.worker.ledger.bans.banned(t + 1)) == (t == 2)
            else:  # banned: out of the round, its payload never fetched
                assert ra.replicas == rb.replicas == sorted([a.id, b.id])
                assert x_id in ra.dropped and x_id in rb.dropped
                assert ra.bytes_fetched == len(pb.to_bytes()) and rb.bytes_fetched == len(pa.to_bytes())
    assert observer is not None
    rc = observer.result(timeout=120)
    assert rc.followed is not None and rc.replicas == sorted([a.id, b.id])  # followed the committed set
    assert rc.bytes_fetched == len(pa.to_bytes()) + len(pb.to_bytes())  # not X's
    assert _state(c) == _state(a) == _state(b)
    assert a.worker.ledger.bans.banned(5) == {x_id[:16]} and a.worker.ledger.bans.entries[x_id[:16]].until == 2 + 1 + 10
    banned_logs = [r for r in caplog.records if "banned as a repeated outlier" in r.getMessage()]
    assert banned_logs and all(x_id[:12] in r.getMessage() for r in banned_logs)
    started = [r for r in caplog.records if "dropped as an outlier in 3 rounds in a row" in r.getMessage()]
    # once per holder that computed it (one that followed the other took its bans), and C, which
    # recomputed rounds 0-3 when it joined by replay (docs/protocol.md, "Joining by replay")
    assert 1 <= len(started) <= 3

"""A voted round (docs/protocol.md, VOTED) over a loopback swarm: real hivemind DHT nodes and PeerServers.

Eight holders of a stage (the small preset's real stage shapes) each hold a random error buffer e and
run `gather_voted` in threads of this process: votes, the roster, supports, values, means. They must
- all take the same roster, the same support and the same mean shard of every range, each mean
  shard the bytes the core functions give from the eight e's (`range_support`, `values_part`,
  `mean_shard`), so a commit from the same start gives one sha256 on every holder;
- refuse an owner that publishes and serves a mean shard other than the mean of the values it
  names, and commit the honest one;
- refuse an owner that publishes and serves a support other than the tally of the votes it names;
- survive an owner killed after the roster (a ninth holder in its own process): its co-owners'
  supports and means are taken, and its missing values count as zero in every mean.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from peer.core.sparseloco.ranges.owner import Shard
from peer.core.sparseloco.ranges.voted import voted_keep
from peer.core.sparseloco.ranges.voted_range import (
    SUPPORT,
    Support,
    mean_shard,
    parse_values,
    parse_votes,
    range_support,
    values_part,
    vote_parts,
)
from peer.errors import PeerError
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.range_records import RosterRecord, ShardsRecord
from peer.net.transport.server import PeerServer
from peer.node.round.payloads import PayloadStore
from peer.node.round.ranges.ownership import owners
from peer.node.round.ranges.voted import VotedResult, gather_voted, sent_adjustment
from peer.node.round.refusals import Refusals
from peer.node.round.timings import RoundTimings
from peer.node.service import PeerService
from tests.integration.test_ranges_round import (  # one loopback swarm's helpers
    STAGE,
    TIMINGS,
    M,
    Node,
    _on_put_shard,
    _plan,
    _shapes,
    _small,
    holders,
)
from tests.integration.test_ranges_round import _check_agreed as _agreed_ranges

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def swarm():
    cfg = _small("exact")
    with holders(cfg, "voted-round-test") as nodes:
        yield cfg, nodes


def _errors(cfg, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=gen) * 1e-2 for name, shape in _shapes(cfg).items()}


def _round(cfg, nodes: list[Node], t: int, timings: RoundTimings = TIMINGS) -> list[VotedResult | None]:
    plan = _plan(cfg)
    for node in nodes:
        node.present()

    def run(i: int) -> VotedResult | None:
        node = nodes[i]
        try:
            own = (node.id, _errors(cfg, 100 * t + i))
            return gather_voted(node.context(cfg), t, STAGE, timings, plan, own=own)
        except PeerError:
            return None

    with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
        return list(pool.map(run, range(len(nodes))))


def _reference(cfg, results: list[VotedResult], nodes: list[Node], t: int) -> dict[int, bytes]:
    """Every range's mean shard as the core functions give it from the roster members' e (roster order)."""
    plan, slc = _plan(cfg), cfg.sparseloco
    keep = voted_keep(cfg.swarm.shard_topk, slc.topk)
    roster = results[0].roster
    assert roster is not None
    by_id = {node.id: 100 * t + i for i, node in enumerate(nodes)}
    es = [_errors(cfg, by_id[e.sender]) for e in roster.entries]
    votes = [vote_parts(e, plan, slc) for e in es]
    out = {}
    for r in range(plan.n):
        parsed = [parse_votes(v[r], plan, r, slc) for v in votes]
        support = range_support(t, STAGE, r, plan, parsed, roster.digest, slc, keep, cfg.seed)
        values = [parse_values(values_part(e, plan, support, slc), plan, support, slc, keep) for e in es]
        out[r] = mean_shard(plan, support, values, slc, cfg.swarm.mean_bits).to_bytes()
    return out


def _check_agreed(cfg, results: list[VotedResult]) -> None:
    """The ranges round's agreement (one roster, the same bytes of every range's mean, one committed state) and
    the same support of every range."""
    _agreed_ranges(cfg, results)
    assert all(result.supports == results[0].supports for result in results)


def test_eight_holders_commit_the_mean_the_core_computes(swarm):
    cfg, nodes = swarm
    results = _round(cfg, nodes, t=1)
    assert all(r is not None for r in results)
    done = [r for r in results if r is not None]
    _check_agreed(cfg, done)
    assert len(done[0].replicas) == M and not any(r.refused or r.computed for r in done)
    want = _reference(cfg, done, nodes, 1)
    assert {r: s.data for r, s in done[0].shards.items()} == want
    by_id = {node.id: 100 + i for i, node in enumerate(nodes)}
    for r in done:  # every contribution is in every mean: e − v̂ on every support is what each sender keeps
        assert r.errors is not None and r.position is not None
        sent = sent_adjustment(r, _plan(cfg), cfg.sparseloco)
        e = _errors(cfg, by_id[r.roster.entries[r.position].sender])
        assert sent is not None and all(torch.equal(e[n] + sent[n], r.errors[n]) for n in e)
        print(f"voted round M={M}: fetched {r.fetched.total} B (vote parts {r.payload_bytes} B), timings {r.timings}")


@contextlib.contextmanager
def _lying(node: Node, magic: bytes, lie: Callable[[bytes], bytes], kind: str):
    """`node` serves `lie(record)` for each record with `magic` it makes, and publishes the lie's hash
    in its `kind` record (a consistent lie: only a recomputation shows it)."""
    lies: dict[str, str] = {}

    def wrap(r: int, data: bytes) -> bytes:
        if not data.startswith(magic):
            return data
        bad = lie(data)
        lies[hashlib.sha256(data).hexdigest()] = hashlib.sha256(bad).hexdigest()
        return bad

    announce = node.dht.announce_round

    def announce_round(k, t, stage, record, ttl_s):
        if k == kind:
            record = {**record, "shards": {r: lies.get(h, h) for r, h in record["shards"].items()}}
        announce(k, t, stage, record, ttl_s)

    node.dht.announce_round = announce_round  # type: ignore[method-assign]
    try:
        with _on_put_shard(node, wrap):
            yield
    finally:
        del node.dht.announce_round


def _doubled_mean(cfg):
    plan, coded = _plan(cfg), dataclasses.replace(cfg.sparseloco, quant_bits=cfg.swarm.mean_bits)

    def lie(data: bytes) -> bytes:
        n = int.from_bytes(data[37:41], "little")  # the shard header's roster size
        shard = Shard.from_bytes(data, plan, coded, n, exact=True)
        first, *rest = shard.payload.entries
        first = dataclasses.replace(first, values=(first.values * 2).astype(np.float32))
        if first.codebook is not None:  # the mean's values are codes: double their magnitudes
            first = dataclasses.replace(first, codebook=(first.codebook * 2).astype(np.float32))
        return dataclasses.replace(shard, payload=dataclasses.replace(shard.payload, entries=(first, *rest))).to_bytes()

    return lie


def _shifted_support(cfg):
    plan, keep = _plan(cfg), voted_keep(cfg.swarm.shard_topk, cfg.sparseloco.topk)

    def lie(data: bytes) -> bytes:
        n = int.from_bytes(data[36:40], "little")  # the support header's roster size
        s = Support.from_bytes(data, plan, cfg.sparseloco, keep, n)
        other = range_support(s.t, s.stage, s.r, plan, [None] * n, s.roster, cfg.sparseloco, keep, seed=12345)
        return dataclasses.replace(s, sets=other.sets).to_bytes(plan, cfg.sparseloco, keep)  # not its votes' tally

    return lie


LIES = RoundTimings(deadline_s=40.0, grace_s=2.0, poll_s=0.1, ttl_s=60)  # the lying owners' rounds


@pytest.mark.parametrize("what", ["mean", "support"])
def test_a_lying_owner_is_refused_and_the_honest_record_committed(swarm, what):
    cfg, nodes = swarm
    for node in nodes:  # a liar is refused for the run (by design): each case starts with none refused
        node.refusals = Refusals()
    t = 2 if what == "mean" else 3
    liar = nodes[3 if what == "mean" else 5]
    if what == "mean":
        ctx = _lying(liar, b"SHRD", _doubled_mean(cfg), "shards")
    else:
        ctx = _lying(liar, SUPPORT, _shifted_support(cfg), "supports")
    with ctx:  # a shard deadline (20 s) no loaded CI box reaches: a holder past it computes a range unchecked
        results = _round(cfg, nodes, t=t, timings=LIES)
    honest = [r for node, r in zip(nodes, results, strict=True) if node is not liar and r is not None]
    assert len(honest) == M - 1
    _check_agreed(cfg, honest)
    for node, result in zip(nodes, results, strict=True):
        if node is not liar:  # every honest holder saw the lie, checked it and refused its owner
            assert result is not None, f"{node.id[:12]} did not finish the round"
            assert liar.id in result.refused and liar.id in node.refusals, (
                f"{node.id[:12]} did not refuse the liar: computed ranges {result.computed}, timings {result.timings}"
            )


def voted_victim_main() -> None:
    """A ninth holder in its own process (argv: the first node's multiaddr): it sets up like the
    others, prints its peer id, waits for the go (stdin), runs voted round 4 and SIGKILLs itself once
    it has tallied its first range, before it publishes its supports (after the roster: an owner)."""
    cfg = _small("exact")
    dht = SwarmDHT(initial_peers=[sys.argv[1]])
    dht.set_run("voted-round-test", cfg.stages)
    node = Node(dht, PayloadStore(), ClientPool(timeout_s=5.0))
    node.server = PeerServer(PeerService(cfg, {}, node.store, node.id, "full"), host="127.0.0.1", port=0)
    record = {"address": node.address, "kind": "full", "outer_step": 5, "shard": M, "joined_at": 0}
    dht.announce_replica(record, ttl_s=120)
    plan, t = _plan(cfg), 4
    print(node.id, flush=True)
    assert int(sys.stdin.readline()) == t
    announce = dht.announce_payload

    def announced(*args, **kwargs):
        # the others start their round once our vote parts are announced: on a loaded machine this process
        # could otherwise announce past their deadline, and a roster closed without us tests nothing here
        done = announce(*args, **kwargs)
        print("announced", flush=True)
        return done

    dht.announce_payload = announced  # type: ignore[method-assign]

    def die(r: int, data: bytes) -> bytes:
        _wait_for_supports(dht, cfg, t, node.id)  # the others have its vote parts (or gave up on them)
        os.kill(os.getpid(), signal.SIGKILL)
        return data

    with _on_put_shard(node, die):
        gather_voted(node.context(cfg), t, STAGE, TIMINGS, plan, own=(node.id, _errors(cfg, 100 * t + M)))


def _wait_for_supports(dht: SwarmDHT, cfg, t: int, me: str, timeout_s: float = 30.0) -> None:
    """Until every other owner of a range of round t has published its supports (a wait on records)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        rosters = dht.get_round("roster", t, STAGE, RosterRecord.parse)
        if rosters:
            senders = next(iter(rosters.values())).senders
            wanted = {o for r in range(_plan(cfg).n) for o in owners(t, STAGE, r, senders, 2)} - {me}
            if wanted <= set(dht.get_round("supports", t, STAGE, ShardsRecord.parse)):
                return
        time.sleep(0.1)  # the poll interval of a record that is on its way
    raise AssertionError(f"the other owners of round {t} did not publish their supports within {timeout_s:.0f} s")


def test_an_owner_killed_after_the_roster_is_covered(swarm, reap_children):
    """A ninth holder owns ranges of round 4 and is SIGKILLed before it publishes their supports: its
    co-owners' supports are taken `swarm.owner_grace_s` after they published, the owners close the
    values without its record (`swarm.roster_quiet_s` after the eighth; both long before the shard
    deadline, 50 s here), it sends no values (a zero in each mean over the roster), and the eight others
    commit one state."""
    cfg, nodes = swarm
    quick = dataclasses.replace(cfg.swarm, owner_grace_s=1.0, roster_quorum=0.8)  # 8 of 9 values close quietly
    cfg = dataclasses.replace(cfg, swarm=quick)
    slow = RoundTimings(deadline_s=100.0, grace_s=2.0, poll_s=0.1, ttl_s=120)  # shard deadline 50 s
    for node in nodes:
        node.refusals = Refusals()
    code = "import sys; from tests.integration.test_voted_round import voted_victim_main; voted_victim_main()"
    maddr = nodes[0].dht.visible_maddrs()[0]
    victim = subprocess.Popen(
        [sys.executable, "-c", code, maddr], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert victim.stdout is not None and victim.stdin is not None
        victim_id = victim.stdout.readline().strip()
        assert victim_id, "the victim process did not start"
        deadline = time.monotonic() + 20.0
        while not all(victim_id in node.dht.get_replicas() for node in nodes):
            assert time.monotonic() < deadline, "the victim's replica record did not reach every holder"
            time.sleep(0.2)
        victim.stdin.write("4\n")
        victim.stdin.flush()
        assert victim.stdout.readline().strip() == "announced", "the victim did not announce its vote parts"
        results = _round(cfg, nodes, t=4, timings=slow)
        assert victim.wait(timeout=30) == -signal.SIGKILL, victim.stdout.read()
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert all(r is not None for r in results)
    done = [r for r in results if r is not None]
    _check_agreed(cfg, done)
    roster = done[0].roster
    assert roster is not None
    senders = [e.sender for e in roster.entries]
    assert victim_id in senders  # it died after the roster
    gone = senders.index(victim_id)
    assert any(victim_id in owners(4, STAGE, r, senders, 2) for r in range(_plan(cfg).n)), "it owned nothing"
    assert not any(r.refused for r in done)
    assert all(not s.shard.is_included(gone) for s in done[0].shards.values())  # no values from the dead
    walls = [r.timings["wall_s"] for r in done]
    print(f"rounds with a dead owner: {min(walls):.1f}–{max(walls):.1f} s")
    # the owners' grace and the quiet close, not the shard deadline (phase timings say which phase waited)
    assert max(walls) < slow.deadline_s / 2, [r.timings for r in done]


def test_a_sender_whose_vote_does_not_parse_is_left_out_of_the_round(swarm):
    """One holder announces (and proves) vote parts whose ranks no index set has (a stuffed or garbage
    vote): every owner refuses them whole, no support counts its vote, no mean includes its values,
    and all eight holders still commit one state."""
    cfg, nodes = swarm
    for node in nodes:
        node.refusals = Refusals()
    stuffer = nodes[6]
    put = stuffer.store.put_parts

    def put_parts(t: int, stage: int, parts: list[bytes]) -> None:
        if stage == STAGE:  # its vote parts (values parts go under values_stage): garbage ranks, still proven
            parts[:] = [p[:4] + b"\xff" * (len(p) - 4) for p in parts]  # in place: the announced root covers them
        put(t, stage, parts)

    stuffer.store.put_parts = put_parts  # type: ignore[method-assign]
    try:
        results = _round(cfg, nodes, t=5)
    finally:
        del stuffer.store.put_parts
    assert all(r is not None for r in results)
    done = [r for r in results if r is not None]
    _check_agreed(cfg, done)
    roster = done[0].roster
    assert roster is not None
    out = [e.sender for e in roster.entries].index(stuffer.id)
    assert all(not s.shard.is_included(out) for s in done[0].supports.values())
    assert all(not s.shard.is_included(out) for s in done[0].shards.values())
    assert all(s.shard.is_included(i) for s in done[0].shards.values() for i in range(M) if i != out)

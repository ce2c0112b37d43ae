"""`peer bench swarm --calibrate`: today's all-to-all on a real loopback swarm, and the simulator beside it.

Where this sits: the simulator (`peer.research.swarm.sim`) claims to reproduce a real round; this measures
one. M replicas of the tiny preset's stage 0, each a real hivemind DHT node and a real gRPC `PeerServer`
on 127.0.0.1 in this process (as tests/integration/test_round_hash.py builds them), run `gather_round`
at once in threads, each contributing a real SparseLoCo payload of the stage's real shapes; per round we
read every peer's `RoundResult.bytes_fetched` and `wall_s`.

The simulator is then given loopback's parameters as the rounds themselves met them (`Timed`: the
nodes' own calls timed in place; never fitted to the round times): one DHT read of a round (the medians
of the three gets `read_round` makes), a DHT store (median `announce_payload`) and the propagation past
its return (from a probe before the rounds), one payload request (median `get_payload`, plus the median
parse and checks of a fetched payload); links of 10 Gbit/s with no RTT; each peer's "compute time" is
when its gather thread began (mean over rounds). It reports the same two figures for the same M. A first
warm-up round (it opens the gRPC channel between every pair, which the simulator does not model) is run
and left out. On a loaded machine the real rounds are slower than the timed calls say (M peers' threads
also wait for a core between calls); the figures say the load average they ran under.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from peer.config import build_config
from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.algorithm import compress
from peer.net.dht import SwarmDHT
from peer.net.pool import ClientPool
from peer.net.transport.messages import PayloadRequest
from peer.net.transport.server import PeerServer
from peer.node.metrics import MetricsWriter
from peer.node.presence import Presence
from peer.node.round.context import RoundContext
from peer.node.round.contribution import received
from peer.node.round.gather import gather_round
from peer.node.round.payloads import PayloadStore, payload_id, payload_validator, read_round
from peer.node.round.refusals import Refusals
from peer.node.round.result import RoundInputs
from peer.node.round.timings import RoundTimings
from peer.node.service import PeerService
from peer.research.swarm.net import LinkClass, LinkMix
from peer.research.swarm.run import simulate
from peer.research.swarm.sim import SimConfig, summarize
from peer.research.swarm.sizes import Sizes

TIMINGS = RoundTimings(60.0, poll_s=0.2, ttl_s=120.0)
STAGE = 0


@dataclass
class Node:
    dht: SwarmDHT
    store: PayloadStore
    clients: ClientPool
    server: PeerServer | None = None
    ctx: RoundContext | None = None  # what a gather of this node takes (its DHT, clients, store), as a full replica


def _payload(cfg: Any, seed: int) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    shapes = stage_shapes(cfg.model, STAGE, cfg.stages)
    delta = {n: torch.randn(s, generator=gen) * 1e-2 for n, s in shapes.items()}
    return compress(delta, None, cfg.sparseloco)[0].to_bytes()


def _start(cfg: Any, M: int, stack: ExitStack) -> list[Node]:
    nodes: list[Node] = []
    first = SwarmDHT()  # every DHT node first: forked at once while no gRPC runs (peer.net.dht_child)
    stack.callback(first.shutdown)
    nodes.append(Node(first, PayloadStore(), ClientPool(timeout_s=10.0)))
    for _ in range(M - 1):
        dht = SwarmDHT(initial_peers=first.visible_maddrs())
        stack.callback(dht.shutdown)
        nodes.append(Node(dht, PayloadStore(), ClientPool(timeout_s=10.0)))
    metrics = MetricsWriter(Path(stack.enter_context(tempfile.TemporaryDirectory())), "full")  # a gather logs none
    stack.callback(metrics.close)
    for node in nodes:
        node.dht.set_run("swarm-calibration", cfg.stages)
        node.server = PeerServer(PeerService(cfg, {}, node.store, node.dht.peer_id, "full"), host="127.0.0.1", port=0)
        stack.callback(node.server.stop, 0.5)
        stack.callback(node.clients.close)
        me = Presence(node.dht.peer_id, "full", incarnation="", address=node.server.address)
        node.ctx = RoundContext(cfg, node.dht, node.clients, node.store, me, Refusals(), metrics, lambda: None)
    return nodes


def _records(nodes: list[Node], t: int) -> None:
    for i, node in enumerate(nodes):
        assert node.server is not None
        rec = {"address": node.server.address, "kind": "full", "outer_step": t, "shard": i, "joined_at": 0}
        node.dht.announce_replica({**rec, "loss": None, "tokens_per_s": 0.0}, ttl_s=120)


def _median_s(fn: Callable[[], Any], n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.monotonic()
        fn()
        times.append(time.monotonic() - t0)
    return statistics.median(times)


def probe(nodes: list[Node], data: bytes) -> dict[str, float]:
    """Loopback's parameters: a DHT read of a round, an announcement's delay until seen, one request."""
    a, b = nodes[0], nodes[-1]
    server = a.server
    assert server is not None
    read_s = _median_s(lambda: read_round(b.dht, 0, STAGE), 7)
    seen: list[float] = []
    stored: list[float] = []
    for k in range(5):
        t = 10_000 + k
        a.store.put(t, STAGE, data)
        rec = {"sha256": payload_id(data), "size": len(data), "address": server.address, "replica": a.dht.peer_id}
        t0 = time.monotonic()
        a.dht.announce_payload(t, STAGE, rec, ttl_s=60)
        stored.append(time.monotonic() - t0)
        while a.dht.peer_id not in b.dht.get_payloads(t, STAGE):
            time.sleep(0.005)
        seen.append(time.monotonic() - t0)
    req = PayloadRequest(t, STAGE, a.dht.peer_id)  # the last probe's round (the store keeps the latest)
    rpc_s = _median_s(lambda: b.clients.get(server.address).get_payload(req, timeout_s=10.0), 9)
    out = {"dht_read_s": read_s, "dht_s": statistics.median(seen), "dht_store_s": statistics.median(stored)}
    return {**out, "rpc_s": rpc_s}


class Timed:
    """How long each named call of the rounds' own DHT nodes and clients took (the calls themselves,
    timed where they are: the simulator's latencies come from the rounds it is compared with)."""

    def __init__(self) -> None:
        self.calls: dict[str, list[float]] = {}

    def wrap(self, obj: Any, name: str) -> None:
        fn = getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.setdefault(name, []).append(time.monotonic() - t0)

        setattr(obj, name, timed)

    def wrap_pool(self, pool: ClientPool) -> None:
        """Every client the pool hands out has its `get_payload` timed."""
        get, wrapped = pool.get, set()

        def timed_get(address: str, *args: Any, **kwargs: Any) -> Any:
            client = get(address, *args, **kwargs)
            if id(client) not in wrapped:
                wrapped.add(id(client))
                self.wrap(client, "get_payload")
            return client

        setattr(pool, "get", timed_get)  # noqa: B010 (an instance attribute over the method)

    def median(self, name: str) -> float:
        return statistics.median(self.calls[name]) if self.calls.get(name) else 0.0


def real_rounds(cfg: Any, nodes: list[Node], rounds: int, timed: Timed) -> list[dict[str, Any]]:
    """`rounds` rounds of today's gather on every node at once: per round, mean bytes fetched, wall time
    and when each peer's gather began (thread start on a busy machine: what the simulator takes as
    that peer's compute time)."""
    checks = SimpleNamespace(validate=payload_validator(stage_shapes(cfg.model, STAGE, cfg.stages), cfg.sparseloco))
    timed.wrap(checks, "validate")  # a fetched payload's parse and checks: part of each fetch's cost
    validate = checks.validate
    for node in nodes:
        for name in ("get_replicas", "get_stage_peers", "get_payloads", "announce_payload"):
            timed.wrap(node.dht, name)
        timed.wrap_pool(node.clients)
    out = []
    for t in range(1, rounds + 1):
        _records(nodes, t)
        own = [_payload(cfg, 1000 * t + i) for i in range(len(nodes))]

        t0 = time.monotonic()
        starts = [0.0] * len(nodes)

        def run(i: int, t: int = t, own: list[bytes] = own, t0: float = t0, starts: list[float] = starts) -> Any:
            node = nodes[i]
            assert node.server is not None
            starts[i] = time.monotonic() - t0  # when this peer's gather begins: its "compute time"
            mine = received(node.dht.peer_id, payload_id(own[i]), own[i], validate)  # our own, identified once
            assert node.ctx is not None
            return gather_round(node.ctx, t, STAGE, TIMINGS, RoundInputs(own=mine, validate=validate))

        with ThreadPoolExecutor(max_workers=len(nodes)) as pool:
            results = list(pool.map(run, range(len(nodes))))
        assert all(r.participants == len(nodes) and not r.timed_out for r in results), [r.participants for r in results]
        out.append(
            {
                "bytes": statistics.fmean(r.bytes_fetched for r in results),
                "round_s": statistics.fmean(r.wall_s for r in results),
                "payload": float(len(own[0])),
                "starts": starts,
            }
        )
    return out


def calibrate(sizes: tuple[int, ...] = (4, 8), rounds: int = 5) -> list[dict[str, Any]]:
    """Per M: the real loopback rounds (mean over rounds), the probes, the simulator's figures."""
    cfg = build_config(environ={})
    rows = []
    for M in sizes:
        with ExitStack() as stack:
            nodes = _start(cfg, M, stack)
            _records(nodes, 0)
            params = probe(nodes, _payload(cfg, 1))
            timed = Timed()
            # one warm-up round first: it opens the gRPC channels between every pair (not modelled)
            real = real_rounds(cfg, nodes, rounds + 1, timed)[1:]
        load = os.getloadavg()[0]
        # the latencies of the rounds themselves (under their own load); the DHT's propagation past a
        # store's return from the probe
        params["dht_read_s"] = sum(timed.median(n) for n in ("get_replicas", "get_stage_peers", "get_payloads"))
        params["dht_s"] = timed.median("announce_payload") + max(0.0, params["dht_s"] - params["dht_store_s"])
        params["dht_store_s"] = timed.median("announce_payload")
        params["rpc_s"] = timed.median("get_payload") + timed.median("validate")
        payload = int(real[0]["payload"])
        sim_cfg = SimConfig(
            peers=M, rule="all", rounds=rounds, deadline_s=TIMINGS.deadline_s, poll_s=TIMINGS.poll_s,
            mix=LinkMix(home=LinkClass(10_000.0, 10_000.0, 0.0, 0.0), rpc_s=params["rpc_s"]),
            dht_s=params["dht_s"], dht_store_s=params["dht_store_s"], dht_read_s=params["dht_read_s"],
            compute_s=tuple(statistics.fmean(r["starts"][i] for r in real) for i in range(M)), fetch_parallel=1,
            sizes=Sizes(payload, (payload,), (payload,), 0), record_ttl_s=120.0,
        )  # fmt: skip
        sim = summarize(simulate(sim_cfg))
        row: dict[str, Any] = {"M": M, "payload_bytes": payload, "load_avg": load, **params}
        row["real_bytes"] = statistics.fmean(r["bytes"] for r in real)
        row["real_round_s"] = statistics.fmean(r["round_s"] for r in real)
        row["real_round_s_each"] = [r["round_s"] for r in real]
        row["sim_bytes"] = statistics.fmean(r["down_mean"] for r in sim)
        row["sim_round_s"] = statistics.fmean(r["round_s"] for r in sim)
        row["round_error"] = row["sim_round_s"] / row["real_round_s"] - 1
        row["bytes_error"] = row["sim_bytes"] / row["real_bytes"] - 1
        rows.append(row)
    return rows

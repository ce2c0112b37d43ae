"""Stage peers serve both kinds of pipeline: real gRPC on 127.0.0.1, the stage peers' servers and the
head in this process (a fixed stage map, `peer.research.bench.pipeline_peers.FixedStages`).

A head forced uncompressed (`policy="never"`) drives three stages through the peers: its inner steps
are a full replica's on the same batches bit for bit — the same losses, the same parameters on every
stage. Bit-identical, not within a tolerance: the boundary crosses the wire as fp32 (the run's
`subspace.wire_dtype` here), an uncompressed call neither projects nor expands it, and the stages run
the ops a full replica's one autograd graph runs, in the same order (the gradient norm is an exact
sum, `global_grad_norm`). Then the same peers answer compressed calls (validation, an inner step) on
the same state, equal to the same calls made in-process; sequential (K = 1: the head relays, backward
calls) and streamed (K = 4: stage 1 calls stage 2 itself) schedules both.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import pytest
import torch

from peer.config import RunConfig, build_config
from peer.core.model.chain import global_grad_norm
from peer.core.model.state import stage_state, state_hash
from peer.net.pool import ClientPool
from peer.net.transport.server import PeerServer
from peer.node.pipeline.driver import PipelineDriver
from peer.node.replica.data_parallel import chain_loss, chain_step
from peer.node.round.payloads import PayloadStore
from peer.node.service import PeerService
from peer.node.stage.worker import StageWorker
from peer.research.bench.pipeline_peers import FixedStages, batches

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _cfg(in_flight: int) -> RunConfig:
    return build_config(
        overrides={
            "stages": 3,
            "train.inner_steps": 3,
            "train.batch_size": 8,
            "train.microbatches": 4,
            "train.seq_len": 32,
            "train.in_flight": in_flight,
            "subspace.wire_dtype": "fp32",
            "swarm.rpc_timeout_s": 60,
        },
        environ={},
    )


@contextmanager
def _stage_peers(cfg: RunConfig) -> Iterator[dict[int, StageWorker | str]]:
    """Stages 1 … S−1, each a `StageWorker` behind the real service and server: {s: worker, -s: address}."""
    servers, out = [], {}
    try:
        for s in range(1, cfg.stages):
            worker = StageWorker(cfg, s)  # built as a pipeline's stage peer is
            service = PeerService(cfg, {s: worker}, PayloadStore(), f"stage-{s}", "stage")
            server = PeerServer(
                service, host="127.0.0.1", port=0, vocab_size=cfg.model.vocab_size, wire_dtype=cfg.subspace.wire_dtype
            )
            servers.append(server)
            out[s], out[-s] = worker, server.address
        yield out
    finally:
        for server in servers:
            server.stop(grace_s=1.0)


def _local_step(chain: Sequence[StageWorker], h: int, x: torch.Tensor, y: torch.Tensor) -> float:
    """One inner step of the chain's own workers called in-process, in stage 0's mode for the outer step."""
    n, total, mode = chain[0].cfg.train.microbatches, 0.0, chain[0].boundary_compressed
    for mb, (mx, my) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
        key = ("local", mb)
        hidden = chain[0].forward(key, mx, None, None).hidden
        for w in chain[1:-1]:
            hidden = w.forward(key, mx, hidden, None, compressed=mode).hidden
        out = chain[-1].forward(key, mx, hidden, my, compressed=mode)
        grad = out.grad
        for w in reversed(chain[1:-1]):
            grad = w.backward(key, grad)
        chain[0].backward(key, grad)
        total += out.loss / n
    norm = global_grad_norm(w.grad_sq_norm() for w in chain)
    for w in chain:
        w.step(0, h, norm)
    return total


def _local_eval(chain: Sequence[StageWorker], x: torch.Tensor, y: torch.Tensor) -> float:
    mode, hidden = chain[0].boundary_compressed, None
    for w in chain[:-1]:
        hidden = w.evaluate(x, hidden, None, compressed=mode).hidden
    loss = chain[-1].evaluate(x, hidden, y, compressed=mode).loss
    assert loss is not None
    return loss


def _hashes(workers: Sequence[StageWorker]) -> list[str]:
    out = []
    for w in workers:
        with w.lock:
            out.append(state_hash(stage_state(w.module)))
    return out


@pytest.mark.parametrize("in_flight", [1, 4])
def test_an_uncompressed_pipeline_is_a_full_replica_and_its_peers_serve_compressed_calls_too(in_flight):
    cfg = _cfg(in_flight)
    data = batches(cfg, 3)
    full = [StageWorker(cfg, s, compressed=False) for s in range(cfg.stages)]
    forward = lambda mx, my: (chain_loss(full, mx, my), 0)  # noqa: E731 - the full replica's micro-batch forward
    clients = ClientPool(cfg.swarm.rpc_timeout_s, cfg.subspace.wire_dtype)
    with _stage_peers(cfg) as peers:
        addresses = {s: str(peers[-s]) for s in range(1, cfg.stages)}
        head = StageWorker(cfg, 0)
        stop = threading.Event()
        driver = PipelineDriver(cfg, "modes", head, FixedStages(addresses), clients, stop, policy="never")
        remote = [head, *(peers[s] for s in range(1, cfg.stages))]
        try:
            for h in (0, 1):
                x, y = data[h]
                assert driver.inner_step(0, h, x, y) == chain_step(full, forward, 0, h, x, y)  # exact floats
            driver.settle_steps()
            assert driver.decision is not None and driver.decision.mode == "uncompressed" == driver.mode
            assert driver.in_flight == in_flight
            assert _hashes(remote) == _hashes(full)  # every stage, bit for bit

            # the same peers, the same state: compressed calls now (the mode is a call's, not a peer's)
            x, y = data[2]
            head.boundary_compressed = full[0].boundary_compressed = True
            assert driver.evaluate([(x, y)]) == _local_eval(full, x, y)
            head.boundary_compressed = full[0].boundary_compressed = False
            with torch.no_grad():
                assert driver.evaluate([(x, y)]) == chain_loss(full, x, y).item()
            head.boundary_compressed = full[0].boundary_compressed = True
            assert driver.inner_step(0, 2, x, y) == _local_step(full, 2, x, y)
            driver.settle_steps()
            assert _hashes(remote) == _hashes(full)
        finally:
            stop.set()
            driver.release()
            clients.close()

"""A pipeline of real processes without a swarm: the stage peers and the head of `peer bench pipeline`.

Each stage s >= 1 runs as its own process (`python -m peer.research.bench.pipeline_peers stage ...`): a
`StageWorker`, the real `PeerService` and `PeerServer` on a TCP port; it writes `READY <port>` to stdout
(the one line of its wire protocol with the parent, `peer.research.bench.delay_relay.announce_ready`) and,
when stopped (SIGTERM), writes a JSON report (hash of its live parameters, busy seconds). The head
(`... head ...`) runs `PipelineDriver` over a fixed map of those addresses (`FixedStages`, in
place of the DHT's stage records: discovery is not what is measured) for a number of inner steps
on seeded random tokens, and writes the losses, timings, busy fractions and per-link bytes.
`whole` measures the whole model in one process (the one-device baseline).

Every process sets one torch thread; the caller pins it (`taskset`) and may put it in a network
namespace (`ip netns exec`). Nothing here changes the math: the same seed gives the same bits.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from peer.config import RunConfig, config_from_dict
from peer.core.model.state import stage_state, state_hash
from peer.net.pool import ClientPool
from peer.net.records import StageRecord
from peer.net.transport.server import PeerServer
from peer.node.pipeline.driver import PipelineDriver
from peer.node.round.payloads import PayloadStore
from peer.node.service import PeerService
from peer.node.stage.worker import StageWorker
from peer.research.bench.delay_relay import announce_ready

log = logging.getLogger(__name__)


_DATA = ("forward", "backward")


class FixedStages:
    """The stage records of a fixed stage -> address map (`peer.node.pipeline.routing.StageRecords`):
    one trainer per stage at outer step 0, free for any pipeline."""

    def __init__(self, addresses: dict[int, str]) -> None:
        self.addresses = addresses

    def get_stage_peers(self, stage: int) -> dict[str, StageRecord]:
        address = self.addresses.get(stage)
        if address is None:
            return {}
        return {f"stage-{stage}": StageRecord(role="trainer", outer_step=0, address=address, pipeline=None)}


def head_driver(
    cfg: RunConfig,
    addresses: dict[int, str],
    worker: StageWorker,
    clients: ClientPool,
    on_schedule: Callable[[dict[str, Any]], None] | None = None,
    policy: str = "always",
) -> PipelineDriver:
    """A head's pipeline over the stage peers at `addresses` (stage -> host:port); `policy`: its
    boundary mode ("always" / "never" compressed, or "auto": chosen by the links each outer step)."""
    stages = FixedStages(addresses)
    return PipelineDriver(
        cfg, "bench-head", worker, stages, clients, threading.Event(), on_schedule=on_schedule, policy=policy
    )


def batches(cfg: RunConfig, n: int, seed: int = 1234) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`n` seeded random (inputs, targets) batches of (batch_size, seq_len) token ids."""
    g = torch.Generator().manual_seed(seed)
    shape = (cfg.train.batch_size, cfg.train.seq_len + 1)
    out = []
    for _ in range(n):
        seq = torch.randint(0, cfg.model.vocab_size, shape, generator=g)
        out.append((seq[:, :-1].contiguous(), seq[:, 1:].contiguous()))
    return out


def _cfg(path: str) -> RunConfig:
    return config_from_dict(json.loads(Path(path).read_text()))


def serve_stage(
    cfg: RunConfig, stage: int, host: str, port: int, report: Path, on_ready: Callable[[int], None] = lambda p: None
) -> None:
    """Serve one stage until SIGTERM (`on_ready(port)` once it listens); then write {"param_hash",
    "busy_s"} to `report`."""
    worker = StageWorker(cfg, stage)
    service = PeerService(cfg, {stage: worker}, PayloadStore(), f"stage-{stage}", "stage")
    server = PeerServer(
        service, host=host, port=port, vocab_size=cfg.model.vocab_size, wire_dtype=cfg.subspace.wire_dtype
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    on_ready(server.port)
    stop.wait()
    server.stop(grace_s=1.0)
    with worker.lock:
        digest = state_hash(stage_state(worker.module))
    report.write_text(json.dumps({"param_hash": digest, "busy_s": worker.busy_s}))


def run_head(
    cfg: RunConfig, addresses: dict[int, str], warmup: int, steps: int, policy: str = "always"
) -> dict[str, Any]:
    """`warmup` + `steps` inner steps of outer step 0; timings of the last `steps` only. A head that
    chooses its boundary mode by the links (`policy` "auto": the node's rule, `peer.node.pipeline.mode`,
    which runs an outer step's first inner step compressed and measures) chooses again after the
    warm-up, as it would at the next outer step, so the timed steps run the mode its links earn."""
    clients = ClientPool(cfg.swarm.rpc_timeout_s, cfg.subspace.wire_dtype)
    worker = StageWorker(cfg, 0)
    driver = head_driver(cfg, addresses, worker, clients, policy=policy)
    if policy == "auto":  # the rule needs stage 0's compute of a whole inner step, measured at the next
        warmup = max(warmup, 2)
    data = batches(cfg, warmup + steps)
    losses: list[float] = []
    for h, (x, y) in enumerate(data[:warmup]):
        losses.append(driver.inner_step(0, h, x, y))
    driver.settle_steps()
    driver.choose_mode(0)
    busy0 = _busy(clients, worker, addresses)
    bytes0 = _link_bytes(clients, addresses)
    started = time.perf_counter()
    for h, (x, y) in enumerate(data[warmup:], start=warmup):
        losses.append(driver.inner_step(0, h, x, y))
    driver.settle_steps()  # the later stages' last step is part of the timed work
    wall = time.perf_counter() - started
    busy1 = _busy(clients, worker, addresses)
    bytes1 = _link_bytes(clients, addresses)
    tokens = steps * cfg.train.batch_size * cfg.train.seq_len
    busy = [(b1 - b0) / wall for b0, b1 in zip(busy0, busy1, strict=True)]
    links = [(b1 - b0) / tokens for b0, b1 in zip(bytes0, bytes1, strict=True)]
    with worker.lock:
        head_hash = state_hash(stage_state(worker.module))
    clients.close()
    return {
        "losses": losses,
        "wall_s": wall,
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "in_flight": driver.in_flight,
        "busy": busy,
        "bytes_per_token": links,
        "head_param_hash": head_hash,
        "mode": driver.mode,
        "mode_reason": driver.decision.reason if driver.decision else "",
    }


def _busy(clients: ClientPool, worker: StageWorker, addresses: dict[int, str]) -> list[float]:
    out = [worker.busy_s]
    for s in sorted(addresses):
        info = clients.get(addresses[s]).info()
        out.append(float(info["busy_s"][str(s)]))
    return out


def _link_bytes(clients: ClientPool, addresses: dict[int, str]) -> list[float]:
    """Bytes over each link s -> s + 1 of the chain (both directions): the head's calls to stage j
    cross links 0 .. j − 1, a stage's streamed calls cross its own link."""
    S = len(addresses) + 1
    per_stage = {s: 0 for s in range(1, S)}
    for s, address in addresses.items():
        stats = clients.get(address).stats()  # the data plane only: forward and backward
        per_stage[s] = sum(stats[k].get(m, 0) for k in ("bytes_sent", "bytes_received") for m in _DATA)
    links = [float(sum(per_stage[j] for j in range(s + 1, S))) for s in range(S - 1)]
    for s in range(1, S - 1):
        info = clients.get(addresses[s]).info()
        links[s] += float(info.get("stream_bytes", 0))
    return links


def whole_model(cfg: RunConfig, warmup: int, steps: int) -> dict[str, Any]:
    """The whole model in this process (one device): tokens/s of the same batches."""
    from dataclasses import replace

    one = replace(cfg, stages=1)
    worker = StageWorker(one, 0, compressed=False)
    data = batches(cfg, warmup + steps)
    n = cfg.train.microbatches
    started, step_s = 0.0, 0.0
    for h, (x, y) in enumerate(data):
        if h == warmup:
            started, step_s = time.perf_counter(), 0.0
        for mb, (mx, my) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
            worker.forward(("whole", mb), mx, None, my)
        stepped = time.perf_counter()
        worker.step(0, h)
        step_s += time.perf_counter() - stepped
    wall = time.perf_counter() - started
    tokens = steps * cfg.train.batch_size * cfg.train.seq_len
    n_params = sum(p.numel() for p in worker.module.parameters())
    # the optimizer step apart (the planner's calibration: compute FLOP/s and step seconds per parameter)
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall, "step_s": step_s / steps,
            "opt_s_per_param": step_s / steps / n_params}  # fmt: skip


class StageProcesses:
    """Start stage processes 1 .. S−1 (each command prefixed by `prefix(s)`), stop them, read reports."""

    def __init__(
        self,
        cfg_path: Path,
        stages: int,
        workdir: Path,
        prefix: Callable[[int], list[str]] | None = None,
        hosts: Callable[[int], tuple[str, str]] | None = None,
    ) -> None:
        self.cfg_path, self.stages, self.workdir = cfg_path, stages, workdir
        self.prefix: Callable[[int], list[str]] = prefix or (lambda s: [])
        # (host to listen on, host the others reach it at)
        self.hosts: Callable[[int], tuple[str, str]] = hosts or (lambda s: ("127.0.0.1", "127.0.0.1"))
        self.procs: dict[int, subprocess.Popen[str]] = {}
        self.ports: dict[int, int] = {}

    def start(self) -> dict[int, str]:
        for s in range(1, self.stages):
            listen, _ = self.hosts(s)
            cmd = [
                *self.prefix(s),
                sys.executable,
                "-m",
                "peer.research.bench.pipeline_peers",
                "stage",
                str(self.cfg_path),
            ]
            cmd += ["--stage", str(s), "--host", listen, "--report", str(self.report(s))]
            self.procs[s] = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=_one_thread_env())
        for s, proc in self.procs.items():
            line = proc.stdout.readline() if proc.stdout is not None else ""
            if not line.startswith("READY "):
                self.stop()
                raise RuntimeError(f"stage {s} process did not start (exit {proc.poll()}): {line!r}")
            self.ports[s] = int(line.split()[1])
        return {s: f"{self.hosts(s)[1]}:{p}" for s, p in self.ports.items()}

    def report(self, s: int) -> Path:
        return self.workdir / f"stage{s}.json"

    def stop(self) -> dict[int, dict[str, Any]]:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        reports = {}
        for s, proc in self.procs.items():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
            if self.report(s).exists():
                reports[s] = json.loads(self.report(s).read_text())
        self.procs = {}
        return reports

    def __enter__(self) -> StageProcesses:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _one_thread_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PEER_LOG_LEVEL": "WARNING"}


def main(argv: Sequence[str] | None = None) -> None:
    """A stage, head or whole-model child process; results go to its --report file. A stage's stdout
    carries only the `READY <port>` line its parent waits for (`StageProcesses.start`)."""
    parser = argparse.ArgumentParser(prog="python -m peer.research.bench.pipeline_peers")
    parser.add_argument("role", choices=("stage", "head", "whole"))
    parser.add_argument("config", help="RunConfig as JSON (RunConfig.to_dict())")
    parser.add_argument("--stage", type=int, default=1)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--report", type=Path)
    parser.add_argument("--addresses", default="", help="head: comma-separated addresses of stages 1..S-1")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--compression", default="always", choices=("always", "never", "auto"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=os.environ.get("PEER_LOG_LEVEL", "WARNING"))
    cfg = _cfg(args.config)
    if args.role == "stage":
        serve_stage(cfg, args.stage, args.host, 0, args.report, announce_ready)  # stdout: the READY line only
        return
    if args.role == "head":
        addresses = {s: a for s, a in enumerate(args.addresses.split(","), start=1) if a}
        result = run_head(cfg, addresses, args.warmup, args.steps, args.compression)
    else:
        result = whole_model(cfg, args.warmup, args.steps)
    args.report.write_text(json.dumps(result))


if __name__ == "__main__":
    main()

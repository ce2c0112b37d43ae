"""`docker compose up` without a container engine: docker-compose.yml's services run as processes.

Each service's `command` runs as written, with its compose `environment`, in the order compose
starts them (a joiner once the bootstrap's healthcheck passes). What the container runtime would
provide is stood in for, and nothing else is changed:
- the compose network: service names (and the 0.0.0.0 bind address) → 127.0.0.1;
- one network namespace per container: each service's fixed ports → free ports of this machine;
- named volumes → directories shared between services exactly as compose shares them; any other
  absolute path (the container's own filesystem, e.g. PEER_CACHE_DIR=/cache) → a private directory;
- `peer` → `python -m peer` of this checkout.
The one addition is PEER_DATA__MAX_CHARS, which shrinks the bootstrap's corpus so its tokenizer
builds in seconds (the run's shape is the compose file's). The swarm must train: the full replica
and the pipeline's head commit a round, with the same parameters for stage 0, and stage0's
`--metrics-port` serves the Prometheus metrics of a live peer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from peer.node.metrics import read_events
from tests.unit.test_compose import load_compose, parse_cli, peer_services, volume_targets

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

LOOPBACK = "127.0.0.1"
PORT_FLAGS = ("--port", "--dht-port", "--grpc-port", "--metrics-port")
HOST_FLAGS = ("--host", "--announce-host")
ROUND_DEADLINE_S = 420.0


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


class Host:
    """This machine playing the compose runtime: volumes, private filesystems, ports, names."""

    def __init__(self, root: Path, compose: dict[str, Any]) -> None:
        self.root, self.compose = root, compose
        self.names = set(compose["services"])
        self.ports: dict[tuple[str, str], int] = {}

    def path(self, service: str, value: str) -> str:
        """A container path as this machine sees it (volumes shared, everything else private)."""
        for target, volume in volume_targets(self.compose["services"][service], self.compose).items():
            if value == target or value.startswith(target.rstrip("/") + "/"):
                return str(self.root / "volumes" / volume / value[len(target) :].lstrip("/"))
        return str(self.root / "fs" / service / value.lstrip("/"))

    def argv(self, service: str) -> list[str]:
        command = [str(a) for a in self.compose["services"][service]["command"]]
        assert command[0] == "peer"
        out = [sys.executable, "-m", "peer"]
        for i, arg in enumerate(command[1:], start=1):
            if command[i - 1] in PORT_FLAGS and arg != "0":
                arg = str(self.ports.setdefault((service, arg), _free_port()))
            elif command[i - 1] in HOST_FLAGS and (arg in self.names or arg == "0.0.0.0"):
                arg = LOOPBACK
            elif arg.startswith("/"):
                arg = self.path(service, arg)
            out.append(arg)
        return out

    def env(self, service: str) -> dict[str, str]:
        env = dict(os.environ)
        for key, value in (self.compose["services"][service].get("environment") or {}).items():
            value = str(value)
            env[key] = self.path(service, value) if value.startswith("/") else value
        env.update(PEER_DATA__MAX_CHARS="300000", OMP_NUM_THREADS="1", PEER_LOG_LEVEL="INFO")
        return env

    def healthy(self, service: str) -> bool:
        """Run the service's healthcheck `CMD test -s PATH` against this machine's files."""
        test = self.compose["services"][service]["healthcheck"]["test"]
        assert test[:3] == ["CMD", "test", "-s"], f"unsupported healthcheck {test}"
        path = Path(self.path(service, test[3]))
        return path.exists() and path.stat().st_size > 0

    def start(self, service: str) -> subprocess.Popen:
        for volume in volume_targets(self.compose["services"][service], self.compose).values():
            (self.root / "volumes" / volume).mkdir(parents=True, exist_ok=True)
        log = (self.root / f"{service}.log").open("w")
        return subprocess.Popen(
            self.argv(service), env=self.env(service), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )


def _tail(root: Path, service: str) -> str:
    path = root / f"{service}.log"
    return path.read_text()[-3000:] if path.exists() else ""


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=10) as reply:
        return reply.read().decode()


def _sample(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_compose_services_train_as_processes(tmp_path, reap_children):
    compose = load_compose({})
    host = Host(tmp_path, compose)
    services = peer_services(compose)  # Prometheus and Grafana are images of their own, not run here
    boot = next(n for n, s in services.items() if s["command"][1] == "bootstrap")
    joiners = [n for n in services if n != boot]
    data_dirs = {
        n: Path(host.path(n, str(parse_cli([str(a) for a in services[n]["command"]])[1]["data_dir"]))) for n in joiners
    }
    procs: dict[str, subprocess.Popen] = {}
    try:
        procs[boot] = host.start(boot)
        deadline = time.monotonic() + 240
        while not host.healthy(boot):  # compose: depends_on condition service_healthy
            assert procs[boot].poll() is None, _tail(tmp_path, boot)
            assert time.monotonic() < deadline, "the bootstrap never became healthy:\n" + _tail(tmp_path, boot)
            time.sleep(0.5)
        for name in joiners:
            procs[name] = host.start(name)

        full = next(n for n in joiners if "--full-replica" in services[n]["command"])
        head = next(n for n in joiners if services[n]["command"][2:4] == ["--stage", "0"])
        deadline = time.monotonic() + ROUND_DEADLINE_S
        while True:
            for name, proc in procs.items():
                assert proc.poll() is None, f"{name} exited {proc.returncode}:\n" + _tail(tmp_path, name)
            rounds = {
                n: {ev["t"]: ev for ev in read_events(data_dirs[n] / "metrics.jsonl", "round")} for n in (full, head)
            }
            common = set(rounds[full]) & set(rounds[head])
            if common:
                break
            assert time.monotonic() < deadline, "no round committed by both replicas:\n" + "\n".join(
                f"--- {n}\n{_tail(tmp_path, n)}" for n in procs
            )
            time.sleep(1.0)
        t = min(common)
        assert rounds[full][t]["stages"]["0"]["param_hash"] == rounds[head][t]["stages"]["0"]["param_hash"]

        port = host.ports[(head, "9100")]
        text = _scrape(port)
        assert (_sample(text, "peer_rounds_total") or 0) >= 1, text
        assert (_sample(text, "peer_outer_step") or 0) >= 1
        assert (_sample(text, "peer_tokens_total") or 0) > 0
        assert _sample(text, "peer_loss") is not None and _sample(text, "peer_round_seconds_count") is not None
        assert 'peer_info{peer_id="' in text and 'role="head"' in text
        swarm = _scrape(host.ports[(boot, "9101")])  # the bootstrap's target in docker/prometheus.yml
        assert _sample(swarm, "peer_bootstrap_outer_step") is not None and "peer_bootstrap_stage_peers{" in swarm
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()

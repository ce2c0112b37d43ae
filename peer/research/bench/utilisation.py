"""`peer bench utilisation`: compute fraction of a real swarm, synchronous against overlapped rounds (issue 36).

How much of an outer step a replica spends in inner steps, with `train.overlap` 0 and 1, on a real
swarm with shaped links.

For each schedule the same swarm is started from scratch (same seed, model, H, T, links): a
bootstrap (`--no-attest`: it fetches no payloads) and two full replicas (`peer join --full-replica`),
each a real `python -m peer` process. As root, the replicas sit in two network namespaces joined by
one veth link (`peer.research.bench.netns.ShapedChain`, `tc tbf` at `rate` on both ends): replica
`a` and the bootstrap in the first, replica `b` in the second, so each replica's payload crosses the
shaped link to the other (and `b`'s DHT traffic shares it). Without namespaces (`netns` False) the
swarm runs on loopback, unshaped. Each replica may be pinned to a core of its own (`taskset`; its
DHT process and p2pd inherit it). The replicas exit by themselves after T outer steps; then the
bootstrap is stopped and their metrics are read (`peer.research.bench.utilisation_report`).

Invariants: every process started here is stopped on the way out (`Children.stop_all`, and the
watchdog of each child should this process be killed); namespaces are removed on the way out; this
module prints nothing (progress lines go to a callback).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from peer.demo.processes import Children
from peer.demo.run import LOOPBACK, peer_command
from peer.errors import ConfigError, NetworkError, PeerError
from peer.node.metrics import METRICS_FILE, read_events
from peer.research.bench.netns import ShapedChain, netns_unavailable
from peer.research.bench.utilisation_report import one_state, replica_figures

REPLICAS = ("a", "b")  # replica a shares the bootstrap's namespace; b has the other one
SCHEDULES = {0: "synchronous", 1: "overlapped"}


@dataclass(frozen=True)
class UtilisationConfig:
    preset: str = "small"
    inner_steps: int = 80  # H
    outer_steps: int = 5  # T: outer steps 1 .. T − 2 are measured (0 warms up; T − 1 has no successor)
    batch_size: int = 4
    seq_len: int = 64
    seed: int = 0
    rate: str = "400kbit"  # tc tbf rate of both ends of the replicas' link ("" = unshaped veth)
    burst: str = "16kbit"  # small: each message pays its serialization time
    overlaps: tuple[int, ...] = (0, 1)
    netns: bool = True
    pin: bool = True  # replica a on core 0, b on core 1 (when there are two)
    tag: str = ""  # namespaces peerb<tag>0, peerb<tag>1 ("": u<pid>, so that two runs never share one)
    max_chars: int = 400_000  # the builtin corpus, capped
    round_timeout_s: float = 60.0
    startup_timeout_s: float = 240.0
    run_timeout_s: float = 900.0  # one schedule's swarm, from the bootstrap to the replicas' exit
    workdir: Path = Path("runs/utilisation")


def check(cfg: UtilisationConfig) -> None:
    """ConfigError naming the flag when the run cannot measure anything."""
    if cfg.outer_steps < 3:
        raise ConfigError("--outer-steps must be 3 or more (outer steps 1 .. T − 2 are measured)")
    if cfg.inner_steps < 1:
        raise ConfigError("--inner-steps must be 1 or more")
    if not cfg.overlaps or any(o not in SCHEDULES for o in cfg.overlaps):
        raise ConfigError("--overlaps must list 0 and/or 1 (train.overlap)")
    if cfg.netns and netns_unavailable() is not None:
        raise ConfigError(f"{netns_unavailable()} (or pass --no-netns: loopback, unshaped)")


@contextlib.contextmanager
def _links(cfg: UtilisationConfig) -> Iterator[ShapedChain | None]:
    if not cfg.netns:
        yield None
        return
    with ShapedChain(2, cfg.rate or None, burst=cfg.burst, tag=cfg.tag or f"u{os.getpid()}") as net:
        yield net


class Swarm:
    """One schedule's swarm: the bootstrap, replicas a and b, in `workdir`."""

    def __init__(self, cfg: UtilisationConfig, overlap: int, workdir: Path, net: ShapedChain | None) -> None:
        self.cfg, self.overlap, self.workdir, self.net = cfg, overlap, workdir, net
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PEER_LOG_LEVEL": os.environ.get("PEER_LOG_LEVEL", "INFO"),
        }
        self.children = Children(workdir, env=env)
        self.host = LOOPBACK if net is None else net.address(0)

    def _prefix(self, where: int, core: int | None) -> list[str]:
        out = [] if self.net is None else self.net.exec_prefix(where)
        pin = self.cfg.pin and core is not None and shutil.which("taskset") and (os.cpu_count() or 1) > core
        return [*out, *(["taskset", "-c", str(core)] if pin else [])]

    def start_bootstrap(self) -> str:
        """The bootstrap's multiaddress the replicas join by."""
        c, address_file = self.cfg, self.workdir / "bootstrap.json"
        argv = peer_command(
            "bootstrap", "--preset", c.preset, "--stages", 2, "--inner-steps", c.inner_steps,
            "--outer-steps", c.outer_steps, "--overlap", self.overlap, "--batch-size", c.batch_size,
            "--seq-len", c.seq_len, "--seed", c.seed, "--max-chars", c.max_chars, "--no-attest",
            "--host", self.host, "--address-file", address_file,
        )  # fmt: skip
        env = {"PEER_SWARM__MIN_REPLICAS": "2", "PEER_SWARM__ROUND_TIMEOUT_S": str(c.round_timeout_s)}
        child = self.children.spawn("bootstrap", [*self._prefix(0, None), *argv], runs_until_stopped=True, env=env)
        deadline = time.monotonic() + c.startup_timeout_s
        while time.monotonic() < deadline:
            self.children.check()
            with contextlib.suppress(OSError, json.JSONDecodeError):
                peers = json.loads(address_file.read_text()).get("initial_peers") or []
                mine = [m for m in peers if f"/{self.host}/" in m]
                if mine:
                    return str(mine[0])
            time.sleep(0.2)
        raise NetworkError(f"the bootstrap did not come up in {c.startup_timeout_s:.0f} s; see {child.log_path}")

    def start_replica(self, name: str, maddr: str) -> None:
        where = REPLICAS.index(name)
        flags = ["--full-replica", "--initial-peers", maddr, "--data-dir", self.workdir / name, "--device", "cpu"]
        argv = peer_command("join", *flags, "--manifest-timeout-s", 120)
        self.children.spawn(name, [*self._prefix(where, where), *argv])

    def wait_replicas(self) -> None:
        """Until both replicas exited (0: they trained T outer steps); PeerError on a failure or timeout."""
        deadline = time.monotonic() + self.cfg.run_timeout_s
        replicas = [c for c in self.children.children if c.name in REPLICAS]
        while any(c.poll() is None for c in replicas):
            self.children.check()
            if time.monotonic() > deadline:
                raise PeerError(f"the replicas did not finish in {self.cfg.run_timeout_s:.0f} s; see {self.workdir}")
            time.sleep(0.5)
        self.children.check()

    def run(self) -> None:
        try:
            maddr = self.start_bootstrap()
            for name in REPLICAS:
                self.start_replica(name, maddr)
            self.wait_replicas()
        finally:
            self.children.stop_all(grace_s=10.0)


def schedule_result(cfg: UtilisationConfig, overlap: int, workdir: Path) -> dict[str, Any]:
    """One schedule's figures from its replicas' metrics files."""
    events = {name: read_events(workdir / name / METRICS_FILE) for name in REPLICAS}
    steps = {n: [e for e in evs if e.get("event") == "step"] for n, evs in events.items()}
    rounds = {n: [e for e in evs if e.get("event") == "round"] for n, evs in events.items()}
    replicas = {n: replica_figures(steps[n], rounds[n], cfg.inner_steps, first=1) for n in REPLICAS}
    return {
        "overlap": overlap,
        "schedule": SCHEDULES[overlap],
        "replicas": replicas,
        "one_state": one_state(rounds),
        "pauses": {n: sum(e.get("event") == "pause" for e in evs) for n, evs in events.items()},
        "workdir": str(workdir),
    }


def run_utilisation(cfg: UtilisationConfig, progress: Callable[[str], None] = lambda _line: None) -> dict[str, Any]:
    """Each schedule of `cfg.overlaps` on a fresh swarm; {"config", "schedules": [one per overlap]}."""
    check(cfg)
    root = Path(cfg.workdir).resolve()
    out: dict[str, Any] = {"config": {**asdict(cfg), "workdir": str(root)}, "schedules": []}
    out["shaping"] = "tc tbf" if cfg.netns and cfg.rate else "none"
    for overlap in cfg.overlaps:
        workdir = root / f"overlap-{overlap}"
        if workdir.exists():
            shutil.rmtree(workdir)  # a fresh swarm: the replicas' data dirs hold no earlier run
        progress(f"{SCHEDULES[overlap]} (train.overlap {overlap}): swarm in {workdir}")
        load = os.getloadavg()[0]
        with _links(cfg) as net:
            Swarm(cfg, overlap, workdir, net).run()
        result = schedule_result(cfg, overlap, workdir)
        result["load_avg"] = [load, os.getloadavg()[0]]  # the machine's 1-min load before and after: others' work
        out["schedules"].append(result)
        progress(f"{SCHEDULES[overlap]}: done, rounds {result['replicas']['a']['rounds']}")
    return out


def config_from_flags(args: dict[str, Any], runs: Path) -> UtilisationConfig:
    """`peer bench utilisation`'s flags made a checked `UtilisationConfig` (logs under `runs` unless --workdir)."""
    try:
        overlaps = tuple(int(x) for x in str(args["overlaps"]).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--overlaps must be comma-separated 0 and/or 1, not {args['overlaps']!r}") from None
    where = args["workdir"] or runs / f"utilisation-{time.strftime('%Y%m%d-%H%M%S')}"
    keys = ("preset", "inner_steps", "outer_steps", "batch_size", "seq_len", "seed", "rate")
    cfg = UtilisationConfig(
        overlaps=overlaps,
        netns=not args["no_netns"],
        pin=not args["no_pin"],
        workdir=where,
        **{k: args[k] for k in keys},
    )
    check(cfg)
    return cfg

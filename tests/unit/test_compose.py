"""docker-compose.yml and the Dockerfile agree with the real `peer` CLI (no Docker engine needed).

Every service's command is parsed by the CLI's own click parser, so an unknown flag, a missing
required option or a bad value type fails here exactly as it would in the container. On top of
that the swarm must be wired consistently: joiners find the bootstrap through the address file it
writes on a volume they share (no peer id to copy, no .env: `docker compose up` alone), every
stage of the run has a peer, every peer announces its own service name, and the bootstrap's key
file lives on a volume so its multiaddr survives restarts.
(tests/e2e/test_compose_processes.py runs these same commands as processes and trains a round.)
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from peer.cli.main import app

try:  # typer >= 0.2x ships its own copy of click; its commands raise that copy's exceptions
    from typer._click import exceptions as click
    from typer._click.core import Context
except ImportError:  # older typer builds on click itself
    import click
    from click import Context

ROOT = Path(__file__).resolve().parents[2]
_VAR = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution (${V}, ${V:-d}, ${V-d}, ${V:?e}, $V, $$) on every string."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1) or m.group(4), m.group(2), m.group(3)
        current = env.get(name)
        if op in (":-", ":?") and not current or op in ("-", "?") and current is None:
            if op.endswith("?"):
                raise ValueError(f"compose would refuse to start: {name} unset ({arg})")
            return arg
        return current or ""

    return _VAR.sub(sub, value)


def parse_cli(argv: list[str]) -> tuple[str, dict[str, Any]]:
    """Parse `peer ...` argv with the CLI's click commands; returns (subcommand path, parsed params).

    Raises click.UsageError (NoSuchOption, MissingParameter, BadParameter, ...) like the CLI would.
    """
    assert argv and argv[0] == "peer", f"command must start with `peer`, got {argv[:1]}"
    command = typer.main.get_command(app)
    parent = Context(command, info_name="peer")
    args, path = list(argv[1:]), []
    while hasattr(command, "get_command"):  # a group: resolve the next word as its subcommand
        assert args, f"`{' '.join(argv)}` names no subcommand"
        name = args.pop(0)
        sub = command.get_command(parent, name)
        if sub is None:
            raise click.UsageError(f"`peer {' '.join([*path, name])}` is not a command of this CLI")
        path.append(name)
        command, parent = sub, Context(sub, info_name=name, parent=parent)
    ctx = command.make_context(path[-1], args, parent=parent.parent)
    return " ".join(path), dict(ctx.params)


def load_compose(env: Mapping[str, str]) -> dict[str, Any]:
    return interpolate(yaml.safe_load((ROOT / "docker-compose.yml").read_text()), env)


def volume_targets(service: Mapping[str, Any], compose: Mapping[str, Any]) -> dict[str, str]:
    """{container path: named volume} of a service; every named volume must be declared."""
    out = {}
    for spec in service.get("volumes", []):
        source, target = spec.split(":")[:2]
        assert source in (compose.get("volumes") or {}), f"volume {source!r} is not declared under volumes:"
        out[target] = source
    return out


def on_volume(path: str, service: Mapping[str, Any], compose: Mapping[str, Any]) -> bool:
    return volume_of(path, service, compose) is not None


def volume_of(path: str, service: Mapping[str, Any], compose: Mapping[str, Any]) -> str | None:
    """The named volume that holds `path` inside `service`'s container (None: not on a volume)."""
    for target, source in volume_targets(service, compose).items():
        if path == target or path.startswith(target.rstrip("/") + "/"):
            return source
    return None


def peer_services(compose: Mapping[str, Any]) -> dict[str, Any]:
    """The services that run `peer` (the others are the monitoring: Prometheus and Grafana images)."""
    return {n: s for n, s in compose["services"].items() if "image" not in s or s["image"].startswith("peer:")}


@pytest.fixture(scope="module")
def parsed() -> tuple[dict[str, Any], dict[str, tuple[str, dict[str, Any]]]]:
    compose = load_compose({})
    commands = {}
    for name, service in peer_services(compose).items():
        command = service.get("command")
        assert isinstance(command, list), f"service {name}: write `command` as a list (no shell parsing)"
        try:
            commands[name] = parse_cli([str(a) for a in command])
        except click.ClickException as exc:
            pytest.fail(
                f"service {name}: `{' '.join(map(str, command))}` is rejected by the CLI: {exc.format_message()}"
            )
    return compose, commands


def test_parser_rejects_what_the_cli_rejects():
    assert parse_cli(["peer", "bootstrap", "--port", "31337"])[1]["port"] == 31337
    with pytest.raises(click.NoSuchOption):
        parse_cli(["peer", "bootstrap", "--no-such-flag"])
    with pytest.raises(click.BadParameter):
        parse_cli(["peer", "bootstrap", "--port", "not-a-port"])
    with pytest.raises(click.MissingParameter):
        parse_cli(["peer", "status"])  # --initial-peers is required
    with pytest.raises(click.UsageError, match="not a command"):
        parse_cli(["peer", "no-such-command"])


def test_every_service_command_parses(parsed):
    compose, commands = parsed
    assert set(commands) == set(peer_services(compose)) and len(commands) >= 4
    kinds = [cmd for cmd, _ in commands.values()]
    assert kinds.count("bootstrap") == 1 and kinds.count("join") == len(kinds) - 1


def test_bootstrap_service_has_a_stable_announced_address(parsed):
    compose, commands = parsed
    (name,) = [n for n, (cmd, _) in commands.items() if cmd == "bootstrap"]
    service, params = compose["services"][name], commands[name][1]
    assert params["announce_host"] == name  # the name other containers resolve
    assert params["host"] == "0.0.0.0" and params["port"] == 31337 and params["grpc_port"] == 31338
    assert params["identity"] is not None and on_volume(str(params["identity"]), service, compose), (
        "the bootstrap key must live on a volume, or its peer id (and every join line) changes on restart"
    )
    health = service["healthcheck"]["test"]
    assert str(params["address_file"]) in health, "the healthcheck must watch the --address-file"
    assert on_volume(str(params["address_file"]), service, compose), "joiners read the address file from a volume"


def test_joiners_cover_every_stage_and_point_at_the_bootstrap(parsed):
    compose, commands = parsed
    (boot,) = [n for n, (cmd, _) in commands.items() if cmd == "bootstrap"]
    boot_params = commands[boot][1]
    n_stages = boot_params["stages"] or 2
    stages, full = [], []
    for name, (cmd, params) in commands.items():
        if cmd != "join":
            continue
        service = compose["services"][name]
        assert not params["initial_peers"], f"{name}: no hand-copied multiaddr (it would need the peer id)"
        boot_file, peers_file = str(boot_params["address_file"]), str(params["initial_peers_file"])
        shared = volume_of(boot_file, compose["services"][boot], compose)
        assert shared is not None and volume_of(peers_file, service, compose) == shared, (
            f"{name} must read the bootstrap's --address-file from the volume the bootstrap writes it to"
        )
        assert peers_file.rsplit("/", 1)[-1] == boot_file.rsplit("/", 1)[-1], name
        assert params["manifest_timeout_s"] >= 300, f"{name} must wait out the bootstrap's first tokenizer build"
        assert params["announce_host"] == name, f"{name} must announce its own service name"
        assert params["port"] and params["dht_port"], f"{name}: --announce-host needs explicit ports"
        assert params["data_dir"] is not None and on_volume(str(params["data_dir"]), service, compose), name
        assert boot in service.get("depends_on", {}), f"{name} must start after the bootstrap"
        if params["full_replica"]:
            assert params["stage"] is None, name
            full.append(name)
        else:
            stages.append(params["stage"])
    assert sorted(stages) == list(range(n_stages)), "one compressed pipeline needs one peer per stage"
    assert len(full) >= 1


def test_up_needs_no_manual_step():
    """No variable to set: the file resolves the same with an empty environment or a stale .env."""
    text = (ROOT / "docker-compose.yml").read_text()
    body = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    assert "$" not in body, "docker-compose.yml must not need variables (.env) to start"
    assert load_compose({}) == load_compose({"BOOTSTRAP_PEER_ID": "12D3KooWStale"})


def test_dockerfile_installs_cpu_torch_then_the_package():
    text = (ROOT / "Dockerfile").read_text()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
    assert lines[0] == "FROM python:3.11-slim"
    runs = [ln for ln in lines if ln.startswith("RUN ")]
    torch_at = next(i for i, ln in enumerate(runs) if "torch==2.13.0" in ln)
    assert "https://download.pytorch.org/whl/cpu" in runs[torch_at]
    package_at = next(i for i, ln in enumerate(runs) if re.search(r"pip install \.(\s|$)", ln))
    assert torch_at < package_at, "install CPU torch before the package, or pip pulls CUDA wheels"
    for line in lines:
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), f"Dockerfile copies {src}, which does not exist"
    build = {s.get("build") for s in load_compose({})["services"].values()} - {None}
    assert build == {"."}


def test_the_operators_bootstrap_folder_agrees_with_the_cli_and_the_config():
    """bootstrap/: the systemd unit's command parses with the real CLI and keeps a fixed key and the
    attester's folder; the sample run.toml builds a valid config."""
    from peer.config import build_config

    unit = (ROOT / "bootstrap" / "peer-bootstrap.service").read_text()
    (exec_start,) = [ln.split("=", 1)[1] for ln in unit.splitlines() if ln.startswith("ExecStart=")]
    argv = exec_start.split()
    assert argv[0].endswith("/peer")
    command, params = parse_cli(["peer", *argv[1:]])
    assert command == "bootstrap" and params["identity"] is not None and params["attest"] is True
    assert str(params["attest_dir"]).startswith("/var/lib/peer") and str(params["config"]) == "/etc/peer/run.toml"
    cfg = build_config(ROOT / "bootstrap" / "run.toml", environ={})
    assert cfg.run_name == "my-run" and cfg.stages == 2 and cfg.swarm.history_rounds == 16


def test_prometheus_scrapes_every_peer_and_the_board_reads_only_series_peer_exports(parsed):
    """The compose Prometheus scrapes each service's --metrics-port by its service name, and every
    series the Grafana board queries is one `peer.net.prometheus` exports (a renamed series would leave
    a panel empty)."""
    from prometheus_client import generate_latest

    from peer.net.prometheus import REGISTRY, SwarmCollector

    compose, commands = parsed
    wanted = {f"{n}:{p['metrics_port']}" for n, (_, p) in commands.items() if p.get("metrics_port")}
    assert len(wanted) == len(commands), "every peer service serves --metrics-port"
    prom = compose["services"]["prometheus"]
    assert "./docker/prometheus.yml:/etc/prometheus/prometheus.yml:ro" in prom["volumes"]
    scrape = yaml.safe_load((ROOT / "docker" / "prometheus.yml").read_text())
    targets = {t for job in scrape["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    assert targets == wanted

    text = generate_latest(REGISTRY).decode()
    snapshot = {"uptime_s": 1.0, "outer_step": 1, "stage_peers": {0: 1}, "stage_seen": {0: 1},
                "replicas": {"pipeline": 1, "full": 0}, "manifest_publications": 1,
                "manifest_refresh_failures": 0, "artifacts_served": 0, "poll_failures": 0}  # fmt: skip
    text += generate_latest(SwarmCollector(lambda: snapshot)).decode()  # type: ignore[arg-type]
    names = set(re.findall(r"^# TYPE (\S+) (\S+)", text, re.M))
    series = set()
    for name, kind in names:
        series |= {name}
        if kind == "counter":
            series |= {name + "_total"}
        if kind == "histogram":
            series |= {name + "_bucket", name + "_sum", name + "_count"}
    board = json.loads((ROOT / "docker" / "grafana" / "dashboards" / "peer.json").read_text())
    queried = {m for p in board["panels"] for t in p["targets"] for m in re.findall(r"\bpeer_[a-z_]+", t["expr"])}
    assert queried and queried <= series, sorted(queried - series)
    grafana = compose["services"]["grafana"]
    assert "./docker/grafana/dashboards:/var/lib/grafana/dashboards:ro" in grafana["volumes"]
    provider = yaml.safe_load((ROOT / "docker/grafana/provisioning/dashboards/peer.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/var/lib/grafana/dashboards"
    source = yaml.safe_load((ROOT / "docker/grafana/provisioning/datasources/prometheus.yml").read_text())
    assert source["datasources"][0]["url"] == "http://prometheus:9090"
    assert {t["datasource"]["uid"] for p in board["panels"] for t in p["targets"]} == {source["datasources"][0]["uid"]}

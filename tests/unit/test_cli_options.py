"""Flags built from dataclass fields (peer.cli.options): a setting's help is its config field's, and the
values a command gets reach the config with flags above `PEER_*` env and TOML."""

from __future__ import annotations

import dataclasses

from peer.cli import options as o
from peer.cli.args import BootstrapArgs, JoinArgs, SimulateArgs
from peer.config import build_config
from peer.core.model.optim import TrainConfig
from peer.node.link_config import LinkConfig, build_link_config


def _helps(cls: type) -> dict[str, str]:
    return {p.name: p.annotation.__metadata__[0].help for p in o.parameters(cls)}


def test_a_settings_help_is_its_config_fields_with_the_value_it_falls_back_to():
    train = {f.name: f for f in dataclasses.fields(TrainConfig)}
    assert _helps(BootstrapArgs)["inner_steps"] == "H: inner steps per outer step (default 20)."
    assert _helps(SimulateArgs)["inner_steps"] == "H: inner steps per outer step (default 10)."  # simulate's own
    assert _helps(JoinArgs)["in_flight"].startswith(train["in_flight"].metadata["help"].rstrip("."))
    link = {f.name: f for f in dataclasses.fields(LinkConfig)}
    assert _helps(JoinArgs)["relay_max_mbps"] == link["relay_max_mbps"].metadata["help"]  # 0: no cap, no suffix


def test_given_settings_override_env_and_the_rest_stay_unset():
    a = BootstrapArgs(inner_steps=5, k_ratio="1/4")
    assert {k: v for k, v in o.overrides(a).items() if v is not None} == {
        "train.inner_steps": 5,
        "subspace.k_ratio": "1/4",
    }
    cfg = build_config(overrides=o.overrides(a), environ={"PEER_TRAIN__INNER_STEPS": "9", "PEER_SEED": "3"})
    assert (cfg.train.inner_steps, cfg.seed, cfg.subspace.k_ratio) == (5, 3, "1/4")
    j = JoinArgs(max_upload_mbps=2.5, relay=True)
    assert o.overrides(j, "link") == {
        "max_upload_mbps": 2.5,
        "max_download_mbps": None,
        "relay": True,
        "relay_max_mbps": None,
    }
    assert build_link_config({}, **o.overrides(j, "link")) == LinkConfig(max_upload_mbps=2.5, relay=True)
    assert "in_flight" not in str(o.overrides(j, "link")) and o.overrides(j)["train.in_flight"] is None


def test_the_command_signature_is_the_dataclass():
    import typer

    from peer.cli.main import app

    join = typer.main.get_command(app).commands["join"]  # type: ignore[attr-defined]
    opts = {p.name: (p.opts, p.secondary_opts, p.default) for p in join.params}
    assert list(opts) == [f.name for f in dataclasses.fields(JoinArgs)]
    assert opts["relay"] == (["--relay"], [], None) and opts["host"][2] == "0.0.0.0"
    assert opts["in_flight"][0] == ["--in-flight"] and opts["verbose"][0] == ["--verbose", "-v"]


def test_every_command_but_bench_is_its_dataclass_and_shares_its_objects_defaults():
    import typer

    from peer.cli.args import DashboardArgs, DemoArgs, ExportArgs, PlanArgs, PrepareArgs, StatusArgs
    from peer.cli.main import app
    from peer.demo.run import DemoConfig
    from peer.research.plan.command import PlanInputs  # PlanArgs's numbers, written twice (import cost)

    root = typer.main.get_command(app)
    commands = root.commands  # type: ignore[attr-defined]
    for cmd, cls in [
        (commands["plan"], PlanArgs),
        (commands["status"], StatusArgs),
        (commands["dashboard"], DashboardArgs),
        (commands["export"], ExportArgs),
        (commands["demo"], DemoArgs),
        (commands["data"].commands["prepare"], PrepareArgs),
    ]:
        assert [p.name for p in cmd.params] == [f.name for f in dataclasses.fields(cls)]
    assert {p.name: p.required for p in commands["status"].params}["initial_peers"]
    assert DemoArgs().outer_steps == DemoConfig().outer_steps
    plan = dataclasses.asdict(PlanInputs())
    assert {k: v for k, v in dataclasses.asdict(PlanArgs()).items() if k in plan} == plan
    assert _helps(PlanArgs)["inner_steps"] == "H: inner steps per outer step."  # the config field's words


def test_every_bench_command_is_its_dataclass_and_shared_flags_share_their_words():
    import typer

    from peer.cli import bench_args as b
    from peer.cli.args import PlanArgs
    from peer.cli.bench import bench_app

    commands = typer.main.get_command(bench_app).commands  # type: ignore[attr-defined]
    classes = {
        "payload": b.PayloadArgs,
        "pipeline": b.PipelineArgs,
        "chaos": b.ChaosArgs,
        "utilisation": b.UtilisationArgs,
        "commit": b.CommitArgs,
        "caps": b.CapsArgs,
        "replica": b.ReplicaArgs,
        "memory": b.MemoryArgs,
        "data": b.DataArgs,
        "swarm": b.SwarmArgs,
        "sybil": b.SybilArgs,
        "codec": b.CodecArgs,
        "fetch": b.FetchArgs,
        "simulate": b.SimulateSpeedArgs,
        "dashboard": b.DashboardBenchArgs,
    }
    assert set(commands) == set(classes)
    for name, cls in classes.items():
        params = {p.name: p for p in commands[name].params}
        assert list(params) == [f.name for f in dataclasses.fields(cls)], name
        assert {k: p.default for k, p in params.items()} == dataclasses.asdict(cls()), name
    sybil = {p.name: p.opts for p in commands["sybil"].params}
    assert sybil["round_t"] == ["--round"] and sybil["json_out"] == ["--json"]
    keep = {p.name: (p.opts, p.secondary_opts) for p in commands["data"].params}["keep"]
    assert keep == (["--keep"], [])  # a bool flag names itself: no --no-keep
    assert _helps(b.PipelineArgs)["microbatches"] == _helps(PlanArgs)["microbatches"]
    assert _helps(b.ReplicaArgs)["seq_len"] == _helps(b.SybilArgs)["seq_len"] == b.SEQ_LEN_HELP

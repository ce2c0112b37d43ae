"""The CLI's own contract, in process: `peer --version`, and outputs that go under runs/ by default."""

from __future__ import annotations

from importlib import metadata

import pytest
from typer.testing import CliRunner

import peer
from peer.cli.main import app

runner = CliRunner()


def test_version_prints_the_installed_package_version():
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"peer {metadata.version('peer')}"


def test_version_falls_back_to_the_source_tree_version(monkeypatch):
    def not_installed(name: str) -> str:
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", not_installed)  # peer.package_version looks it up at call time
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"peer {peer.__version__}"


@pytest.mark.parametrize(
    ("flags", "written"),
    [
        ([], "runs/plan.png"),
        (["--json", "out/plan.json"], "out/plan.png"),
        (["--png", "figs/u.png"], "figs/u.png"),
    ],
)
def test_plan_writes_its_plot_where_the_user_says_or_under_runs(tmp_path, monkeypatch, flags, written):
    monkeypatch.chdir(tmp_path)
    result = runner.invoke(app, ["plan", "--preset", "tiny", "--stages", "2", "--seq-len", "64", *flags])
    assert result.exit_code == 0, result.output
    assert (tmp_path / written).read_bytes()[:4] == b"\x89PNG"
    assert not list(tmp_path.glob("*.png")), "nothing is written into the current directory itself"


def test_join_takes_its_precision_from_PEER_PRECISION_and_the_run_config_ignores_it(monkeypatch):
    """`PEER_PRECISION=bf16 peer demo`: the demo's joins inherit the variable as their --precision,
    and the bootstrap's run config (which reads PEER_* variables) does not take it for a run field."""
    from peer.config import build_config
    from peer.errors import ConfigError

    monkeypatch.setenv("PEER_LOG_LEVEL", "WARNING")  # `peer join` sets it when unset
    argv = ["join", "--stage", "1", "--initial-peers", "/ip4/127.0.0.1/tcp/9"]
    result = runner.invoke(app, argv, env={"PEER_PRECISION": "fp8"})  # refused before any network
    assert isinstance(result.exception, ConfigError) and "--precision must be" in str(result.exception)
    cfg = build_config(environ={"PEER_PRECISION": "bf16", "PEER_ACTIVATION_CHECKPOINTING": "1"})
    assert cfg == build_config(environ={})

"""The CLI's own contract, in process: `peer --version`, and outputs that go under runs/ by default."""

from __future__ import annotations

from importlib import metadata

import pytest
from typer.testing import CliRunner

import peer
from peer.cli import app

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

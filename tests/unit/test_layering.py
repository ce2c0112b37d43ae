"""The dependency direction of DESIGN §4 holds: math never imports networking, transport/dht never
import math, nothing imports the CLI, and only peer/dht.py imports hivemind."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MATH = ["model", "subspace", "sparseloco", "data", "simulate", "replica", "optim", "checkpoint"]
NETWORK = ("grpc", "hivemind", "asyncio", "peer.transport", "peer.dht")


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def _hits(names: set[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == b or n.startswith(b + ".") for b in banned))


@pytest.mark.parametrize("module", MATH)
def test_math_modules_import_no_networking(module):
    path = ROOT / "peer" / f"{module}.py"
    assert path.exists(), path
    assert _hits(imports_of(path), NETWORK) == []


def test_transport_and_dht_import_no_math():
    math_mods = tuple(f"peer.{m}" for m in MATH)
    files = [*(ROOT / "peer" / "transport").glob("*.py"), ROOT / "peer" / "dht.py"]
    offenders = {str(f.relative_to(ROOT)): _hits(imports_of(f), math_mods) for f in files if f.exists()}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_only_dht_imports_hivemind_and_nothing_imports_cli():
    files = [p for p in (ROOT / "peer").rglob("*.py")] + list((ROOT / "bootstrap").rglob("*.py"))
    hivemind_users = sorted(str(f.relative_to(ROOT)) for f in files if _hits(imports_of(f), ("hivemind",)))
    assert hivemind_users == ["peer/dht.py"]
    cli_users = sorted(
        str(f.relative_to(ROOT)) for f in files
        if f.name not in ("cli.py", "__main__.py") and _hits(imports_of(f), ("peer.cli",))
    )
    assert cli_users == []


def test_only_transport_uses_the_wire_protobufs():
    """Only peer/transport turns tensors into our gRPC messages (export may read sentencepiece's own
    model proto, which is a file format, not the wire)."""
    files = [p for p in (ROOT / "peer").rglob("*.py") if "transport" not in p.parts]
    users = sorted(
        str(f.relative_to(ROOT)) for f in files
        if any(n.startswith("peer.transport.peer_pb2") or n == "grpc" for n in imports_of(f))
    )
    assert users == []

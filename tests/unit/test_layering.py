"""The dependency direction of the layout holds, checked by folder (docs/architecture.md):

- `peer/core/` (the math) imports only `peer.core` and `peer.errors`, and no networking; each core
  module owns its config section and `peer/config.py` assembles them, so core never imports it;
- `peer/net/` (the network) imports nothing from `peer.core`, `peer.node` or any room above them;
- `peer/node/` (one peer) may import `peer.core` and `peer.net`, never a room above it;
- `peer/bootstrap/` (the bootstrap node) may import core, net and node; `peer/research/`,
  `peer/export/` and `peer/demo/` anything but the CLI; nothing imports `peer/cli/`;
- only `peer/net/` imports hivemind, only `peer/net/transport/` imports grpc and the wire protobufs;
- no import circle anywhere in `peer/`, counting every import a file makes: at the top, inside a
  function and under `TYPE_CHECKING`.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT / "peer"
NETWORK = ("grpc", "hivemind", "asyncio")
TOP_LEVEL = {"peer.config", "peer.errors", "peer"}  # peer/__init__.py, config, errors


def imports_of(path: Path, root: Path = ROOT) -> set[str]:
    """Every module a file imports, absolute (relative imports resolved against its package)."""
    tree = ast.parse(path.read_text())
    package = ".".join(path.relative_to(root).with_suffix("").parts[:-1])
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names if base == "peer")  # `from peer import x`
    return names


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the modules of this project it imports}. `from pkg import name` is an edge to the
    submodule `pkg.name` when that is a module (as import-linter and pydeps count it), else to `pkg`."""
    files = {module_name(f, root): f for f in (root / "peer").rglob("*.py")}

    def nearest(name: str) -> str:
        while name and name not in files:
            name = name.rpartition(".")[0]  # `peer.core.model.decoder.ModelConfig` -> `peer.core.model.decoder`
        return name

    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges.update(nearest(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    parent = parts[: len(parts) - node.level + 1]
                    base = ".".join([*parent, base] if base else parent)
                edges.update(f"{base}.{a.name}" if f"{base}.{a.name}" in files else nearest(base) for a in node.names)
        graph[name] = edges - {"", name}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(circles)


def _hits(names: set[str], banned: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == b or n.startswith(b + ".") for b in banned))


def _files(folder: str) -> list[Path]:
    return sorted((PEER / folder).rglob("*.py"))


def _offenders(folder: str, banned: tuple[str, ...]) -> dict[str, list[str]]:
    found = {str(f.relative_to(ROOT)): _hits(imports_of(f), banned) for f in _files(folder)}
    return {k: v for k, v in found.items() if v}


ROOMS = ("core", "net", "node", "bootstrap", "research", "export", "demo", "cli")  # the package's folders
ABOVE_NODE = ("peer.bootstrap", "peer.research", "peer.export", "peer.demo", "peer.cli")


def test_every_module_lives_in_a_room():
    """Only config and errors sit at the top of the package; everything else is in a room."""
    top = sorted(p.name for p in PEER.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "config.py", "errors.py"]
    assert {p.name for p in PEER.iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ROOMS)


def test_core_imports_only_core_errors_and_no_networking():
    banned = ("peer.net", "peer.node", *ABOVE_NODE, "peer.config", *NETWORK)
    assert _offenders("core", banned) == {}
    assert _files("core"), "peer/core is empty"
    assert _files("core/sparseloco/codec"), "peer/core/sparseloco/codec is empty"


def test_net_imports_neither_core_nor_node():
    assert _offenders("net", ("peer.core", "peer.node", *ABOVE_NODE)) == {}


def test_node_imports_no_room_above_it():
    assert _offenders("node", ABOVE_NODE) == {}


@pytest.mark.parametrize("folder", ["bootstrap", "research", "export", "demo"])
def test_the_operator_and_research_rooms_import_no_cli_and_not_each_other_upward(folder):
    """The bootstrap node, research, export and demo import core, net, node (and research its own
    rooms): never the CLI, and the bootstrap node never research or demo code."""
    banned = ("peer.cli",)
    if folder == "bootstrap":
        banned = ("peer.cli", "peer.research", "peer.demo", "peer.export")
    assert _offenders(folder, banned) == {}


@pytest.mark.parametrize("folder", [r for r in ROOMS if r != "cli"])
def test_nothing_imports_the_cli(folder):
    """Nothing imports `peer.cli`, not even its plots or renderers: research and demo code returns data
    and the CLI draws and prints it (issue 35)."""
    assert _offenders(folder, ("peer.cli",)) == {}


def test_top_level_modules_import_no_room_but_core():
    """config and errors sit under every folder: they may import the math's config types only."""
    for name in ("config.py", "errors.py"):
        assert _hits(imports_of(PEER / name), ("peer.net", "peer.node", *ABOVE_NODE, *NETWORK)) == []


def test_only_net_imports_hivemind_and_only_transport_uses_grpc():
    files = list(PEER.rglob("*.py"))
    rel = {f: f.relative_to(ROOT).as_posix() for f in files}
    hivemind_users = sorted(rel[f] for f in files if _hits(imports_of(f), ("hivemind",)))
    assert hivemind_users and all(p.startswith("peer/net/") for p in hivemind_users), hivemind_users
    wire = ("grpc", "peer.net.transport.peer_pb2", "peer.net.transport.peer_pb2_grpc")
    grpc_users = sorted(rel[f] for f in files if _hits(imports_of(f), wire))
    assert grpc_users and all(p.startswith("peer/net/transport/") for p in grpc_users), grpc_users


def test_the_rule_checker_sees_a_violation(tmp_path):
    """The checks above can fail: a core module importing the network is caught, relative or not."""
    bad = tmp_path / "peer" / "core" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("import grpc\nfrom peer.net import dht\nfrom ..node import session\n")
    assert _hits(imports_of(bad, tmp_path), ("grpc", "peer.net", "peer.node")) == ["grpc", "peer.net", "peer.node"]


@pytest.mark.parametrize(
    "line",
    ["from peer.config import TrainConfig", "from peer import config", "import peer.config", "from ... import config"],
)
def test_the_rule_checker_sees_core_importing_the_config(tmp_path, line):
    """However a core module (here two folders down, as in peer/core/model/) names peer.config, it is caught."""
    bad = tmp_path / "peer" / "core" / "model" / "bad.py"
    bad.parent.mkdir(parents=True)
    bad.write_text(line + "\n")
    assert _hits(imports_of(bad, tmp_path), ("peer.config",)) == ["peer.config"]


def test_net_reads_process_trees_through_psutil():
    """The DHT daemon's process tree is found and reaped with psutil, never by parsing /proc. The one
    read of /proc is a process's own thread names (gRPC's core threads, `dht_child.grpc_running`),
    which psutil does not give."""
    uses = {str(f.relative_to(ROOT)): re.findall(r"/proc/[^\"']*", f.read_text()) for f in _files("net")}
    assert {path: found for path, found in uses.items() if found} == {
        "peer/net/dht_child.py": ["/proc/{os.getpid()}/task/*/comm"]
    }


def test_no_import_circles_anywhere():
    """Every import counts, also one inside a function or under `TYPE_CHECKING`: a circle hidden
    there is still a circle in the design."""
    graph = import_graph()
    assert len(graph) > 50 and graph["peer.node.session"], "the import graph is empty"
    assert import_circles(graph) == []


def test_the_circle_checker_sees_hidden_circles(tmp_path):
    """A circle made only by a function-local import and one made under TYPE_CHECKING are found."""
    pkg = tmp_path / "peer" / "node"
    pkg.mkdir(parents=True)
    (tmp_path / "peer" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from peer.node import b\n")
    (pkg / "b.py").write_text("def f():\n    from . import a\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from peer.node.d import D\n")
    (pkg / "d.py").write_text("import peer.node.c\n")
    (pkg / "e.py").write_text("import peer.node.a\n")  # imports into a circle, is not in one
    assert import_circles(import_graph(tmp_path)) == [
        ["peer.node.a", "peer.node.b"],
        ["peer.node.c", "peer.node.d"],
    ]

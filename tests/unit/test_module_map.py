"""docs/architecture.md's map of every module ("Every module, in one line") is the code's own: one row
per module under peer/ (generated protobuf stubs aside), in path order, each with the first line of
that module's opening docstring. A module added, moved or re-described without the map fails here;
`python -m tests.unit.test_module_map` prints the section to paste."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "architecture.md"
HEADING = "## Every module, in one line"


def summary(path: Path) -> str:
    """The first line of a module's docstring, without its closing quotes ("" when it has none)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return doc.strip().splitlines()[0].strip() if doc.strip() else ""


def modules() -> list[Path]:
    skip = ("_pb2.py", "_pb2_grpc.py")
    return sorted(p for p in (ROOT / "peer").rglob("*.py") if not p.name.endswith(skip))


def rows() -> list[str]:
    return [f"| `{p.relative_to(ROOT).as_posix()}` | {summary(p).replace('|', '/')} |" for p in modules()]


def section() -> str:
    return "\n".join([HEADING, "", "| module | what it is |", "| --- | --- |", *rows()])


def documented() -> list[str]:
    text = DOC.read_text()
    assert HEADING in text, f"{DOC} has no '{HEADING}' section"
    body = text.split(HEADING, 1)[1].split("\n## ", 1)[0]
    return [ln for ln in body.splitlines() if ln.startswith("| `")]


def test_every_module_has_an_opening_docstring():
    assert [p.relative_to(ROOT).as_posix() for p in modules() if not summary(p)] == []


def test_the_map_lists_every_module_with_its_docstring():
    assert documented() == rows()


def test_the_map_check_sees_a_missing_row():
    assert rows()[1:] != rows() and len(rows()) > 100


if __name__ == "__main__":
    print(section())

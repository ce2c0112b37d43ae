"""Generate the committed gRPC stubs for protos/peer.proto into peer/net/transport/.

    python protos/generate.py            # (re)write peer/net/transport/peer_pb2.py, .pyi and peer_pb2_grpc.py
    python protos/generate.py --check    # exit 1 if the committed stubs differ from a fresh build
    python protos/generate.py --out DIR  # write the stubs into DIR instead

Runs `grpc_tools.protoc` in-process, then rewrites the absolute `import peer_pb2` in the gRPC stub
to a package-relative one so the stubs import as `peer.net.transport.peer_pb2*`. `peer_pb2.pyi` gives
the message classes their field types, so mypy checks the codec against the schema. The output depends
on the grpcio-tools version (it is recorded in the stubs), so regenerate after upgrading it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent
REPO_ROOT = PROTO_DIR.parent
PROTO_FILE = PROTO_DIR / "peer.proto"
DEFAULT_OUT = REPO_ROOT / "peer" / "net" / "transport"
STUB_NAMES = ("peer_pb2.py", "peer_pb2.pyi", "peer_pb2_grpc.py")

_ABSOLUTE_IMPORT = "import peer_pb2 as peer__pb2\n"
_RELATIVE_IMPORT = "from . import peer_pb2 as peer__pb2\n"


def generate(out_dir: Path) -> list[Path]:
    """Compile peer.proto into `out_dir`; returns the paths of the written stubs."""
    from grpc_tools import protoc  # build-time dependency only (grpcio-tools)

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"--proto_path={PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            PROTO_FILE.name,
        ]
        rc = protoc.main(args)
        if rc != 0:
            raise RuntimeError(f"protoc failed with exit code {rc} on {PROTO_FILE}")
        written = []
        for name in STUB_NAMES:
            text = (Path(tmp) / name).read_text(encoding="utf-8")
            if name == "peer_pb2_grpc.py":
                if _ABSOLUTE_IMPORT not in text:
                    raise RuntimeError(f"unexpected import layout in generated {name}")
                text = text.replace(_ABSOLUTE_IMPORT, _RELATIVE_IMPORT, 1)
            target = out_dir / name
            target.write_bytes(text.encode("utf-8"))
            written.append(target)
    return written


def stale_stubs(committed_dir: Path = DEFAULT_OUT) -> list[str]:
    """Names of committed stubs that differ from a fresh build (empty when all are fresh)."""
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = []
        for name in STUB_NAMES:
            committed = Path(committed_dir) / name
            fresh = (Path(tmp) / name).read_bytes()
            if not committed.is_file() or committed.read_bytes() != fresh:
                stale.append(name)
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed stubs are stale")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_stubs(args.out)
        if stale:
            print(
                f"stale gRPC stubs in {args.out}: {', '.join(stale)}; run `python protos/generate.py`",
                file=sys.stderr,
            )
            return 1
        print(f"gRPC stubs in {args.out} are fresh")
        return 0
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Dataset fetch throughput between two processes on loopback (`peer bench fetch`).

Writes a synthetic prepared dataset (`--tokens` random uint16 ids in `--shard-tokens` shards, 1 %
more for validation), serves it from a separate process as the bootstrap does (a real PeerServer
with the bootstrap's ArtifactHandler and the data plane's Gate), and fetches it with
`peer.node.data.fetch.DatasetFetch` into an empty folder:
- `uncapped`: no cap on either side;
- `capped`:   the fetcher's download bucket at `--max-download-mbps`;
- `resume`:   the server process is killed once about half the bytes arrived, the fetch ends with
  its one-line error, a new server starts, and the fetch is run again: it continues from the
  .part files (bytes moved the second time ~ what was missing).
`bench_fetch` returns one dict (the CLI prints it as JSON): MB/s per phase and the bytes of the resumed
fetch. `python -m peer.research.bench.fetch --serve DIR --port-file FILE` is the serving process.

    peer bench fetch --tokens 100000000 --max-download-mbps 400
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from peer.core.data.shards import TOKENIZER_FILE, DatasetIndex, PreparedDataset, ShardWriter, write_index
from peer.core.files import atomic_write_bytes
from peer.errors import PeerError
from peer.net.pool import ClientPool
from peer.net.ratelimit import Link, LinkCaps
from peer.net.transport.dialer import Outbound
from peer.node.data.fetch import DatasetFetch, RunDataset
from peer.node.manifest import dataset_index_sha256

log = logging.getLogger(__name__)
MB = 1e6


def synthetic(root: Path, tokens: int, shard_tokens: int) -> PreparedDataset:
    """A prepared folder of random ids (the tokenizer file is a stand-in: only its hash is checked)."""
    root.mkdir(parents=True, exist_ok=True)
    fake = b"bench-fetch stand-in tokenizer"
    atomic_write_bytes(root / TOKENIZER_FILE, fake)
    rng, shards = np.random.default_rng(0), []
    for split, count in (("train", tokens), ("val", max(1, tokens // 100))):
        writer = ShardWriter(root, split, "uint16", shard_tokens)
        for start in range(0, count, 1 << 22):
            writer.add(rng.integers(0, 1 << 16, size=min(1 << 22, count - start), dtype=np.uint16))
        shards += writer.close()
    index = DatasetIndex("uint16", 1 << 16, 2, hashlib.sha256(fake).hexdigest(), tuple(shards), 0, 0.01, "synthetic")
    write_index(root, index)
    return PreparedDataset.open(root)


def serve(folder: Path, port_file: Path) -> None:
    """The serving process: the bootstrap's artefact handler over the prepared folder, until killed."""
    from peer.bootstrap.artifacts import ArtifactHandler
    from peer.net.transport import PeerServer
    from peer.net.transport.gate import Gate
    from peer.node.data.serve import DatasetServer

    dataset = PreparedDataset.open(folder)
    handler = ArtifactHandler({}, {"run_id": "bench"}, DatasetServer(dataset))
    server = PeerServer(handler, host="127.0.0.1", interceptors=[Gate("bench-server")])
    atomic_write_bytes(port_file, str(server.port).encode())
    threading.Event().wait()


@contextlib.contextmanager
def server_process(folder: Path, work: Path) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    port_file = work / f"port-{time.monotonic_ns()}"
    cmd = [sys.executable, "-m", "peer.research.bench.fetch", "--serve", str(folder), "--port-file", str(port_file)]
    proc = subprocess.Popen(cmd)
    try:
        deadline = time.monotonic() + 60
        while not port_file.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the serving process did not start")
            time.sleep(0.05)
        yield f"127.0.0.1:{port_file.read_text()}", proc
    finally:
        proc.kill()
        proc.wait(10)


def fetch(dataset: PreparedDataset, into: Path, address: str, down_mbps: float | None) -> dict[str, Any]:
    """One fetch of every shard into `into`: seconds, bytes received, MB/s (or the error)."""
    index = dataset.index
    run = RunDataset(index.fingerprint, index.val_fingerprint, dataset_index_sha256(index))
    with contextlib.closing(ClientPool(30.0, outbound=Outbound(link=Link(LinkCaps(download_mbps=down_mbps))))) as pool:
        fetcher = DatasetFetch(into, run, lambda: [address], pool.get, call_s=10.0, max_passes=2)
        t0, error = time.monotonic(), None
        try:
            fetcher.ensure(dataset.tokenizer_path, lambda idx: list(idx.shards))
        except PeerError as exc:
            error = str(exc)
        dt = time.monotonic() - t0
        got = pool.bytes_received().get("get_artifact", 0)
    out: dict[str, Any] = {"s": round(dt, 2), "bytes": got, "MB_per_s": round(got / MB / dt, 1)}
    if error:
        out["error"] = error
    return out


def _peak_rss_mb(pid: int) -> float:
    """A process's peak resident memory (Linux: VmHWM), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) * 1024 / MB, 1)
    return float("nan")


def _kill_at_half(proc: subprocess.Popen[bytes], folder: Path, total: int) -> None:
    while proc.poll() is None:
        held = sum(p.stat().st_size for p in folder.glob("*.bin*")) if folder.exists() else 0
        if held >= total // 2:
            proc.kill()
            return
        time.sleep(0.01)


def bench_fetch(tokens: int, shard_tokens: int, max_download_mbps: float, work: Path | None = None) -> dict[str, Any]:
    """The three fetches of the module's docstring on a synthetic dataset of `tokens` ids (in `work`, else a
    temporary folder removed afterwards): MB/s per phase, the server's peak RSS, the resumed fetch's bytes."""
    root = work or Path(tempfile.mkdtemp(prefix="bench-fetch-"))
    try:
        t0 = time.monotonic()
        dataset = synthetic(root / "served", tokens, shard_tokens)
        total = sum(dataset.nbytes(s) for s in dataset.index.shards)
        result: dict[str, Any] = {"dataset_MB": round(total / MB, 1), "shards": len(dataset.index.shards)}
        result["write_s"] = round(time.monotonic() - t0, 1)
        with server_process(dataset.root, root) as (address, proc):
            ready = _peak_rss_mb(proc.pid)
            log.info("fetching %.1f MB uncapped, then capped at %g Mbit/s", total / MB, max_download_mbps)
            result["uncapped"] = fetch(dataset, root / "uncapped", address, None)
            # streamed from disk: serving the whole dataset adds a few chunks, not the dataset
            result["server_peak_rss_MB"] = {"ready": ready, "after_serving": _peak_rss_mb(proc.pid)}
            result["capped"] = fetch(dataset, root / "capped", address, max_download_mbps)
            result["capped"]["cap_MB_per_s"] = round(max_download_mbps / 8, 1)
        with server_process(dataset.root, root) as (address, proc):
            log.info("fetching again, the server killed halfway")
            killer = threading.Thread(target=_kill_at_half, args=(proc, root / "resume", total), daemon=True)
            killer.start()
            first = fetch(dataset, root / "resume", address, None)
        with server_process(dataset.root, root) as (address, _):
            second = fetch(dataset, root / "resume", address, None)
        PreparedDataset.open(root / "resume").verify()
        result["resume"] = {"interrupted": first, "resumed": second, "verified": True}
        return result
    finally:
        if work is None:
            shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """The serving child of `server_process` (`--serve DIR --port-file FILE`): it writes its port to the
    file and serves until killed. The benchmark itself is `peer bench fetch` (`bench_fetch`)."""
    parser = argparse.ArgumentParser(description="the serving process of `peer bench fetch`")
    parser.add_argument("--serve", type=Path, required=True)
    parser.add_argument("--port-file", type=Path, required=True)
    args = parser.parse_args(argv)
    serve(args.serve, args.port_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())

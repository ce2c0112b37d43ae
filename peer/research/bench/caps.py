"""`peer bench caps`: does a peer's `--max-upload-mbps` / `--max-download-mbps` hold?

A capped peer runs in its own process (a real PeerServer with the data plane's Gate, caps set as
`peer join` sets them); this process calls it over real gRPC on 127.0.0.1 with no cap of its own:
- upload:   it fetches a large round payload (GetPayload) again and again;
- download: it sends large gradients (Backward, 4 MiB each) again and again;
- priority: both at once through the upload cap: activations (Backward replies) against payloads.
Each phase reads the capped peer's own byte counters (its Info) at the start and end of a
`window_s` window after a 1 s warm-up (the bucket's burst) and compares the rate with the cap; the
priority split is counted by the bench's clients. Targets: within 10 % of the cap; with both
kinds in flight the activations get most of the cap (round payloads yield).
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch

from peer.errors import PeerError
from peer.net.ratelimit import MBIT
from peer.net.transport import (
    BackwardReply,
    BackwardRequest,
    PayloadRequest,
    PeerClient,
    StateReply,
    StepReply,
)

log = logging.getLogger(__name__)

PAYLOAD_BYTES = 8 << 20
GRAD_SHAPE = (4, 256, 1024)  # 4 MiB of float32 per Backward request / reply


class _Capped:
    """The capped peer's handler: a big payload, and Backward answering a gradient as big as it got."""

    def forward(self, request: Any) -> Any:
        raise PeerError("the caps bench sends no forward passes")

    def backward(self, request: BackwardRequest) -> BackwardReply:
        return BackwardReply(grad=torch.zeros(request.grad.shape))

    def step(self, request: Any) -> StepReply:
        return StepReply(ok=True, message="")

    def get_payload(self, request: PayloadRequest) -> bytes:
        return bytes(PAYLOAD_BYTES)

    def get_state(self, request: Any) -> StateReply:
        return StateReply(outer_step=0, meta={}, tensors={})

    def get_artifact(self, request: Any) -> bytes:
        return b""

    def info(self) -> dict[str, Any]:
        return {"peer_id": "capped"}


def serve(up_mbps: float, down_mbps: float) -> None:
    """Run the capped peer until stdin closes (the bench's child process); prints its address."""
    from peer.net import ratelimit
    from peer.net.transport import PeerServer
    from peer.net.transport.gate import Gate

    gate = Gate("capped", link=ratelimit.Link(ratelimit.LinkCaps(up_mbps, down_mbps)))
    server = PeerServer(_Capped(), interceptors=[gate], max_message_bytes=64 << 20)
    sys.stdout.write(json.dumps({"address": server.address}) + "\n")
    sys.stdout.flush()
    sys.stdin.read()
    server.stop()


@contextlib.contextmanager
def _capped_peer(up_mbps: float, down_mbps: float) -> Iterator[str]:
    code = f"from peer.research.bench.caps import serve; serve({up_mbps!r}, {down_mbps!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise PeerError("the capped peer of the bench did not start")
        yield str(json.loads(line)["address"])
    finally:
        if proc.stdin is not None:
            proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class _Flow:
    """One call loop in a thread, counting the bytes it moved (per the client's byte counters)."""

    def __init__(self, address: str, call: Callable[[PeerClient], None], direction: str) -> None:
        self.client = PeerClient(address, timeout_s=120, max_message_bytes=64 << 20)
        self.call, self.direction = call, direction
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.call(self.client)

    def moved(self) -> int:
        counters = self.client.stats()["bytes_received" if self.direction == "down" else "bytes_sent"]
        return sum(counters.values())


def _fetch(client: PeerClient) -> None:
    client.get_payload(PayloadRequest(0, 0, "x"))


def _push(client: PeerClient) -> None:
    client.backward(BackwardRequest("bench", 0, 0, 0, 1, torch.ones(GRAD_SHAPE)))


def _link_bytes(address: str, kind: str) -> int:
    """The capped peer's own count of the bytes it let through (`net` of its Info)."""
    with PeerClient(address, timeout_s=30) as client:
        return int(client.info()["net"][kind])


def _measure(flows: list[_Flow], window_s: float, address: str, kind: str) -> list[float]:
    """Bytes/s over `window_s` after a 1 s warm-up: the capped peer's `kind` count, then each flow's."""
    for f in flows:
        f.thread.start()
    time.sleep(1.0)
    start = [_link_bytes(address, kind), *(f.moved() for f in flows)]
    t0 = time.monotonic()
    time.sleep(window_s)
    end = [_link_bytes(address, kind), *(f.moved() for f in flows)]
    rates = [(e - s) / (time.monotonic() - t0) for e, s in zip(end, start, strict=True)]
    for f in flows:
        f.stop.set()
    for f in flows:
        f.thread.join(timeout=120)
        f.client.close()
    return rates


def bench_caps(mbps: float = 20.0, window_s: float = 10.0) -> dict[str, Any]:
    """Achieved rates under an upload and a download cap of `mbps`; the priority split."""
    out: dict[str, Any] = {"cap_mbps": mbps, "window_s": window_s}
    with _capped_peer(mbps, 0.0) as address:
        up, _ = _measure([_Flow(address, _fetch, "down")], window_s, address, "bytes_up")
        out["upload_mbps"] = up / MBIT
        _, high, low = _measure(
            [_Flow(address, _push, "down"), _Flow(address, _fetch, "down")], window_s, address, "bytes_up"
        )
        out["priority_high_mbps"], out["priority_low_mbps"] = high / MBIT, low / MBIT
    with _capped_peer(0.0, mbps) as address:
        down, _ = _measure([_Flow(address, _push, "up")], window_s, address, "bytes_down")
        out["download_mbps"] = down / MBIT
    out["upload_error"] = abs(out["upload_mbps"] / mbps - 1)
    out["download_error"] = abs(out["download_mbps"] / mbps - 1)
    out["high_share"] = out["priority_high_mbps"] / max(1e-9, out["priority_high_mbps"] + out["priority_low_mbps"])
    return out

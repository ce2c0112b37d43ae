"""A userspace TCP relay that adds a fixed round-trip time (for hosts without `tc netem`).

`python -m peer.research.bench.delay_relay --listen HOST:PORT --to HOST:PORT --rtt-ms 50` accepts
connections on `--listen`, opens one to `--to` for each, and copies bytes both ways, holding every
chunk for half the round trip in each direction. The delay is pipelined (a chunk read at time τ
is written at τ + rtt/2, whatever is still queued before it), so the relay adds latency, not a
bandwidth limit: shape bandwidth separately (`tc tbf`, `peer.research.bench.netns`). Once listening,
`main` writes `READY <port>` to stdout — the one line of its wire protocol with the parent that
started it (`peer.research.bench.pipeline` reads it), not output for a person; stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import collections
import signal
import socket
import threading
import time
from collections.abc import Callable, Sequence

CHUNK = 64 * 1024


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]") or "127.0.0.1", int(port)


class _Pipe:
    """One direction of one connection: a reader queues (due time, bytes), a writer sends when due."""

    def __init__(self, src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        self.src, self.dst, self.delay_s = src, dst, delay_s
        self.queue: collections.deque[tuple[float, bytes]] = collections.deque()
        self.ready = threading.Condition()
        self.closed = False

    def start(self) -> None:
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._write, daemon=True).start()

    def _read(self) -> None:
        try:
            while data := self.src.recv(CHUNK):
                with self.ready:
                    self.queue.append((time.monotonic() + self.delay_s, data))
                    self.ready.notify()
        except OSError:
            pass
        with self.ready:
            self.closed = True
            self.ready.notify()

    def _write(self) -> None:
        try:
            while True:
                with self.ready:
                    self.ready.wait_for(lambda: bool(self.queue) or self.closed)
                    if not self.queue:
                        break
                    due, data = self.queue.popleft()
                pause = due - time.monotonic()
                if pause > 0:
                    time.sleep(pause)
                self.dst.sendall(data)
            self.dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def relay(
    listen: str, target: str, rtt_s: float, stop: threading.Event, on_ready: Callable[[int], None] = lambda port: None
) -> None:
    """Serve until `stop` is set; `on_ready(port)` once listening."""
    server = socket.create_server(_split(listen), reuse_port=False)
    server.settimeout(0.2)
    on_ready(server.getsockname()[1])
    while not stop.is_set():
        try:
            client, _ = server.accept()
        except TimeoutError:
            continue
        try:
            upstream = socket.create_connection(_split(target), timeout=10)
        except OSError:
            client.close()
            continue
        upstream.settimeout(None)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _Pipe(client, upstream, rtt_s / 2).start()
        _Pipe(upstream, client, rtt_s / 2).start()
    server.close()


def announce_ready(port: int) -> None:
    """The child's side of the protocol with its parent: one `READY <port>` line on stdout (a pipe)."""
    print(f"READY {port}", flush=True)


def main(argv: Sequence[str] | None = None) -> None:
    """The relay as a child process: its stdout carries only the `READY <port>` line (`announce_ready`)."""
    parser = argparse.ArgumentParser(prog="python -m peer.research.bench.delay_relay")
    parser.add_argument("--listen", required=True, help="HOST:PORT to accept on (port 0: any)")
    parser.add_argument("--to", required=True, help="HOST:PORT to relay to")
    parser.add_argument("--rtt-ms", type=float, required=True, help="round trip added (half each way)")
    args = parser.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    relay(args.listen, args.to, args.rtt_ms / 1e3, stop, announce_ready)


if __name__ == "__main__":
    main()

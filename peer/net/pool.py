"""A pool of gRPC clients, one `PeerClient` per peer address, shared by every round and role.

Invariants:
- at most one open client per address; `drop` closes it and the next `get` opens a fresh one;
- the byte counters are cumulative over the pool's life: a dropped (or closed) client's counts
  are folded into the retired totals before it is closed, so nothing is lost on reconnect;
- every method is thread-safe (one lock guards the client map and the retired totals).
"""

from __future__ import annotations

import threading

from peer.net.transport.client import PeerClient
from peer.net.transport.dialer import Outbound

_COUNTERS = ("bytes_sent", "bytes_received")


class ClientPool:
    """One PeerClient per address, reused across rounds; byte counters survive dropped clients."""

    def __init__(self, timeout_s: float, wire_dtype: str = "fp32", outbound: Outbound | None = None) -> None:
        """`outbound`: the admission proof and link buckets of every client (default: none, uncapped)."""
        self.timeout_s, self.wire_dtype = timeout_s, wire_dtype
        self.outbound = outbound or Outbound()
        self._clients: dict[str, PeerClient] = {}
        self._retired: dict[str, dict[str, int]] = {kind: {} for kind in _COUNTERS}
        self._lock = threading.Lock()

    def get(self, address: str) -> PeerClient:
        """The open client for `address`, created on first use."""
        with self._lock:
            if address not in self._clients:
                self._clients[address] = PeerClient(
                    address, timeout_s=self.timeout_s, wire_dtype=self.wire_dtype, outbound=self.outbound
                )
            return self._clients[address]

    def _retire(self, client: PeerClient) -> None:
        """Fold `client`'s byte counters into the retired totals and close it (lock held)."""
        stats = client.stats()
        for kind in _COUNTERS:
            for method, n in stats[kind].items():
                self._retired[kind][method] = self._retired[kind].get(method, 0) + n
        client.close()

    def drop(self, address: str) -> None:
        """Close the client for `address` (e.g. after a peer failed); keep its byte counts."""
        with self._lock:
            client = self._clients.pop(address, None)
            if client is not None:
                self._retire(client)

    def _totals(self, kind: str) -> dict[str, int]:
        with self._lock:
            total = dict(self._retired[kind])
            for c in self._clients.values():
                for method, n in c.stats()[kind].items():
                    total[method] = total.get(method, 0) + n
        return total

    def bytes_sent(self) -> dict[str, int]:
        """Bytes sent per gRPC method, over every client this pool ever held."""
        return self._totals("bytes_sent")

    def bytes_received(self) -> dict[str, int]:
        """Bytes received per gRPC method, over every client this pool ever held."""
        return self._totals("bytes_received")

    def close(self) -> None:
        """Close every client; the counters stay readable."""
        with self._lock:
            for c in self._clients.values():
                self._retire(c)
            self._clients = {}

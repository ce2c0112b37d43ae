"""Outer rounds over the swarm: announce → fetch → commit the same set in the same order.

Round (t, s) — DESIGN §3. Contributors are the replicas working on outer step t: every pipeline
(its stage-s peer sends the payload, tagged with the pipeline's id) and every full replica (one
payload per stage, tagged with its own id). Each contributor
1. keeps its encoded payload in its `PayloadStore` (served by gRPC `get_payload`) and announces
   {sha256, size, address, replica} under `round.{t}.{s}` in the DHT;
2. polls the DHT until every expected replica has announced (or the round deadline passes),
   fetching each new payload once and checking its sha256 and format;
3. commits every payload it holds, ordered by replica id, so all holders apply the same sum in the
   same order and stay bit-identical.
Hot spares and compressed stages that only need stage 0's embedding change run the same gather
without a payload of their own (observers).

Expected replicas for round t: live replica records (pipelines' heads and full replicas) that joined
at or before t and are at outer step t − 1 or later. A dead replica drops out when its record
expires; a slow one is waited for until the deadline. The DHT offers no notifications, so the
wait is a bounded poll (`poll_s`) under one deadline.
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from peer.dht import SwarmDHT
from peer.errors import NetworkError, PeerError
from peer.transport.client import PeerClient
from peer.transport.messages import PayloadRequest

log = logging.getLogger(__name__)


class PayloadStore:
    """Payloads this process serves, by (outer step, stage); keeps the newest `keep` rounds."""

    def __init__(self, keep: int = 3) -> None:
        self._data: dict[tuple[int, int], bytes] = {}
        self._lock = threading.Lock()
        self.keep = keep

    def put(self, t: int, stage: int, payload: bytes) -> None:
        with self._lock:
            self._data[(t, stage)] = payload
            for key in [k for k in self._data if k[0] <= t - self.keep]:
                del self._data[key]

    def get(self, t: int, stage: int) -> bytes | None:
        with self._lock:
            return self._data.get((t, stage))


class ClientPool:
    """One PeerClient per address, reused across rounds; byte counters survive dropped clients."""

    def __init__(self, timeout_s: float, wire_dtype: str = "fp32") -> None:
        self.timeout_s, self.wire_dtype = timeout_s, wire_dtype
        self._clients: dict[str, PeerClient] = {}
        self._retired: dict[str, dict[str, int]] = {"bytes_sent": {}, "bytes_received": {}}
        self._lock = threading.Lock()

    def get(self, address: str) -> PeerClient:
        with self._lock:
            if address not in self._clients:
                self._clients[address] = PeerClient(address, timeout_s=self.timeout_s, wire_dtype=self.wire_dtype)
            return self._clients[address]

    def _retire(self, client: PeerClient) -> None:
        stats = client.stats()
        for kind in ("bytes_sent", "bytes_received"):
            for method, n in stats[kind].items():
                self._retired[kind][method] = self._retired[kind].get(method, 0) + n
        client.close()

    def drop(self, address: str) -> None:
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
        return self._totals("bytes_sent")

    def bytes_received(self) -> dict[str, int]:
        return self._totals("bytes_received")

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                self._retire(c)
            self._clients = {}


@dataclass
class RoundResult:
    """What one peer committed for round (t, s), in commit order, and why it stopped waiting."""

    t: int
    stage: int
    replicas: list[str] = field(default_factory=list)  # replica ids, commit order
    payloads: list[bytes] = field(default_factory=list)
    expected: int = 0
    timed_out: bool = False
    wall_s: float = 0.0
    bytes_fetched: int = 0

    @property
    def participants(self) -> int:
        return len(self.replicas)


def expected_replicas(dht: SwarmDHT, t: int) -> set[str]:
    """Replica ids that should contribute to round t (see the module docstring)."""
    out = set()
    for rid, rec in dht.get_replicas().items():
        if rec.get("joined_at", 0) <= t and rec.get("outer_step", -1) >= t - 1:
            out.add(rid)
    return out


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def gather_round(
    dht: SwarmDHT,
    clients: ClientPool,
    t: int,
    stage: int,
    timeout_s: float,
    own: tuple[str, bytes] | None = None,
    store: PayloadStore | None = None,
    address: str = "",
    validate: Callable[[bytes], None] | None = None,
    poll_s: float = 0.2,
    ttl_s: float = 60.0,
    stop: threading.Event | None = None,
) -> RoundResult:
    """Contribute `own` = (replica id, payload bytes) if given, then collect the round's payloads.

    `validate(payload)` raises PeerError for a malformed payload (it is then skipped).
    Returns when every expected replica's payload is held, or at the deadline.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    held: dict[str, bytes] = {}
    bad: set[str] = set()
    retry_at: dict[str, float] = {}  # unreachable senders are retried with backoff, not every poll
    result = RoundResult(t=t, stage=stage)
    if own is not None:
        replica_id, payload = own
        if store is None:
            raise ValueError("a contributor needs a PayloadStore to serve its payload")
        store.put(t, stage, payload)
        dht.announce_payload(t, stage, {"sha256": sha256(payload), "size": len(payload), "address": address,
                                        "replica": replica_id}, ttl_s=ttl_s)
        held[replica_id] = payload
    while True:
        announced = dht.get_payloads(t, stage)
        for sender, rec in sorted(announced.items()):
            rid = rec.get("replica", sender)
            if rid in held or sender in bad or retry_at.get(sender, 0.0) > time.monotonic():
                continue
            try:
                remaining = max(0.5, deadline - time.monotonic())
                data = clients.get(rec["address"]).get_payload(PayloadRequest(t, stage, sender), timeout_s=remaining)
                if sha256(data) != rec.get("sha256"):
                    raise PeerError(f"payload from {sender} does not match its announced sha256")
                if validate is not None:
                    validate(data)
            except NetworkError as exc:
                retry_at[sender] = time.monotonic() + 2.0
                log.info("round %d stage %d: payload of %s not reachable yet: %s", t, stage, sender[:12], exc)
                continue
            except PeerError as exc:
                log.warning("round %d stage %d: rejecting payload of %s: %s", t, stage, sender[:12], exc)
                bad.add(sender)
                continue
            held[rid] = data
            result.bytes_fetched += len(data)
        # every live replica of round t, and anyone who announced a payload for it: a payload some
        # peers hold and others skipped would split the stage's parameters
        expected = expected_replicas(dht, t) | {rec.get("replica", pid) for pid, rec in announced.items()
                                                if pid not in bad}
        result.expected = len(expected)
        # Done when every live replica of round t is held (an observer whose contributors all left
        # commits what it holds; they linger after their last round so this is rare).
        if expected <= set(held):
            break
        if time.monotonic() >= deadline:
            result.timed_out = True
            log.warning("round %d stage %d: deadline after %.0fs with %d/%d payloads (missing: %s)", t, stage,
                        timeout_s, len(held), len(expected), ", ".join(sorted(expected - set(held)))[:200])
            break
        if stop is not None and stop.wait(poll_s):
            raise PeerError("stopped while waiting for a round")
        elif stop is None:
            time.sleep(poll_s)
    result.replicas = sorted(held)
    result.payloads = [held[r] for r in result.replicas]
    result.wall_s = time.monotonic() - started
    return result

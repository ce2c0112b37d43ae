"""How the swarm reaches this peer: the reachability check at join and the reverse streams after it.

Modes (published in every record as "connectivity", shown by `peer status`):
- direct:  others dial the announced host:port (the dial-back check succeeded);
- relayed: this peer cannot be dialled and keeps one reverse stream to a relay (the bootstrap or
           a peer started with `--relay`); its address is "PEERID@relay-host:port", anyone reaches
           it through the relay;
- reverse: it cannot be dialled and no relay is offered: it keeps reverse streams to every directly
           reachable peer of the run (the heads, stages and full replicas it works with, at most
           `MAX_LINKS`) and those peers call it over them; its address names the first of them.

The check asks the bootstrap (then a few live peers) to dial this peer back (Tunnel.DialBack) and
logs one line: reachable, or not reachable with what to do (`--announce-host`, port forwarding) and
what it does meanwhile (a relay or reverse streams). If nobody can be asked, the peer stays direct.

Invariants: every network step has a deadline; the keeper thread never raises (a DHT or link error
is logged and retried next tick); `close` stops the thread and every stream.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from peer.errors import PeerError
from peer.net.dht import SwarmDHT
from peer.net.records import ReplicaRecord, StageRecord
from peer.net.transport.dialer import Outbound
from peer.net.transport.reverse import ReverseLink, ask_dial_back
from peer.node.presence import Presence

log = logging.getLogger(__name__)

MAX_LINKS = 8  # reverse streams a hidden peer keeps in "reverse" mode
CHECK_TIMEOUT_S = 20.0  # the callee's dial-back itself gives up after 5 s
CONNECT_WAIT_S = 10.0  # how long start() waits for the first stream before publishing the address


class Connectivity:
    """Decides this peer's connectivity mode and keeps its reverse streams (see module docstring)."""

    def __init__(
        self,
        dht: SwarmDHT,
        me: Presence,
        stages: int,
        announce_interval_s: float,
        bootstrap_address: str,
        local_address: str,
        outbound: Outbound,
    ) -> None:
        """`me.address` is the direct address to check; a routed one replaces it when nobody can dial it."""
        self.dht, self.me, self.stages = dht, me, stages
        self.announce_interval_s, self.bootstrap_address = announce_interval_s, bootstrap_address
        self.local_address = local_address  # where this peer's own server answers its reverse streams
        self.outbound = outbound  # the proof and link of this peer's calls (dial-back, reverse streams)
        self.direct_address = me.address
        self.mode = "direct"
        self.seen_host = ""
        self._links: dict[str, ReverseLink] = {}
        self._relay: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ the check
    def start(self) -> None:
        """Run the reachability check, log its one line, and set up reverse streams if needed."""
        reachable, relays, checker = self._check()
        port = self.direct_address.rpartition(":")[2]
        if reachable:
            log.info("reachable: peers can dial this peer at %s (checked by %s)", self.direct_address, checker)
            return
        advice = (
            f"to be dialled directly, forward TCP port {port} to this machine and pass "
            f"--announce-host {self.seen_host or 'YOUR_PUBLIC_IP'} --port {port}"
        )
        if relays:
            self.mode, self._relay = "relayed", relays[0]
            self._open(relays[0])
            log.warning(
                "not reachable at %s (seen from %s as %s): using a relay (%s); %s",
                self.direct_address, checker, self.seen_host or "?", relays[0], advice,
            )  # fmt: skip
        else:
            self.mode = "reverse"
            self._sync_links()
            log.warning(
                "not reachable at %s (seen from %s as %s): serving calls over reverse streams to the peers it "
                "works with (no relay offered; start one with `peer join --relay` on a reachable machine); %s",
                self.direct_address, checker, self.seen_host or "?", advice,
            )  # fmt: skip
        self._wait_connected()
        self._publish_address()
        self._thread = threading.Thread(target=self._keep, name="peer-connectivity", daemon=True)
        self._thread.start()

    def _candidates(self) -> list[str]:
        """Who to ask for a dial-back: the bootstrap, then a few directly reachable live peers."""
        found = [self.bootstrap_address]
        found += self._direct_peers()[:3]
        return [a for a in dict.fromkeys(found) if a and a != self.direct_address]

    def _check(self) -> tuple[bool, list[str], str]:
        """(reachable, relays offered, who checked)."""
        relays: list[str] = []
        for hub in self._candidates():
            try:
                reply = ask_dial_back(hub, self.direct_address, timeout_s=CHECK_TIMEOUT_S, outbound=self.outbound)
            except PeerError as exc:
                log.debug("reachability check via %s failed: %s", hub, exc)
                continue
            self.seen_host = reply.seen_host
            if reply.relay:
                relays.append(hub)
            if reply.ok and reply.peer_id in ("", self.me.peer_id):
                return True, relays, hub
            relays += [a for a in self._relay_peers() if a not in relays]
            return False, relays, hub
        log.warning("could not check reachability (no peer answered); assuming others can dial %s", self.direct_address)
        return True, relays, "nobody"

    # ------------------------------------------------------------------ streams
    def _records(self) -> list[StageRecord | ReplicaRecord]:
        """Other peers' live stage and replica records (none when the DHT cannot be read)."""
        out: list[tuple[str, StageRecord | ReplicaRecord]] = []
        try:
            for s in range(self.stages):
                out += self.dht.get_stage_peers(s).items()
            out += self.dht.get_replicas().items()
        except PeerError as exc:
            log.debug("connectivity: could not read the swarm's records: %s", exc)
        return [r for pid, r in out if pid != self.me.peer_id]

    def _direct_peers(self) -> list[str]:
        addresses = [
            r.address
            for r in self._records()
            if r.address and "@" not in r.address and (r.net.connectivity or "direct") == "direct"
        ]
        return list(dict.fromkeys(addresses))

    def _relay_peers(self) -> list[str]:
        return [r.address for r in self._records() if r.net.relay and "@" not in r.address]

    def _open(self, hub: str) -> None:
        with self._lock:
            if hub not in self._links:
                self._links[hub] = ReverseLink(
                    hub, self.local_address, on_change=self._publish_address, outbound=self.outbound
                )

    def _sync_links(self) -> None:
        """Reverse mode: one stream to each directly reachable peer of the run (at most MAX_LINKS)."""
        want = self._direct_peers()[:MAX_LINKS]
        for hub in want:
            self._open(hub)
        with self._lock:
            gone = [h for h in self._links if h not in want]
            closing = [self._links.pop(h) for h in gone]
        for link in closing:
            link.close()

    def _wait_connected(self) -> None:
        with self._lock:
            links = list(self._links.values())
        for link in links:
            if link.connected.wait(CONNECT_WAIT_S / max(1, len(links))):
                return

    def _keep(self) -> None:
        interval = self.announce_interval_s
        while not self._stop.wait(max(1.0, interval)):
            try:
                if self.mode == "reverse":
                    self._sync_links()
                self._publish_address()
            except Exception:  # noqa: BLE001 - the keeper logs and tries again next tick
                log.exception("connectivity keeper failed; retrying")

    def via(self) -> list[str]:
        """Hubs holding a live reverse stream of this peer."""
        with self._lock:
            return [h for h, link in self._links.items() if link.connected.is_set()]

    def _publish_address(self) -> None:
        if self.mode == "direct":
            return
        via = self.via()
        hub = self._relay if self.mode == "relayed" else (via[0] if via else "-")
        self.me.address = f"{self.me.peer_id}@{hub}"

    def fields(self) -> dict[str, Any]:
        """What this peer's records say about its connectivity."""
        return {"connectivity": self.mode, "via": self.via()}

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        with self._lock:
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()

"""Fetching one announced payload of a round: the announcer first, then whoever else holds it.

The one fetcher of an all-to-all round's payloads (docs/protocol.md, "Gather", FOLLOW, RECONCILE,
"Joining by replay"): the gather's fetch of a bound announcement (`peer.node.round.gather`), the
fetch of a claimed set's entries (`peer.node.round.verify.SetFetcher`: FOLLOW, the checks of a
claim, a joiner's replay) all call `Fetcher.fetch`. It returns a `Contribution`
(`peer.node.round.contribution.received`: checked against the announced sha256, parsed once) and
keeps it in the `PayloadStore`, so this holder serves it on as a second source.

Sources, in order, each tried once per call (bounded), each call under its own deadline:
1. what we hold: our own payload, or the one we fetched from that sender earlier (`PayloadStore`);
   a holder of stage s ≥ 2 reading stage 0's embedding views (`ViewReader.relay` = s − 1) then asks
   the relays: two of the announcers of round (t, s − 1), ranked by a hash of (us, the sender), which
   observe stage 0 too and serve the views they fetched. While none holds the view yet it raises
   `NotRelayed` (the gather asks again at a later poll) until `relay_until` (a gather's start plus
   `relay_wait_s`), then falls through to the sender. So a stage-0 holder serves its view to stage
   1's M holders instead of the M·(S − 1) holders of every later stage, and each holder of a middle
   stage serves about M views (docs/protocol.md, "Embedding views"); a relay's answer is never binding;
2. the announcer, under the caller's `deadline` (else one `rpc_s`);
3. a claimer that named the payload in its committed set (`claimer`);
4. the round's other announcers — contributors and observers keep what they fetched; for stage 0
   also the announcers of the other stages, whose holders observe stage 0 for their T⊥;
5. only with `holders` (a replay of rounds whose contributors may all have left): the stage's
   holders and attesters now.
Any source is as good as the sender: the announced id decides. With a `ViewReader` (an observer of
stage 0 whose T⊥ needs only u) each source is asked for the payload's embedding view (kind EMBED),
checked against the same id; a whole payload held here serves as its own view. `strict` (the
gather) makes the announcer's answer binding — an announcement without an address, bytes that do not match it or a
refusal other than "gone" reject the payload (PeerError) — and, when nobody else serves it, raises
the announcer's own error; without it a wrong answer only costs a try, and nothing served raises
NetworkError.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Iterator, Mapping
from typing import Any, cast

from peer.errors import NetworkError, PeerError
from peer.net.pool import ClientPool
from peer.net.records import Announcement
from peer.net.transport.errors import NotFoundError
from peer.net.transport.messages import PayloadKind, PayloadRequest
from peer.node.round.contribution import Contribution, Mismatch, Reading, ViewReader, received
from peer.node.round.payloads import PayloadStore

log = logging.getLogger(__name__)

MIN_ANNOUNCER_S = 0.5  # the announcer is given at least this long, even at the deadline
RELAY_TRIES = 2  # relays asked for a view per try
RELAY_RETRY_S = 0.5  # a view no relay held yet is asked of them again this much later
RELAY_READ_S = 1.0  # how long one DHT read of the relays' announcements is used
RELAY_WAIT_S = 20.0  # the most a gather waits for its relays before it asks the sender


class Unreadable(NetworkError):
    """The DHT could not be read, so the fetch could not ask everyone who may hold the payload (a
    fetch that asked everyone and got nothing is a plain NetworkError: nobody serves it)."""


class NotRelayed(NetworkError):
    """No relay holds the view yet and the wait for them is not over: asked again at a later poll."""


def relay_wait_s(deadline_s: float) -> float:
    """How long a gather of views waits for its relays: a quarter of its deadline, at most `RELAY_WAIT_S`
    (a relay fetches each view from its sender at the round's start, as we would)."""
    return min(deadline_s / 4, RELAY_WAIT_S)


class Fetcher:
    """Fetches announced payloads of rounds (module docstring): bounded, a deadline per call."""

    def __init__(
        self,
        dht: Any,
        clients: ClientPool,
        store: PayloadStore,
        me: str,
        rpc_s: float,
        n_stages: int = 1,
        holders: bool = False,
    ) -> None:
        """`rpc_s`: one try at a source other than the announcer; `n_stages`: the run's stages (stage
        0's payloads are asked of every stage's announcers); `holders`: ask the stage's holders and
        attesters as a last resort. Views wait for their relays until `relay_until` (monotonic; a
        gather sets it: `relay_wait_s`), by default not at all."""
        self.dht, self.clients, self.store, self.me = dht, clients, store, me
        self.rpc_s, self.n_stages, self.holders = rpc_s, n_stages, holders
        self.relay_until = -math.inf
        self._relay_next: dict[tuple[int, str], float] = {}  # (t, sender): when its relays are asked again
        self._relay_read: dict[tuple[int, int], tuple[float, dict[str, Announcement]]] = {}
        self._skipped: set[str] = set()  # relays that were unreachable or served wrong bytes

    def fetch(
        self,
        t: int,
        stage: int,
        sender: str,
        ann: Announcement,
        parse: Reading,
        announcements: Mapping[str, Announcement],
        deadline: float | None = None,
        claimer: str | None = None,
        strict: bool = False,
    ) -> Contribution:
        """`sender`'s payload of round (t, `stage`) as announced by `ann`, from the sources of the module
        docstring; `announcements`: the round's (any stage's) announcements already read; `parse`: how
        it is read (whole, or its view). PeerError when it does not parse; NetworkError (strict: the
        announcer's error) when nobody serves it."""
        replica = ann.replica_of(sender)
        held = self._held(t, stage, sender, ann, replica, parse)
        if held is not None:
            return held
        if isinstance(parse, ViewReader) and parse.relay is not None and stage == 0:
            relayed = self._relayed(t, sender, ann, replica, parse)
            if relayed is not None:
                return self._keep(t, stage, sender, relayed)
        kind = PayloadKind.EMBED if isinstance(parse, ViewReader) else PayloadKind.PAYLOAD
        request = PayloadRequest(t, stage, sender, kind)
        first: PeerError | None = None
        if strict and not ann.address:
            raise PeerError(f"the announcement of {sender} has no address")
        if ann.address:
            timeout_s = self.rpc_s if deadline is None else max(MIN_ANNOUNCER_S, deadline - time.monotonic())
            try:
                data = self.clients.get(ann.address).get_payload(request, timeout_s=timeout_s)
                return self._keep(t, stage, sender, received(replica, ann.sha256, data, parse))
            except Mismatch:
                if strict:
                    raise
            except (NetworkError, NotFoundError) as exc:  # the sender is gone, or restarted without it
                first = exc
            except PeerError:
                if strict:
                    raise
        for who, address in self._others(t, stage, sender, ann, announcements, claimer):
            try:
                data = self.clients.get(address).get_payload(request, timeout_s=self.rpc_s)
                got = received(replica, ann.sha256, data, parse)
            except PeerError:  # unreachable, not held there, or wrong bytes: the next one
                continue
            log.info("round %d stage %d: payload of %s served by %s", t, stage, sender[:12], who[:12])
            return self._keep(t, stage, sender, got)
        if first is not None:
            raise first
        raise NetworkError(f"nobody serves the payload of {sender[:12]} for round {t} stage {stage}")

    def _held(
        self, t: int, stage: int, sender: str, ann: Announcement, replica: str, parse: Reading
    ) -> Contribution | None:
        """The payload from our own store: fetched from `sender` before (a view only when a view is
        wanted), or our own (as encoded, or parsed here when the store was given bare bytes)."""
        got = self.store.fetched(t, stage, sender)
        if got is not None and got.sha256 == ann.sha256 and (isinstance(parse, ViewReader) or not got.view):
            return got
        mine = self.store.mine(t, stage)
        if mine is None or mine.sha256 != ann.sha256:
            return None
        if mine.payload is None:
            return received(replica, ann.sha256, mine.data, parse.whole if isinstance(parse, ViewReader) else parse)
        return Contribution(replica, mine.sha256, mine.data, mine.payload)

    def _relayed(self, t: int, sender: str, ann: Announcement, replica: str, parse: ViewReader) -> Contribution | None:
        """`sender`'s stage-0 view from the relays (module docstring, source 1); None: ask the sender
        (no relay announced, or the wait is over); NotRelayed: ask again later."""
        relays = self._relays(t, cast(int, parse.relay), sender)
        if not relays:
            return None
        if time.monotonic() < self._relay_next.get((t, sender), 0.0):
            raise NotRelayed(f"the view of {sender[:12]} was asked of its relays moments ago")
        request = PayloadRequest(t, 0, sender, PayloadKind.EMBED)
        for who, address in relays[:RELAY_TRIES]:
            try:
                data = self.clients.get(address).get_payload(request, timeout_s=self.rpc_s)
            except NotFoundError:  # not fetched there yet
                continue
            except PeerError:  # unreachable, or refused: not asked again by this fetcher
                self._skipped.add(who)
                continue
            try:
                got = received(replica, ann.sha256, data, parse)
            except PeerError:  # bytes that do not prove the id cost the relay its turn
                log.warning("round %d stage 0: relay %s served a wrong view of %s", t, who[:12], sender[:12])
                self._skipped.add(who)
                continue
            log.debug("round %d stage 0: the view of %s relayed by %s", t, sender[:12], who[:12])
            return got
        if time.monotonic() >= self.relay_until:
            return None
        self._relay_next[(t, sender)] = time.monotonic() + RELAY_RETRY_S
        raise NotRelayed(f"no relay holds the view of {sender[:12]} yet")

    def _relays(self, t: int, relay: int, sender: str) -> list[tuple[str, str]]:
        """(who, address) of the announcers of round (t, `relay`), in the order a hash of (us, `sender`,
        them) gives (each relay serves about as many views as it fetched); [] when none can be read."""
        at, read = self._relay_read.get((t, relay), (-math.inf, {}))
        if time.monotonic() - at > RELAY_READ_S:
            try:
                read = dict(self.dht.get_payloads(t, relay))
            except NetworkError:
                read = {}
            self._relay_read[(t, relay)] = (time.monotonic(), read)
        skip = {self.me, sender, *self._skipped}
        live = [(p, rec.address) for p, rec in read.items() if rec.address and p not in skip]
        return sorted(live, key=lambda pa: hashlib.sha256(f"{self.me}|{sender}|{pa[0]}".encode()).digest())

    def _keep(self, t: int, stage: int, sender: str, got: Contribution) -> Contribution:
        self.store.put_fetched(t, stage, sender, got)
        return got

    def _others(
        self,
        t: int,
        stage: int,
        sender: str,
        ann: Announcement,
        announcements: Mapping[str, Announcement],
        claimer: str | None,
    ) -> Iterator[tuple[str, str]]:
        """(who, address) of every other source, in order; DHT reads only when reached (lazily)."""
        if claimer and claimer != ann.address:
            yield "its claimer", claimer
        others = dict(announcements)
        for x in range(1, self.n_stages) if stage == 0 else ():  # observers of stage 0 keep it too
            try:
                others.update(self.dht.get_payloads(t, x))
            except NetworkError as exc:
                raise Unreadable(f"the announcements of round {t} stage {x} could not be read: {exc}") from exc
        for other, rec in sorted(others.items()):
            if other not in (sender, self.me) and rec.address:
                yield other, rec.address
        if not self.holders:
            return
        try:  # last resort: observers and spares keep what they fetched for the history window
            stage_holders = {**self.dht.get_stage_peers(stage), **self.dht.get_stage_peers(stage, kind="attest")}
        except PeerError:
            return
        for pid, srec in sorted(stage_holders.items()):
            if pid not in (sender, self.me) and srec.address and not srec.left:
                yield f"holder {pid}", srec.address

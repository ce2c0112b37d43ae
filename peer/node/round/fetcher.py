"""Fetching one announced payload of a round: the announcer first, then whoever else holds it.

The one fetcher of an all-to-all round's payloads (docs/protocol.md, "Gather", FOLLOW, RECONCILE,
"Joining by replay"): the gather's fetch of a bound announcement (`peer.node.round.gather`), the
fetch of a claimed set's entries (`peer.node.round.verify.SetFetcher`: FOLLOW, the checks of a
claim, a joiner's replay) all call `Fetcher.fetch`. It returns a `Contribution`
(`peer.node.round.contribution.received`: checked against the announced sha256, parsed once) and
keeps it in the `PayloadStore`, so this holder serves it on as a second source.

Sources, in order, each tried once per call (bounded), each call under its own deadline:
1. what we hold: our own payload, or the one we fetched from that sender earlier (`PayloadStore`);
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

import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

from peer.errors import NetworkError, PeerError
from peer.net.pool import ClientPool
from peer.net.records import Announcement
from peer.net.transport.errors import NotFoundError
from peer.net.transport.messages import PayloadKind, PayloadRequest
from peer.node.round.contribution import Contribution, Mismatch, Reading, ViewReader, received
from peer.node.round.payloads import PayloadStore

log = logging.getLogger(__name__)

MIN_ANNOUNCER_S = 0.5  # the announcer is given at least this long, even at the deadline


class Unreadable(NetworkError):
    """The DHT could not be read, so the fetch could not ask everyone who may hold the payload (a
    fetch that asked everyone and got nothing is a plain NetworkError: nobody serves it)."""


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
        attesters as a last resort."""
        self.dht, self.clients, self.store, self.me = dht, clients, store, me
        self.rpc_s, self.n_stages, self.holders = rpc_s, n_stages, holders

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

"""The payloads of outer rounds, apart from the round logic: what a peer serves, what it accepts.

- `PayloadStore`: the payloads this process serves over gRPC `get_payload`, newest rounds only
  (whole, or as their embedding views: `view`).
- `payload_validator`: a received payload parses with this run's settings and fits the stage's
  parameters exactly (names, shapes, each once, stage 0's embedding present), else PayloadError:
  a payload that could not be applied is never committed; `round_validator` builds it for round
  (t, stage) as seen by one of our stage workers (an observer of stage 0 uses stage 0's shapes), and
  `round_reading` how that round's payloads are read: whole, or (an observer of stage 0, whose T⊥
  needs only u) as views, whose entry `view_validator` checks.
- `payload_id`: the id announced with every payload; `sha256`: the plain digest of parts and shards
  (`peer.node.round.contribution`).
- `read_round`, `poll_pause`: one poll of a round's DHT records (replicas, stage holders,
  announcements), and the pause between polls.
- `announce`: serve and announce our contribution. Fetching: `peer.node.round.fetcher`.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from peer.config import RunConfig
from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.codec.format import Payload, PayloadError, SparseLoCoConfig
from peer.core.sparseloco.codec.sections import View, read_view, view_bytes
from peer.core.sparseloco.ranges import merkle_proof
from peer.core.subspace.state import EMBED
from peer.errors import NetworkError, PeerError
from peer.net.dht import SwarmDHT, dht_time
from peer.net.records import Announcement, ReplicaRecord, StageRecord
from peer.node.presence import Presence
from peer.node.round.claims import closed_elsewhere, swarm_clock
from peer.node.round.contribution import Contribution, Reading, ViewReader, payload_id, sha256, whole
from peer.node.round.payload_disk import PayloadDisk

if TYPE_CHECKING:
    from peer.node.stage.state import StageState

__all__ = [
    "SETTLE_S",
    "PayloadStore",
    "announce",
    "payload_id",
    "payload_validator",
    "poll_pause",
    "read_round",
    "round_reading",
    "sha256",
    "view_validator",
]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Mine:
    """Our own payload of a round as the store keeps it (`payload` None: given as bare bytes)."""

    data: bytes
    sha256: str
    payload: Payload | None = None


class PayloadStore:
    """Payloads this process serves, by (outer step, stage); keeps the newest `keep` rounds, and its
    own and fetched payloads of the newest `history` rounds (a joiner replays them: docs/protocol.md,
    "Joining by replay").

    Besides our own payload of each round it keeps the payloads we fetched from others (by sender),
    so a holder can serve a committed set whose sender died after sending (`gather_round` asks the
    round's other contributors for it; the announced sha256 makes any source as good as the sender).
    A ranges round keeps parts (ours, with merkle proofs made once per range, and the ones we
    fetched) and shards instead (`peer.node.round.ranges.exchange`).
    """

    def __init__(self, keep: int = 3, history: int = 3, disk: PayloadDisk | None = None) -> None:
        """`disk`: whole payloads also kept in files, read back by `restore` (a peer's `--resume`)."""
        self._data: dict[tuple[int, int], Mine] = {}  # ours
        self._fetched: dict[tuple[int, int, str], Contribution] = {}  # by sender, checked and parsed
        self._views: dict[tuple[int, int, str, str], bytes] = {}  # views made of whole payloads, by sender and id
        self._parts: dict[tuple[int, int], list[bytes]] = {}
        self._proofs: dict[tuple[int, int, int], tuple[bytes, ...]] = {}
        self._fetched_parts: dict[tuple[int, int, str, int], tuple[bytes, tuple[bytes, ...]]] = {}
        self._shards: dict[tuple[int, int, int, str], bytes] = {}
        self._lock = threading.Lock()
        self.keep, self.history = keep, max(keep, history)
        self.disk = disk

    def restore(self) -> int:
        """Serve again the whole payloads `disk` kept (an earlier run of this peer): how many."""
        if self.disk is None:
            return 0
        n = 0
        for kept in self.disk.read():
            got = whole(kept.replica, kept.data, kept.payload)
            with self._lock:
                if kept.sender is None:
                    self._data[(kept.t, kept.stage)] = Mine(got.data, got.sha256, got.payload)
                else:
                    self._fetched[(kept.t, kept.stage, kept.sender)] = got
                self._expire(kept.t)
            n += 1
        return n

    def _keep(self, t: int, stage: int, sender: str | None, replica: str, data: bytes) -> None:
        if self.disk is not None:
            self.disk.write(t, stage, sender, replica, data)
            self.disk.expire(t - self.history + 1)

    def put(self, t: int, stage: int, payload: bytes | Contribution) -> None:
        """Our payload of (t, stage): the contribution we announce, or bare bytes (identified here, once;
        bytes that are no payload — a test's faulty sender — under their plain sha256)."""
        if isinstance(payload, Contribution):
            mine = Mine(payload.data, payload.sha256, payload.payload)
        else:
            try:
                mine = Mine(payload, payload_id(payload))
            except PayloadError:
                mine = Mine(payload, sha256(payload))
        with self._lock:
            self._data[(t, stage)] = mine
            self._expire(t)
        self._keep(t, stage, None, payload.replica if isinstance(payload, Contribution) else "", mine.data)

    def put_fetched(self, t: int, stage: int, sender: str, got: Contribution) -> None:
        """`sender`'s contribution of (t, stage) that we fetched and checked (served as a second source)."""
        with self._lock:
            self._fetched[(t, stage, sender)] = got
            self._expire(t)
        if not got.view:
            self._keep(t, stage, sender, got.replica, got.data)

    def _expire(self, t: int) -> None:
        held: tuple[tuple[dict[Any, Any], int], ...] = (
            (self._data, self.history),
            (self._fetched, self.history),
            (self._views, self.history),
            (self._parts, self.keep),
            (self._proofs, self.keep),
            (self._fetched_parts, self.keep),
            (self._shards, self.keep),
        )
        for keyed, rounds in held:
            for key in [k for k in keyed if k[0] <= t - rounds]:
                del keyed[key]

    def get(self, t: int, stage: int, sender: str | None = None) -> bytes | None:
        """Our own payload of (t, stage) or, with `sender`, the one we fetched whole from that sender."""
        with self._lock:
            if sender is not None:
                got = self._fetched.get((t, stage, sender))
                return got.data if got is not None and not got.view else None
            own = self._data.get((t, stage))
            return own.data if own is not None else None

    def view(self, t: int, stage: int, sender: str | None = None) -> bytes | None:
        """The embedding view (`peer.core.sparseloco.codec.sections`) of our own payload of (t, stage) or,
        with `sender`, of the one we fetched from that sender (whole, or its view as fetched). Made
        once per payload: a round's stage-0 payloads are asked for by every later stage's holder."""
        with self._lock:
            got = self._fetched.get((t, stage, sender)) if sender is not None else None
            own = self._data.get((t, stage)) if sender is None else None
        if got is not None and got.view:
            return got.data
        mine = Mine(got.data, got.sha256, got.payload) if got is not None else own
        if mine is None:
            return None
        key = (t, stage, sender or "", mine.sha256)
        with self._lock:
            made = self._views.get(key)
        if made is None:
            try:
                payload = mine.payload if mine.payload is not None else Payload.from_bytes(mine.data)
            except PayloadError:  # bare bytes that are no payload have no view
                return None
            made = view_bytes(mine.data, payload)  # outside the lock: it reads every value (the norm)
            with self._lock:
                self._views[key] = made
        return made

    def mine(self, t: int, stage: int) -> Mine | None:
        """Our own payload of (t, stage), its sha256 and (when we encoded it) its parsed form."""
        with self._lock:
            return self._data.get((t, stage))

    def fetched(self, t: int, stage: int, sender: str) -> Contribution | None:
        """The contribution we fetched from `sender` for (t, stage), as checked and parsed then."""
        with self._lock:
            return self._fetched.get((t, stage, sender))

    # a ranges round (docs/protocol.md, RANGES): parts with their merkle proofs, and shards
    def put_parts(self, t: int, stage: int, parts: Sequence[bytes]) -> None:
        """Our parts of (t, stage), one per range, in range order (their proofs are made when asked)."""
        with self._lock:
            self._parts[(t, stage)] = list(parts)
            self._expire(t)

    def put_part(self, t: int, stage: int, sender: str, r: int, part: bytes, proof: Sequence[bytes]) -> None:
        """`sender`'s part of range r that we fetched and checked (served again as a second source)."""
        with self._lock:
            self._fetched_parts[(t, stage, sender, r)] = (part, tuple(proof))
            self._expire(t)

    def parts(
        self, t: int, stage: int, sender: str | None, ranges: Iterable[int]
    ) -> list[tuple[int, bytes, tuple[bytes, ...]]]:
        """(range, part, proof) of our parts (`sender` None) or of the ones we fetched from `sender`,
        for each of `ranges` held here."""
        out = []
        with self._lock:
            for r in ranges:
                if sender is None:
                    own = self._parts.get((t, stage))
                    if own is None or not 0 <= r < len(own):
                        continue
                    if (t, stage, r) not in self._proofs:
                        self._proofs[(t, stage, r)] = tuple(bytes.fromhex(h) for h in merkle_proof(own, r))
                    out.append((r, own[r], self._proofs[(t, stage, r)]))
                elif (t, stage, sender, r) in self._fetched_parts:
                    out.append((r, *self._fetched_parts[(t, stage, sender, r)]))
        return out

    def put_shard(self, t: int, stage: int, r: int, shard: bytes) -> None:
        """A shard of range r of (t, stage) we computed or took (served to any holder that asks)."""
        with self._lock:
            self._shards[(t, stage, r, sha256(shard))] = shard
            self._expire(t)

    def shards(self, t: int, stage: int, ranges: Iterable[int], want: str = "") -> list[tuple[int, bytes]]:
        """(range, shard) of each of `ranges` held here: the one whose sha256 is `want` (any, if "")."""
        wanted = set(ranges)
        with self._lock:
            held = {
                k[2]: v
                for k, v in self._shards.items()
                if k[:2] == (t, stage) and k[2] in wanted and want in ("", k[3])
            }
        return sorted(held.items())


def payload_validator(
    shapes: Mapping[str, tuple[int, ...]], cfg: SparseLoCoConfig, required: Iterable[str] = ()
) -> Callable[[bytes], Payload]:
    """A `validate` for `gather_round`: a well-formed SparseLoCo payload (`Payload.from_bytes` with
    this run's settings) whose every entry is a parameter of the stage with its exact shape, each
    at most once, and that carries every `required` name (stage 0: embed.weight, which the round's
    T⊥ update needs). Returns the parsed payload; raises PayloadError, so a payload that could not
    be applied is never committed.
    """
    shapes = {name: tuple(shape) for name, shape in shapes.items()}
    required = frozenset(required)
    n_elements = sum(math.prod(shape) for shape in shapes.values())

    def validate(data: bytes) -> Payload:
        payload = Payload.from_bytes(data, max_elements=n_elements, cfg=cfg)
        seen: set[str] = set()
        for entry in payload.entries:
            if entry.name not in shapes:
                raise PayloadError(f"invalid SparseLoCo payload: {entry.name[:64]!r} is not a parameter of this stage")
            if tuple(entry.shape) != shapes[entry.name]:
                raise PayloadError(
                    f"invalid SparseLoCo payload: {entry.name!r} has shape {tuple(entry.shape)}, "
                    f"the stage's parameter is {shapes[entry.name]}"
                )
            if entry.name in seen:
                raise PayloadError(f"invalid SparseLoCo payload: {entry.name!r} appears twice")
            seen.add(entry.name)
        if required - seen:
            raise PayloadError(f"invalid SparseLoCo payload: missing {sorted(required - seen)}")
        return payload

    return validate


def view_validator(
    shapes: Mapping[str, tuple[int, ...]], cfg: SparseLoCoConfig, relay: int | None = None
) -> ViewReader:
    """Read stage 0's payloads (`shapes`: stage 0's) as embedding views: a view with this run's settings
    whose entry is the embedding with its exact shape (`read_view`; PayloadError otherwise, so a view
    that could not be applied is never committed); a whole payload as `payload_validator` reads it;
    `relay`: the stage whose holders are asked for the views first (`ViewReader`)."""
    shape = tuple(shapes[EMBED])

    def read(data: bytes) -> View:
        view = read_view(data, cfg, max_elements=math.prod(shape))
        if not view.payload.entries:
            raise PayloadError(f"invalid SparseLoCo payload: missing ['{EMBED}']")
        got = tuple(view.payload.entries[0].shape)
        if got != shape:
            raise PayloadError(f"invalid SparseLoCo payload: {EMBED!r} has shape {got}, the stage's is {shape}")
        return view

    return ViewReader(read, payload_validator(shapes, cfg, required=[EMBED]), relay)


def round_reading(cfg: RunConfig, worker: StageState, stage: int) -> Reading:
    """How round (t, stage)'s payloads are read by `worker`: whole (`round_validator`), or — stage 0
    observed by a holder of another stage, whose T⊥ needs only u, a function of views (the embedding
    is screened apart: `peer.core.sparseloco.robust.sections`) — as embedding views (`view_validator`),
    which a holder of stage s ≥ 2 asks first of stage s − 1's holders (docs/protocol.md, "Embedding views")."""
    if stage == 0 != worker.stage:
        relay = worker.stage - 1 if worker.stage >= 2 else None
        return view_validator(stage_shapes(cfg.model, 0, cfg.stages), cfg.sparseloco, relay)
    return round_validator(cfg, worker, stage)


def round_validator(cfg: RunConfig, worker: StageState, stage: int) -> Callable[[bytes], Payload]:
    """Payloads of round (t, stage) for `worker`: the format, and entries that fit the stage's
    parameters (its own stage: the worker's tensors; an observer gather of stage 0: stage 0's shapes)."""
    if stage == worker.stage:
        shapes = {name: tuple(v.shape) for name, v in worker.start.items()}
    else:
        shapes = stage_shapes(cfg.model, stage, cfg.stages)
    return payload_validator(shapes, cfg.sparseloco, required=[EMBED] if stage == 0 else [])


RESTART_ROUNDS = 2  # rounds past its join a restarted peer checks for its earlier process's announcements
SETTLE_S = 2.0  # longer than a commit takes to appear in the DHT on a busy machine (chaos runs: < 1 s)


def read_round(
    dht: Any, t: int, stage: int
) -> tuple[dict[str, ReplicaRecord], dict[str, StageRecord], dict[str, Announcement], dict[str, Announcement]]:
    """(replicas, holders of `stage` with graceful leaves kept, announcements of (t, stage), those of
    (t, 0)): one poll of round (t, stage); a DHT that does not answer raises NetworkError."""
    replicas = dht.get_replicas()
    holders = dht.get_stage_peers(stage, keep_left=True)
    payloads = dht.get_payloads(t, stage)
    return replicas, holders, payloads, payloads if stage == 0 else dht.get_payloads(t, 0)


def poll_pause(stop: threading.Event | None, poll_s: float) -> None:
    """One poll interval of a gather; PeerError once `stop` is set."""
    if stop is not None and stop.wait(poll_s):
        raise PeerError("stopped while waiting for a round")
    if stop is None:
        time.sleep(poll_s)


def first_payload(
    dht: SwarmDHT, store: PayloadStore, me: Presence, t: int, stage: int, own: Contribution, overlap: int = 0
) -> Contribution | None:
    """What we contribute to round (t, stage): `own`; the other payload this process announced for
    that round already; or nothing (None: we observe) when an earlier incarnation of this peer did.

    A sender announces one payload per round. Its announcement is one DHT record per sender, so a
    second one replaces the first, and a set other holders committed from the first would then name a
    payload "no replica announced": an honest claimer refused as a forger. A re-sync while the round
    was in flight makes a holder redo its outer step and encode another payload: the first is sent
    again, and the new one goes back to the error buffer as any payload not committed does
    (`peer.node.stage.commit.own_adjustment`). A peer restarted with its identity (`--resume`) may redo
    a round its killed process announced: it leaves that record in place and observes the round
    (checked in the `RESTART_ROUNDS` rounds from `me.joined_at`, this process's first round), and
    moves `joined_at` past it, so its next record tells the others not to wait for it there.

    Nor does a holder announce for a round the swarm closed rounds ago (`claims.closed_elsewhere`,
    `overlap` = `train.overlap`; its gather re-syncs at once then): a record made long after the
    round's own ones would outlive them, and a round whose announcements expired would then still look
    young (`peer.node.round.verify.alive`)."""
    first = store.mine(t, stage)
    if first is not None and first.payload is not None:
        if first.sha256 == own.sha256:
            return own
        log.warning(
            "round %d stage %d: contributing the payload this peer announced first (%s), not the one its "
            "re-sync made (%s): a sender announces one payload per round",
            *(t, stage, first.sha256[:12], own.sha256[:12]),
        )
        return whole(own.replica, first.data, first.payload)
    try:
        others = {p: r for p, r in dht.get_replicas().items() if p != dht.peer_id}
    except NetworkError:
        others = {}  # unknown: the gather's own reads decide
    if others and closed_elsewhere(swarm_clock(others), t, overlap=overlap):
        log.warning("round %d stage %d: the swarm closed this round rounds ago; observing it", t, stage)
        return None
    return None if announced_before(dht, me, t, stage, own.sha256) else own


def announced_before(dht: SwarmDHT, me: Presence, t: int, stage: int, sha: str) -> bool:
    """Whether the DHT holds another announcement of ours for round (t, stage) than the payload `sha`
    (an earlier process's, before a restart, or ours before a re-sync): we observe that round, and
    `me.joined_at` moves past it (`first_payload`). Read only in the `RESTART_ROUNDS` rounds from
    `joined_at`: an earlier process can have announced only the rounds about the swarm's clock when
    this one joined, and a re-sync moves `joined_at` just past the round it redoes. A DHT that does not answer
    says nothing here; the gather's own reads decide then."""
    if t > me.joined_at + RESTART_ROUNDS:
        return False
    try:
        ann = dht.get_payloads(t, stage).get(dht.peer_id)
    except NetworkError:
        return False
    if ann is None or ann.sha256 == sha:
        return False
    log.warning(
        "round %d stage %d: an earlier process of this peer announced %s for this round: observing it, not "
        "replacing that announcement (a sender announces one payload per round)",
        *(t, stage, ann.sha256[:12]),
    )
    me.joined_at = max(me.joined_at, t + 1)
    return True


def announce(
    dht: SwarmDHT,
    t: int,
    stage: int,
    own: Contribution,
    store: PayloadStore | None,
    address: str,
    inc: str,
    peers: Mapping[str, str] | None,
    timeout_s: float,
    ttl_s: float,
    mode: str | None = None,
) -> float:
    """Serve and announce our payload of (t, stage); returns when we close the round at the latest
    (DHT time: the deadline fence, `peer.node.round.agreement.fenced_by`). `mode`: a head's boundary
    mode of the outer step, named by its announcement."""
    if store is None:
        raise ValueError("a contributor needs a PayloadStore to serve its payload")
    store.put(t, stage, own)
    closes = dht_time() + timeout_s
    peers = dict(peers) if peers is not None else None
    record = Announcement(own.sha256, len(own.data), address, own.replica, inc, round(closes, 3), peers, mode=mode)
    dht.announce_payload(t, stage, record.to_record(), ttl_s=ttl_s)
    return closes

"""What a DHT record may hold, and which records a reader believes.

Per-peer records live under one subkey per peer, the subkey being ``[owner:<that peer's RSA
public key>]``; hivemind's `RSASignatureValidator` (on every node running `peer.net.dht`) refuses
a store under an owner subkey unless that key signed it, and drops such a record from other
nodes' answers if its signature is wrong. A `RecordReader` then maps the subkey back to the
signer's peer id and keeps a record only if
- its subkey is an owner key (else "unsigned"),
- its ``"peer_id"`` field is the signer's (else "forged"),
- the swarm's `Admission` admits the signer (else "not_admitted"),
- it is not a ``{"state": "left"}`` record and not older than the caller's `max_age_s`,
- it parses into its typed record (`StageRecord`, `ReplicaRecord`, `Announcement`: every field
  present has its type, else "malformed").
Readers get typed records, never the raw dicts; `to_record` gives back the exact dict an owner publishes.

Invariants: values are msgpack-friendly builtins (`check_plain`); a dropped record is counted and
warned about once per (reason, peer), with the warnings bounded so forged keys cannot flood the log.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from peer.errors import ManifestMismatch
from peer.net.admission import PROOF_FIELD, Admission, admission_proof
from peer.net.identity import owner_peer_id, unseal
from peer.net.round_points import RoundPoint, parse_rounds, valid_rounds

logger = logging.getLogger(__name__)

DROP_REASONS = ("unsigned", "forged", "not_admitted", "malformed")
MODES = ("compressed", "uncompressed")  # a pipeline's boundary mode in an outer step (`mode` fields)
R = TypeVar("R")
_MAX_WARNED = 64  # distinct (reason, peer) warnings per reader: keys are free to make


def check_plain(value: Any, where: str) -> None:
    """Raise TypeError unless `value` is made of msgpack-friendly builtins (str dict keys)."""
    if value is None or type(value) in (bool, int, float, str, bytes):
        return
    if type(value) in (list, tuple):
        for i, item in enumerate(value):
            check_plain(item, f"{where}[{i}]")
        return
    if type(value) is dict:
        for k, item in value.items():
            if type(k) is not str:
                raise TypeError(f"DHT record key {where}.{k!r} must be a str")
            check_plain(item, f"{where}.{k}")
        return
    raise TypeError(f"DHT record field {where} has type {type(value).__name__}; use plain int/float/str/list/dict")


class RecordReader:
    """Signs this peer's records and filters other peers' records under the swarm's admission policy."""

    def __init__(self, peer_id: str, secret: bytes | None) -> None:
        self.peer_id = peer_id
        self.admission = Admission()  # set from the manifest
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)
        self._secret = secret
        self._warned: set[tuple[str, str]] = set()

    def drop(self, reason: str, who: str, detail: str) -> None:
        """Count a dropped record; warn once per (reason, peer) so a flood does not flood the log."""
        self.dropped[reason] += 1
        if (reason, who) not in self._warned and len(self._warned) < _MAX_WARNED:
            self._warned.add((reason, who))
            logger.warning("ignoring DHT records from %s: %s", who, detail)

    def sign(self, record: Mapping[str, Any], now: float) -> dict[str, Any]:
        """`record` with this peer's "time", "peer_id" and (secret mode) admission proof added."""
        out = {**record, "time": now, "peer_id": self.peer_id}
        if self._secret is not None:
            out[PROOF_FIELD] = admission_proof(self._secret, self.peer_id)
        return out

    def records(
        self,
        value: Any,
        now: float,
        max_age_s: float | None,
        parse: Callable[[Any], R | None],
        keep_left: bool = False,
    ) -> dict[str, R]:
        """Live, signed, admitted per-peer records of a subkeyed DHT value, parsed by `parse`, keyed by
        the signer's peer id (with `keep_left`, graceful leaves' {"state": "left"} records too); their
        signatures were checked by this node's hivemind validator before we see them."""
        if value is None:
            return {}
        if not isinstance(value, dict):
            logger.warning("ignoring a DHT value of type %s where per-peer records were expected", type(value).__name__)
            return {}
        out: dict[str, R] = {}
        for subkey, item in value.items():
            record = getattr(item, "value", None)
            signer = owner_peer_id(subkey)
            if signer is None:
                self.drop("unsigned", str(subkey)[:16], "its subkey is not a signing key (an old or forged record)")
                continue
            if not isinstance(record, dict):
                continue
            if record.get("peer_id") != signer:
                self.drop("forged", signer, f"it claims to be {str(record.get('peer_id'))[:16]} but signs as {signer}")
                continue
            if not self.admission.admits(signer, record, self._secret):
                self.drop("not_admitted", signer, f"it is not admitted to this {self.admission.mode}-mode swarm")
                continue
            if record.get("state") == "left" and not keep_left:
                continue
            stamp = record.get("time")
            if max_age_s is not None and (not isinstance(stamp, (int, float)) or now - stamp > max_age_s):
                continue
            parsed = parse({k: v for k, v in record.items() if k != PROOF_FIELD})
            if parsed is None:
                self.drop("malformed", signer, "a field of its record has the wrong type")
                continue
            out[signer] = parsed
        return out


def choose_manifest(
    value: Any, initial_ids: Collection[str], drop: Callable[[str, str, str], None]
) -> tuple[str, dict[str, Any]] | None:
    """(signer, manifest) of the signed manifest copies in `value`; None if there is none.

    Takes the copy signed by one of `initial_ids` (the newest such), else the only copy (with a
    warning); several copies from different signers and none from an initial peer is a
    `ManifestMismatch`, and so is a copy that is not a JSON object.
    """
    copies: dict[str, tuple[float, Any]] = {}
    for subkey, item in value.items() if isinstance(value, dict) else ():
        signer = owner_peer_id(subkey)
        if signer is None:
            drop("unsigned", str(subkey)[:16], "an unsigned manifest copy")
            continue
        copies[signer] = (item.expiration_time, item.value)
    if not copies:
        return None
    trusted = [s for s in copies if s in initial_ids]
    if trusted:
        signer = max(trusted, key=lambda s: copies[s][0])
    elif len(copies) == 1:
        (signer,) = copies
        if initial_ids:
            logger.warning(
                "the manifest is signed by %s, which is not one of --initial-peers; cannot check it comes "
                "from the bootstrap (pass the bootstrap's own multiaddr to be sure)",
                signer,
            )
    else:
        raise ManifestMismatch(
            f"{len(copies)} different peers signed a manifest and none of them is an --initial-peers peer; "
            "pass the bootstrap's own multiaddr as --initial-peers"
        )
    text = copies[signer][1]
    try:
        manifest = json.loads(text) if isinstance(text, (str, bytes)) else None
    except ValueError:
        manifest = None
    if not isinstance(manifest, dict):
        raise ManifestMismatch(
            f"the manifest signed by {signer} is not a JSON object; check --initial-peers points at a peer swarm"
        )
    return signer, manifest


@dataclass(frozen=True)
class _Copy:
    """A manifest copy as `choose_manifest` reads it (like hivemind's ValueWithExpiration)."""

    value: Any
    expiration_time: float


def unsealed_copies(sealed: Any) -> tuple[dict[bytes, _Copy], dict[str, dict[str, Any]]]:
    """The valid seals of `peer.manifest.sealed` (whoever re-published them) as manifest copies keyed
    by their signer's owner subkey, and {signer peer id: seal}."""
    copies: dict[bytes, _Copy] = {}
    seals: dict[str, dict[str, Any]] = {}
    for item in sealed.values() if isinstance(sealed, dict) else ():
        opened = unseal(item.value)
        if opened is None:
            continue
        signer, text = opened
        owner = item.value["owner"]
        if owner not in copies or copies[owner].expiration_time < item.expiration_time:
            copies[owner] = _Copy(text, item.expiration_time)
            seals[signer] = item.value
    return copies, seals


# ---------------------------------------------------------------------------------- typed records
# Each per-peer record is parsed once, where it leaves the DHT (`RecordReader.records`), into one of
# the frozen records below; readers use attributes. `parse` returns None for a record with a field
# of the wrong type (the reader drops it as "malformed"); a missing field takes the default its
# readers always assumed. `to_record` is the exact dict the owner publishes (the signer adds "time"
# and "peer_id"; `parse` reads them back), so the wire format is the one of docs/protocol.md.


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _opt(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: v is None or check(v)


def _is_dict(v: Any) -> bool:
    return isinstance(v, dict) and all(isinstance(k, str) for k in v)


def _str_list(v: Any) -> bool:
    return isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v)


def _str_map(v: Any) -> bool:
    return _is_dict(v) and all(isinstance(x, str) for x in v.values())


def _fields(raw: Any, spec: Mapping[str, Callable[[Any], bool]]) -> dict[str, Any] | None:
    """The fields of `spec` present in `raw`, each checked; None when `raw` is not a dict or one is malformed."""
    if not isinstance(raw, Mapping):
        return None
    out = {}
    for name, check in spec.items():
        if name in raw:
            if not check(raw[name]):
                return None
            out[name] = raw[name]
    return out


_SIGNED = {"peer_id": _is_str, "time": _is_num}  # added by the signer (`RecordReader.sign`)


@dataclass(frozen=True)
class NetFields:
    """How others reach a peer and what it allows (docs/connectivity.md): in its stage and replica records.

    Its owner publishes every field but "via" (see `to_record`); None is a record that does not say."""

    connectivity: str | None = None  # direct, reverse, relayed (None: a record that does not say)
    via: tuple[str, ...] | None = None  # hubs holding its reverse streams (absent before the check ran)
    relay: bool | None = None  # it relays for others (`peer join --relay`)
    auth_failures: int | None = None  # calls its gate refused
    max_upload_mbps: float | None = None
    max_download_mbps: float | None = None

    SPEC: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "connectivity": _opt(_is_str),
        "via": _opt(_str_list),
        "relay": _opt(lambda v: isinstance(v, bool)),
        "auth_failures": _opt(_is_int),
        "max_upload_mbps": _opt(_is_num),
        "max_download_mbps": _opt(_is_num),
    }

    @classmethod
    def of(cls, fields: Mapping[str, Any]) -> NetFields:
        """From checked fields (`_fields(raw, NetFields.SPEC)`)."""
        out = dict(fields)
        if out.get("via") is not None:
            out["via"] = tuple(out["via"])
        return cls(**out)

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"connectivity": self.connectivity}
        if self.via is not None:
            out["via"] = list(self.via)
        out.update(
            relay=self.relay,
            auth_failures=self.auth_failures,
            max_upload_mbps=self.max_upload_mbps,
            max_download_mbps=self.max_download_mbps,
        )
        return out


@dataclass(frozen=True)
class StageRecord:
    """A holder's `stage.{s}` record: where it serves, its state and its claim (`peer.node.round.claims`).

    A graceful leave publishes only {"state": "left"}: `left` is then true and the rest is default."""

    address: str = ""
    role: str = ""  # "trainer", "spare", "head", "full"
    state: str = ""  # "syncing", "ready", "busy", "left"
    outer_step: int | None = None
    param_hash: str | None = None
    perp_hash: str | None = None
    inc: str | None = None  # the publishing process's incarnation
    pipeline: str | None = None  # the head that claimed it this outer step
    committed: tuple[str, ...] = ()  # replica id prefixes of its last committed set
    bans: dict[str, Any] | None = None  # raw: `peer.node.round.bans.Bans.from_record`
    state_id: str | None = None
    link: dict[str, Any] | None = None  # raw: `peer.node.round.claims.Link.from_record`
    refused: tuple[str, ...] = ()  # holders whose state failed its check (prefixes)
    tokens_per_s: float | None = None
    in_flight: int | None = None  # a head's micro-batches in flight
    training: int | None = None  # the outer step it trains while its last round is in flight (overlap)
    net: NetFields = NetFields()
    peer_id: str = ""  # the signer
    time: float = 0.0  # DHT time of the announcement

    SPEC: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "address": _is_str,
        "role": _is_str,
        "state": _is_str,
        "outer_step": _opt(_is_int),
        "param_hash": _opt(_is_str),
        "perp_hash": _opt(_is_str),
        "inc": _opt(_is_str),
        "pipeline": _opt(_is_str),
        "committed": _str_list,
        "bans": _opt(_is_dict),
        "state_id": _opt(_is_str),
        "link": _opt(_is_dict),
        "refused": _str_list,
        "tokens_per_s": _opt(_is_num),
        "in_flight": _opt(_is_int),
        "training": _opt(_is_int),
        **_SIGNED,
    }

    @property
    def left(self) -> bool:
        return self.state == "left"

    @property
    def trains(self) -> int | None:
        """The outer step whose inner steps it serves: `training` while a round is in flight, else
        its committed outer step."""
        return self.training if self.training is not None else self.outer_step

    @classmethod
    def parse(cls, raw: Any) -> StageRecord | None:
        fields, net = _fields(raw, cls.SPEC), _fields(raw, NetFields.SPEC)
        if fields is None or net is None:
            return None
        for name in ("committed", "refused"):
            if name in fields:
                fields[name] = tuple(fields[name])
        return cls(**fields, net=NetFields.of(net))

    def to_record(self) -> dict[str, Any]:
        return {
            "address": self.address,
            "role": self.role,
            "state": self.state,
            "outer_step": self.outer_step,
            "param_hash": self.param_hash,
            "perp_hash": self.perp_hash,
            "inc": self.inc,
            "pipeline": self.pipeline,
            "committed": list(self.committed),
            "bans": self.bans,
            "state_id": self.state_id,
            "link": self.link,
            "refused": list(self.refused),
            "tokens_per_s": self.tokens_per_s,
            "in_flight": self.in_flight,
            **({"training": self.training} if self.training is not None else {}),  # only while ahead
            **self.net.to_record(),
        }


@dataclass(frozen=True)
class ReplicaRecord:
    """A pipeline head's or full replica's `replica` record: its outer step, data shard and progress."""

    address: str = ""
    kind: str = ""  # "pipeline" or "full"
    outer_step: int | None = None
    shard: int | None = None
    loss: float | None = None
    tokens_per_s: float | None = None
    joined_at: int = 0  # the first round it contributes to
    inc: str | None = None
    done: bool | None = None  # past its last round (None: a record that does not say)
    pipeline_peers: dict[str, str] | None = None  # a head's {"<stage>": peer id}: binds their payloads
    ranks: int | None = None  # a full replica's processes (torchrun ranks; None: a record that does not say)
    global_batch: int | None = None  # sequences per inner step over all its ranks
    mode: str | None = None  # a head's boundary mode this outer step, one of MODES (None: not said)
    rounds: tuple[RoundPoint, ...] = ()  # its last committed rounds (`peer.net.round_points`)
    net: NetFields = NetFields()
    left: bool = False  # {"state": "left"}: a graceful leave
    peer_id: str = ""
    time: float = 0.0

    SPEC: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "address": _is_str,
        "kind": _is_str,
        "outer_step": _opt(_is_int),
        "shard": _opt(_is_int),
        "loss": _opt(_is_num),
        "tokens_per_s": _opt(_is_num),
        "joined_at": _is_int,
        "inc": _opt(_is_str),
        "done": _opt(lambda v: isinstance(v, bool)),
        "pipeline_peers": _opt(_str_map),
        "ranks": _opt(_is_int),
        "global_batch": _opt(_is_int),
        "mode": _opt(MODES.__contains__),
        "rounds": valid_rounds,
        **_SIGNED,
    }

    @classmethod
    def parse(cls, raw: Any) -> ReplicaRecord | None:
        fields, net = _fields(raw, cls.SPEC), _fields(raw, NetFields.SPEC)
        if fields is None or net is None or not _opt(_is_str)(raw.get("state")):
            return None
        fields["rounds"] = parse_rounds(fields.get("rounds", ()))
        return cls(**fields, net=NetFields.of(net), left=raw.get("state") == "left")

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "address": self.address,
            "kind": self.kind,
            "outer_step": self.outer_step,
            "shard": self.shard,
            "loss": self.loss,
            "tokens_per_s": self.tokens_per_s,
            "joined_at": self.joined_at,
            "inc": self.inc,
            "done": self.done,
            **self.net.to_record(),
        }
        if self.pipeline_peers is not None:
            out["pipeline_peers"] = self.pipeline_peers
        if self.ranks is not None:  # absent, not null: a record older peers read as before
            out["ranks"], out["global_batch"] = self.ranks, self.global_batch
        out |= {"mode": self.mode} if self.mode is not None else {}  # a head's only: absent in others'
        if self.rounds:  # absent while it has committed none
            out["rounds"] = [p.to_record() for p in self.rounds]
        return out


@dataclass(frozen=True)
class Announcement:
    """A payload announcement of round (t, s) (`round.{t}.{s}`): what to fetch, from where, for whom."""

    sha256: str = ""
    size: int = 0
    address: str = ""
    replica: str | None = None  # the replica it speaks for (None: its sender)
    inc: str | None = None
    closes: float | None = None  # DHT time by which its sender closes the round (the deadline fence)
    peers: dict[str, str] | None = None  # a head's stage-0 announcement: {"<stage>": peer id} it binds
    root: str | None = None  # a ranges round: the merkle root of its parts (sha256 = of the parts concatenated)
    ranges: int | None = None  # a ranges round: how many parts (ranges) it was cut into
    mode: str | None = None  # a head's: its outer step's boundaries, "compressed" or "uncompressed"
    peer_id: str = ""
    time: float = 0.0

    SPEC: ClassVar[dict[str, Callable[[Any], bool]]] = {
        "sha256": _is_str,
        "size": _is_int,
        "address": _is_str,
        "replica": lambda v: isinstance(v, str) and bool(v),
        "inc": _opt(_is_str),
        "closes": _opt(_is_num),
        "peers": _str_map,
        "root": _opt(_is_str),
        "ranges": _opt(_is_int),
        "mode": _opt(MODES.__contains__),
        **_SIGNED,
    }

    def replica_of(self, sender: str) -> str:
        """The replica this announcement speaks for: its "replica", else its sender."""
        return self.replica if self.replica is not None else sender

    @classmethod
    def parse(cls, raw: Any) -> Announcement | None:
        fields = _fields(raw, cls.SPEC)
        return None if fields is None else cls(**fields)

    def to_record(self) -> dict[str, Any]:
        out: dict[str, Any] = {"sha256": self.sha256, "size": self.size, "address": self.address}
        out.update(replica=self.replica, inc=self.inc, closes=self.closes)
        if self.peers is not None:
            out["peers"] = self.peers
        if self.root is not None:  # absent, not null, in an all-to-all round: the records of before
            out["root"], out["ranges"] = self.root, self.ranges
        out |= {"mode": self.mode} if self.mode is not None else {}  # a head's only: absent in others'
        return out

"""Dishonest stage holders, for tests: `peer` unchanged, except for what they publish (issue 34).

`python -m tests.e2e.attackers join --stage 1 ...` runs the real CLI. The holder inside is honest: it
trains nothing (a hot spare), follows the honest commits and holds the honest state. What it
publishes in its `stage.{s}` record (`peer.node.records.Records.stage`, patched here) is the attack,
chosen by `ATTACK`:

- `censor`: as soon as every expected replica of round (t, 1) has announced (and stage 0's set is
  complete), claim round t committed with the set minus one payload (`ATTACK_TARGET`: `last` to
  announce, `first`, or `full`: the full replica's), its state the TRUE commit of that subset from
  the round's start state (`peer.node.stage.commit.compute`, the worker's own commit path), so an
  honest holder that follows it commits without that payload. `ATTACK_DELAY_S`: claim that long
  after the set is complete instead of at once.
- `replay`: once every replica named in our link of round t − 1 has announced round t, claim that
  old link (its genuine entries, its state) relabelled as round t from the round's start state.
- `embed` (the T⊥ splitter): claim the honest stage-1 set with an `embed` (stage 0's set that moved
  T⊥) that is a strict subset of stage 0's set, with the true state for it: of the strict subsets,
  the one whose state id comes first in the canonical order (most payloads, then smallest id).
- `initial`: at outer step 0 (no link), claim the negated initial parameters as our state, and
  serve that state over `GetState`.
- `negate`: the same at every outer step: after each commit, claim (with the honest link: same
  round, same `prev`, same set) and serve the negated parameters.

Every attacker publishes its record with a `pipeline` of its own, so no head claims it as its stage
peer (it stays a spare beside the honest one). Each attack it makes is logged ("ATTACK censor round
3 claimed 1 of 2 ...") and written to its metrics.jsonl as an `attack` event: `kind`, `t` (the
round claimed, or the outer step of a negated state), and per kind `claimed`/`of`/`target`,
`replayed`, `embed`/`embed_of`/`first`, `param_hash` (the negated state's), `state`.
`ATTACK=none` runs the same unclaimable spare with no attack (the tests' baseline).
"""

from __future__ import annotations

import dataclasses
import faulthandler
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from itertools import combinations
from typing import Any

import torch

from peer.cli.main import main
from peer.core.model.state import state_hash
from peer.core.sparseloco.commit import embedding_update
from peer.errors import PeerError
from peer.net.transport.messages import PayloadRequest, StateReply, StateRequest
from peer.node.records import Own, Records
from peer.node.round.agreement import round_view
from peer.node.round.bans import PREFIX
from peer.node.round.claims import entry, state_id
from peer.node.round.contribution import Contribution
from peer.node.round.payloads import payload_id, round_validator
from peer.node.round.rounds import Rounds
from peer.node.service import PeerService
from peer.node.stage.commit import compute
from peer.node.stage.ledger import make_link
from peer.node.stage.worker import StageWorker

log = logging.getLogger("attackers")
log.setLevel(logging.DEBUG if os.environ.get("ATTACK_DEBUG") else logging.INFO)

ATTACK = os.environ.get("ATTACK", "none")  # censor | replay | embed | initial | negate | none
TARGET = os.environ.get("ATTACK_TARGET", "last")  # censor: last | first | full
DELAY_S = float(os.environ.get("ATTACK_DELAY_S", "0"))  # censor: seconds between a complete set and the claim
UNCLAIMABLE = "attacker-pipeline"  # the `pipeline` our records name: no head claims us (routing `_candidates`)
POLL_S = 0.05  # how often the attack thread reads the round's records (faster than an honest holder)


@dataclass(frozen=True)
class Forged:
    """A claim of round `t`, published instead of our worker's own while the worker is at outer step
    t or t + 1 (so a late claim replaces our own claim of round t), or t + 2 for a late one (it stays
    up while the honest holders gather t + 1 and t + 2, as a censor that wants to be followed keeps it)."""

    t: int
    state: str
    link: dict[str, Any]
    param_hash: str = ""
    perp_hash: str = ""


class Context:
    """What the attack reads of the peer it runs in (captured from the real constructors)."""

    def __init__(self) -> None:
        self.rounds: Rounds | None = None
        self.worker: StageWorker | None = None
        self.forged: Forged | None = None
        self.logged: set[tuple[str, int]] = set()
        self.thread: threading.Thread | None = None
        self.lock = threading.Lock()

    def event(self, kind: str, t: int, message: str, **fields: Any) -> None:
        """One attack, logged once: a log line and an `attack` metrics event."""
        with self.lock:
            if (kind, t) in self.logged:
                return
            self.logged.add((kind, t))
        log.warning("ATTACK %s round %d %s", kind, t, message)
        if self.rounds is not None:
            self.rounds.metrics.log("attack", kind=kind, t=t, **fields)


CTX = Context()
faulthandler.register(signal.SIGUSR1)  # `kill -USR1 <pid>` prints every thread (a stuck attack)

# ---------------------------------------------------------------- capturing the real peer's parts
_honest_rounds_init = Rounds.__init__
_honest_stage_record = Records.stage
_honest_get_state = PeerService.get_state


def _rounds_init(self: Rounds, *args: Any, **kwargs: Any) -> None:
    _honest_rounds_init(self, *args, **kwargs)
    CTX.rounds = self


def _stage_record(self: Records, worker: StageWorker, role: str) -> Own:
    """Our record as the real peer builds it, then what the attack publishes instead."""
    own = _honest_stage_record(self, worker, role)
    record = dataclasses.replace(own.record, pipeline=UNCLAIMABLE)
    if worker.stage > 0 and CTX.worker is None:
        CTX.worker = worker
        _start_attack()
    forged = CTX.forged
    if forged is not None and worker is CTX.worker and worker.outer_step <= forged.t + (2 if DELAY_S else 1):
        record = dataclasses.replace(
            record,
            outer_step=forged.t + 1,
            state_id=forged.state,
            link=forged.link,
            param_hash=forged.param_hash or record.param_hash,
            perp_hash=forged.perp_hash or record.perp_hash,
            committed=tuple(rid for rid, _ in forged.link["set"]),
        )
    elif _negating(worker):
        param_hash, claimed = _negated_ids(worker)
        record = dataclasses.replace(record, param_hash=param_hash, state_id=claimed)
        CTX.event(ATTACK, worker.outer_step, f"claims the negated state {claimed}", param_hash=param_hash)
    return dataclasses.replace(own, record=record)


def _negating(worker: StageWorker) -> bool:
    return worker.stage > 0 and (ATTACK == "negate" or (ATTACK == "initial" and worker.outer_step == 0))


def _negated(worker: StageWorker) -> dict[str, torch.Tensor]:
    return {name: -value for name, value in worker.start.items()}


def _negated_ids(worker: StageWorker) -> tuple[str, str]:
    """(param hash, state id) of the worker's state with its parameters negated (T⊥, bans kept)."""
    with worker.lock:
        param_hash = state_hash(_negated(worker))
        return param_hash, state_id(param_hash, worker.perp_hash(), worker.ledger.bans.to_record())


def _get_state(self: PeerService, request: StateRequest) -> StateReply:
    """`GetState` serves the negated state we claim (so a download of it checks out)."""
    reply = _honest_get_state(self, request)
    worker = self.workers.get(request.stage)
    if worker is None or not _negating(worker):
        return reply
    with worker.lock:
        tensors = {**_negated(worker), "perp": reply.tensors["perp"]}
        param_hash, claimed = _negated_ids(worker)
    log.warning("ATTACK %s served the negated state %s at outer step %d", ATTACK, claimed, reply.outer_step)
    return StateReply(reply.outer_step, {**reply.meta, "param_hash": param_hash, "state_id": claimed}, tensors)


Rounds.__init__ = _rounds_init  # type: ignore[method-assign]
Records.stage = _stage_record  # type: ignore[method-assign]
PeerService.get_state = _get_state  # type: ignore[method-assign]


# ---------------------------------------------------------------- the attacks on round claims
@dataclass
class Seen:
    """One round's payloads as the attack thread read them, by sender: (replica id, sha256,
    announcement time, bytes, parsed); bytes None until fetched."""

    payloads: dict[str, tuple[str, str, float, bytes | None, Any]] = dataclasses.field(default_factory=dict)
    expected: set[str] = dataclasses.field(default_factory=set)

    @property
    def announced(self) -> set[str]:
        return {rid for rid, *_ in self.payloads.values()}

    @property
    def complete(self) -> bool:
        """Every expected replica (at least two) has announced."""
        return len(self.expected) >= 2 and self.expected <= self.announced

    def fetched(self, skip: str | None = None) -> list[tuple]:
        """The fetched payloads (all but replica `skip`'s), or [] while one of them is not fetched."""
        out = [p for p in self.payloads.values() if p[0] != skip]
        return out if all(p[3] is not None for p in out) else []


def _start_attack() -> None:
    if ATTACK in ("censor", "replay", "embed") and CTX.thread is None:
        CTX.thread = threading.Thread(target=_attack_loop, name="attack", daemon=True)
        CTX.thread.start()


def _attack_loop() -> None:
    """One attack per round, each in a thread of its own (a delayed claim overlaps the next round)."""
    while CTX.rounds is None or CTX.worker is None:
        time.sleep(POLL_S)
    worker, started = CTX.worker, set()
    while True:
        t = worker.outer_step
        if t not in started:
            started.add(t)
            threading.Thread(
                target=_attack_round, args=(CTX.rounds, worker, t), name=f"attack-{t}", daemon=True
            ).start()
        time.sleep(POLL_S)


def _attack_round(rounds: Rounds, worker: StageWorker, t: int) -> None:
    try:
        {"censor": _censor, "replay": _replay, "embed": _embed}[ATTACK](rounds, worker, t)
    except (PeerError, ValueError, KeyError) as exc:
        log.warning("ATTACK %s round %d not made: %s", ATTACK, t, exc)
    except Exception as exc:  # the swarm left (the DHT closing), or a bug: logged, the attack goes on
        log.warning("ATTACK %s round %d failed: %r", ATTACK, t, exc)


class Watch:
    """Round t's announcements of our stage and of stage 0, read as often as `POLL_S` (the replica
    and holder records, which change slowly, every `RECORDS_S`), each new payload fetched at once."""

    RECORDS_S = 0.5

    def __init__(self, rounds: Rounds, worker: StageWorker, t: int) -> None:
        self.rounds, self.worker, self.t = rounds, worker, t
        with worker.lock:  # the round's start state: what the attack commits from, whenever it claims
            if worker.outer_step != t:
                raise ValueError(f"our worker left round {t}")
            self.start = (dict(worker.start), worker._perp_cpu(), worker.ledger.bans, worker.state_id())
        self.ours, self.stage0 = Seen(), Seen()
        self.records_at = 0.0
        self.replicas: dict[str, Any] = {}
        self.holders: dict[int, dict[str, Any]] = {}

    def poll(self) -> None:
        dht, me, t = self.rounds.dht, self.rounds.me, self.t
        if time.monotonic() - self.records_at > self.RECORDS_S:
            self.replicas = dht.get_replicas()
            self.holders = {s: dht.get_stage_peers(s) for s in (0, self.worker.stage)}
            self.records_at = time.monotonic()
        anns0 = dht.get_payloads(t, 0)
        anns = dht.get_payloads(t, self.worker.stage)
        for stage, got, seen in ((0, anns0, self.stage0), (self.worker.stage, anns, self.ours)):
            view = round_view(t, stage, got, anns0, self.replicas, self.holders[stage], me.peer_id, me.incarnation)
            seen.expected = set(view.expected)
            parse = round_validator(self.rounds.cfg, self.worker, stage)
            for sender, (rid, ann) in view.bound.items():
                if sender in seen.payloads and seen.payloads[sender][3] is not None:
                    continue
                data = None
                try:
                    data = self.rounds.clients.get(ann.address).get_payload(PayloadRequest(t, stage, sender))
                except PeerError as exc:
                    log.info("ATTACK round %d stage %d: payload of %s not fetched: %s", t, stage, sender[:12], exc)
                try:
                    ok = data is not None and payload_id(data) == ann.sha256
                except PeerError:  # no payload at all
                    ok = False
                seen.payloads[sender] = (rid, ann.sha256, ann.time, data if ok else None, parse(data) if ok else None)

    def until(self, done: Any) -> bool:
        """Poll until `done()`; False when our worker is two rounds past t (the round closed long
        ago: our claim of it would come late) or the round's deadline passed three times over."""
        deadline = time.monotonic() + 3 * self.rounds.cfg.swarm.round_timeout_s
        while self.worker.outer_step <= self.t + 1 and time.monotonic() < deadline:
            self.poll()
            log.debug(
                "ATTACK round %d: ours %s of %s, stage 0 %s of %s",
                self.t,
                sorted(r[:8] for r in self.ours.announced),
                sorted(r[:8] for r in self.ours.expected),
                sorted(r[:8] for r in self.stage0.announced),
                sorted(r[:8] for r in self.stage0.expected),
            )
            if done():
                return True
            time.sleep(POLL_S)
        return False


def _commit(watch: Watch, ours: list[tuple], stage0: list[tuple]) -> tuple[str, Forged]:
    """The true commit of round t from the round's start state (`Watch.start`) of `ours` (our
    stage's set) with T⊥ moved by `stage0` (stage 0's set), each [(replica, sha256, time, bytes,
    parsed)]; its state id and the claim naming it."""
    rounds, worker, t = watch.rounds, watch.worker, watch.t
    ours, stage0 = sorted(ours), sorted(stage0)  # commit order: replica ids
    keys = [p[0] for p in stage0]
    update = embedding_update([p[4] for p in stage0], rounds.cfg.sparseloco, keys=keys) if stage0 else None
    start, perp, bans, prev = watch.start
    parsed = [p[4] for p in ours]
    out = compute(rounds.cfg, worker.stage, worker.U, t, start, perp, bans, parsed, [p[0] for p in ours], update)
    committed = [Contribution(p[0], p[1], p[3], p[4]) for p in ours]
    link = make_link(t, prev, out, committed, [entry(p[0], p[1]) for p in stage0])
    return out.state, Forged(t, out.state, link.to_record(), out.param_hash, out.perp_hash)


def _claim(rounds: Rounds, forged: Forged) -> None:
    CTX.forged = forged
    rounds.publish()


def _censor(rounds: Rounds, worker: StageWorker, t: int) -> None:
    """Claim round t without one payload; with `TARGET` last and no delay, the commit of the set
    minus the one replica still to announce is computed beforehand and claimed the moment it does."""
    watch = Watch(rounds, worker, t)
    ready: tuple[str, tuple[str, Forged]] | None = None  # (the missing replica, its precomputed claim)

    def almost() -> bool:  # all but one announced and fetched, stage 0 complete and fetched
        missing = watch.ours.expected - watch.ours.announced
        return (
            watch.stage0.complete and bool(watch.stage0.fetched()) and len(missing) == 1 and bool(watch.ours.fetched())
        )

    if TARGET == "last" and not DELAY_S and watch.until(lambda: almost() or watch.ours.complete):
        missing = watch.ours.expected - watch.ours.announced
        if len(missing) == 1:
            kept = watch.ours.fetched()
            ready = (missing.pop(), _commit(watch, kept, watch.stage0.fetched()))
    if not watch.until(lambda: watch.ours.complete and watch.stage0.complete and bool(watch.stage0.fetched())):
        return
    by_time = sorted(watch.ours.payloads.values(), key=lambda p: p[2])
    if ready is not None:
        target = next(p for p in by_time if p[0] == ready[0])
    elif TARGET == "full":
        replicas = watch.replicas
        target = next((p for p in by_time if replicas.get(p[0]) and replicas[p[0]].kind == "full"), by_time[-1])
    else:
        target = by_time[0] if TARGET == "first" else by_time[-1]
    if ready is None:
        if not watch.until(lambda: bool(watch.ours.fetched(skip=target[0]))):
            return
        kept = watch.ours.fetched(skip=target[0])
        ready = (target[0], _commit(watch, kept, watch.stage0.fetched()))
    if DELAY_S:
        time.sleep(DELAY_S)
    claimed, forged = ready[1]
    _claim(rounds, forged)
    n = len(forged.link["set"])
    CTX.event(
        "censor",
        t,
        f"claimed {n} of {len(by_time)} (dropped {target[0][:12]}, the {TARGET}) as state {claimed}",
        claimed=n,
        of=len(by_time),
        target=target[0][:16],
        state=claimed,
    )


def _replay(rounds: Rounds, worker: StageWorker, t: int) -> None:
    old = worker.ledger.history.get(t - 1)
    if old is None:
        return
    named = {rid for rid, _ in old.entries}
    while worker.outer_step == t:
        anns = rounds.dht.get_payloads(t, worker.stage)
        if named <= {ann.replica_of(sender)[:PREFIX] for sender, ann in anns.items()}:
            break
        time.sleep(POLL_S)
    else:
        return
    prev = worker.state_id()
    record = {**old.to_record(), "t": t, "prev": prev}
    _claim(rounds, Forged(t, old.state, record))
    CTX.event("replay", t, f"claimed round {t - 1}'s set as round {t}'s from {prev}", replayed=t - 1, state=old.state)


def _embed(rounds: Rounds, worker: StageWorker, t: int) -> None:
    watch = Watch(rounds, worker, t)
    sets = (watch.ours, watch.stage0)
    if not watch.until(lambda: all(x.complete and x.fetched() for x in sets)):
        return
    ours, stage0 = watch.ours.fetched(), sorted(watch.stage0.fetched())
    honest, _ = _commit(watch, ours, stage0)
    tries = [_commit(watch, ours, list(sub)) for k in range(len(stage0)) for sub in combinations(stage0, k)]
    claimed, forged = min(tries, key=lambda x: x[0])
    _claim(rounds, forged)
    CTX.event(
        "embed",
        t,
        f"claimed embed {len(forged.link['embed'])} of {len(stage0)} as state {claimed} "
        f"({'before' if claimed < honest else 'after'} the honest {honest} in the canonical order)",
        embed=len(forged.link["embed"]),
        embed_of=len(stage0),
        first=claimed < honest,
        state=claimed,
    )


if __name__ == "__main__":
    main()  # the `peer` CLI (it reads sys.argv and exits)

"""Catching a censor: a claim of round (t, s) that no honest close could have made.

A censor publishes the true commit of the round's set minus a payload, so that holders following it
leave that payload out (FOLLOW no longer follows such a set: `peer.node.round.follow.omission`). Its
claim is a worse claim nobody adopts; this module says when it is also proof of dishonesty.

An honest holder closes round t in one of three ways (docs/protocol.md, GATHER): complete (every
expected replica's payload held, or rejected as malformed or gone with its dead sender), at its
deadline, or by following a claim that itself leaves nothing out. No holder's deadline comes before
the earliest deadline any contributor announced (`closes`): a contributor's deadline is its own
announced one, and an observer starts gathering once the round is announced. So a claim from the
state we committed round t from (the same bans: the same replicas expected), seen more than the
grace before that earliest deadline, that leaves out a payload we validated, of a replica committed
in our previous round (every holder expects it) whose sender was alive at every poll of our gather
(records that lapsed once — a frozen process — may have made an honest holder give it up), cannot
come from an honest close: its holder is refused (`censored`). The grace absorbs clocks and record propagation. A censor
that waits for the earliest deadline looks like a slow honest holder and is not refused — nor
followed.

`Evidence` is what a holder saw of one round, kept for the next rounds while it can still prove
something (`recent`: until the round's earliest deadline minus the grace has passed). A censor
usually publishes its claim of round t while we train or gather t + 1, and a short round can end in
one poll, so a claim of t is judged whenever we next see it (`CensorWatch` checks every kept round).

A censor is refused for `REFUSAL_ROUNDS` rounds, not for good (`peer.node.round.refusals`): the proof rests on
this holder's view of liveness, which can be wrong (a head's graceful leave once made honest holders look like
censors), and a refusal that never ends strands the holder that made it.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable
from dataclasses import dataclass

from peer.node.round.bans import PREFIX
from peer.node.round.claims import Claim
from peer.node.round.refusals import Refusals

REFUSAL_ROUNDS = 16  # how long a proven censor's claims are ignored (a false state's: for good)


@dataclass(frozen=True)
class Evidence:
    """What this holder saw of round `t`: enough to judge another holder's claim of it."""

    t: int
    prev: str  # the state id the round was (is being) committed from
    suspects: frozenset[str]  # replicas whose payload we validated, expected by all, sender alive
    closes: float | None  # the earliest deadline any contributor announced (DHT time)


def censored(claim: Claim, ev: Evidence, seen_at: float, grace_s: float) -> str | None:
    """Why `claim`, first seen at `seen_at` (DHT time), proves its holder a censor; None if it does not."""
    link = claim.link
    if link is None or link.t != ev.t or link.prev != ev.prev or ev.closes is None:
        return None
    if seen_at >= ev.closes - grace_s:
        return None  # maybe a deadline close
    named = set(link.replicas)
    left = sorted(r for r in ev.suspects if r[:PREFIX] not in named)
    if not left:
        return None
    return (
        f"it claimed round {ev.t} closed without the payload of {left[0][:12]}, validated here, of a live replica "
        f"every holder expects, {ev.closes - seen_at:.1f} s before the round's earliest deadline"
    )


def recent(
    kept: Iterable[Evidence], new: Evidence | None, now: float, grace_s: float, most: int = 4
) -> tuple[Evidence, ...]:
    """The rounds' evidence worth keeping at DHT time `now`: `kept` and `new`, less those that can no
    longer prove a censor (a claim first seen from now on is past their deadline fence), the latest
    `most` at the most."""
    evs = [*kept, *([new] if new is not None else [])]
    live = [ev for ev in evs if ev.closes is not None and now < ev.closes - grace_s]
    return tuple(sorted(live, key=lambda ev: ev.t)[-most:])


def evidence(
    t: int,
    prev: str | None,
    validated: Collection[str],
    established: Collection[str],
    alive: Collection[str],
    closes: Iterable[float | None],
) -> Evidence | None:
    """The evidence of a round we gather from state `prev` (None: we observe a stage we do not hold,
    and judge nobody): the payloads we `validated` whose replicas are `established` (prefixes of
    our previous committed set) and `alive`, and the earliest of the announced deadlines `closes`."""
    if prev is None:
        return None
    deadlines = [c for c in closes if c is not None]
    suspects = frozenset(r for r in validated if r[:PREFIX] in established and r in alive)
    return Evidence(t, prev, suspects, min(deadlines) if deadlines else None)


class CensorWatch:
    """Refuses the holders of claims that prove censorship (`censored`), each judged on when we first saw it."""

    def __init__(self, refusals: Refusals | None, stage: int, grace_s: float) -> None:
        self.refusals, self.stage, self.grace_s = refusals, stage, grace_s
        self.first_seen: dict[tuple[str, str], float] = {}  # (holder, state) -> DHT time

    def check(self, claims: Iterable[Claim], rounds: Iterable[Evidence | None], now: float) -> None:
        if self.refusals is None:
            return
        evs = [ev for ev in rounds if ev is not None]
        if evs:
            self.refusals.expire(max(ev.t for ev in evs))
        for claim in claims:
            if claim.link is None or claim.peer in self.refusals:
                continue
            seen_at = self.first_seen.setdefault((claim.peer, claim.state), now)
            for ev in evs:
                why = censored(claim, ev, seen_at, self.grace_s)
                if why is not None:
                    self.refusals.refuse(claim.peer, self.stage, ev.t, why, rounds=REFUSAL_ROUNDS)
                    break

"""Holders whose published state failed its check: refused for the rest of the run (a censor: for a while).

A holder's claim (`peer.node.round.claims`) that names payloads no replica announced, or whose state does
not follow from the set it names, is proof of a dishonest (or broken) holder: every honest holder
that checks it finds the same. Its claims are then ignored — never followed, never counted in a
majority, never a state to download — and it is listed in our stage records ("refused"), in the
log once, and in metrics (`refused` events). Its payload contributions still go through median
clipping and outlier screening like anyone's: refusing them here would make holders that checked
it and holders that did not commit different sets.

A false state is proof by recomputation and is refused for good. A censor's proof
(`peer.node.round.censors`) rests on what this holder saw of liveness and deadlines, so it is refused for
`rounds` rounds only (`expire`): a holder that misjudged (a view that missed a head's leave) is not stranded
for the run, and a censor that censors again is proven and refused again.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class Refusals:
    """Peer ids refused as holders, with the reason of the first refusal."""

    def __init__(self, on_refuse: Callable[..., Any] | None = None) -> None:
        self._reasons: dict[str, str] = {}
        self._until: dict[str, int] = {}  # peer -> the round from which a time-limited refusal no longer holds
        self._lock = threading.Lock()
        self._on_refuse = on_refuse  # e.g. the metrics writer's log(event, **fields)

    def refuse(self, peer: str, stage: int, t: int, reason: str, rounds: int | None = None) -> None:
        """Refuse `peer`'s claims from now on (logged once); for `rounds` rounds after round t only, if given."""
        with self._lock:
            if peer in self._reasons:
                if rounds is None:  # proof for good outlasts a time-limited refusal
                    self._until.pop(peer, None)
                return
            self._reasons[peer] = reason
            if rounds is not None:
                self._until[peer] = t + rounds
        span = "from now on" if rounds is None else f"until round {t + rounds}"
        log.warning(
            "stage %d round %d: refusing the state published by %s and ignoring its claims %s: %s",
            stage,
            t,
            peer[:12],
            span,
            reason,
        )
        if self._on_refuse is not None:
            self._on_refuse("refused", peer=peer, stage=stage, t=t, reason=reason, rounds=rounds)

    def expire(self, t: int) -> list[str]:
        """End the time-limited refusals that do not hold at round t; returns those peers."""
        with self._lock:
            gone = sorted(p for p, until in self._until.items() if until <= t)
            for p in gone:
                del self._until[p], self._reasons[p]
        for p in gone:
            log.info(
                "round %d: no longer refusing %s (its refusal was for a while; new proof refuses it again)", t, p[:12]
            )
            if self._on_refuse is not None:
                self._on_refuse("refusal_ended", peer=p, t=t)
        return gone

    def __contains__(self, peer: object) -> bool:
        with self._lock:
            return peer in self._reasons

    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._reasons)

    def record(self) -> list[str]:
        """The refused peers' id prefixes (16 chars), for our stage records."""
        return sorted(p[:16] for p in self.peers())

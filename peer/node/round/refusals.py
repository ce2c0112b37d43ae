"""Holders whose published state failed its check: refused for the rest of the run.

A holder's claim (`peer.node.round.claims`) that names payloads no replica announced, or whose state does
not follow from the set it names, is proof of a dishonest (or broken) holder: every honest holder
that checks it finds the same. Its claims are then ignored — never followed, never counted in a
majority, never a state to download — and it is listed in our stage records ("refused"), in the
log once, and in metrics (`refused` events). Its payload contributions still go through median
clipping and outlier screening like anyone's: refusing them here would make holders that checked
it and holders that did not commit different sets.
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
        self._lock = threading.Lock()
        self._on_refuse = on_refuse  # e.g. the metrics writer's log(event, **fields)

    def refuse(self, peer: str, stage: int, t: int, reason: str) -> None:
        """Refuse `peer`'s claims from now on (logged once)."""
        with self._lock:
            if peer in self._reasons:
                return
            self._reasons[peer] = reason
        log.warning(
            "stage %d round %d: refusing the state published by %s and ignoring its claims from now on: %s",
            stage,
            t,
            peer[:12],
            reason,
        )
        if self._on_refuse is not None:
            self._on_refuse("refused", peer=peer, stage=stage, t=t, reason=reason)

    def __contains__(self, peer: object) -> bool:
        with self._lock:
            return peer in self._reasons

    def peers(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._reasons)

    def record(self) -> list[str]:
        """The refused peers' id prefixes (16 chars), for our stage records."""
        return sorted(p[:16] for p in self.peers())

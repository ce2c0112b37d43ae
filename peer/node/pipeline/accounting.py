"""What the head's activations would have cost uncompressed: the `act_bytes` of its round record.

For every micro-batch the head sends, the bytes its link would carry with uncompressed (b, L, d)
boundaries in the same schedule: every stage's call (forward and, when training, backward)
through the head when it relays the chain, only stage 1's call when the stages stream it on.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from peer.config import WIRE_DTYPES, RunConfig
from peer.net.transport.codec import encoded_size
from peer.net.transport.framing import framed_size
from peer.net.transport.messages import BackwardReply, BackwardRequest, ForwardReply, ForwardRequest


class EquivalentBytes:
    """A running total of uncompressed-equivalent activation bytes (thread-safe)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.total = 0
        self._cache: dict[tuple[int, int, bool, bool], int] = {}
        self._lock = threading.Lock()

    def add(self, b: int, L: int, train: bool = True, route: tuple[str, ...] | None = None) -> None:
        """One (b, L) micro-batch; `route` (addresses of stages 2 … S−1): streamed through stage 1."""
        with self._lock:
            self.total += self._bytes(b, L, train, route)

    def _bytes(self, b: int, L: int, train: bool, route: tuple[str, ...] | None) -> int:
        key = (b, L, train, route is not None)
        if key not in self._cache:
            d, S, wire = self.cfg.model.d_model, self.cfg.stages, self.cfg.subspace.wire_dtype
            tok = torch.zeros(b, L, dtype=torch.int32)
            full = torch.zeros(b, L, d, dtype=WIRE_DTYPES[wire])  # (b, L, d)
            msgs: list[Any] = []
            if route is not None:  # only stage 1's call crosses the head's link
                msgs += [
                    ForwardRequest("p", 0, 0, 0, 1, tok, full, targets=tok, route=route, window=S),
                    ForwardReply(loss=0.0, grad=full),
                ]
            for s in range(1, 1 if route is not None else S):
                last = s == S - 1
                msgs.append(ForwardRequest("p", 0, 0, 0, s, tok, full, targets=tok if last else None, train=train))
                if last:
                    msgs.append(ForwardReply(loss=0.0, grad=full) if train else ForwardReply(loss=0.0))
                else:
                    msgs.append(ForwardReply(hidden=full))
                if train and not last:
                    msgs += [BackwardRequest("p", 0, 0, 0, s, full), BackwardReply(grad=full)]
            self._cache[key] = sum(framed_size(encoded_size(m, wire)) for m in msgs)
        return self._cache[key]

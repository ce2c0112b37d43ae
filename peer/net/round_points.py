"""The recent committed rounds a head or full replica publishes in its `replica` record ("rounds").

Each entry is ``[t, train_loss, val_loss, wall_s]``: the outer step it committed, the mean training
loss of that outer step's inner steps, its validation loss (None where it measured none) and the
round's wall seconds. The record carries the last `MAX_ROUNDS` of them, newest last, so a reader
that polls less often than rounds commit (the bootstrap's dashboard, `peer.bootstrap.dashboard`)
still sees one point per committed round; nobody decides anything from them, they are a replica's
claim about itself, shown as such.

Invariants: a value with more than `MAX_ROUNDS` entries, an entry that is not four fields, a
negative or non-int t, or a loss that is not a number or None is malformed (the whole record is
then dropped, like any other malformed field); a record without "rounds" parses to ().
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MAX_ROUNDS = 8  # entries a record may carry: bounded, a few polls' worth of rounds


def _num_or_none(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))


@dataclass(frozen=True)
class RoundPoint:
    """One committed round as its replica reports it."""

    t: int
    loss: float | None = None
    val_loss: float | None = None
    wall_s: float | None = None

    def to_record(self) -> list[Any]:
        return [self.t, self.loss, self.val_loss, self.wall_s]


def valid_rounds(value: Any) -> bool:
    """A well-formed "rounds" value (see the module docstring)."""
    if not isinstance(value, (list, tuple)) or len(value) > MAX_ROUNDS:
        return False
    for entry in value:
        if not isinstance(entry, (list, tuple)) or len(entry) != 4:
            return False
        t = entry[0]
        if not isinstance(t, int) or isinstance(t, bool) or t < 0 or not all(_num_or_none(x) for x in entry[1:]):
            return False
    return True


def parse_rounds(value: Any) -> tuple[RoundPoint, ...]:
    """The points of a value `valid_rounds` accepted."""
    return tuple(RoundPoint(int(e[0]), *(None if x is None else float(x) for x in e[1:])) for e in value)

"""What one gather of round (t, stage) starts from (`RoundInputs`) and what it ends with (`RoundResult`).

Both are plain values: a gather's caller decides its inputs (`peer.node.round.rounds`), the gather
(`peer.node.round.gather.gather_round`) fills its result, and the commit takes it from there.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field

from peer.core.sparseloco.codec.format import Payload
from peer.node.round.censors import Evidence
from peer.node.round.claims import Claim
from peer.node.round.contribution import Contribution, Reading


@dataclass
class RoundResult:
    """What one peer committed for round (t, s), in commit order, and why it stopped waiting."""

    t: int
    stage: int
    replicas: list[str] = field(default_factory=list)  # replica ids, commit order
    contributions: list[Contribution] = field(default_factory=list)  # hashed and parsed once (same order)
    expected: int = 0
    rejected: list[str] = field(default_factory=list)  # replica ids whose payload failed its checks
    dropped: list[str] = field(default_factory=list)  # replicas out of the round for everyone
    timed_out: bool = False
    behind: bool = False  # the round was committed elsewhere and cannot be reproduced here: re-sync
    followed: Claim | None = None  # the claim whose set we took (its state is checked after our commit)
    evidence: Evidence | None = None  # what we saw of the round, to judge claims of it in the next one
    wall_s: float = 0.0
    bytes_fetched: int = 0

    @property
    def participants(self) -> int:
        return len(self.replicas)

    @property
    def payloads(self) -> list[bytes]:
        return [c.data for c in self.contributions]

    @property
    def parsed(self) -> list[Payload]:
        return [c.payload for c in self.contributions]


@dataclass(frozen=True)
class RoundInputs:
    """What one gather of round (t, stage) starts from, decided by its caller (`gather_round`).

    `own`: our contribution, encoded once (None: an observer). `validate(payload)` parses a payload and
    raises PeerError for a malformed one (it is then skipped, and its replica no longer waited for);
    None parses payloads as they are; a `ViewReader` reads their embedding views (stage 0 observed).
    `peers`: a head's binding ({"<stage>": peer id}), carried by our announcement with `mode` (a head's
    boundary mode of the outer step, "compressed" or "uncompressed"). `quorum` (the run's
    first round only: `swarm.min_replicas`) keeps the set open until that many payloads are held.
    `banned`: peer.node.round.bans. `prev`: the id of our state at outer step t (a holder of the stage;
    None for an observer of a stage it does not hold): the claims we may follow start from it.
    `established`: the replicas of our last committed set (a claim that leaves one out before any
    deadline is refused: `peer.node.round.censors`); `previous`: what we saw of earlier rounds that can
    still prove a censor, whose claims are judged the same way.
    """

    own: Contribution | None = None
    validate: Reading | None = None
    peers: Mapping[str, str] | None = None
    mode: str | None = None
    quorum: int = 1
    banned: Collection[str] = frozenset()
    prev: str | None = None
    established: Collection[str] = ()
    previous: Sequence[Evidence] = ()

"""A round's clocks: how long a gather waits, polls and fetches, and when a read is fresh enough to close on.

One `RoundTimings` value is built from the run's config (`RoundTimings.from_config`) and handed to every
gather of the run (`peer.node.round.gather`, the ranges round `peer.node.round.ranges`); tests and the
simulator build their own.
"""

from __future__ import annotations

from dataclasses import dataclass

from peer.config import SwarmConfig, history_ttl_s
from peer.node.round.stalls import stall_watch

FRESH_S = 1.0  # a set is closed only on a DHT read begun at most this long ago (a frozen process re-reads)
MAX_SLOW_READS = 3  # reads in a row that each took longer than FRESH_S: the DHT is slow, not we frozen


@dataclass(frozen=True)
class RoundTimings:
    """A round's clocks, one value built from the run's config (`from_config`)."""

    deadline_s: float  # T_r: how long a gather waits for the expected payloads
    grace_s: float = 5.0  # FOLLOW and the deadline fence: how long past T_r; to fetch a followed set
    poll_s: float = 0.2  # between two DHT polls
    ttl_s: float = 60.0  # announcements' lifetime: a claim naming them is checked against them later
    lapse_s: float = 28.0  # a stall this long may have let our records lapse (`peer.node.round.stalls`)

    @classmethod
    def from_config(cls, swarm: SwarmConfig) -> RoundTimings:
        return cls(
            deadline_s=swarm.round_timeout_s,
            grace_s=max(2.0, 2 * swarm.rpc_timeout_s),
            ttl_s=history_ttl_s(swarm),  # announcements outlive the round: a joiner's replay checks them
            lapse_s=max(1.0, swarm.record_ttl_s - swarm.announce_interval_s),
        )

    def stalled(self, since: float) -> bool:
        """Whether this process stood still, since monotonic time `since`, long enough that its
        records may have lapsed (others then close rounds without it)."""
        return stall_watch().longest_since(since) >= self.lapse_s

    @property
    def rpc_s(self) -> float:
        """One try at a second source of a payload."""
        return min(self.grace_s, 3.0)

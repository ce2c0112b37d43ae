"""The start-up wait for `swarm.min_replicas` (`peer.node.session.quorum_over`): a peer at outer step
0 waits for the run's first replicas, never for a run that already started without it (chaos: a fresh
full replica waited a whole claim timeout before re-syncing to a swarm 80 rounds on)."""

from __future__ import annotations

from peer.net.records import ReplicaRecord
from peer.node.session import quorum_over


def _at(*steps: int) -> dict[str, ReplicaRecord]:
    return {f"r{i}": ReplicaRecord(kind="full", outer_step=t) for i, t in enumerate(steps)}


def test_a_fresh_run_waits_until_enough_replicas_are_online():
    assert not quorum_over(_at(0), "me", have=1, need=2)
    assert quorum_over(_at(0, 0), "me", have=2, need=2)


def test_a_run_past_outer_step_0_is_joined_without_waiting():
    assert quorum_over(_at(81, 80), "me", have=1, need=3)


def test_our_own_record_and_a_lone_runaway_do_not_end_the_wait():
    replicas = {**_at(0), "me": ReplicaRecord(kind="full", outer_step=5)}
    assert not quorum_over(replicas, "me", have=1, need=2)  # our own step is not the swarm's
    assert not quorum_over(_at(0, 0, 40), "me", have=2, need=4)  # the lower median of the others: 0

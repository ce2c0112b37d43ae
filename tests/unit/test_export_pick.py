"""Which outer step `peer export` takes, row by row: live (`pick_step`) and from checkpoint folders."""

from __future__ import annotations

from pathlib import Path

import pytest

from peer.errors import CheckpointError
from peer.export.checkpoints import PeerFolder, pick_outer_step
from peer.export.live import pick_step
from peer.node.round.claims import Claim, Link


def _claims(*held: tuple[int, str]) -> list[Claim]:
    """One claim per holder: (outer step, state id)."""
    return [Claim(f"peer{i}", t, state, None) for i, (t, state) in enumerate(held)]


AGREE = {0: _claims((4, "a"), (4, "a")), 1: _claims((4, "b"), (4, "b"))}


def test_every_stage_agreeing_on_one_step_is_fetched_from_its_majority():
    pick = pick_step(AGREE, clock=4)
    assert pick.outer_step == 4 and not pick.wait and not pick.refuse
    assert {s: (w.state, w.holders) for s, w in pick.winners.items()} == {
        0: ("a", ("peer0", "peer1")),
        1: ("b", ("peer0", "peer1")),
    }


@pytest.mark.parametrize(
    ("claims", "why"),
    [
        ({0: _claims((4, "a"), (5, "c")), 1: AGREE[1]}, "strict majority"),  # mid-commit: the vote splits
        ({0: _claims((5, "c"), (5, "c")), 1: AGREE[1]}, "different outer steps"),  # stage 0 committed first
        ({0: AGREE[0], 1: []}, "stage 1 has no live holder"),
    ],
    ids=["split-vote", "stages-apart", "no-holder"],
)
def test_a_swarm_in_the_middle_of_a_commit_is_read_again(claims, why):
    pick = pick_step(claims, clock=5)
    assert pick.outer_step is None and not pick.refuse and why in pick.wait


def test_a_minority_claiming_a_step_past_the_clock_is_not_believed():
    claims = {0: _claims((4, "a"), (4, "a"), (99, "forged")), 1: AGREE[1]}
    assert pick_step(claims, clock=4).outer_step == 4


def test_an_asked_step_is_waited_for_then_fetched():
    assert "waiting for outer step 5" in pick_step(AGREE, clock=4, wanted=5).wait
    assert pick_step(AGREE, clock=4, wanted=4).outer_step == 4


def _one_on(peer: str, prev: str, state: str = "c") -> Claim:
    """A holder at outer step 5 whose round 4 started from `prev`."""
    return Claim(peer, 5, state, Link(4, prev, state, ()))


def test_a_holder_one_round_past_the_asked_step_vouches_for_the_state_it_started_from():
    claims = {0: [Claim("peer0", 4, "a", None), _one_on("peer1", "a")], 1: AGREE[1]}
    pick = pick_step(claims, clock=5, wanted=4)
    assert pick.outer_step == 4 and pick.winners[0].state == "a" and pick.winners[0].holders == ("peer0", "peer1")
    split = {0: [Claim("peer0", 4, "a", None), _one_on("peer1", "x")], 1: AGREE[1]}  # its round began elsewhere
    assert "strict majority" in pick_step(split, clock=5, wanted=4).wait
    assert pick_step(claims, clock=5).outer_step is None  # without an asked step: the newest, not a vouch


@pytest.mark.parametrize(
    "claims",
    [
        {0: _claims((6, "c"), (6, "c")), 1: AGREE[1]},  # stage 0's majority has moved on
        {0: _claims((5, "c"), (5, "c")), 1: AGREE[1]},  # one round on, but no link names where it began
        {0: _claims((5, "c"), (6, "d")), 1: AGREE[1]},  # no majority, but every holder is past it
    ],
    ids=["majority-past", "one-on-unlinked", "all-past"],
)
def test_an_asked_step_the_holders_are_past_is_refused_in_one_line(claims):
    pick = pick_step(claims, clock=6, wanted=4)
    assert pick.outer_step is None and "hold only their current state" in pick.refuse
    assert "--outer-step 4" in pick.refuse and "\n" not in pick.refuse


def _folder(name: str, *steps: int) -> PeerFolder:
    return PeerFolder(Path(name), {t: Path(name) / f"step-{t:06d}" for t in steps}, None)


def test_checkpoint_folders_export_their_newest_common_step_or_the_asked_one():
    folders = [_folder("s0", 2, 3, 4), _folder("s1", 3, 4, 5)]
    assert pick_outer_step(folders, None) == 4
    assert pick_outer_step(folders, 3) == 3


@pytest.mark.parametrize(
    ("steps", "asked", "needle"),
    [
        (((3, 4), (5, 6)), None, "no outer step in common"),
        (((3, 4), (4, 5)), 3, "no checkpoint at outer step 3 in s1"),
    ],
    ids=["none-common", "asked-missing"],
)
def test_checkpoint_folders_without_the_step_are_refused_listing_each_folders_steps(steps, asked, needle):
    folders = [_folder("s0", *steps[0]), _folder("s1", *steps[1])]
    with pytest.raises(CheckpointError) as err:
        pick_outer_step(folders, asked)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg
    assert f"s0 has outer steps {', '.join(map(str, steps[0]))}" in msg
    assert f"s1 has outer steps {', '.join(map(str, steps[1]))}" in msg

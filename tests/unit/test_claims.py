"""The pure rules that read state claims (`peer.node.round.claims`, docs/protocol.md "Claims"), row by row."""

from __future__ import annotations

from peer.net.records import ReplicaRecord, StageRecord
from peer.node.round.claims import (
    SHA_CHARS,
    Claim,
    Link,
    better,
    closed_elsewhere,
    committed_only_from_others,
    entry,
    followable,
    majority,
    observed,
    parse_claims,
    state_id,
    swarm_clock,
    voters,
)

SHA = "a" * 64


def _link(t: int, prev: str, *rids: str, state: str = "s") -> dict:
    return {"t": t, "prev": prev, "set": [list(entry(r * 20, SHA)) for r in rids]}


def _rec(step: int, sid: str, link: dict | None = None, **extra) -> StageRecord:
    """A holder's stage record as the DHT reader hands it over: parsed from what the holder published."""
    rec = StageRecord.parse({"outer_step": step, "state_id": sid, **({"link": link} if link else {}), **extra})
    assert rec is not None
    return rec


def test_a_link_round_trips_and_malformed_links_are_none():
    link = Link(3, "p", "s", (entry("A" * 20, SHA), entry("B" * 20, "b" * 64)), embed=(entry("H" * 20, SHA),))
    assert Link.from_record(link.to_record(), "s") == link
    assert link.replicas == ["A" * 16, "B" * 16] and len(link.entries[0][1]) == SHA_CHARS
    good = link.to_record()
    for bad in (
        None,
        {**good, "t": -1},
        {**good, "t": True},
        {**good, "prev": ""},
        {**good, "set": [["A", "short"]]},
        {**good, "set": [["A", "z" * SHA_CHARS]]},  # not hex
        {**good, "set": "everything"},
        {**good, "embed": [[1, 2]]},
    ):
        assert Link.from_record(bad, "s") is None
    assert Link.from_record(good, "") is None  # a link without its state claims nothing


def test_parse_claims_keeps_only_well_formed_live_claims_of_others():
    holders = {
        "me": _rec(2, "x"),
        "a": _rec(2, "s", _link(1, "p", "A")),
        "b": _rec(2, "s"),  # no link: a downloaded or initial state
        "gone": StageRecord(state="left"),
        "sync": _rec(2, "s", state="syncing"),
        "no_state": StageRecord(outer_step=2),
        "bad": _rec(2, "s"),
    }
    assert StageRecord.parse({"outer_step": "2", "state_id": "s"}) is None  # junk never reaches a reader
    claims = parse_claims(holders, me="me", refused={"bad"})
    assert set(claims) == {"a", "b"}
    assert claims["a"].link is not None and claims["b"].link is None


def test_only_claims_from_our_own_state_are_followable_best_first():
    claims = parse_claims(
        {
            "x": _rec(6, "s2", _link(5, "mine", "A")),
            "y": _rec(6, "s9", _link(5, "mine", "A", "B")),  # more payloads: first
            "z": _rec(6, "s1", _link(5, "other", "A", "B", "C")),  # from another state: not checkable
            "w": _rec(7, "s3", _link(6, "s9", "A")),  # a later round
        }
    )
    assert [c.peer for c in followable(claims.values(), 5, "mine")] == ["y", "x"]
    assert followable(claims.values(), 5, "nobody's") == []


def test_the_canonical_order_is_more_payloads_then_the_smaller_state():
    mine = Claim("me", 6, "s5", Link(5, "p", "s5", (entry("A" * 20, SHA),)))
    claims = parse_claims(
        {
            "big": _rec(6, "s9", _link(5, "p", "A", "B")),
            "tie_small": _rec(6, "s1", _link(5, "p", "C")),
            "tie_large": _rec(6, "s7", _link(5, "p", "D")),
            "same": _rec(6, "s5", _link(5, "p", "A")),  # our own state: nothing to check
        }
    )
    assert [c.peer for c in better(claims.values(), mine)] == ["big", "tie_small"]
    assert better(claims.values(), Claim("me", 6, "s5", None)) == []  # no link: nothing to compare


def test_the_swarm_clock_is_the_lower_median_of_the_replicas():
    reps = {p: ReplicaRecord(outer_step=t) for p, t in (("a", 4), ("b", 5), ("c", 90))}
    assert swarm_clock(reps) == 5  # one replica claiming round 90 does not move it
    assert swarm_clock({"a": ReplicaRecord(outer_step=4), "x": ReplicaRecord(outer_step=90)}) == 4  # 1:1: the lower
    assert swarm_clock({**reps, "d": ReplicaRecord(outer_step=99)}) == 5
    assert swarm_clock(reps, refused={"a"}) == 5 and swarm_clock({}) == 0
    left = ReplicaRecord.parse({"state": "left", "outer_step": 9})
    assert left is not None and left.left
    assert swarm_clock({"a": ReplicaRecord(outer_step=3), "l": left, "n": ReplicaRecord()}) == 3


def test_a_majority_is_strict_counted_by_peer_and_bounded_by_the_clock():
    def claims(**states: tuple[int, str]):
        return list(parse_claims({p: _rec(t, s) for p, (t, s) in states.items()}).values())

    win = majority(claims(a=(5, "h"), b=(5, "h"), x=(5, "f")), clock=5)
    assert win is not None and (win.outer_step, win.state, win.holders) == (5, "h", ("a", "b"))
    assert majority(claims(a=(5, "h"), x=(5, "f")), clock=5) is None  # an even split: nobody wins
    assert majority(claims(a=(5, "h"), x=(5, "f")), clock=5, mine=(5, "h")).state == "h"  # our vote breaks it
    assert majority(claims(x=(5, "f")), clock=5, mine=(5, "h")) is None
    assert majority(claims(x=(9, "f")), clock=5) is None  # past the swarm's clock: not believed
    lone = majority(claims(x=(6, "f")), clock=5)
    assert lone is not None and lone.holders == ("x",)  # the only other holder, one round ahead
    assert majority(claims(a=(5, "h")), clock=5, mine=(5, "h")).holders == ("a",)


def test_a_round_is_closed_elsewhere_once_the_clock_is_two_rounds_past_it():
    assert closed_elsewhere(clock=7, t=5)  # the replicas committed t + 1 already: re-sync, never commit t
    assert closed_elsewhere(clock=20, t=5)  # woke from a long freeze, whatever the holders' votes say now
    assert not closed_elsewhere(clock=6, t=5)  # one round: the others may still follow or be followed
    assert not closed_elsewhere(clock=5, t=5)


def test_after_a_stall_past_our_records_lifetime_one_round_of_the_clock_is_enough():
    assert closed_elsewhere(clock=6, t=5, stalled=True)  # the others saw us gone and closed t without us
    assert not closed_elsewhere(clock=5, t=5, stalled=True)  # nobody past t: our set may still be the one


def test_an_observer_takes_the_set_most_holders_committed():
    claims = parse_claims(
        {
            "a": _rec(4, "s1", _link(3, "p", "A", "B")),
            "b": _rec(4, "s1", _link(3, "p", "A", "B")),
            "x": _rec(4, "s0", _link(3, "q", "A", "B", "C")),  # bigger, but alone
        }
    )
    assert [c.peer for c in observed(claims.values(), 3)] == ["a", "x"]


def test_state_ids_cover_parameters_perp_and_bans():
    ids = {state_id(p, q, b) for p in ("1", "2") for q in ("1", "2") for b in ({}, {"A": [1, 2, 0]})}
    assert len(ids) == 8 and all(len(i) == 16 for i in ids)


def test_a_claim_whose_perp_moved_by_another_stage_0_set_is_no_vote():
    # CI's chaos run: two stage peers had moved T⊥ by stage 0's set {full, head} of a round whose head
    # died before committing it; the full replica, stage 0's one holder, committed {full}. Their two
    # claims outvoted the one right T⊥, sent it back a round, and they rebased onto it a moment later
    ours = (entry("F" * 20, SHA),)
    theirs = (entry("F" * 20, SHA), entry("H" * 20, SHA))
    moved = [Claim(p, 5, "x", Link(4, "p", "x", ours, embed=theirs)) for p in ("a", "b")]
    right = Claim("c", 5, "y", Link(4, "p", "y", ours, embed=ours))
    plain = Claim("d", 5, "z", None)  # a downloaded state: no link to judge its T⊥ by
    early = Claim("e", 4, "w", Link(3, "q", "w", ours, embed=theirs))
    everyone = [*moved, right, plain, early]
    assert voters(everyone, 5, ours) == [right, plain]
    assert voters(everyone, 5, None) == [*moved, right, plain]  # stage 0's set not known: every claim votes
    outvoted = majority(moved, 5, (5, "y"))
    assert outvoted is not None and outvoted.state == "x"  # counted as before: 2 of 3 send us back
    kept = majority(voters(moved, 5, ours), 5, (5, "y"))
    assert kept is None or kept.state == "y"  # counted now: nobody outvotes the T⊥ stage 0 committed


def test_round_t_committed_only_from_other_states_is_told_apart():
    link = lambda prev: Link(4, prev, "s", (entry("A" * 20, SHA),))  # noqa: E731
    assert committed_only_from_others([Claim("a", 5, "s", link("other"))], 4, "ours")
    both = [Claim("a", 5, "s", link("other")), Claim("b", 5, "s", link("ours"))]
    assert not committed_only_from_others(both, 4, "ours")
    assert not committed_only_from_others([Claim("a", 5, "s", link("other"))], 4, "ours", refused={"a"})
    assert not committed_only_from_others([Claim("a", 4, "s", None)], 4, "ours")  # nobody committed round 4 yet

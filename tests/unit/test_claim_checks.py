"""The pure checks a holder makes of another's claim before it changes anything (docs/protocol.md, Claims).

Row by row: which set entries are genuine, forged or unknown (`peer.node.round.verify.resolve`), what a
claimed set leaves out and whether that can be followed (`peer.node.round.follow.omission`), when a
claim proves its holder a censor (`peer.node.round.censors.censored`), and which stage-0 set a stage > 0
must move T⊥ by (`peer.node.round.recheck.stage0_set`).
"""

from __future__ import annotations

from peer.net.records import Announcement, StageRecord
from peer.node.round.censors import REFUSAL_ROUNDS, CensorWatch, Evidence, censored, evidence, recent
from peer.node.round.claims import Claim, Link, entry
from peer.node.round.follow import omission
from peer.node.round.recheck import linked_set, stage0_set
from peer.node.round.refusals import Refusals
from peer.node.round.verify import Verdict, alive, resolve

SHA_A, SHA_B, SHA_OLD = "a" * 64, "b" * 64, "c" * 64
REPLICAS = {"ra": "ra".ljust(40, "0"), "rb": "rb".ljust(40, "0")}


def _anns(**shas: str) -> dict[str, Announcement]:
    """Round announcements: each replica announces its own payload (sender = replica)."""
    return {REPLICAS[r]: Announcement(sha256=sha, replica=REPLICAS[r]) for r, sha in shas.items()}


def test_an_entry_is_genuine_only_with_its_replicas_announced_sha256():
    anns = _anns(ra=SHA_A, rb=SHA_B)
    assert resolve(entry(REPLICAS["ra"], SHA_A), 0, anns, anns, {}).verdict is Verdict.GENUINE
    # a replica that never announced the round: made up (a padded set)
    assert resolve(entry("madeup".ljust(40, "x"), SHA_A), 0, anns, anns, {}).verdict is Verdict.FORGED
    # a real replica named with a payload it never announced for this round (an old round's set
    # relabelled, a made-up payload in its name): forged too, so its claimer is refused
    assert resolve(entry(REPLICAS["rb"], SHA_OLD), 0, anns, anns, {}).verdict is Verdict.FORGED
    # the round's records are gone: nothing can be said
    assert resolve(entry(REPLICAS["rb"], SHA_OLD), 0, {}, {}, {}).verdict is Verdict.UNKNOWN


def test_a_round_read_as_its_announcements_expire_proves_no_forgery():
    """A joiner replaying the oldest rounds of the history window reads their announcements as they
    expire one by one: an entry missing then is unknown, not forged (its claimer is not refused)."""
    ra = {REPLICAS["ra"]: Announcement(sha256=SHA_A, replica=REPLICAS["ra"], time=100.0)}
    assert alive(ra, now=150.0, ttl_s=128.0)  # the oldest visible one is 50 s old: none can have expired
    assert not alive(ra, now=170.0, ttl_s=128.0)  # 70 s, past half the lifetime: rb's may have gone first
    assert alive(ra, now=1e9, ttl_s=None)  # not judged
    missing = entry(REPLICAS["rb"], SHA_B)
    assert resolve(missing, 0, ra, ra, {}, complete=False).verdict is Verdict.UNKNOWN
    assert resolve(missing, 0, ra, ra, {}).verdict is Verdict.FORGED  # while the round is young: forged
    assert resolve(entry(REPLICAS["ra"], SHA_A), 0, ra, ra, {}, complete=False).verdict is Verdict.GENUINE


def test_an_entry_whose_announcement_no_longer_binds_it_is_unknown_not_forged():
    # a stage peer announced for head h, then h's round-t announcement bound another peer
    h, p = "head".ljust(40, "0"), "peer1".ljust(40, "0")
    anns = {p: Announcement(sha256=SHA_A, replica=h)}
    anns0 = {h: Announcement(sha256=SHA_B, replica=h, peers={"1": "other"})}
    assert resolve(entry(h, SHA_A), 1, anns, anns0, {}).verdict is Verdict.UNKNOWN


def _claim(*replicas: str) -> Claim:
    link = Link(0, "prev", "state", tuple(entry(r, SHA_A) for r in replicas))
    return Claim("c", 1, "state", link)


def test_a_set_is_followable_only_when_it_leaves_out_nothing_we_could_still_commit():
    a, b, c = "a" * 20, "b" * 20, "c" * 20
    bound = {a, b, c}
    assert omission(_claim(a, b, c), bound, held={a, b}, rejected=set()).followable
    left = omission(_claim(a, b), bound, held={a, b, c}, rejected=set())  # leaves out c, which we hold
    assert not left.followable and left.validated == {c}
    left = omission(_claim(a, b), bound, held={a, b}, rejected=set())  # c announced, not fetched yet
    assert not left.followable and left.unchecked == {c} and not left.validated
    assert omission(_claim(a, b), bound, held={a, b}, rejected={c}).followable  # we tried c: it is bad or gone
    own = omission(_claim(a, b), {a, b}, held={a, b, "me" * 10}, rejected=set())
    assert own.validated == {"me" * 10}  # our own payload above all
    # an observer's payload whose sender lapsed (a frozen head) is one the holders may have given up
    assert omission(_claim(a, b), bound, held={a, b, c}, rejected=set(), given_up={c}).followable
    assert omission(_claim(a, b), bound, held={a, b}, rejected=set(), given_up={c}).followable
    assert not omission(_claim(a), bound, held={a, b, c}, rejected=set(), given_up={c}).followable  # b is alive


def test_a_censor_is_a_claim_from_our_state_without_an_expected_live_payload_before_any_deadline():
    a, b = "a" * 20, "b" * 20
    ev = Evidence(0, "prev", frozenset({a, b}), closes=100.0)
    assert censored(_claim(a), ev, seen_at=90.0, grace_s=2.0)  # leaves out b, seen 10 s before any deadline
    assert censored(_claim(a), ev, seen_at=98.5, grace_s=2.0) is None  # within the grace: maybe a deadline close
    assert censored(_claim(a, b), ev, seen_at=90.0, grace_s=2.0) is None  # leaves nothing out
    assert censored(_claim(a), Evidence(0, "other", ev.suspects, 100.0), 90.0, 2.0) is None  # another state
    assert censored(_claim(a), Evidence(1, "prev", ev.suspects, 100.0), 90.0, 2.0) is None  # another round
    assert censored(_claim(a), Evidence(0, "prev", ev.suspects, None), 90.0, 2.0) is None  # no deadline known


def test_a_censor_is_refused_for_a_while_and_a_false_state_for_good():
    # the censor proof rests on this holder's view of liveness: its refusal ends, a recomputed false state's never
    a, b, censor, forger = "a" * 20, "b" * 20, "c", "f" * 20  # `_claim` is holder "c"'s claim of round 0
    events: list[tuple[str, dict]] = []
    refusals = Refusals(on_refuse=lambda event, **kw: events.append((event, kw)))
    watch = CensorWatch(refusals, stage=1, grace_s=2.0)
    watch.check([_claim(a)], [Evidence(0, "prev", frozenset({a, b}), closes=100.0)], now=90.0)
    refusals.refuse(forger, 1, 0, "it claims a state its set does not give")
    assert censor in refusals and forger in refusals
    watch.check([], [Evidence(REFUSAL_ROUNDS - 1, "p", frozenset(), closes=None)], now=95.0)
    assert censor in refusals  # still within its rounds
    watch.check([], [Evidence(REFUSAL_ROUNDS, "p", frozenset(), closes=None)], now=96.0)
    assert censor not in refusals and forger in refusals
    assert [e for e, _ in events] == ["refused", "refused", "refusal_ended"]
    assert events[0][1]["rounds"] == REFUSAL_ROUNDS and events[1][1]["rounds"] is None
    # proof for good outlasts a time-limited refusal of the same peer
    refusals.refuse(b, 1, 30, "a censor", rounds=2)
    refusals.refuse(b, 1, 31, "a false state")
    assert refusals.expire(40) == [] and b in refusals


def test_a_round_is_kept_as_evidence_while_a_claim_of_it_can_still_prove_a_censor():
    s = frozenset({"a" * 20})
    old, mid, new = Evidence(1, "p1", s, closes=100.0), Evidence(2, "p2", s, closes=104.0), Evidence(3, "p3", s, 108.0)
    kept = recent((old, mid), new, now=99.0, grace_s=2.0)
    assert kept == (mid, new)  # round 1's fence (98) has passed: nothing seen from now on proves anything
    assert recent(kept, None, now=103.0, grace_s=2.0) == (new,)  # a gather that saw nothing keeps the rest
    assert recent((), Evidence(4, "p4", s, None), now=0.0, grace_s=2.0) == ()  # no deadline known: no proof
    many = [Evidence(t, f"p{t}", s, 1000.0) for t in range(9)]
    assert [ev.t for ev in recent(many, None, now=0.0, grace_s=2.0, most=4)] == [5, 6, 7, 8]  # the latest few


def test_only_expected_live_payloads_we_validated_are_evidence():
    a, b, new, dead = "a" * 20, "b" * 20, "n" * 20, "d" * 20
    ev = evidence(3, "prev", validated={a, b, new, dead}, established={a[:16], b[:16], dead[:16]},
                  alive={a, b, new}, closes=[105.0, None, 101.0])  # fmt: skip
    assert ev is not None and ev.suspects == {a, b} and ev.closes == 101.0  # a newcomer, a dead sender: no
    assert evidence(3, None, {a}, {a[:16]}, {a}, [100.0]) is None  # an observer judges nobody


def _holder(step: int, t: int | None = None, *replicas: str) -> StageRecord:
    link = None
    if t is not None:
        link = {"t": t, "prev": "p", "set": [list(entry(r, SHA_A)) for r in replicas]}
    return StageRecord(outer_step=step, state_id=f"s{step}{len(replicas)}", link=link)


def test_stage_0s_set_for_t_perp_is_the_one_a_strict_majority_of_its_holders_claims():
    a, b = "a" * 20, "b" * 20
    both, one = (entry(a, SHA_A), entry(b, SHA_A)), (entry(a, SHA_A),)
    holders = {"h1": _holder(4, 3, a, b), "h2": _holder(4, 3, a, b), "h3": _holder(4, 3, a)}
    assert stage0_set(holders, 3, refused=()) == both
    assert stage0_set(holders, 3, refused={"h1"}) is None  # one against one: no set yet
    assert stage0_set(holders, 3, refused={"h1"}, own=both) == both  # our own stage-0 commit votes too
    # a holder still gathering round 3 has not voted, but it counts: no majority yet
    holders = {"h1": _holder(4, 3, a, b), "h2": _holder(3, 2, a), "h3": _holder(4, 3, a)}
    assert stage0_set(holders, 3, refused=()) is None
    assert stage0_set({"h1": _holder(4, 3, a)}, 3, refused=()) == one


def test_stage_0s_set_from_its_links_is_the_one_a_strict_majority_of_the_unrefused_links_names():
    """An observer whose gather lost round t reads stage 0's set from the `chain.{t}.0` links its
    holders published (their claims have gone past t)."""
    a, b = "a" * 20, "b" * 20
    both, one = (entry(a, SHA_A), entry(b, SHA_A)), (entry(a, SHA_A),)
    links = {"h1": Link(3, "s", "x", both), "h2": Link(3, "s", "x", both), "h3": Link(3, "s", "y", one)}
    assert linked_set(links, 3, refused=()) == both
    assert linked_set(links, 3, refused={"h1"}) is None  # one against one
    assert linked_set(links, 4, refused=()) is None  # no link of round 4
    older = {**links, "h4": Link(2, "s", "z", one)}
    assert linked_set(older, 3, refused=()) == both  # another round's link is no vote
    ranges = {p: Link(3, "s", "x", both, ranges=("r", "d")) for p in ("h1", "h2")}
    assert linked_set(ranges, 3, refused=()) is None  # a ranges round's embedding is read from its shards

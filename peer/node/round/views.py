"""An observer's embedding views of stage 0's payloads, checked whole where a claim leaves one out.

A holder of a stage s > 0 whose T⊥ needs only stage 0's embedding change reads stage 0's payloads as
views (`peer.node.round.contribution.ViewReader`; `peer.core.sparseloco.codec.sections`): each proves
the embedding's entry, the header and the whole payload's norm against the announced id — what u
reads — but not that the whole payload behind that id is valid. An honest holder of stage 0 checks
the whole and rejects an invalid one (bytes that are no payload, or whose id is not the announced
one: an index that lies about the norm), so its committed set leaves that payload out. So before a
gather of stage 0 judges a claim of the round that leaves out a payload it holds as a view
(`peer.node.round.follow.omission`, `peer.node.round.censors`), it fetches that payload whole
(`ViewChecks.confirm`): one that fails is rejected here too, as by every holder of stage 0, and a
claim naming it is not followed (`invalid`); a valid one replaces the view (the claim then leaves out
a payload we validated, as in any gather). One whose whole nobody serves while its sender is gone is
given up (`lost`), as a gather gives up a whole payload it could not fetch before its sender left: no
honest holder of stage 0 holds it either (it would serve it), so the claim that leaves it out is the
set stage 0 committed (`peer bench chaos`: a stage peer that kept a dead head's view committed another
T⊥ than the stage-0 holders). Only a payload some claim leaves out costs a whole fetch.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from peer.errors import NetworkError, PeerError
from peer.net.records import Announcement
from peer.node.round.agreement import IGNORED, RoundView
from peer.node.round.bans import PREFIX
from peer.node.round.claims import Claim
from peer.node.round.contribution import Contribution, ViewReader
from peer.node.round.fetcher import Fetcher

log = logging.getLogger(__name__)

RETRY_S = 1.0  # a payload not fetched whole is tried again after this long


class ViewChecks:
    """The whole-payload checks of one gather's views (module docstring)."""

    def __init__(self, fetcher: Fetcher, t: int, stage: int) -> None:
        self.fetcher, self.t, self.stage = fetcher, t, stage
        self.invalid: set[str] = set()  # replica prefixes whose view held but whose whole failed its checks
        self.retry_at: dict[str, float] = {}

    def confirm(
        self,
        held: dict[str, Contribution],
        claims: Iterable[Claim],
        bound: Mapping[str, tuple[str, Announcement]],
        announcements: Mapping[str, Announcement],
        parse: ViewReader,
        alive: Callable[[str], bool] = lambda sender: True,
    ) -> tuple[int, list[tuple[str, str]], list[str]]:
        """Fetch whole every view in `held` (by replica id) that a claim of round t leaves out; `bound`:
        the round's bound announcements (sender → (replica, announcement)), `alive` whether a sender
        still publishes a record. Replaces each valid one in `held`, removes each invalid one and each
        nobody serves whole while its sender is gone; returns the bytes fetched, the (replica, sender)
        rejected and the replicas given up."""
        named = [set(c.link.replicas) for c in claims if c.link is not None and c.link.t == self.t]
        left_out = sorted(r for r, c in held.items() if c.view and any(r[:PREFIX] not in n for n in named))
        senders = {rid: (sender, ann) for sender, (rid, ann) in bound.items()}
        nbytes, rejected, lost = 0, [], []
        for rid in left_out:
            if rid not in senders or self.retry_at.get(rid, 0.0) > time.monotonic():
                continue
            sender, ann = senders[rid]
            try:
                got = self.fetcher.fetch(self.t, self.stage, sender, ann, parse.whole, announcements, strict=True)
            except NetworkError as exc:
                if not alive(sender):  # nobody serves it whole and its sender is gone: as if never fetched
                    log.warning(
                        "round %d stage %d: giving up the view of %s: its sender left and nobody serves it whole",
                        self.t,
                        self.stage,
                        rid[:12],
                    )
                    del held[rid]
                    lost.append(rid)
                    continue
                self.retry_at[rid] = time.monotonic() + RETRY_S
                log.info(
                    "round %d stage %d: payload of %s not fetched whole yet: %s", self.t, self.stage, rid[:12], exc
                )
                continue
            except PeerError as exc:
                log.warning("round %d stage %d: rejecting %s, whose view held: %s", self.t, self.stage, rid[:12], exc)
                del held[rid]
                self.invalid.add(rid[:PREFIX])
                rejected.append((rid, sender))
                continue
            held[rid] = got
            nbytes += len(got.data)
        return nbytes, rejected, lost


def log_ignored(view: RoundView, logged: set[tuple[str, str]], t: int, stage: int) -> None:
    """Log each announcement `round_view` ignored, once, and at most 16 of a round (`IGNORED` says why)."""
    for sender, rid, why in view.ignored:
        if (sender, rid) not in logged and len(logged) < 16:  # bounded log
            logged.add((sender, rid))
            log.warning(
                "round %d stage %d: ignoring the announcement of %s for replica %s: %s",
                t,
                stage,
                sender[:12],
                rid[:12],
                IGNORED[why].format(stage=stage),
            )


def log_short_close(view: RoundView, held: Iterable[str], seen: Iterable[str], t: int, stage: int) -> None:
    """Say why a set of our own closed with fewer payloads than the holders we saw gathering: the
    replicas the round expected, those it dropped and ignored, and who was seen (the one line a log
    needs to tell whether a holder was left out for a reason or by a wrong view of the round); a set of
    one payload is always said, with the records read (a lone commit's first clue)."""
    have, gathering = sorted(held), sorted(set(seen) | view.gathering)
    if len(have) >= len(gathering) and len(have) > 1:
        return
    log.info(
        "round %d stage %d: closing with %d payload(s) (%s) of %d holders seen gathering (%s): expected %s, "
        "dropped %s, bound %s, ignored %d; records %s",
        t,
        stage,
        len(have),
        ",".join(r[:12] for r in have),
        len(gathering),
        ",".join(p[:12] for p in gathering),
        ",".join(sorted(r[:12] for r in view.expected)) or "none",
        ",".join(sorted(r[:12] for r in view.dropped)) or "none",
        ",".join(sorted(f"{s[:12]}>{r[:12]}" for s, (r, _) in view.bound.items())) or "none",
        len(view.ignored),
        " ".join(_records(view)) or "none",
    )


def _records(view: RoundView) -> list[str]:
    """The records a view was decided on: "id:kind@step+joined" per replica, "id:role@step" per holder."""
    out = [f"{p[:8]}:{r.kind}@{r.outer_step}+{r.joined_at}" for p, r in sorted(view.replicas.items())]
    return out + [f"{p[:8]}:{r.role}@{r.outer_step}" for p, r in sorted(view.holders.items())]

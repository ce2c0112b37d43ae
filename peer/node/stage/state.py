"""One stage's committed state held by a peer, and its outer rounds (no networking, no pipeline).

Its parts: the stage's view of the model and T⊥ (`module`); θ_start and the committed state's hashes
(`StartCache`, float32 on the CPU: the portable commit's input); the inner AdamW and the SparseLoCo error
buffer (`StageOptimizer`); what rounds left behind — bans, the claim that reached the state (`link`), the
state committed from (`prev`) — in `RoundLedger`. `contribution()` encodes our payload once
(`contribute_parts()` / `contribute_votes()` in a ranges or voted round, committed by `apply_ranges()`);
`commit_round()` commits contributions through `peer.node.stage.commit.compute` →
`peer.core.sparseloco.commit`; `recompute()` / `switch()` check another holder's claim of the round and take
it when it holds (docs/protocol.md). `state_dict()` / `load_state_dict()` are the only way in or out
(checkpoints, state sync). Synchronous and thread-safe (one lock); `StageWorker` adds the pipeline compute.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from peer.config import RunConfig
from peer.core.model.state import check_stage_state, stage_state
from peer.core.sparseloco.algorithm import decompress, pseudo_gradient
from peer.core.sparseloco.aligned import fed_back
from peer.core.sparseloco.codec.format import Payload
from peer.core.sparseloco.commit import RoundCommit
from peer.core.sparseloco.ranges import RangePlan, encode_parts
from peer.core.subspace.state import perp_of, set_perp
from peer.net.transport.messages import StateReply
from peer.node.round.bans import Bans
from peer.node.round.claims import Entry, Link, state_id
from peer.node.round.contribution import Contribution, bare, encoded
from peer.node.round.ranges.shard import RangeShard
from peer.node.stage.ahead import Ahead, cloned
from peer.node.stage.commit import Outcome, Prev, compute, log_commit, named, own_adjustment
from peer.node.stage.initial import canonical_state, initial_module
from peer.node.stage.ledger import RoundLedger, make_link
from peer.node.stage.optimizer import StageOptimizer
from peer.node.stage.ranges import commit_ranges, parts_delta, ranges_link, returned
from peer.node.stage.start_cache import StartCache

log = logging.getLogger(__name__)


class StageState:
    """One stage view with its optimizers, θ_start and committed round state."""

    def __init__(self, cfg: RunConfig, stage: int, compressed: bool = True, device: str = "cpu") -> None:
        """compressed=False: a full replica's stage (T_S trained freely, no boundary compression)."""
        self.cfg, self.stage, self.compressed = cfg, stage, compressed
        self.is_first, self.is_last = stage == 0, stage == cfg.stages - 1
        self.device = torch.device(device)
        self.module, U = initial_module(cfg, stage)
        self.module.to(self.device)
        self.U = U.to(self.device)
        self.optim = StageOptimizer(self.module, cfg.train, cfg.sparseloco)
        self.lock = threading.RLock()
        self.settled = threading.Condition(self.lock)  # notified when no autograd graph holds the parameters
        self.outer_step = 0
        self.ahead: Ahead | None = None  # training outer step t + 1 while round t is in flight (overlap)
        self.cache = StartCache(stage_state(self.module))
        self.ledger = RoundLedger(cfg.swarm.history_rounds)
        self.loads = 0  # states adopted so far (`load_state_dict`): a change no hash may show (the optimizer)
        # whether the state was reached by a checked path: the canonical initial state, then only our
        # own commits, checked switches and replayed rounds; a loaded state is not (docs/protocol.md,
        # "Joining by replay")
        self.verified = True
        # (param hash, perp hash, state id) of the committed state, read without the lock: the round's
        # threads ask for it while the trainer holds the lock through an inner step (overlap); every
        # change of the committed state clears it first, under the lock (`_install`, `load_state_dict`)
        self._published: tuple[str, str, str] | None = None
        self.initial_state_id = self.state_id()  # the canonical initial state's id: recomputed, never voted on

    @property
    def start(self) -> Mapping[str, torch.Tensor]:
        """θ_start: the committed parameters of the current outer step (read-only)."""
        return self.cache.start

    def _reset_step(self) -> None:
        """Forget the current inner step's gradients (the pipeline also forgets its activations)."""
        self.optim.zero_grad()

    # ---------------------------------------------------------------- overlapped outer steps
    @property
    def train_step(self) -> int:
        """The outer step whose inner steps this stage trains: t + 1 while round t is in flight."""
        ahead = self.ahead
        return ahead.training if ahead is not None else self.outer_step

    def begin_overlap(self) -> None:
        """Our payload of round t is encoded: train outer step t + 1 while the round runs (`Ahead`)."""
        with self.lock:
            self.ahead = Ahead(self.module, self.outer_step + 1)

    def end_overlap(self) -> bool:
        """Round t is over: True when it committed (the parameters were rebased onto it); else the
        progress made since the boundary stands on a state the swarm left: it is dropped (θ ← θ_start)."""
        with self.lock:
            ahead, self.ahead = self.ahead, None
            if ahead is None or self.outer_step == ahead.training:
                return ahead is not None
            self._wait_settled()
            with torch.no_grad():
                params = dict(self.module.named_parameters())
                for name, value in self.start.items():
                    params[name].copy_(value)
            self._written()
            self._reset_step()
            return False

    def _graphs_alive(self) -> bool:
        """Whether an autograd graph of a pending micro-batch holds the parameters (the pipeline)."""
        return False

    def _written(self) -> None:
        """The parameters changed outside an optimizer step (a worker drops its weight casts)."""

    def _settle(self) -> None:
        """Under the lock, trained ahead: `_wait_settled` before the committed state is read to be
        replaced (the wait releases the lock; from its end the lock is held through the change)."""
        if self.ahead is not None:
            self._wait_settled()

    def _wait_settled(self) -> None:
        """Under the lock: wait until no pending micro-batch holds the parameters, so they can be
        written in place; past two RPC deadlines the inner step's micro-batches are dropped (the
        head replays the step)."""
        if self.settled.wait_for(lambda: not self._graphs_alive(), timeout=2 * self.cfg.swarm.rpc_timeout_s):
            return
        log.warning("stage %d: an inner step held the parameters past its deadline; dropping it", self.stage)
        self._reset_step()

    # ---------------------------------------------------------------- outer rounds
    def encode_round(self) -> Payload:
        """This peer's SparseLoCo payload for the current outer step (updates the error buffer)."""
        with self.lock:
            return self.optim.encode(pseudo_gradient(self.start, stage_state(self.module)))

    def contribution(self, replica_id: str) -> Contribution:
        """`encode_round` as our contribution in `replica_id`'s name (serialized and hashed once),
        remembered until the round is checked (`maintain`)."""
        with self.lock:
            own = encoded(replica_id, self.encode_round())
            self.ledger.last_contribution = own
            return own

    def contribute(self, replica_id: str) -> Payload:
        """`contribution`'s payload (tests, benches: committed with `apply_round`)."""
        return self.contribution(replica_id).payload

    def n_prev(self) -> int | None:
        """Contributions the round before the current one committed (0 at the first; None: a state adopted
        without its link, then `n_prev_of` asks the other holders): what `round_rule` reads."""
        with self.lock:
            link = self.ledger.link
            if self.outer_step == 0:
                return 0
            return len(link.entries) if link is not None and link.t == self.outer_step - 1 else None

    def contribute_parts(self, replica_id: str, plan: RangePlan) -> list[Payload]:
        """A ranges round's contribution: the pseudo-gradient as one part per range of `plan`
        (`peer.core.sparseloco.ranges.encode_parts`: the error feedback of `encode_round`, band by band),
        remembered until the round commits (`apply_ranges`) or returns it (`return_unsent_parts`)."""
        with self.lock:
            delta = pseudo_gradient(self.start, stage_state(self.module))
            parts, self.optim.errors = encode_parts(delta, self.optim.errors, self.cfg.sparseloco, plan)
            self.ledger.last_contribution = None
            self.ledger.last_parts = (replica_id, plan, parts)
            return parts

    def contribute_votes(self) -> dict[str, torch.Tensor]:
        """A voted round's contribution (docs/protocol.md, VOTED): e = β·e + Δ becomes the error buffer
        (nothing sent yet, so a failed round returns nothing) and is returned to vote and send from."""
        with self.lock:
            delta, errors = pseudo_gradient(self.start, stage_state(self.module)), self.optim.errors or {}
            self.optim.errors = {n: fed_back(d, errors.get(n), self.cfg.sparseloco.beta) for n, d in delta.items()}
            self.ledger.last_contribution, self.ledger.last_parts = None, None
            return self.optim.errors

    def return_unsent_parts(self) -> None:
        """Our parts of a ranges round that did not commit go back into the error buffer whole."""
        with self.lock:
            own = self.ledger.last_parts
            if own is not None:
                self.optim.feed_back(parts_delta(own[1], own[2], self.start))
            self.ledger.last_parts = None

    def apply_ranges(
        self,
        plan: RangePlan,
        roster: Sequence[tuple[str, str]],
        digest: str,
        shards: Mapping[int, RangeShard],
        position: int | None,
        embed_update: torch.Tensor | None,
        embed_set: Sequence[Entry] | None = None,
        sent: Mapping[str, torch.Tensor] | None = None,
    ) -> RoundCommit:
        """Commit a ranges round: θ ← θ_start − η·Δ̄ with Δ̄ assembled from the agreed shards of every
        range (`roster`: its (replica id, payload sha256) entries, `digest` its digest; `shards`: the
        checked shard of every range, each hashed once where it was taken; `position`: our
        contribution's place in it, None when absent), T⊥ and bans as `apply_round`; what each shard
        dropped or clipped from our part returns to our error buffer (`peer.node.stage.ranges`); a voted
        round's `sent`: −v̂ of the means that include us (`peer.node.round.ranges.voted.sent_adjustment`)."""
        with self.lock:  # computed outside the lock, as `commit_round`
            t, start, perp, ledger = self.outer_step, self.start, self._perp_cpu(), self.ledger
        parsed = {r: s.shard for r, s in shards.items()}
        replicas = [rid for rid, _ in roster]
        out = commit_ranges(
            self.cfg, self.stage, self.U, t, start, perp, ledger.bans, plan, replicas, parsed, embed_update
        )
        with self.lock:
            self._settle()  # first: its wait releases the lock, and the state is checked after it
            self._still_at(t)
            own = ledger.last_parts
            adjustment = returned(own[1], self.start, own[2], position, parsed) if own is not None else None
            adjustment = dict(sent) if sent is not None else adjustment
            prev = Prev(t, self.start, perp, ledger.bans, self.state_id(), adjustment, None)
            self.optim.feed_back(adjustment)
            self._install(out, ranges_link(t, prev.state, out, roster, digest, shards, embed_set))
            ledger.prev = prev
            log_commit(self.stage, out, len(roster))
            return out.committed.commit

    def observe(self) -> None:
        """This round's own stage is gathered without a payload or parts of ours (spare, catch-up)."""
        with self.lock:
            self.ledger.last_contribution = None
            self.ledger.last_parts = None

    def return_unsent(self, payload: Payload) -> None:
        """A payload that missed the commit goes back into the error buffer: nothing is lost."""
        with self.lock:
            self.optim.feed_back(decompress(payload))

    def apply_round(
        self, committed: Sequence[Payload], embed_update: torch.Tensor | None, replicas: Sequence[str] = (),
        embed_set: Sequence[Entry] | None = None,
    ) -> RoundCommit:  # fmt: skip
        """`commit_round` of bare payloads (tests, benches), from `replicas` when one id per payload."""
        return self.commit_round(bare(committed, replicas), embed_update, embed_set)

    def commit_round(
        self,
        committed: Sequence[Contribution],
        embed_update: torch.Tensor | None,
        embed_set: Sequence[Entry] | None = None,
    ) -> RoundCommit:
        """Commit the current round: θ ← θ_start − η·mean(clip(Δ̂)) over the committed set (in its
        given order), the ban state advanced with it; next outer step.

        Stage 0's result carries the embedding's committed change, the T⊥ update of every other
        stage (`embed_update`, from stage 0's committed set `embed_set`, which the link names).
        What the round took from our own payload (all of it if the set lacks it) returns to our
        error buffer. The state committed from is kept (`prev`) so a claim of another holder can
        be checked against it (`recompute`).
        """
        with self.lock:  # computed outside the lock: the next outer step may train meanwhile (overlap)
            t, start, perp, ledger = self.outer_step, self.start, self._perp_cpu(), self.ledger
        out = compute(self.cfg, self.stage, self.U, t, start, perp, ledger.bans, *named(committed), embed_update)
        with self.lock:
            self._settle()  # first: its wait releases the lock, and the state is checked after it
            self._still_at(t)
            adjustment = own_adjustment(ledger.last_contribution, out, committed)
            prev = Prev(t, start, perp, ledger.bans, self.state_id(), adjustment, ledger.last_contribution)
            self.optim.feed_back(adjustment)
            self._install(out, make_link(t, prev.state, out, committed, embed_set))
            ledger.prev = prev
            log_commit(self.stage, out, len(committed))
            return out.committed.commit

    def recompute(self, committed: Sequence[Contribution], embed_update: torch.Tensor | None) -> Outcome | None:
        """The commit of the last round with another set, from the state it was committed from (nothing
        changes); None when that state is not kept (initial, downloaded or resumed state)."""
        with self.lock:
            prev = self.ledger.prev
        if prev is None:
            return None
        return compute(
            self.cfg, self.stage, self.U, prev.t, prev.start, prev.perp, prev.bans, *named(committed), embed_update
        )

    def switch(self, out: Outcome, committed: Sequence[Contribution], embed_set: Sequence[Entry] | None = None) -> None:
        """Replace our commit of the last round by `out` (a checked better claim, `recompute`): the
        state, bans and link become its own; our error buffer gives back what our commit took from
        our payload and takes what `out` takes instead."""
        with self.lock:
            self._settle()
            prev = self.ledger.prev
            if prev is None or out.t != prev.t or self.outer_step != prev.t + 1:
                raise ValueError(f"stage {self.stage}: no commit of round {out.t} to replace")
            adjustment = own_adjustment(prev.own, out, committed)
            self.optim.feed_back(prev.adjustment, -1.0)
            self.optim.feed_back(adjustment)
            self._install(out, make_link(out.t, prev.state, out, committed, embed_set))
            self.ledger.prev = Prev(prev.t, prev.start, prev.perp, prev.bans, prev.state, adjustment, prev.own)
            self._reset_step()

    def _still_at(self, t: int) -> None:
        """A commit computed outside the lock still follows our state (nothing else moved it)."""
        if self.outer_step != t:
            raise ValueError(f"stage {self.stage}: moved to outer step {self.outer_step} while committing round {t}")

    def _install(self, out: Outcome, link: Link) -> None:
        """Make a computed commit our state (under the lock): parameters, T⊥, θ_start, bans, link.
        Trained ahead (overlap), the local parameters are rebased onto it instead (`Ahead`).
        The wait for a pending micro-batch releases the lock: a reader may publish the old ids
        meanwhile, so they are cleared after it, the lock held from there to the new state."""
        done = out.committed
        self._settle()
        self._published = None
        with torch.no_grad():
            if self.ahead is not None:
                self.ahead.rebase(self.module, done.params)
            else:
                params = dict(self.module.named_parameters())
                for name, value in done.params.items():
                    params[name].copy_(value)
            if done.perp is not None:
                set_perp(self.module, done.perp)
        self._written()
        self.outer_step = out.t + 1
        self.cache.set(done.params)
        self.cache.known(self.outer_step, (out.param_hash, out.perp_hash))
        self.ledger.committed(out, link)

    def _perp_cpu(self) -> torch.Tensor | None:
        """A CPU copy of T⊥ (None when the run uses no subspace)."""
        try:
            return perp_of(self.module).detach().to("cpu", torch.float32, copy=True)
        except ValueError:
            return None

    # ---------------------------------------------------------------- state
    def snapshot(self) -> dict[str, torch.Tensor]:
        """Parameters and T⊥ for a late joiner (the committed θ_start of the current outer step)."""
        with self.lock:
            out = {k: v.detach().cpu().clone() for k, v in self.start.items()}
            out["perp"] = perp_of(self.module).detach().cpu().clone()
            return out

    def reply(self) -> StateReply:
        """The committed state as `GetState` answers it: θ_start and T⊥, with the outer step, hashes,
        state id and bans (a holder's service and the bootstrap's attester serve this one reply)."""
        with self.lock:
            meta = {"param_hash": self.param_hash(), "perp_hash": self.perp_hash(), "stage": self.stage}
            meta |= {"state_id": self.state_id(), "bans": self.ledger.bans.to_record()}
            return StateReply(outer_step=self.outer_step, meta=meta, tensors=self.snapshot())

    def state_dict(self) -> dict[str, Any]:
        """Everything the next round depends on (the tensors are this worker's own, not copies):

        {"outer_step": t, "params": {name: θ}, "start": {name: θ_start}, "perp": T⊥,
         "errors": {name: e} | None, "optimizer": {"state": {"<name>/<key>": tensor},
         "param_groups": [{hyperparameters..., "params": [global names]}]},
         "bans": the ban record, "link": the link record (or None)}
        """
        with self.lock:
            link = self.ledger.link
            if self.ahead is not None:  # trained meanwhile: a copy, taken between two optimizer steps
                self._wait_settled()
                return cloned(self._state_refs(link))
            return self._state_refs(link)

    def _state_refs(self, link: Link | None) -> dict[str, Any]:
        """`state_dict` by reference (under the lock)."""
        return {
            "outer_step": self.outer_step,
            "params": {n: p.detach() for n, p in self.module.named_parameters()},
            "start": dict(self.start),
            "perp": perp_of(self.module).detach(),
            **self.optim.state_dict(),  # "errors", "optimizer"
            "bans": self.ledger.bans.to_record(),
            "link": None if link is None else {**link.to_record(), "state": link.state},
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Adopt a state: "outer_step", "start" and "perp" are required; "params" defaults to θ_start,
        "errors" to an empty buffer, "optimizer" to a fresh AdamW, "bans" to none and "link" to
        none (a late joiner's state).

        Every name and shape is checked before anything changes (ValueError); the current inner
        step's gradients and pending activations are dropped. The state the last round was
        committed from is forgotten: a loaded state is checked against claims by majority only.
        """
        with self.lock:
            if self.ahead is not None:  # the progress trained ahead stands on a state we leave
                self._wait_settled()
                self.ahead = None
            own = dict(self.module.named_parameters())
            start, params, perp = state["start"], state.get("params", state["start"]), state["perp"]
            check_stage_state(self.module, self.stage, start, params, perp)
            self._published = None
            optim = self.optim.loaded(state, self.stage)
            with torch.no_grad():
                for name, value in params.items():
                    own[name].copy_(value.to(own[name].device))
            set_perp(self.module, perp.to(self.device))
            self.cache.set(start)
            self.optim = optim
            self.outer_step = int(state["outer_step"])
            link = state.get("link")
            self.ledger.adopted(
                Bans.from_record(state.get("bans")),
                Link.from_record(link, link.get("state")) if isinstance(link, Mapping) else None,
            )
            self.loads += 1
            self.verified = False  # whoever loaded it says otherwise (`reset_initial`, a resumed checkpoint)
            self._reset_step()

    def reset_initial(self, errors: Mapping[str, torch.Tensor] | None = None) -> None:
        """Become the canonical initial state at outer step 0, recomputed from the config (never
        downloaded); `errors`: the error buffer to keep (default: an empty one)."""
        start, perp = canonical_state(self.cfg, self.stage)
        state: dict[str, Any] = {"outer_step": 0, "start": start, "perp": perp}
        if errors is not None:
            state["errors"] = errors
        self.load_state_dict(state)
        with self.lock:
            self.verified = True

    def rewind(self) -> bool:
        """Go back to the state our last round was committed from (`ledger.prev`, kept until the
        next commit), when the state we hold now was reached by a checked path: a holder whose commit
        was overtaken replays from there (`peer.node.round.replay`). What our commit returned to the error
        buffer is taken back out; the AdamW moments stay. False when no such state is kept."""
        with self.lock:
            prev, verified = self.ledger.prev, self.verified
            if prev is None or not verified or prev.perp is None or self.outer_step != prev.t + 1:
                return False
            state: dict[str, Any] = {
                "outer_step": prev.t,
                "start": prev.start,
                "params": prev.start,
                "perp": prev.perp,
                "bans": prev.bans.to_record(),
                **self.optim.state_dict(),
            }
            self.load_state_dict(state)
            self.optim.feed_back(prev.adjustment, -1.0)
            self.verified = True
            return True

    def fresh_optimizer(self, keep_errors: bool = False) -> None:
        """A fresh AdamW and (unless `keep_errors`) an empty error buffer, as any late joiner starts."""
        with self.lock:
            errors = self.optim.errors if keep_errors else None
            self.optim = self.optim.loaded({"errors": errors}, self.stage)
            self._reset_step()

    def replay(self, committed: Sequence[Contribution], embed_update: torch.Tensor | None) -> Outcome:
        """The commit of the current round with `committed` from our state (nothing changes): a
        joiner's check of a holder's link (`peer.node.round.replay`)."""
        with self.lock:
            t, start, perp, bans = self.outer_step, self.start, self._perp_cpu(), self.ledger.bans
        return compute(self.cfg, self.stage, self.U, t, start, perp, bans, *named(committed), embed_update)

    def advance(self, out: Outcome, committed: Sequence[Contribution], embed_set: Sequence[Entry] | None) -> None:
        """Install `out`, a checked commit of the current round computed by `replay`, as an observer
        (nothing of ours was in the round); the state stays as verified as it was."""
        with self.lock:
            self._settle()
            if out.t != self.outer_step:
                raise ValueError(
                    f"stage {self.stage}: a commit of round {out.t} does not follow outer step {self.outer_step}"
                )
            prev = Prev(out.t, self.start, self._perp_cpu(), self.ledger.bans, self.state_id(), None, None)
            self.ledger.last_contribution = None
            self.ledger.last_parts = None
            self._install(out, make_link(out.t, prev.state, out, committed, embed_set))
            self.ledger.prev = prev
            self._reset_step()

    def param_hash(self) -> str:
        """Hash of the committed parameters θ_start (published in every record refresh)."""
        return self._ids()[0]

    def perp_hash(self) -> str:
        return self._ids()[1]

    def state_id(self) -> str:
        """The id of the committed state (parameters, T⊥, bans): what this holder claims (peer.node.round.claims)."""
        return self._ids()[2]

    def _ids(self) -> tuple[str, str, str]:
        """(θ_start hash, T⊥ hash, state id) of the committed state: the published tuple when the state
        has not changed since it was made (no lock: a reader racing a change gets the state before it),
        else made under the lock (`StartCache` keeps the hashes) and published."""
        published = self._published
        if published is not None:
            return published
        with self.lock:
            param, perp = self.cache.hashes(self.outer_step, lambda: perp_of(self.module))
            self._published = (param, perp, state_id(param, perp, self.ledger.bans.to_record()))
            return self._published

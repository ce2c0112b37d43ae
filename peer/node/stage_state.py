"""One stage's committed state held by a peer, and its outer rounds (no networking, no pipeline).

θ_start of the current outer step (kept on the CPU, float32: the portable commit's input), T⊥,
the SparseLoCo error buffer, the ban state and the claim that reached the state (`link`; the state
committed from, `prev`, kept until the next commit). `encode_round()` produces this peer's payload;
`apply_round()` commits a set through `peer.node.stage_commit.compute` → `peer.core.commit`;
`recompute()` / `switch()` check another holder's claim of the same round and take it when it holds
(docs/protocol.md). `state_dict()` / `load_state_dict()` are the only way in or out of the stage's
state (checkpoints, state sync). Every method is synchronous and thread-safe (one lock).
`peer.node.stage_worker.StageWorker` adds the pipeline compute on top.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from peer.config import RunConfig
from peer.core.commit import NO_CLIP, RoundCommit, state_hash
from peer.core.feedback import add_to_errors
from peer.core.model import Decoder, build_stage
from peer.core.optim import build_adamw
from peer.core.outer import attach_subspace, check_stage_state, initial_split, perp_of, set_perp, stage_state
from peer.core.sparseloco import ClipStats, Payload, compress, decompress, pseudo_gradient
from peer.core.subspace import make_basis
from peer.node.bans import NONE as NO_BANS
from peer.node.bans import Bans
from peer.node.claims import Entry, Link, entry, state_id
from peer.node.optimizer_state import load_named_optimizer_state, named_optimizer_state
from peer.node.stage_commit import Outcome, Prev, compute, own_adjustment

log = logging.getLogger(__name__)

HISTORY = 16  # rounds of our own links kept to audit other holders' claims of those rounds


class StageState:
    """One stage view with its optimizer, subspace buffers and committed round state."""

    def __init__(self, cfg: RunConfig, stage: int, compressed: bool = True, device: str = "cpu") -> None:
        """compressed=False: a full replica's stage (T_S trained freely, no boundary compression)."""
        self.cfg, self.stage, self.compressed = cfg, stage, compressed
        self.is_first, self.is_last = stage == 0, stage == cfg.stages - 1
        self.device = torch.device(device)
        self.module: Decoder = build_stage(cfg.model, stage, cfg.stages, cfg.seed)
        U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
        w, perp = initial_split(cfg, U)
        attach_subspace(self.module, w, perp)
        self.module.to(self.device)
        self.U = U.to(self.device)
        self.optimizer = build_adamw(self.module.named_parameters(), cfg.train)
        self.lock = threading.RLock()
        self.outer_step = 0
        self._start_version = 0
        self._set_start(stage_state(self.module))
        self.errors: dict[str, torch.Tensor] | None = None
        self.last_contribution: tuple[str, Payload] | None = None  # (replica id, payload) until its round commits
        self.last_committed: list[str] = []  # replica ids committed in the last round
        self.last_clip: ClipStats = NO_CLIP  # what median clipping did in the last round
        self.last_dropped: list[str] = []  # replicas outlier screening dropped in the last round
        self.bans: Bans = NO_BANS  # repeated outliers not fetched from (peer.node.bans), with the committed state
        self.link: Link | None = None  # how the committed state was reached (None: initial or downloaded)
        self.history: dict[int, Link] = {}  # our links of the last HISTORY rounds (claims are audited against them)
        self.prev: Prev | None = None  # the state the last round was committed from (checks recompute from it)
        self._hash_key: tuple[int, int] | None = None
        self._hash_value = ("", "")

    @property
    def start(self) -> Mapping[str, torch.Tensor]:
        """θ_start: the committed parameters of the current outer step (read-only)."""
        return self._start

    def _set_start(self, value: Mapping[str, torch.Tensor]) -> None:
        """Every change of θ_start (or T⊥) goes through here: it keys the hash cache. θ_start is
        kept on the CPU in float32 (the portable commit's input), whatever device trains."""
        self._start = {n: v.detach().to("cpu", torch.float32) for n, v in value.items()}
        self._start_version += 1

    def _reset_step(self) -> None:
        """Forget the current inner step's gradients (the pipeline also forgets its activations)."""
        self.optimizer.zero_grad(set_to_none=True)

    # ---------------------------------------------------------------- outer rounds
    def encode_round(self) -> Payload:
        """This peer's SparseLoCo payload for the current outer step (updates the error buffer)."""
        with self.lock:
            delta = pseudo_gradient(self.start, stage_state(self.module))
            # the old error buffers are overwritten by the new ones (no model-sized allocation);
            # nothing else holds them between rounds (checkpoints are written inside the round)
            payload, self.errors = compress(delta, self.errors, self.cfg.sparseloco, in_place=True)
            return payload

    def contribute(self, replica_id: str) -> Payload:
        """`encode_round`, remembered as (replica id, payload) until the round is checked (`maintain`)."""
        with self.lock:
            payload = self.encode_round()
            self.last_contribution = (replica_id, payload)
            return payload

    def observe(self) -> None:
        """This round's own stage is gathered without a payload of ours (spare, catch-up)."""
        with self.lock:
            self.last_contribution = None

    def return_unsent(self, payload: Payload) -> None:
        """A payload that missed the commit goes back into the error buffer: nothing is lost."""
        with self.lock:
            self.errors = add_to_errors(self.errors, decompress(payload))

    def apply_round(
        self,
        committed: Sequence[Payload],
        embed_update: torch.Tensor | None,
        replicas: Sequence[str] = (),
        embed_set: Sequence[Entry] | None = None,
    ) -> RoundCommit:
        """Commit the current round: θ ← θ_start − η·mean(clip(Δ̂)) over the committed set (in its
        given order, from `replicas`), the ban state advanced with it; next outer step.

        Stage 0's result carries the embedding's committed change, the T⊥ update of every other
        stage (`embed_update`, from stage 0's committed set `embed_set`, which the link names).
        What the round took from our own payload (all of it if the set lacks it) returns to our
        error buffer. The state committed from is kept (`prev`) so a claim of another holder can
        be checked against it (`recompute`).
        """
        with self.lock:
            t = self.outer_step
            perp = self._perp_cpu()
            out = compute(
                self.cfg, self.stage, self.U, t, self.start, perp, self.bans, committed, replicas, embed_update
            )
            adjustment = own_adjustment(self.last_contribution, out, committed)
            prev = Prev(t, self.start, perp, self.bans, self.state_id(), adjustment, self.last_contribution)
            self.errors = add_to_errors(self.errors, adjustment)
            self._install(out, Link(t, prev.state, out.state, _entries(replicas, committed), _set(embed_set)))
            self.prev = prev
            self._log_commit(out, len(committed))
            return out.committed.commit

    def recompute(
        self, committed: Sequence[Payload], replicas: Sequence[str], embed_update: torch.Tensor | None
    ) -> Outcome | None:
        """The commit of the last round with another set, from the state it was committed from (nothing
        changes); None when that state is not kept (initial, downloaded or resumed state)."""
        with self.lock:
            prev = self.prev
        if prev is None:
            return None
        return compute(
            self.cfg, self.stage, self.U, prev.t, prev.start, prev.perp, prev.bans, committed, replicas, embed_update
        )

    def switch(self, out: Outcome, committed: Sequence[Payload], embed_set: Sequence[Entry] | None = None) -> None:
        """Replace our commit of the last round by `out` (a checked better claim, `recompute`): the
        state, bans and link become its own; our error buffer gives back what our commit took from
        our payload and takes what `out` takes instead."""
        with self.lock:
            prev = self.prev
            if prev is None or out.t != prev.t or self.outer_step != prev.t + 1:
                raise ValueError(f"stage {self.stage}: no commit of round {out.t} to replace")
            adjustment = own_adjustment(prev.own, out, committed)
            self.errors = add_to_errors(add_to_errors(self.errors, prev.adjustment, -1.0), adjustment)
            self._install(out, Link(out.t, prev.state, out.state, _entries(out.replicas, committed), _set(embed_set)))
            self.prev = Prev(prev.t, prev.start, prev.perp, prev.bans, prev.state, adjustment, prev.own)
            self._reset_step()

    def _install(self, out: Outcome, link: Link) -> None:
        """Make a computed commit our state (under the lock): parameters, T⊥, θ_start, bans, link."""
        done = out.committed
        with torch.no_grad():
            params = dict(self.module.named_parameters())
            for name, value in done.params.items():
                params[name].copy_(value)
            if done.perp is not None:
                set_perp(self.module, done.perp)
        self.outer_step = out.t + 1
        self._set_start(done.params)
        self._hash_key, self._hash_value = (self._start_version, self.outer_step), (out.param_hash, out.perp_hash)
        self.bans = out.bans
        self.last_clip = done.commit.clip
        self.last_dropped = list(out.dropped)
        self.last_committed = list(out.replicas)
        self.last_contribution = None
        self.link = link
        self.history[link.t] = link
        for old in [t for t in self.history if t <= link.t - HISTORY]:
            del self.history[old]

    def _perp_cpu(self) -> torch.Tensor | None:
        """A CPU copy of T⊥ (None when the run uses no subspace)."""
        try:
            return perp_of(self.module).detach().to("cpu", torch.float32, copy=True)
        except ValueError:
            return None

    def _log_commit(self, out: Outcome, n: int) -> None:
        clip = out.committed.commit.clip
        if out.dropped:
            log.warning(
                "stage %d round %d: screened out %d of %d contributions as outliers: %s",
                self.stage,
                out.t,
                len(out.dropped),
                n,
                ", ".join(r[:12] for r in out.dropped),
            )
        if clip.n_clipped:
            log.info(
                "stage %d round %d: clipped %d of %d contributions (max norm %.3g x median %.3g)",
                self.stage,
                out.t,
                clip.n_clipped,
                n,
                clip.max_ratio,
                clip.median,
            )

    # ---------------------------------------------------------------- state
    def snapshot(self) -> dict[str, torch.Tensor]:
        """Parameters and T⊥ for a late joiner (the committed θ_start of the current outer step)."""
        with self.lock:
            out = {k: v.detach().cpu().clone() for k, v in self.start.items()}
            out["perp"] = perp_of(self.module).detach().cpu().clone()
            return out

    def state_dict(self) -> dict[str, Any]:
        """Everything the next round depends on (the tensors are this worker's own, not copies):

        {"outer_step": t, "params": {name: θ}, "start": {name: θ_start}, "perp": T⊥,
         "errors": {name: e} | None, "optimizer": {"state": {"<name>/<key>": tensor},
         "param_groups": [{hyperparameters..., "params": [global names]}]},
         "bans": the ban record, "link": the link record (or None)}
        """
        with self.lock:
            return {
                "outer_step": self.outer_step,
                "params": {n: p.detach() for n, p in self.module.named_parameters()},
                "start": dict(self.start),
                "perp": perp_of(self.module).detach(),
                "errors": None if self.errors is None else dict(self.errors),
                "optimizer": named_optimizer_state(self.module, self.optimizer),
                "bans": self.bans.to_record(),
                "link": None if self.link is None else {**self.link.to_record(), "state": self.link.state},
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
            own = dict(self.module.named_parameters())
            start, params, perp = state["start"], state.get("params", state["start"]), state["perp"]
            check_stage_state(self.module, self.stage, start, params, perp)
            optimizer = build_adamw(self.module.named_parameters(), self.cfg.train)
            if state.get("optimizer") is not None:
                load_named_optimizer_state(self.module, optimizer, state["optimizer"], self.stage)
            with torch.no_grad():
                for name, value in params.items():
                    own[name].copy_(value.to(own[name].device))
            set_perp(self.module, perp.to(self.device))
            self._set_start(start)
            errors = state.get("errors")
            self.errors = None if errors is None else {n: e.to("cpu", torch.float32) for n, e in errors.items()}
            self.optimizer = optimizer
            self.outer_step = int(state["outer_step"])
            self.bans = Bans.from_record(state.get("bans"))
            link = state.get("link")
            self.link = Link.from_record(link, link.get("state")) if isinstance(link, Mapping) else None
            self.last_committed = self.link.replicas if self.link is not None else []
            self.prev = None
            self.history = {} if self.link is None else {self.link.t: self.link}
            self._reset_step()

    def param_hash(self) -> str:
        """Hash of the committed parameters θ_start (published in every record refresh)."""
        return self._hashes()[0]

    def perp_hash(self) -> str:
        return self._hashes()[1]

    def state_id(self) -> str:
        """The id of the committed state (parameters, T⊥, bans): what this holder claims (peer.node.claims)."""
        with self.lock:
            return state_id(self.param_hash(), self.perp_hash(), self.bans.to_record())

    def _hashes(self) -> tuple[str, str]:
        """(θ_start, T⊥) hashes, computed once per committed state: θ_start and T⊥ change only
        through `_set_start`, which bumps `_start_version`, the key of the cache."""
        with self.lock:
            key = (self._start_version, self.outer_step)
            if self._hash_key != key:
                self._hash_value = (state_hash(self.start), state_hash({"perp": perp_of(self.module)}))
                self._hash_key = key
            return self._hash_value


def _entries(replicas: Sequence[str], payloads: Sequence[Payload]) -> tuple[Entry, ...]:
    """A committed set's names: (replica id prefix, payload sha256 prefix) in commit order (positions
    stand in for replica ids a caller did not give)."""
    ids = list(replicas) if len(replicas) == len(payloads) else [f"{i:016d}" for i in range(len(payloads))]
    return tuple(entry(r, hashlib.sha256(p.to_bytes()).hexdigest()) for r, p in zip(ids, payloads, strict=True))


def _set(value: Sequence[Entry] | None) -> tuple[Entry, ...] | None:
    return None if value is None else tuple(value)

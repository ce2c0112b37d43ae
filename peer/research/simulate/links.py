"""Compression chosen by the link in the simulator (issue 39): each replica's mode in each outer step.

The paper compresses by interconnect bandwidth, not by role (arXiv 2601.02360 §2.3), and so does a
swarm's head (`peer.node.pipeline.mode`). `het-bw-pp-compress` gives every replica a link
(`LinkSchedule`: Mbit/s per replica, or none for a full replica, optionally changed from a given
outer step on: a link degraded or restored mid-run), and every outer step each pipeline replica's
mode is the node's own rule, `choose_mode("auto", …)` with `subspace.uncompressed_min_util`, on the
figures a head would hold: the planner's compute of one micro-batch on one stage
(`peer.research.plan.command.microbatch_compute_s` at the run's micro-batch and `LinkSchedule.flops`)
and the stated bandwidth as the slowest link (a cap, no round trip). Unlike a head, the simulator
knows its compute before the first outer step, so it does not run that step compressed to measure it.

A replica's mode in one outer step is one letter: `F` a full replica (no link, never compressed), `U`
a pipeline running uncompressed (the paper's uncompressed replica: the same math as `F`), `C` a
pipeline compressed at the run's k/d. The other configurations have fixed modes (`replica_modes`):
`sparseloco` all `F`, `pp-compress` all `C`, `het-pp-compress` a fraction α of `F` ("by role") first.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from peer.config import RunConfig
from peer.errors import ConfigError
from peer.node.pipeline.mode import LinkFigures, choose_mode, message_bytes
from peer.research.plan.command import PlanInputs, microbatch_compute_s

BY_LINK = "het-bw-pp-compress"  # the configuration whose modes the links choose
FULL, UNCOMPRESSED, COMPRESSED = "F", "U", "C"
LINK_FLOPS = PlanInputs.flops  # a stage's sustained FLOP/s unless stated: `peer plan --flops`'s default

Links = tuple[float | None, ...]  # Mbit/s per replica; None: a full replica (no link)


@dataclass(frozen=True)
class LinkSchedule:
    """Every replica's link, per phase: (first outer step, links) from step 0 on, steps increasing;
    `flops` is one stage's sustained FLOP/s, what the compute of a micro-batch is planned at."""

    phases: tuple[tuple[int, Links], ...]
    flops: float = LINK_FLOPS

    def at(self, t: int) -> Links:
        """The links of outer step t: those of the last phase begun by t."""
        return [links for first, links in self.phases if first <= t][-1]

    def to_json(self) -> dict[str, Any]:
        """`peer simulate --json`'s "links": the phases (null: a full replica) and the FLOP/s."""
        phases = [{"from_step": first, "mbps": list(links)} for first, links in self.phases]
        return {"phases": phases, "flops": self.flops}


def parse_links(text: str, what: str = "--links") -> Links:
    """ "full,full,1000,10" → (None, None, 1000.0, 10.0); ConfigError naming the flag otherwise."""
    items = [x.strip() for x in text.split(",")]
    out: list[float | None] = []
    for item in items:
        if item.lower() == "full":
            out.append(None)
            continue
        try:
            mbps = float(item)
        except ValueError:
            mbps = float("nan")
        if not mbps > 0 or mbps == float("inf"):
            raise ConfigError(f"{what}: each link is Mbit/s > 0 or 'full' (a full replica), got {item!r} in {text!r}")
        out.append(mbps)
    return tuple(out)


def parse_schedule(links: str | None, changes: str | None, flops: float | None = None) -> LinkSchedule | None:
    """`--links LINKS`, `--links-change T:LINKS[;T:LINKS…]` and `--link-flops` as a schedule (None: no
    --links). A change names every replica's link from outer step T on; a full replica stays one."""
    if links is None:
        if changes:
            raise ConfigError("--links-change needs --links (every replica's link from outer step 0)")
        return None
    phases: list[tuple[int, Links]] = [(0, parse_links(links))]
    for part in [p.strip() for p in (changes or "").split(";") if p.strip()]:
        step, sep, rest = part.partition(":")
        try:
            first = int(step)
        except ValueError:
            first = -1
        if not sep or first <= phases[-1][0]:
            raise ConfigError(
                f"--links-change: expected T:LINKS, outer steps T increasing from 1, e.g. 10:full,10,10; got {part!r}"
            )
        phases.append((first, parse_links(rest, "--links-change")))
    schedule = LinkSchedule(tuple(phases), LINK_FLOPS if flops is None else flops)
    check_schedule(schedule)
    return schedule


def check_schedule(schedule: LinkSchedule, replicas: int | None = None) -> None:
    """ConfigError: a phase naming another number of replicas (than `replicas`, when given), a full
    replica that becomes a pipeline or back (a role, not a link), FLOP/s not positive."""
    if not schedule.flops > 0:
        raise ConfigError(f"--link-flops must be a positive FLOP/s rate, e.g. 1e11, got {schedule.flops:g}")
    first = schedule.phases[0][1]
    want = len(first) if replicas is None else replicas
    for step, links in schedule.phases:
        if len(links) != want:
            raise ConfigError(f"--links names {len(links)} replicas from outer step {step}; the run has {want}")
        moved = [m for m, (a, b) in enumerate(zip(first, links, strict=True)) if (a is None) != (b is None)]
        if moved:
            raise ConfigError(
                f"--links-change: replica {moved[0]} changes between a full replica and a pipeline at outer step "
                f"{step}; a full replica has no link to change"
            )


def link_mode(cfg: RunConfig, mbps: float | None, flops: float) -> str:
    """One replica's mode for one outer step on a link of `mbps` (None: a full replica): the node's rule."""
    if mbps is None:
        return FULL
    b = cfg.train.batch_size // cfg.train.microbatches
    compute_s = microbatch_compute_s(cfg.model, cfg.stages, b, cfg.train.seq_len, flops)
    figures = LinkFigures(compute_s, mbps * 1e6 / 8, 0.0, "caps") if cfg.stages > 1 else None
    target = cfg.subspace.uncompressed_min_util
    decision = choose_mode("auto", figures, message_bytes(cfg, cfg.model.d_model), target)
    return COMPRESSED if decision.compressed else UNCOMPRESSED


def link_modes(cfg: RunConfig, schedule: LinkSchedule) -> list[str]:
    """Every outer step's modes under `schedule`, one letter per replica (module docstring)."""
    chosen: dict[Links, str] = {}
    out = []
    for t in range(cfg.train.outer_steps):
        at = schedule.at(t)
        if at not in chosen:
            chosen[at] = "".join(link_mode(cfg, mbps, schedule.flops) for mbps in at)
        out.append(chosen[at])
    return out


def check_links(configs: Sequence[str], schedule: LinkSchedule | None, replicas: int, fixed: str, overlap: int) -> None:
    """ConfigError: het-bw-pp-compress without --links, --links without it, links for another M, or a
    switch that cannot be followed: `fixed` names a switch on that fixes a replica's mode when it is
    built (the Table 5c/5d ablations; "" none), `overlap` N > 0 overlaps a round with the next step."""
    if schedule is None:
        if BY_LINK in configs:
            raise ConfigError(f"{BY_LINK} needs --links: every replica's Mbit/s, or 'full' for a full replica")
        return
    if BY_LINK not in configs:
        raise ConfigError(f"--links choose the modes of {BY_LINK}; add it to --configs")
    check_schedule(schedule, replicas)
    if fixed:
        raise ConfigError(f"{BY_LINK} with {fixed}: it fixes a replica's mode when the replica is built")
    if overlap and len(schedule.phases) > 1:
        raise ConfigError(
            "--links-change with --overlap: a replica that switches mode while its round is in flight is not modelled"
        )


def fixed_modes(outer_steps: int, replicas: int, n_uncompressed: int) -> list[str]:
    """A configuration of fixed modes: the first `n_uncompressed` full replicas, the rest compressed."""
    return [FULL * n_uncompressed + COMPRESSED * (replicas - n_uncompressed)] * outer_steps


def mode_summary(modes: Sequence[str]) -> str:
    """ "FFUUUCCC × 10, FFCCCCCC × 10": the runs of equal outer steps, in order."""
    return ", ".join(f"{m} × {len(list(run))}" for m, run in itertools.groupby(modes))

"""`peer plan`: the planner's tables and figures, drawn from what `peer.research.plan.command.plan` computes.

Two tables (per pipeline and bandwidth; the round's bytes per stage holder), Fig. 2 (utilisation,
one curve per k/d) at the `--png` path, Fig. 3 (wall-clock of `--tokens`) beside it, and the
`--json` file; with `--memory`, one table of `peer.research.plan.memory`'s rows (or with `--ranks N` /
`--sharded`, per rank of a full replica: `peer.research.plan.ranks`) and the fewest sharded ranks per GPU size instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from peer.cli.plots import plot_utilisation, plot_wallclock, wallclock_png
from peer.cli.render import human_bytes
from peer.core.memory import MAX_RANKS, format_bytes
from peer.research.plan.command import plan
from peer.research.plan.figures import by_k_ratio
from peer.research.plan.memory import MODES, mode_name, plan_memory
from peer.research.plan.round import HolderRound


def plan_command(
    out: Callable[[Any], None],
    args: Mapping[str, Any],
    png: Path,
    json_out: Path | None,
    write_json: Callable[[Path, dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """`peer plan`: the rows for the CLI's flags (`args`), the tables and the file paths handed to `out`:
    Fig. 2 (utilisation, one curve per k/d) at `png`, Fig. 3 (wall-clock of `--tokens`) beside it."""
    result = plan(args)
    rows, inputs = result.rows, result.inputs
    for table in plan_tables(rows, dataclasses.asdict(inputs), result.holders):
        out(table)
    out(f"plot: {plot_utilisation(rows, png)}")
    if inputs.tokens is not None:
        out(f"plot: {plot_wallclock(rows, wallclock_png(png), inputs.tokens)}")
    if json_out:
        write_json(json_out, result.to_json())
        out(f"results: {json_out}")
    return rows


def plan_tables(
    rows: Sequence[Mapping[str, Any]], inputs: Mapping[str, Any], holders: Mapping[bool, Sequence[HolderRound]]
) -> list[Table]:
    """`peer plan`'s two tables: per pipeline (each k/d, then uncompressed) and bandwidth, and the
    round's bytes per stage holder (`holders[compressed]`). `inputs`: `PlanInputs` as a dict."""
    return [_pipeline_table(rows, inputs), _round_table(holders, inputs["replicas"])]


def _pipeline_table(rows: Sequence[Mapping[str, Any]], inputs: Mapping[str, Any]) -> Table:
    budget, overlap = inputs["tokens"] is not None, bool(inputs["overlap"])
    steps = f", {inputs['tokens']:.3g} tokens = {rows[0]['outer_steps_compressed']:,} outer steps" if budget else ""
    table = Table(
        title=(
            f"peer plan — {rows[0]['model']}, {inputs['stages']} stages, M={inputs['replicas']}, "
            f"H={inputs['inner_steps']}, {inputs['microbatches']}×{inputs['microbatch_size']}×{inputs['seq_len']} "
            "tokens per inner step, " + ("overlapped" if overlap else "synchronous") + " outer steps" + steps
        ),
        caption="k/d none: the uncompressed pipeline; act/µb: boundary bytes per micro-batch (forward + "
        "backward); round s: the slowest holder's busier link direction (next table); commit: the slowest "
        f"holder's, seconds on its {inputs['commit_device']}"
        + ("; N: inner steps of t + 1 the round overlaps; sync: util on the synchronous schedule" if overlap else ""),
    )
    columns = ["k/d", "k", "Mbit/s", "util", "s/outer", "round s", "commit", "act/µb"]
    columns += (["N", "sync"] if overlap else []) + (["hours"] if budget else [])
    for col in columns:
        table.add_column(col, justify="left" if col == "k/d" else "right", no_wrap=True)
    groups = [(g[0]["k_ratio"], str(g[0]["k"]), "compressed", g) for g in by_k_ratio(rows).values()]
    groups.append(("none", "d", "uncompressed", groups[0][3]))
    for n, (label, k, kind, group) in enumerate(groups):
        if n:
            table.add_section()
        for r in group:
            cells = [
                label,
                k,
                f"{r['bandwidth_mbps']:g}",
                f"{100 * r[f'util_{kind}']:.1f} %",
                f"{r[f'outer_s_{kind}']:,.0f}",
                f"{r[f'round_s_{kind}']:,.0f}",
                _seconds(r[f"commit_s_{kind}"]),
                human_bytes(r[f"boundary_bytes_{kind}"]),
            ]
            if overlap:
                cells += [str(r[f"overlap_steps_{kind}"]), f"{100 * r[f'util_sync_{kind}']:.1f} %"]
            if budget:
                cells.append(f"{r[f'wallclock_h_{kind}']:,.0f}")
            table.add_row(*cells)
    return table


def _seconds(value: float) -> str:
    """Seconds to two decimals below 100, whole above."""
    return f"{value:.2f}" if value < 100 else f"{value:,.0f}"


def _round_table(holders: Mapping[bool, Sequence[HolderRound]], replicas: int) -> Table:
    table = Table(
        title=f"the round per stage holder, M={replicas}, all-to-all (payloads fetched: own stage, stage 0)",
        caption="compressed: the later stages also fetch all of stage 0's payloads (for T⊥) as embedding views, "
        "stage 1 from stage 0's holders, each later stage from the holders of the stage before it; "
        "uncompressed: each way",
    )
    for col in ("stage", "payload", "own", "stage 0", "fetched", "served", "uncompressed"):
        table.add_column(col, justify="right", no_wrap=True)
    for c, u in zip(holders[True], holders[False], strict=True):
        table.add_row(
            str(c.stage),
            human_bytes(c.payload_bytes),
            str(c.own_fetched),
            str(c.stage0_fetched),
            human_bytes(c.fetched_bytes),
            human_bytes(c.served_bytes),
            human_bytes(u.link_bytes),
        )
    return table


def plan_memory_command(
    out: Callable[[Any], None],
    args: Mapping[str, Any],
    json_out: Path | None,
    write_json: Callable[[Path, dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """`peer plan --memory`: the per-stage table (with `--ranks N` / `--sharded`: per rank of a full
    replica instead), the fewest sharded ranks per GPU size, and the JSON file."""
    from peer.research.plan.ranks import plan_ranks

    inputs, rows = plan_memory(args)
    replica, per_rank, fit = plan_ranks(args)
    out(memory_table(rows, inputs["microbatch_size"]) if per_rank is None else rank_table(per_rank, replica))
    out(fit_table(fit, inputs["microbatch_size"]))
    if json_out:
        ranks = {} if per_rank is None else {"ranks": per_rank}
        write_json(json_out, {"inputs": {**inputs, **replica}, "rows": rows, **ranks, "fit": fit})
        out(f"results: {json_out}")
    return rows


def memory_table(rows: list[dict[str, Any]], microbatch_size: int) -> Table:
    """`peer plan --memory`'s table: per preset and stage count, the largest stage's peak per mode."""
    table = Table(
        title=f"peer plan --memory: GPU memory of the largest stage (K in flight, {microbatch_size} seq each)",
        caption="ckpt: --activation-checkpointing; host: RAM beside the GPU (θ_start, error buffer, rounds); "
        "on a CPU device both are one memory (--json: `cpu <mode>`)",
    )
    for col in ("model", "S", "seq", "K", *(mode_name(p, c) for p, c in MODES), "host"):
        table.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
    for r in rows:
        modes = [format_bytes(r[mode_name(p, c)]) for p, c in MODES]
        table.add_row(
            r["model"], str(r["stages"]), str(r["seq_len"]), str(r["in_flight"]), *modes, format_bytes(r["host"])
        )
    return table


def rank_table(rows: list[dict[str, Any]], replica: Mapping[str, Any]) -> Table:
    """Per preset, one rank's GPU memory per mode of a full replica over `--ranks` ranks."""
    N, sharded = replica["ranks"], replica["sharded"]
    kind = "sharded over them (FSDP2, planned: issue 40)" if sharded else "DDP (every rank the whole replica)"
    table = Table(
        title=f"peer plan --memory --ranks {N}: GPU memory per rank of a full replica of {N} "
        f"rank{'s' if N > 1 else ''}, {kind}, {replica['microbatch_size']} seq per micro-batch",
        caption="a one-stage run (S stages: S − 1 more copies of T⊥ per rank); host: RAM beside each rank's GPU"
        + (" (its shard of θ_start, the error buffer and the round)" if sharded else ""),
    )
    for col in ("model", "seq", *(mode_name(p, c) for p, c in MODES), "host"):
        table.add_column(col, justify="left" if col == "model" else "right", no_wrap=True)
    for r in rows:
        modes = [format_bytes(r[mode_name(p, c)]) for p, c in MODES]
        table.add_row(r["model"], str(r["seq_len"]), *modes, format_bytes(r["host"]))
    return table


def fit_table(rows: list[dict[str, Any]], microbatch_size: int) -> Table:
    """Per preset and mode: DDP's per-rank GPU memory and the devices it fits, and the fewest
    sharded ranks that fit each GPU size (`peer.research.plan.ranks.fit_rows`)."""
    from peer.research.plan.ranks import DEVICES_GIB, FIT_MODES

    table = Table(
        title=f"which presets fit on which GPUs, and how many ({microbatch_size} seq per micro-batch per rank)",
        caption="DDP: every rank holds the whole replica; sharded: the fewest FSDP2 ranks whose per-rank memory "
        "fits the GPU (each rank's shards with the round on shards: what a follower of `peer join --sharded` "
        f"holds; its rank 0 still holds the whole replica for the round); —: none up to {MAX_RANKS}; GiB of the "
        "GPU's own memory, nothing kept back",
    )
    for col in ("model", "mode", "DDP per rank", "DDP fits", *(f"sharded {g} GiB" for g in DEVICES_GIB)):
        table.add_column(col, justify="left" if col in ("model", "mode", "DDP fits") else "right", no_wrap=True)
    for n, r in enumerate(rows):
        if n:
            table.add_section()
        for p, c in FIT_MODES:
            mode = mode_name(p, c)
            ddp = r["ddp " + mode]
            fits = [f"{g} GiB" for g in DEVICES_GIB if ddp <= g * 2**30]
            ranks = [r[f"{mode} {g}GiB"] for g in DEVICES_GIB]
            cells = ["—" if k is None else str(k) for k in ranks]
            table.add_row(r["model"], mode, format_bytes(ddp), ", ".join(fits) or "none", *cells)
    return table


def plan_recommend_command(
    out: Callable[[Any], None],
    args: Mapping[str, Any],
    json_out: Path | None,
    write_json: Callable[[Path, dict[str, Any]], None],
) -> list[dict[str, Any]]:
    """`peer plan --recommend`: per bandwidth the mode and k/d (`peer.research.plan.recommend`), and the JSON file."""
    from peer.research.plan.command import parse_bandwidths, resolve_model
    from peer.research.plan.recommend import recommend

    inputs, recs = recommend(args, parse_bandwidths(args["bandwidth_mbps"]), args["target_util"])
    name, _ = resolve_model(inputs)
    table = Table(
        title=f"peer plan --recommend — {name}, {inputs.stages} stages, M={inputs.replicas}, H={inputs.inner_steps}, "
        f"target {100 * args['target_util']:.0f} % utilisation, " + ("overlapped" if inputs.overlap else "synchronous"),
        caption="loss: the Δ of final loss arXiv 2601.02360's Table 2 measured at that k/d (512M, SparseLoCo; "
        "interpolated in log d/k), with every pipeline compressed / half the replicas uncompressed",
    )
    for col in ("Mbit/s", "mode", "k/d", "util", "uncompressed", "loss (all / half)", "why"):
        table.add_column(col, justify="right" if col in ("Mbit/s", "util", "uncompressed") else "left")
    rows = [dataclasses.asdict(r) for r in recs]
    for r in recs:
        loss = "—" if r.loss_pp is None else f"+{r.loss_pp:.1f} % / +{r.loss_het:.1f} %"
        table.add_row(
            f"{r.bandwidth_mbps:g}", r.mode, r.k_ratio or "—", f"{100 * r.util:.1f} %",
            f"{100 * r.util_uncompressed:.1f} %", loss if r.mode != "uncompressed" else "0", r.reason,
        )  # fmt: skip
    out(table)
    if json_out:
        write_json(json_out, {"inputs": dataclasses.asdict(inputs), "target_util": args["target_util"], "rows": rows})
        out(f"results: {json_out}")
    return rows

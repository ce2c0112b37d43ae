"""`peer plan`'s tables and figures: Fig. 2 (compute utilisation against inter-stage bandwidth, one
curve per k/d and the uncompressed pipeline, one plot) and Fig. 3 (hours to train a token budget
against bandwidth, the same curves and the compute-only bound), and their curves as JSON.

The rows come from `peer.research.plan.command.plan_rows` (one per k/d and bandwidth); the round's bytes per
holder from `peer.research.plan.round.round_holders`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rich.table import Table

from peer.cli.plots import figure
from peer.cli.render import human_bytes
from peer.research.plan.round import HolderRound

MARKERS = "o^vD"  # one per k/d curve (they overlap where the round, not the boundary, sets the time)


def _groups(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
    """The rows by k/d, in the order given."""
    out: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        out.setdefault(r["k_ratio"], []).append(r)
    return out


def curve_label(row: Mapping[str, Any]) -> str:
    return f"k/d={row['k_ratio']} (k={row['k']})"


def figure_curves(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The plotted curves as JSON: "figure2" (utilisation, 0–1) and, with a token budget, "figure3"
    (hours), each {"bandwidth_mbps": x, "curves": {label: y}}: one curve per k/d, then "uncompressed"."""
    groups = _groups(rows)
    first = next(iter(groups.values()))
    x = [r["bandwidth_mbps"] for r in first]
    util = {curve_label(g[0]): [r["util_compressed"] for r in g] for g in groups.values()}
    util["uncompressed"] = [r["util_uncompressed"] for r in first]
    out: dict[str, Any] = {"figure2": {"bandwidth_mbps": x, "curves": util}}
    if "wallclock_h_compressed" in first[0]:
        hours = {curve_label(g[0]): [r["wallclock_h_compressed"] for r in g] for g in groups.values()}
        hours["uncompressed"] = [r["wallclock_h_uncompressed"] for r in first]
        out["figure3"] = {"bandwidth_mbps": x, "curves": hours, "compute_only_h": compute_only_hours(first[0])}
    return out


def compute_only_hours(row: Mapping[str, Any]) -> float:
    """The budget's hours with infinitely fast links: the outer steps' compute alone."""
    compute_s = row["util_compressed"] * row["outer_s_compressed"]  # H·m·compute
    return float(row["outer_steps_compressed"] * compute_s / 3600.0)


def plot_utilisation(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """Fig. 2: utilisation against bandwidth (log x), one curve per k/d and the uncompressed pipeline."""
    curves = figure_curves(rows)["figure2"]
    title = f"{rows[0]['model']}: compute utilisation vs inter-stage bandwidth"
    with figure(path, title, "inter-stage bandwidth (Mbit/s)", "compute utilisation (%)", figsize=(6.5, 4)) as ax:
        for i, (label, ys) in enumerate(curves["curves"].items()):
            style = "s--" if label == "uncompressed" else MARKERS[i % len(MARKERS)] + "-"
            ax.plot(curves["bandwidth_mbps"], [100 * y for y in ys], style, label=label, markersize=7 - i % 4)
        ax.set_xscale("log")
        ax.set_ylim(0, 105)
        ax.grid(alpha=0.3, which="both")
    return Path(path)


def wallclock_png(png: Path) -> Path:
    """Fig. 3's file beside Fig. 2's: runs/plan.png → runs/plan-wallclock.png."""
    return png.with_name(f"{png.stem}-wallclock{png.suffix or '.png'}")


def plot_wallclock(rows: Sequence[Mapping[str, Any]], path: Path, tokens: float) -> Path:
    """Fig. 3: hours to train `tokens` against bandwidth (log x, log y), one curve per k/d, the
    uncompressed pipeline and the compute-only bound."""
    curves = figure_curves(rows)["figure3"]
    title = f"{rows[0]['model']}: wall-clock for {tokens:.3g} tokens"
    with figure(path, title, "inter-stage bandwidth (Mbit/s)", "wall-clock (hours)", figsize=(6.5, 4)) as ax:
        x = curves["bandwidth_mbps"]
        for i, (label, ys) in enumerate(curves["curves"].items()):
            style = "s--" if label == "uncompressed" else MARKERS[i % len(MARKERS)] + "-"
            ax.plot(x, ys, style, label=label, markersize=7 - i % 4)
        ax.axhline(curves["compute_only_h"], color="gray", linestyle=":", label="compute only")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
    return Path(path)


def plan_tables(
    rows: Sequence[Mapping[str, Any]], inputs: Mapping[str, Any], holders: Mapping[bool, Sequence[HolderRound]]
) -> list[Table]:
    """`peer plan`'s two tables: per pipeline (each k/d, then uncompressed) and bandwidth, and the
    round's bytes per stage holder (`holders[compressed]`). `inputs`: `PlanInputs` as a dict."""
    return [_pipeline_table(rows, inputs), _round_table(holders, inputs["replicas"])]


def _pipeline_table(rows: Sequence[Mapping[str, Any]], inputs: Mapping[str, Any]) -> Table:
    budget = inputs["tokens"] is not None
    steps = f", {inputs['tokens']:.3g} tokens = {rows[0]['outer_steps_compressed']:,} outer steps" if budget else ""
    table = Table(
        title=(
            f"peer plan — {rows[0]['model']}, {inputs['stages']} stages, M={inputs['replicas']}, "
            f"H={inputs['inner_steps']}, {inputs['microbatches']}×{inputs['microbatch_size']}×{inputs['seq_len']} "
            "tokens per inner step" + steps
        ),
        caption="k/d none: the uncompressed pipeline; act/µb: boundary bytes per micro-batch (forward + "
        "backward); round s: the slowest holder's busier link direction (next table)",
    )
    columns = ["k/d", "k", "Mbit/s", "util", "s/outer", "round s", "act/µb"] + (["hours"] if budget else [])
    for col in columns:
        table.add_column(col, justify="left" if col == "k/d" else "right", no_wrap=True)
    groups = [(g[0]["k_ratio"], str(g[0]["k"]), "compressed", g) for g in _groups(rows).values()]
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
                human_bytes(r[f"boundary_bytes_{kind}"]),
            ]
            if budget:
                cells.append(f"{r[f'wallclock_h_{kind}']:,.0f}")
            table.add_row(*cells)
    return table


def _round_table(holders: Mapping[bool, Sequence[HolderRound]], replicas: int) -> Table:
    table = Table(
        title=f"the round per stage holder, M={replicas}, all-to-all (payloads fetched: own stage, stage 0)",
        caption="compressed: the later stages also fetch all of stage 0's payloads (for T⊥), which stage 0's "
        "holders serve; uncompressed: each way",
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

"""`peer plan`'s figures as data: the curves of Fig. 2 (compute utilisation against inter-stage
bandwidth, one curve per k/d and the uncompressed pipeline) and Fig. 3 (hours to train a token budget
against bandwidth, the same curves and the compute-only bound), as the `--json` file holds them and
`peer.cli.plots` draws them.

The rows come from `peer.research.plan.command.plan_rows` (one per k/d and bandwidth).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def by_k_ratio(rows: Sequence[Mapping[str, Any]]) -> dict[str, list[Mapping[str, Any]]]:
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
    groups = by_k_ratio(rows)
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

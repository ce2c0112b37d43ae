"""What `peer bench …` prints: the tables and lines of the benchmarks' results.

The benchmarks (`peer.research.bench.*`) return dicts and dataclasses and print nothing; the commands in
`peer.cli.bench` show what is built here (rich tables and plain lines, nothing printed here).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.table import Table


def pipeline_table(result: Mapping[str, Any]) -> Table:
    """`peer bench pipeline`'s table: one row per configuration measured."""
    header, *body = pipeline_rows(result)
    table = Table(*header, title="peer bench pipeline")
    for row in body:
        table.add_row(*row)
    return table


def pipeline_rows(result: Mapping[str, Any]) -> list[list[str]]:
    """Rows of `peer bench pipeline`'s table (header first)."""
    out = [["k/d", "link", "in flight", "tok/s", "plan tok/s", "eff.", "vs unshaped", "busy", "bubble", "B/token/link"]]
    for r in result["rows"]:
        link = r["rate"] + (f" +{r['rtt_ms']:g}ms" if r["rtt_ms"] else "")
        vs = "" if r.get("vs_unshaped") is None else f"{r['vs_unshaped']:.2f}x"
        kd = (
            r["k_ratio"]
            if r.get("compression", "always") == "always"
            else f"{r['k_ratio']} {r['compression']}→{r['mode']}"
        )
        out.append(
            [kd, link, str(r["in_flight"]), f"{r['tokens_per_s']:.0f}", f"{r['plan_tokens_per_s']:.0f}",
             f"{r['efficiency']:.2f}", vs,
             "/".join(f"{x:.2f}" for x in r["busy"]), f"{r['bubble']:.2f}",
             "/".join(f"{x:.0f}" for x in r["bytes_per_token"])]
        )  # fmt: skip
    return out


def pipeline_summary(result: Mapping[str, Any]) -> list[str]:
    """`peer bench pipeline`: one line per target of issue 9 that this result can speak to."""
    rows = result["rows"]
    split, wire = result["bench"].get("split", "even"), result["bench"].get("wire_dtype", "fp32")
    lines = [
        f"one device: {result['one_device_tokens_per_s']:.0f} tok/s; shaping: {result['shaping']}; split: {split}; "
        f"wire: {wire}"
    ]
    for r in rows:
        if r["rate"] == "unshaped" and not r["rtt_ms"]:
            mode = "" if r.get("compression", "always") == "always" else f" ({r['compression']}: {r['mode']})"
            lines.append(
                f"k/d={r['k_ratio']}{mode} in_flight={r['in_flight']}: scaling efficiency {r['efficiency']:.2f}"
            )
    for r in rows:
        if r.get("compression", "always") != "always" and r.get("vs_compressed") is not None:
            link = r["rate"] + (f" +{r['rtt_ms']:g}ms" if r["rtt_ms"] else "")
            lines.append(
                f"{link}, in_flight={r['in_flight']}: --compression {r['compression']} ran {r['mode']}, "
                f"{r['vs_compressed']:.2f}x the tokens/s of the same pipeline forced compressed at k/d={r['k_ratio']}"
                + (
                    f" (median of the paired repeats {r['paired_vs_compressed']:.2f}x)"
                    if "paired_vs_compressed" in r
                    else ""
                )
            )
    return lines


def simulate_speed_lines(out: Mapping[str, Any]) -> list[str]:
    """`peer bench simulate`: the wall times of the three paths and the speed-ups."""
    w = {k: ", ".join(f"{x:.1f}" for x in v) for k, v in out["wall_s"].items()}
    return [
        f"peer simulate, tiny, M={out['replicas']}, H={out['inner_steps']}, T={out['outer_steps']}, {out['configs']}",
        f"  old   (in process, dense decode, then the commit): {w['old']} s",
        f"  fused (in process, fused commit): {w['fused']} s   {out['speedup_fused']:.2f}x",
        f"  new   ({out['workers']} workers, fused commit): {w['new']} s   {out['speedup_new']:.2f}x",
        "  (speed-ups: the fastest run of each path)",
        f"  results bit-identical on all runs: {out['bit_identical']}",
    ]


def utilisation_table(result: Mapping[str, Any]) -> Table:
    """`peer bench utilisation`'s table: one row per schedule and replica (medians over the measured outer steps)."""
    cols = ("schedule", "replica", "compute fraction", "outer step s", "inner steps s", "boundary s", "round s",
            "gather s", "step s")  # fmt: skip
    table = Table(*cols, title="peer bench utilisation")
    for sched in result["schedules"]:
        for name, r in sched["replicas"].items():
            cells = [r[k] for k in ("compute_fraction", "outer_step_s", "compute_s", "boundary_s", "landed_s",
                                    "round_wall_s", "step_s")]  # fmt: skip
            table.add_row(sched["schedule"], name, *("—" if v is None else f"{v:.2f}" for v in cells))
    return table


def utilisation_lines(result: Mapping[str, Any]) -> list[str]:
    """`peer bench utilisation`: the run's links, each schedule's one-state check, the issue's targets."""
    c = result["config"]
    lines = [
        f"{c['preset']}, H={c['inner_steps']}, T={c['outer_steps']}, batch {c['batch_size']}×{c['seq_len']}; "
        f"link: {c['rate'] or 'unshaped'} ({result['shaping']}); two full replicas; logs in {c['workdir']}"
    ]
    for sched in result["schedules"]:
        one = sched["one_state"]
        fraction = _mean([r["compute_fraction"] for r in sched["replicas"].values()])
        mean = "—" if fraction is None else f"{fraction:.2f}"
        target = "≤ 0.70" if sched["overlap"] == 0 else "≥ 0.95"
        lines.append(
            f"{sched['schedule']}: compute fraction {mean} (target {target}); one state per (t, stage): "
            f"{one['agreed']}/{one['checked']} ({one['all_holders']} held by both); pauses {sched['pauses']}; "
            f"load average {sched['load_avg'][0]:.1f} → {sched['load_avg'][1]:.1f}"
        )
    walls = {
        sched["overlap"]: _mean([r["outer_step_s"] for r in sched["replicas"].values()])
        for sched in result["schedules"]
    }
    sync, overlapped = walls.get(0), walls.get(1)
    if sync and overlapped:
        lines.append(
            f"outer step: {sync:.1f} s synchronous, {overlapped:.1f} s overlapped "
            f"({sync / overlapped:.2f}x the tokens per second)"
        )
    return lines


def _mean(xs: list[float | None]) -> float | None:
    got = [x for x in xs if x is not None]
    return sum(got) / len(got) if got else None


def commit_table(result: Mapping[str, Any]) -> Table:
    """`peer bench commit`: the portable commit's speed by device and thread count, and its state ids."""
    title = "commit speed by device and threads (medians; CPU s: all the process's threads)"
    table = Table("device", "threads", "seconds", "speed-up", "CPU s", "state id", title=title)
    base: dict[str, float] = {}
    for r in result["runs"]:
        base.setdefault(r["device"], r["seconds"])
        speedup = f"{base[r['device']] / r['seconds']:.2f}x"
        table.add_row(r["device"], str(r["threads"]), f"{r['seconds']:.2f}", speedup, f"{r['cpu_s']:.2f}", r["state"])
    return table


def dashboard_lines(out: Mapping[str, Any]) -> list[str]:
    """`peer bench dashboard`'s result in a few lines."""
    p = out["first_paint"]
    mib = 1 << 20
    lines = [
        f"{p['holders']} holders over {p['stages']} stages, {p['replicas']} replicas, {p['polls']} reads of history: "
        f"/api/dashboard {p['api_dashboard_s'] * 1000:.0f} ms, {p['api_dashboard_bytes'] / 1024:.0f} KiB"
    ]
    if p["first_paint_s"] is None:
        lines.append("first paint: not measured (no chromium binary; apt-get install chromium)")
    else:
        runs = ", ".join(f"{x * 1000:.0f}" for x in p["first_paint_runs_s"])
        lines.append(
            f"first paint (page's performance.now(), real clock): median {p['first_paint_s'] * 1000:.0f} ms "
            f"(runs {runs} ms); navigation command → painted seen: {p['navigate_to_seen_s'] * 1000:.0f} ms"
        )
    m = out.get("memory")
    if m:
        lines.append(
            f"memory over {m['rounds']} rounds ({m['holders']} holders, {m['replicas']} replicas, "
            f"{m['ingest_s_per_round'] * 1000:.1f} ms per read): RSS at start {m['rss_start_bytes'] / mib:.1f} MiB"
        )
        for s in m["samples"]:
            grown = (s["rss_bytes"] - m["rss_start_bytes"]) / mib
            lines.append(
                f"  after {s['rounds']:>6} rounds: RSS {s['rss_bytes'] / mib:.1f} MiB (+{grown:.1f}), "
                f"history file {s['history_bytes'] / mib:.1f} MiB"
            )
        lines.append(f"  points kept per replica: {m['points_kept_per_replica']} (the ring's capacity bounds it)")
    return lines

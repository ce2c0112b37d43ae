"""What `peer bench caps`, `data`, `swarm` and `sybil` print, and the bodies of those commands: each
turns the flags into one call of its research module (`peer.research.bench.*`), which returns data, and lays
the result out as rich tables and lines for `peer/cli/bench.py` to print.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from peer.core.data.loader import load_corpus
from peer.errors import ConfigError
from peer.research.bench.caps import bench_caps
from peer.research.bench.data import TARGET_RSS_SPREAD, TARGET_TOKENS_PER_S, bench_data, parse_size
from peer.research.bench.swarm import parse_ints, parse_rules, run_one, sim_config, targets
from peer.research.bench.sybil import (
    COLLUSIONS,
    LossRow,
    SybilResult,
    bench_config,
    bench_sybil,
    colluder_counts,
    losses,
)

__all__ = [
    "caps_command",
    "data_command",
    "data_tables",
    "losses_table",
    "rows_table",
    "swarm_command",
    "sybil_command",
]

Show = Callable[[Any], None]


def caps_command(echo: Callable[[str], None], mbps: float, window_s: float, repeats: int, json_out: Any) -> None:
    """The CLI body: `repeats` runs, each phase's median, one line per figure."""
    runs = []
    for i in range(repeats):
        echo(f"run {i + 1}/{repeats}: caps {mbps:g} Mbit/s, {window_s:g} s windows…")
        runs.append(bench_caps(mbps, window_s))
    summary = {key: sorted(r[key] for r in runs)[len(runs) // 2] for key in runs[0]}
    for key in ("upload_mbps", "download_mbps", "priority_high_mbps", "priority_low_mbps"):
        echo(f"{key:>20}: {summary[key]:8.2f} Mbit/s (cap {mbps:g})")
    ok = summary["upload_error"] <= 0.10 and summary["download_error"] <= 0.10
    verdict = "within" if ok else "NOT within"
    echo(
        f"cap accuracy: upload {summary['upload_error']:.1%}, download {summary['download_error']:.1%} ({verdict} 10 %)"
    )
    echo(f"activations' share of the upload cap with round payloads competing: {summary['high_share']:.0%}")
    if json_out:
        with open(json_out, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=2)


def data_command(show: Show, args: dict[str, Any], write_json: Callable[[Path, dict[str, Any]], None]) -> None:
    """`peer bench data` with the CLI's flag values."""
    sizes = [parse_size(s) for s in str(args["sizes"]).split(",") if s.strip()]
    if not sizes:
        raise ConfigError("--sizes names no corpus; give token counts like 10M,1B")
    keys = ("workdir", "batches", "batch_size", "seq_len", "n_shards", "steps", "keep")
    result = bench_data(sizes, **{k: args[k] for k in keys}, show=show)
    for table in data_tables(result):
        show(table)
    if args.get("json_out"):
        write_json(args["json_out"], result)
        show(f"results: {args['json_out']}")


def data_tables(result: dict[str, Any]) -> list[Any]:
    """The three rich tables of a `bench_data` result."""
    mib = 1 << 20
    speed = Table(title=f"batch assembly, one core (target ≥ {TARGET_TOKENS_PER_S / 1e6:.0f} M tokens/s)")
    for col in ("batch", "seq_len", "CPU µs/batch", "M tokens/s (CPU)", "wall µs/batch", "M tokens/s (wall)"):
        speed.add_column(col, justify="right")
    for r in result["speed"]:
        speed.add_row(
            str(r["batch_size"]),
            str(r["seq_len"]),
            f"{r['us_per_batch']:.1f}",
            f"{r['tokens_per_s'] / 1e6:.1f}",
            f"{r['wall_us_per_batch']:.1f}",
            f"{r['wall_tokens_per_s'] / 1e6:.1f}",
        )
    memory = Table(
        title=f"a head's resident memory: {result['batches']} batches of {result['batch_size']} × {result['seq_len']} "
        f"(peaks {result['rss_spread']:+.2%} apart; target ≤ {TARGET_RSS_SPREAD:.0%})"
    )
    for col in ("corpus tokens", "peak RSS MiB", "final RSS MiB", "anon MiB", "max file-backed MiB", "read s"):
        memory.add_column(col, justify="right")
    for r in result["memory"]:
        memory.add_row(
            f"{r['corpus_tokens']:,}",
            f"{r['hwm_bytes'] / mib:.1f}",
            f"{r['rss_bytes'] / mib:.1f}",
            f"{r['anon_bytes'] / mib:.1f}",
            f"{r['max_file_bytes'] / mib:.1f}",
            f"{r['read_s']:.2f}",
        )
    share = Table(title="data's share of an inner step (full replica, one core)")
    for col in ("preset", "batch × seq_len", "train_batch µs", "inner step ms", "fraction"):
        share.add_column(col, justify="right")
    for r in result["step_share"]:
        share.add_row(
            r["preset"],
            f"{r['batch_size']} × {r['seq_len']}",
            f"{1e6 * r['batch_s']:.1f}",
            f"{1e3 * r['step_s']:.1f}",
            f"{r['fraction']:.3%}",
        )
    return [speed, memory, share]


def swarm_command(
    out: Callable[[Any], None], args: Mapping[str, Any], write_json: Callable[[Path, dict[str, Any]], None]
) -> dict[str, Any]:
    """`peer bench swarm`: the table (or the calibration), the targets, the JSON file."""
    if args["calibrate"]:
        from peer.research.swarm.calib import calibrate  # real DHT nodes and gRPC: only when asked

        rows = calibrate(tuple(parse_ints(args["calibrate_peers"], "--calibrate-peers")), args["calibrate_rounds"])
        out(calib_table(rows))
        result: dict[str, Any] = {"calibration": rows}
    else:
        rules = parse_rules(args["rules"])
        rows = []
        for M in parse_ints(args["peers"], "--peers"):
            for rule in rules:
                rows.append(run_one(sim_config(args, M, rule)))
                out(f"M={M} {rule}: round {rows[-1]['round_s']:.1f} s, {rows[-1]['down_payloads']:.2f} payloads down")
        out(swarm_table(rows, f"peer bench swarm: {args['preset']}, stage {args['stage']} of {args['stages']}"))
        checks = targets(rows, sim_config(args, 2, rules[0]))
        for c in checks:
            out(f"target {'met' if c['met'] else 'MISSED'}: {c['target']}: {c['value']}")
        inputs = dataclasses.asdict(sim_config(args, 2, rules[0]))
        result = {"inputs": {k: v for k, v in inputs.items() if k not in ("peers", "rule", "sizes")}, "rows": rows}
        result["targets"] = checks
    if args["json_out"]:
        write_json(args["json_out"], result)
        out(f"results: {args['json_out']}")
    return result


def _mb(x: float) -> str:
    return f"{x / 1e6:,.1f}"


def swarm_table(rows: list[dict[str, Any]], title: str) -> Table:
    table = Table(
        title=title,
        caption="bytes per peer per round: MB (payloads); round: announce → commit; "
        "late: holders without the whole set at the deadline",
    )
    cols = ("M", "rule", "R", "down mean", "down max", "up mean", "up max", "round s", "max s", "util")
    for col in (*cols, "counted", "lost"):
        table.add_column(col, justify="left" if col == "rule" else "right", no_wrap=True)
    for r in rows:
        table.add_row(
            str(r["M"]), r["rule"], str(r["R"]),
            f"{_mb(r['down_mean'])} ({r['down_payloads']:.2f})", f"{_mb(r['down_max'])} ({r['down_max_payloads']:.1f})",
            f"{_mb(r['up_mean'])} ({r['up_payloads']:.2f})", f"{_mb(r['up_max'])} ({r['up_max_payloads']:.1f})",
            f"{r['round_s']:.1f}", f"{r['round_max_s']:.1f}", f"{100 * r['util']:.1f}%",
            f"{r['counted']:.0f}/{r['holders']:.0f}",
            f"{r['lost']}/{r['rounds']}" + (f" ({r['timeouts']} late)" if r["timeouts"] else ""),
        )  # fmt: skip
    return table


def calib_table(rows: list[dict[str, Any]]) -> Table:
    table = Table(title="peer bench swarm --calibrate: real loopback all-to-all vs the simulator (tiny, stage 0)")
    for col in ("M", "bytes real", "bytes sim", "round real s", "round sim s", "error", "load"):
        table.add_column(col, justify="right", no_wrap=True)
    for r in rows:
        table.add_row(
            str(r["M"]), f"{r['real_bytes']:,.0f}", f"{r['sim_bytes']:,.0f}", f"{r['real_round_s']:.3f}",
            f"{r['sim_round_s']:.3f}", f"{100 * r['round_error']:+.0f}%", f"{r['load_avg']:.1f}",
        )  # fmt: skip
    return table


def sybil_command(show: Callable[[Any], None], args: dict[str, Any], write_json: Callable[[Path, dict], None]) -> None:
    """`peer bench sybil`: measure the round's rows and show them (and write them, with --json)."""
    strategies = [s.strip() for s in args["strategies"].split(",") if s.strip()]
    for s in [*strategies, args["loss_strategy"]]:
        if s not in COLLUSIONS:
            raise ConfigError(f"--strategies: unknown {s!r}; choose from {', '.join(COLLUSIONS)}")
    cfg = bench_config(
        args["preset"], args["stages"], args["inner_steps"], args["batch_size"], args["seq_len"], args["seed"]
    )
    if not 0 <= args["stage"] < cfg.stages:
        raise ConfigError(f"--stage must be in 0..{cfg.stages - 1}")
    data = load_corpus(cfg.data)
    result = bench_sybil(cfg, data, args["replicas"], args["round"], args["stage"], strategies)
    show(rows_table(result))
    if args["loss_outer_steps"]:
        run = replace(cfg, train=replace(cfg.train, outer_steps=args["loss_outer_steps"]))
        counts = [0, *dict.fromkeys(colluder_counts(args["replicas"]))]
        result = replace(result, losses=losses(run, data, args["replicas"], args["loss_strategy"], counts))
        show(losses_table(result.losses))
    if args["json_out"]:
        write_json(args["json_out"], asdict(result))


def rows_table(result: SybilResult) -> Table:
    """The rows as a rich table (the CLI prints it)."""
    title = f"{result.preset}, stage {result.stage} of {result.stages}, round t={result.t}, M={result.replicas}"
    caption = "deviation ‖u − u_h‖/‖u_h‖, cosine and norm ‖u‖/‖u_h‖ of u against u_h"
    table = Table(title=title, caption=caption, box=box.SIMPLE)
    for col in ("colluders", "strategy", "screening", "deviation", "cosine", "norm", "dropped", "honest"):
        table.add_column(col, justify="left" if col in ("strategy", "screening") else "right")
    for r in result.rows:
        table.add_row(
            f"{r.colluders}/{r.replicas} ({r.fraction:.0%})",
            r.strategy,
            "on" if r.screening else "off",
            f"{r.deviation:.2f}",
            f"{r.cosine:+.2f}",
            f"{r.norm:.2f}",
            f"{r.colluders_dropped}/{r.colluders}",
            str(r.honest_dropped),
        )
    return table


def losses_table(rows: Sequence[LossRow]) -> Table:
    """The loss runs as a rich table (the CLI prints it); Δ % against the K = 0 row."""
    honest = next((r.val_loss for r in rows if r.colluders == 0), math.nan)
    table = Table(title="held-out loss, colluders in every round of every stage", box=box.SIMPLE)
    for col in ("colluders", "strategy", "val loss", "Δ %", "dropped"):
        table.add_column(col, justify="left" if col == "strategy" else "right")
    for r in rows:
        dropped = f"{r.colluders_dropped}/{r.colluders * r.rounds}"
        delta = f"{100 * (r.val_loss / honest - 1):+.2f}"
        table.add_row(str(r.colluders), r.strategy, f"{r.val_loss:.4f}", delta, dropped)
    return table

"""`peer bench …`: the benchmarks that measure the design's budgets, as a typer sub-app of `peer`.

Each command gets its flags as one dataclass (`peer.cli.bench_args`) and hands them to the module that measures
(`peer.research.bench.common`, `pipeline`, `chaos`, `utilisation`, `commit`, `caps`, `data`, `sybil`, `fetch`,
`simulate`, …), which returns its result and prints nothing; the command shows it (`peer.cli.render`,
`peer.cli.bench_render`, `peer.cli.plots`) on the terminal and, with `--json`, writes it to a file.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from peer.cli import options as o
from peer.cli.bench_args import (
    CapsArgs,
    ChaosArgs,
    CodecArgs,
    CommitArgs,
    DashboardBenchArgs,
    DataArgs,
    FetchArgs,
    MemoryArgs,
    PayloadArgs,
    PipelineArgs,
    ReplicaArgs,
    SimulateSpeedArgs,
    SwarmArgs,
    SybilArgs,
    UtilisationArgs,
)
from peer.core.files import atomic_write_bytes
from peer.errors import ConfigError

bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that measure the design's budgets.")
console = Console()

RUNS = Path("runs")  # where a benchmark writes when no flag names a path


def _setup_logging(verbose: bool) -> None:
    level = os.environ.get("PEER_LOG_LEVEL", "DEBUG" if verbose else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _show(x: Any) -> None:
    """One line or rich renderable of a benchmark's output, as the benchmarks have always printed it."""
    console.print(x, soft_wrap=True, highlight=False)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    atomic_write_bytes(Path(path), (json.dumps(data, indent=2, sort_keys=False) + "\n").encode())


@o.command(bench_app, "payload")
def bench_payload_cmd(a: PayloadArgs) -> None:
    """Serialized SparseLoCo payload bytes per parameter on a real model's pseudo-gradient."""
    from peer.cli.render import metric_table
    from peer.research.bench.common import bench_payload

    with console.status(f"building a ~{a.params:.3g}-parameter model and measuring its payload…"):
        if a.repeats < 1:
            raise ConfigError("--repeats must be 1 or more")
        src = str(a.templar_src) if a.templar_src is not None else None
        result = bench_payload(int(a.params), seed=a.seed, repeats=a.repeats, templar_src=src)
    console.print(metric_table("SparseLoCo payload", result))
    if a.json_out:
        _write_json(a.json_out, result)


@o.command(bench_app, "pipeline")
def bench_pipeline_cmd(a: PipelineArgs) -> None:
    """Measured pipeline throughput: stage processes on their own cores, shaped links, old vs new schedule."""
    from peer.cli.bench_render import pipeline_summary, pipeline_table
    from peer.cli.plots import plot_pipeline
    from peer.research.bench.pipeline import run_from_flags

    args = dataclasses.asdict(a)
    json_out = args.pop("json_out")
    result = run_from_flags(_show, **args)
    _show(pipeline_table(result))
    for line in pipeline_summary(result):
        _show(line)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
        _show(f"results: {json_out}; plot: {plot_pipeline(result, json_out.with_suffix('.png'))}")


@o.command(bench_app, "chaos")
def bench_chaos_cmd(a: ChaosArgs) -> None:
    """Random kill -9 / SIGTERM / SIGSTOP churn on a loopback swarm: recovery, stalls, disagreements, orphans."""
    _setup_logging(a.verbose)
    from peer.cli.render import metric_table
    from peer.research.bench.chaos import config_from_flags, run_chaos

    cfg = config_from_flags(dataclasses.asdict(a), RUNS)
    schedule = "sequential" if cfg.in_flight == 1 else f"in flight {cfg.in_flight or 'auto'}"
    _show(
        f"peer bench chaos: {cfg.faults} faults ({cfg.long_stops} long freezes); {cfg.microbatches} micro-batches, "
        f"{schedule}; logs in {cfg.workdir}"
    )
    result = run_chaos(cfg, _show)
    _show(metric_table("chaos", result.summary))
    if a.json_out:
        _write_json(a.json_out, {"summary": result.summary, "faults": result.faults})


@o.command(bench_app, "utilisation")
def bench_utilisation_cmd(a: UtilisationArgs) -> None:
    """Compute fraction of two full replicas on shaped links: synchronous against overlapped rounds (train.overlap)."""
    _setup_logging(False)
    from peer.cli.bench_render import utilisation_lines, utilisation_table
    from peer.research.bench.utilisation import config_from_flags, run_utilisation

    cfg = config_from_flags(dataclasses.asdict(a), RUNS)
    result = run_utilisation(cfg, _show)
    _show(utilisation_table(result))
    for line in utilisation_lines(result):
        _show(line)
    if a.json_out:
        _write_json(a.json_out, result)


@o.command(bench_app, "commit")
def bench_commit_cmd(a: CommitArgs) -> None:
    """Cost of committing one round at a preset's stage 0, by device and thread count: the portable commit
    against the one before it."""
    from peer.cli.bench_render import commit_table
    from peer.cli.render import metric_table
    from peer.research.bench.commit import bench_commit, check_flags

    threads, devices = check_flags(a.replicas, a.repeats, a.stages, a.threads, a.device)
    _show(f"peer bench commit: stage 0 of {a.preset} split in {a.stages}, {a.replicas} contributions")
    result = bench_commit(RUNS / f"commit-{a.preset}", a.preset, a.stages, 0, a.replicas, a.repeats, threads, devices)
    _show(metric_table("commit", {k: v for k, v in result.items() if not k.endswith("_runs_s") and k != "runs"}))
    _show(commit_table(result))
    if a.json_out:
        _write_json(a.json_out, result)


@o.command(bench_app, "caps")
def bench_caps_cmd(a: CapsArgs) -> None:
    """Achieved rate under `peer join --max-upload-mbps/--max-download-mbps` caps (real gRPC on loopback)."""
    from peer.cli.bench_results import caps_command

    caps_command(lambda x: console.print(x, soft_wrap=True, highlight=False), a.mbps, a.window_s, a.repeats, a.json_out)


@o.command(bench_app, "replica")
def bench_replica_cmd(a: ReplicaArgs) -> None:
    """Full-replica tokens/s: 1 rank on one core against N torchrun ranks on N cores (DDP or --sharded, gloo)."""
    from peer.research.bench.replica import run_bench

    if a.ranks < 2 or a.repeats < 1 or a.steps < 1 or a.warmup < 0:
        raise ConfigError("--ranks must be 2 or more, --repeats and --steps 1 or more, --warmup 0 or more")
    if a.memory:
        _replica_memory(a)
        return
    args = [a.preset, *map(str, (a.stages, a.batch_size, a.seq_len, a.microbatches, a.warmup, a.steps))]
    if a.gather_per_step and not a.sharded:
        raise ConfigError("--gather-per-step applies to --sharded")
    args += (["--sharded"] if a.sharded else []) + (["--gather-per-step"] if a.gather_per_step else [])
    result = run_bench(a.ranks, a.repeats, args, lambda line: console.print(line, highlight=False))
    console.print(
        f"median tokens/s: 1 rank {result['median_1']:,.0f}, {a.ranks} ranks {result[f'median_{a.ranks}']:,.0f}: "
        f"{result['speedup']:.2f}x (load average {result['load_avg']:.2f})",
        highlight=False,
    )
    held = result["held_bytes"]
    console.print(
        f"parameters + AdamW per rank: 1 rank {held['1']}, {a.ranks} ranks {held[str(a.ranks)]}", highlight=False
    )
    if a.json_out:
        _write_json(a.json_out, result)


def _replica_memory(a: ReplicaArgs) -> None:
    """`peer bench replica --memory`: per-rank peaks of a sharded replica with its round on the bands."""
    from peer.core.memory import format_bytes
    from peer.research.bench.replica_memory import run_bench as memory_bench

    if a.gather_per_step:
        raise ConfigError("--memory measures the sharded replica `peer join --sharded` runs: drop --gather-per-step")
    if a.batch_size % a.microbatches:
        raise ConfigError(f"--batch-size {a.batch_size} must be a multiple of --microbatches {a.microbatches}")
    args = [a.preset, *map(str, (a.stages, a.batch_size, a.seq_len, a.microbatches))]
    r = memory_bench(a.ranks, args, lambda line: console.print(line, highlight=False))
    console.print(f"unsharded replica: peak {format_bytes(r['whole_peak'])}", highlight=False)
    for rank, (peak, bands, phases) in enumerate(zip(r["rank_peaks"], r["rank_bands"], r["rank_phases"], strict=True)):
        share = peak / r["whole_peak"]
        where = ", ".join(f"{name} {format_bytes(v)}" for name, v in phases.items())
        console.print(
            f"sharded rank {rank}/{a.ranks}: peak {format_bytes(peak)} ({share:.1%} of the unsharded; "
            f"target ≤ {r['target_share']:.1%}), θ_start + error rows {format_bytes(bands)}; peak by phase: {where}",
            highlight=False,
        )
    if a.json_out:
        _write_json(a.json_out, r)


@o.command(bench_app, "memory")
def bench_memory_cmd(a: MemoryArgs) -> None:
    """The memory estimate against the measured peak for tiny and small stages on the CPU."""
    from peer.core.memory import format_bytes
    from peer.research.bench.memory import bench_memory, default_cases

    rows = bench_memory(list(default_cases()), rss=a.rss)
    for r in rows:
        extra = f"  rss {format_bytes(r['rss'])}" if a.rss else ""
        est, measured = format_bytes(r["estimate"]), format_bytes(r["measured"])
        console.print(f"{r['case']:<32} estimate {est:>9}  measured {measured:>9}  {r['error']:+.1%}{extra}")
    if a.json_out:
        _write_json(a.json_out, {"rows": rows})


@o.command(bench_app, "data")
def bench_data_cmd(a: DataArgs) -> None:
    """The loader: batch tokens/s on one core, a head's RSS on a small and a huge corpus, data's share of a step."""
    from peer.cli.bench_results import data_command

    data_command(lambda x: console.print(x, soft_wrap=True, highlight=False), dataclasses.asdict(a), _write_json)


@o.command(bench_app, "swarm")
def bench_swarm_cmd(a: SwarmArgs) -> None:
    """Simulated rounds of M peers on home/datacenter links: today's all-to-all vs range-sharded rounds."""
    from peer.cli.bench_results import swarm_command

    swarm_command(lambda x: console.print(x, soft_wrap=True, highlight=False), dataclasses.asdict(a), _write_json)


@o.command(bench_app, "sybil")
def bench_sybil_cmd(a: SybilArgs) -> None:
    """K colluders (10/33/50 % of M) against the median clip and screening: how far the committed update moves."""
    from peer.cli.bench_results import sybil_command

    args = dataclasses.asdict(a)
    args["round"] = args.pop("round_t")
    sybil_command(lambda x: console.print(x, soft_wrap=True, highlight=False), args, _write_json)


@o.command(bench_app, "codec")
def bench_codec_cmd(a: CodecArgs) -> None:
    """The codec's round trip against templar's, RUNS times on one real Δ: one JSON line per run, then per baseline."""
    from peer.research.bench.common import codec_runs

    src = str(a.templar_src) if a.templar_src is not None else None
    for line in codec_runs(int(a.params), a.runs, src):
        typer.echo(json.dumps(line))


@o.command(bench_app, "fetch")
def bench_fetch_cmd(a: FetchArgs) -> None:
    """Dataset fetch throughput between two processes on loopback: uncapped, capped, resumed after a kill."""
    _setup_logging(False)
    from peer.research.bench.fetch import bench_fetch

    result = bench_fetch(a.tokens, a.shard_tokens, a.max_download_mbps, a.workdir)
    typer.echo(json.dumps(result, indent=1))
    if a.json_out:
        _write_json(a.json_out, result)


@o.command(bench_app, "simulate")
def bench_simulate_cmd(a: SimulateSpeedArgs) -> None:
    """`peer simulate`'s speed: the same sweep on the old path and the new one, bit for bit (exit 1 if not)."""
    from peer.cli.bench_render import simulate_speed_lines
    from peer.research.bench.simulate import bench

    out = bench(a.outer_steps, a.inner_steps, a.replicas, a.workers, a.repeats)
    typer.echo("\n".join(simulate_speed_lines(out)))
    if a.json_out:
        _write_json(a.json_out, out)
    if not out["bit_identical"]:
        raise typer.Exit(1)


@o.command(bench_app, "dashboard")
def bench_dashboard_cmd(a: DashboardBenchArgs) -> None:
    """The dashboard's first paint in headless Chromium with many holders, and its memory after many rounds."""
    from peer.cli.bench_render import dashboard_lines
    from peer.research.bench.dashboard import first_paint, memory

    if min(a.holders, a.stages, a.replicas, a.polls, a.repeats) < 1 or a.rounds < 0:
        raise ConfigError(
            "--holders, --stages, --replicas, --polls and --repeats must be 1 or more, --rounds 0 or more"
        )
    a.workdir.mkdir(parents=True, exist_ok=True)
    for old in a.workdir.glob("*.sqlite*"):  # each measurement starts from an empty history
        old.unlink()
    out: dict[str, Any] = {}
    if a.rounds:  # first, so the RSS it samples is not the first paint's leftovers
        out["memory"] = memory(a.workdir, a.rounds, a.memory_holders, a.stages, a.replicas)
    out["first_paint"] = first_paint(a.workdir, a.holders, a.stages, a.replicas, a.polls, a.repeats)
    for line in dashboard_lines(out):
        _show(line)
    if a.json_out:
        _write_json(a.json_out, out)

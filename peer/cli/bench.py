"""`peer bench …`: the benchmarks that measure the design's budgets, as a typer sub-app of `peer`.

Each command parses its flags (`peer.cli.flags`) and hands them to the module that measures
(`peer.research.bench.common`, `pipeline`, `chaos`, `commit`, `caps`, `data`, `sybil`, `fetch`, `simulate`, …),
which returns its result and prints nothing; the command shows it (`peer.cli.render`, `peer.cli.bench_render`,
`peer.cli.plots`) on the terminal and, with `--json`, writes it to a file.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console

from peer.cli import flags
from peer.cli import flags_plan as plan_flags
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


@bench_app.command("payload")
def bench_payload_cmd(
    params: flags.BenchParams = 178e6,
    seed: flags.BenchSeed = 0,
    repeats: flags.BenchRepeats = 3,
    json_out: flags.BenchJson = None,
    templar_src: flags.BenchTemplarSrc = None,
) -> None:
    """Serialized SparseLoCo payload bytes per parameter on a real model's pseudo-gradient."""
    from peer.cli.render import metric_table
    from peer.research.bench.common import bench_payload

    with console.status(f"building a ~{params:.3g}-parameter model and measuring its payload…"):
        if repeats < 1:
            raise ConfigError("--repeats must be 1 or more")
        src = str(templar_src) if templar_src is not None else None
        result = bench_payload(int(params), seed=seed, repeats=repeats, templar_src=src)
    console.print(metric_table("SparseLoCo payload", result))
    if json_out:
        _write_json(json_out, result)


@bench_app.command("pipeline")
def bench_pipeline_cmd(
    stages: flags.PipeStages = 2,
    preset: flags.PipePreset = "small",
    split: flags.PipeSplit = "cost",
    seq_len: flags.PipeSeqLen = 128,
    batch_size: flags.PipeBatch = 16,
    microbatches: plan_flags.Microbatches = 8,
    k_ratios: flags.PipeKRatios = "1/8,1",
    rate: flags.PipeRate = "",
    rtt_ms: flags.PipeRtt = "",
    in_flight: flags.PipeInFlight = "1,0",
    wire_dtype: plan_flags.PlanWireDtype = "bf16",
    steps: flags.PipeSteps = 3,
    repeats: flags.PipeRepeats = 1,
    no_netns: flags.PipeNoNetns = False,
    json_out: flags.PipeJson = None,
) -> None:
    """Measured pipeline throughput: stage processes on their own cores, shaped links, old vs new schedule."""
    args = {k: v for k, v in locals().items() if k != "json_out"}
    from peer.cli.bench_render import pipeline_summary, pipeline_table
    from peer.cli.plots import plot_pipeline
    from peer.research.bench.pipeline import run_from_flags

    result = run_from_flags(_show, **args)
    _show(pipeline_table(result))
    for line in pipeline_summary(result):
        _show(line)
    if json_out:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2) + "\n")
        _show(f"results: {json_out}; plot: {plot_pipeline(result, json_out.with_suffix('.png'))}")


@bench_app.command("chaos")
def bench_chaos_cmd(
    faults: flags.ChaosFaults = 20,
    seed: flags.ChaosSeed = 0,
    round_timeout_s: flags.ChaosRoundTimeout = 20.0,
    inner_steps: flags.ChaosInnerSteps = 5,
    microbatches: flags.ChaosMicrobatches = 4,
    in_flight: flags.ChaosInFlight = 0,
    long_stops: flags.ChaosLongStops = 2,
    workdir: flags.ChaosWorkdir = None,
    json_out: flags.ChaosJson = None,
    verbose: flags.Verbose = False,
) -> None:
    """Random kill -9 / SIGTERM / SIGSTOP churn on a loopback swarm: recovery, stalls, disagreements, orphans."""
    args = dict(locals())
    _setup_logging(verbose)
    from peer.cli.render import metric_table
    from peer.research.bench.chaos import config_from_flags, run_chaos

    cfg = config_from_flags(args, RUNS)
    schedule = "sequential" if cfg.in_flight == 1 else f"in flight {cfg.in_flight or 'auto'}"
    _show(
        f"peer bench chaos: {cfg.faults} faults ({cfg.long_stops} long freezes); {cfg.microbatches} micro-batches, "
        f"{schedule}; logs in {cfg.workdir}"
    )
    result = run_chaos(cfg, _show)
    _show(metric_table("chaos", result.summary))
    if json_out:
        _write_json(json_out, {"summary": result.summary, "faults": result.faults})


@bench_app.command("commit")
def bench_commit_cmd(
    preset: flags.CommitPreset = "178M",
    stages: flags.CommitStages = 2,
    replicas: flags.CommitReplicas = 4,
    repeats: flags.CommitRepeats = 3,
    json_out: flags.BenchJson = None,
) -> None:
    """Cost of committing one round at a preset's stage 0: the portable commit against the one before it."""
    from peer.cli.render import metric_table
    from peer.research.bench.commit import bench_commit, check_flags

    check_flags(replicas, repeats, stages)
    _show(f"peer bench commit: stage 0 of {preset} split in {stages}, {replicas} contributions")
    result = bench_commit(RUNS / f"commit-{preset}", preset, stages, 0, replicas, repeats)
    _show(metric_table("commit", {k: v for k, v in result.items() if not k.endswith("_runs_s")}))
    if json_out:
        _write_json(json_out, result)


@bench_app.command("caps")
def bench_caps_cmd(
    mbps: flags.CapsMbps = 20.0,
    window_s: flags.CapsWindow = 10.0,
    repeats: flags.CapsRepeats = 1,
    json_out: flags.BenchJson = None,
) -> None:
    """Achieved rate under `peer join --max-upload-mbps/--max-download-mbps` caps (real gRPC on loopback)."""
    from peer.research.bench.caps import command

    command(lambda x: console.print(x, soft_wrap=True, highlight=False), mbps, window_s, repeats, json_out)


@bench_app.command("replica")
def bench_replica_cmd(
    ranks: flags.ReplicaRanks = 2,
    preset: flags.PipePreset = "small",
    stages: flags.ReplicaStages = 2,
    batch_size: flags.PipeBatch = 8,
    seq_len: flags.PipeSeqLen = 128,
    microbatches: plan_flags.Microbatches = 2,
    warmup: flags.ReplicaWarmup = 2,
    steps: flags.ReplicaSteps = 6,
    repeats: flags.ReplicaRepeats = 3,
    json_out: flags.BenchJson = None,
) -> None:
    """Full-replica tokens/s: 1 rank on one core against N torchrun ranks on N cores (DDP, gloo)."""
    from peer.research.bench.replica import run_bench

    if ranks < 2 or repeats < 1 or steps < 1 or warmup < 0:
        raise ConfigError("--ranks must be 2 or more, --repeats and --steps 1 or more, --warmup 0 or more")
    args = [preset, *map(str, (stages, batch_size, seq_len, microbatches, warmup, steps))]
    result = run_bench(ranks, repeats, args, lambda line: console.print(line, highlight=False))
    console.print(
        f"median tokens/s: 1 rank {result['median_1']:,.0f}, {ranks} ranks {result[f'median_{ranks}']:,.0f}: "
        f"{result['speedup']:.2f}x (load average {result['load_avg']:.2f})",
        highlight=False,
    )
    if json_out:
        _write_json(json_out, result)


@bench_app.command("memory")
def bench_memory_cmd(
    rss: Annotated[bool, typer.Option("--rss", help="Also peak RSS per case (a fresh process each).")] = False,
    json_out: flags.BenchJson = None,
) -> None:
    """The memory estimate against the measured peak for tiny and small stages on the CPU."""
    from peer.core.memory import format_bytes
    from peer.research.bench.memory import bench_memory, default_cases

    rows = bench_memory(list(default_cases()), rss=rss)
    for r in rows:
        extra = f"  rss {format_bytes(r['rss'])}" if rss else ""
        est, measured = format_bytes(r["estimate"]), format_bytes(r["measured"])
        console.print(f"{r['case']:<32} estimate {est:>9}  measured {measured:>9}  {r['error']:+.1%}{extra}")
    if json_out:
        _write_json(json_out, {"rows": rows})


@bench_app.command("data")
def bench_data_cmd(
    sizes: flags.DataSizes = "10M,1B",
    batches: flags.DataBatches = 2000,
    batch_size: flags.PipeBatch = 8,
    seq_len: flags.PipeSeqLen = 128,
    n_shards: flags.DataShards = 4,
    steps: flags.DataSteps = 3,
    workdir: flags.DataWorkdir = None,
    keep: flags.DataKeep = False,
    json_out: flags.BenchJson = None,
) -> None:
    """The loader: batch tokens/s on one core, a head's RSS on a small and a huge corpus, data's share of a step."""
    from peer.research.bench.data import command

    command(lambda x: console.print(x, soft_wrap=True, highlight=False), dict(locals()), _write_json)


def _opt(help_text: str, *names: str) -> Any:
    return typer.Option(*names, help=help_text)


@bench_app.command("swarm")
def bench_swarm_cmd(
    peers: Annotated[
        str, _opt("Swarm sizes M to simulate, comma-separated.", "--peers")
    ] = "8,16,32,64,128,256,512,1000",
    rules: Annotated[str, _opt("Round rules to compare: all (today) and/or ranges.", "--rules")] = "all,ranges",
    rounds: Annotated[int, _opt("Outer rounds simulated per M and rule.", "--rounds")] = 2,
    seed: Annotated[int, _opt("Seed of every draw (links, compute jitter, churn).", "--seed")] = 0,
    preset: Annotated[str, _opt("Model preset (shapes for payload and compute).", "--preset")] = "1B",
    stages: Annotated[int, _opt("Pipeline stages of the model.", "--stages")] = 4,
    stage: Annotated[int, _opt("The stage whose round is simulated.", "--stage")] = 0,
    inner_steps: Annotated[int, _opt("H: inner steps per outer round.", "--inner-steps")] = 50,
    flops: Annotated[float, _opt("One device's sustained FLOP/s (the planner's).", "--flops")] = 400e12,
    home_up_mbps: Annotated[float, _opt("Home link upload, Mbit/s.", "--home-up-mbps")] = 20.0,
    home_down_mbps: Annotated[float, _opt("Home link download, Mbit/s.", "--home-down-mbps")] = 100.0,
    home_rtt_ms: Annotated[str, _opt("Home RTT range MIN,MAX in ms (uniform).", "--home-rtt-ms")] = "20,200",
    dc_fraction: Annotated[float, _opt("Share of datacenter peers, 0..1.", "--dc-fraction")] = 0.0,
    dc_up_mbps: Annotated[float, _opt("Datacenter upload, Mbit/s.", "--dc-up-mbps")] = 1000.0,
    dc_down_mbps: Annotated[float, _opt("Datacenter download, Mbit/s.", "--dc-down-mbps")] = 1000.0,
    dc_rtt_ms: Annotated[str, _opt("Datacenter RTT range MIN,MAX in ms.", "--dc-rtt-ms")] = "5,50",
    rate_spread: Annotated[
        float, _opt("σ of a log-normal factor on each peer's rates (0: none).", "--rate-spread")
    ] = 0.0,
    rpc_ms: Annotated[float, _opt("Server CPU per request, ms.", "--rpc-ms")] = 1.0,
    churn_per_h: Annotated[float, _opt("Leaves (and joins) per peer per hour.", "--churn-per-h")] = 0.5,
    deadline_s: Annotated[float, _opt("A round's deadline, s (swarm.round_timeout_s).", "--deadline-s")] = 120.0,
    fetch_parallel: Annotated[int, _opt("Requests in flight per peer (ranges).", "--fetch-parallel")] = 16,
    range_backups: Annotated[int, _opt("Owners per range beyond the primary.", "--range-backups")] = 1,
    shard_topk: Annotated[int, _opt("Entries per tile a shard keeps (0: sparseloco.topk).", "--shard-topk")] = 0,
    calibrate: Annotated[bool, _opt("Instead: a real loopback all-to-all vs the simulator.", "--calibrate")] = False,
    calibrate_peers: Annotated[str, _opt("Replicas of the loopback swarms.", "--calibrate-peers")] = "4,8",
    calibrate_rounds: Annotated[int, _opt("Rounds of each loopback swarm.", "--calibrate-rounds")] = 5,
    json_out: flags.BenchJson = None,
) -> None:
    """Simulated rounds of M peers on home/datacenter links: today's all-to-all vs range-sharded rounds."""
    from peer.research.bench.swarm import command

    command(lambda x: console.print(x, soft_wrap=True, highlight=False), dict(locals()), _write_json)


@bench_app.command("sybil")
def bench_sybil_cmd(
    replicas: Annotated[int, _opt("M: contributors of the round measured.", "--replicas")] = 10,
    strategies: Annotated[
        str, _opt("Colluders' strategies: aligned, reversed, orthogonal, threshold (comma-separated).", "--strategies")
    ] = "aligned,reversed,orthogonal,threshold",
    preset: Annotated[str, _opt("Model preset of the honest run.", "--preset")] = "tiny",
    stages: Annotated[int, _opt("Pipeline stages of the model.", "--stages")] = 2,
    stage: Annotated[int, _opt("The stage whose round is measured.", "--stage")] = 0,
    round_t: Annotated[int, _opt("Outer step of the round measured (rounds before it run honestly).", "--round")] = 3,
    inner_steps: Annotated[int, _opt("H: inner steps per outer round.", "--inner-steps")] = 5,
    batch_size: flags.PipeBatch = 4,
    seq_len: flags.PipeSeqLen = 32,
    seed: Annotated[int, _opt("Seed of the run and of the colluders' target direction.", "--seed")] = 0,
    loss_outer_steps: Annotated[
        int, _opt("Also simulate runs this long with K colluders in every round (0: no).", "--loss-outer-steps")
    ] = 0,
    loss_strategy: Annotated[str, _opt("The colluders' strategy in those runs.", "--loss-strategy")] = "threshold",
    json_out: flags.BenchJson = None,
) -> None:
    """K colluders (10/33/50 % of M) against the median clip and screening: how far the committed update moves."""
    from peer.research.bench.sybil import command

    args = dict(locals())
    args["round"] = args.pop("round_t")
    command(lambda x: console.print(x, soft_wrap=True, highlight=False), args, _write_json)


@bench_app.command("codec")
def bench_codec_cmd(
    params: flags.BenchParams = 178e6,
    runs: Annotated[int, _opt("Runs of the codec figures, each the median of 3 repetitions.", "--runs")] = 5,
    templar_src: flags.BenchTemplarSrc = None,
) -> None:
    """The codec's round trip against templar's, RUNS times on one real Δ: one JSON line per run, then per baseline."""
    from peer.research.bench.common import codec_runs

    src = str(templar_src) if templar_src is not None else None
    for line in codec_runs(int(params), runs, src):
        typer.echo(json.dumps(line))


@bench_app.command("fetch")
def bench_fetch_cmd(
    tokens: Annotated[int, _opt("Token ids in the synthetic dataset served.", "--tokens")] = 100_000_000,
    shard_tokens: Annotated[int, _opt("Token ids per shard.", "--shard-tokens")] = 1 << 24,
    max_download_mbps: Annotated[
        float, _opt("The capped fetch's download cap, Mbit/s.", "--max-download-mbps")
    ] = 400.0,
    workdir: Annotated[
        Path | None, _opt("Where the dataset and the fetches go (default: a temporary folder).", "--workdir")
    ] = None,
    json_out: flags.BenchJson = None,
) -> None:
    """Dataset fetch throughput between two processes on loopback: uncapped, capped, resumed after a kill."""
    _setup_logging(False)
    from peer.research.bench.fetch import bench_fetch

    result = bench_fetch(tokens, shard_tokens, max_download_mbps, workdir)
    typer.echo(json.dumps(result, indent=1))
    if json_out:
        _write_json(json_out, result)


@bench_app.command("simulate")
def bench_simulate_cmd(
    outer_steps: Annotated[int, _opt("T: outer steps of every run.", "--outer-steps")] = 4,
    inner_steps: Annotated[int, _opt("H: inner steps per outer step.", "--inner-steps")] = 10,
    replicas: Annotated[int, _opt("M: replicas of every run.", "--replicas")] = 4,
    workers: Annotated[
        int | None, _opt("Worker processes of the new path (default: all cores, at most M).", "--workers")
    ] = None,
    repeats: Annotated[int, _opt("Runs of the old and the new path, interleaved.", "--repeats")] = 2,
    json_out: flags.BenchJson = None,
) -> None:
    """`peer simulate`'s speed: the same sweep on the old path and the new one, bit for bit (exit 1 if not)."""
    from peer.cli.bench_render import simulate_speed_lines
    from peer.research.bench.simulate import bench

    out = bench(outer_steps, inner_steps, replicas, workers, repeats)
    typer.echo("\n".join(simulate_speed_lines(out)))
    if json_out:
        _write_json(json_out, out)
    if not out["bit_identical"]:
        raise typer.Exit(1)

"""`peer` command line: parse flags, build the config, call one function, show the result.

The only module that prints. Every `PeerError` becomes a one-line `error: …` and exit code 2.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from peer.errors import PeerError

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Peer-to-peer pre-training of LLMs.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks that measure the design's budgets.")
app.add_typer(bench_app, name="bench")
console = Console()
err_console = Console(stderr=True)

CONFIG_OPT = typer.Option(None, "--config", help="TOML run config (defaults < TOML < PEER_* env < flags).")


def _setup_logging(verbose: bool) -> None:
    level = os.environ.get("PEER_LOG_LEVEL", "DEBUG" if verbose else "WARNING")
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


def _write_json(path: Path, data: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")


@app.command()
def simulate(
    preset: str = typer.Option("tiny", help="Model preset: tiny, small, 178M, 512M, 1B."),
    replicas: int = typer.Option(4, help="M: replicas trained side by side."),
    stages: int = typer.Option(2, help="S: pipeline stages per replica."),
    k_ratio: str = typer.Option("1/8", "--k-ratio", help="Subspace width k/d of compressed boundaries, e.g. 1/8."),
    het_fraction: float = typer.Option(0.5, "--het-fraction", help="α: fraction of uncompressed replicas in het-pp-compress."),
    inner_steps: int = typer.Option(10, "--inner-steps", help="H: inner steps per outer step."),
    outer_steps: int = typer.Option(20, "--outer-steps", help="T: outer steps."),
    batch_size: int = typer.Option(8, "--batch-size", help="Sequences per inner step per replica."),
    seq_len: int = typer.Option(64, "--seq-len", help="Tokens per sequence."),
    lr: Optional[float] = typer.Option(None, help="Peak inner learning rate."),
    seed: int = typer.Option(0, help="Run seed (init, U, data order)."),
    configs: str = typer.Option("adamw,sparseloco,pp-compress,het-pp-compress", help="Comma-separated configs to run."),
    dataset: Optional[str] = typer.Option(None, help="Local path or hub name; default: the embedded corpus."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write results as JSON here."),
    plot: Optional[Path] = typer.Option(None, help="Loss-curve PNG (default: next to --json, or simulate.png)."),
    save: Optional[Path] = typer.Option(None, help="Write each config's final model checkpoint under DIR/<config>/."),
    config: Optional[Path] = CONFIG_OPT,
    verbose: bool = typer.Option(False, "--verbose", "-v"),
) -> None:
    """Run the paper's configurations (Table 2) in one process on the same data and steps."""
    _setup_logging(verbose)
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    from peer.config import build_config
    from peer.data import build_token_data
    from peer.simulate import plot_curves, simulate as run_simulation

    overrides = {
        "preset": preset, "seed": seed, "stages": stages, "subspace.k_ratio": k_ratio,
        "train.inner_steps": inner_steps, "train.outer_steps": outer_steps,
        "train.batch_size": batch_size, "train.seq_len": seq_len, "train.lr": lr, "data.dataset": dataset,
    }
    cfg = build_config(config, overrides)
    names = [c.strip() for c in configs.split(",") if c.strip()]
    with console.status("preparing data and tokenizer…"):
        data = build_token_data(cfg.data)
    total = cfg.train.inner_steps * cfg.train.outer_steps
    columns = [TextColumn("{task.description:<16}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
               TextColumn("loss {task.fields[loss]:.3f}"), TimeElapsedColumn(), TimeRemainingColumn()]
    with Progress(*columns, console=console, transient=False) as bar:
        tasks = {n: bar.add_task(n, total=total, loss=float("nan")) for n in names}

        def progress(name: str, done: int, _total: int, loss: float) -> None:
            bar.update(tasks[name], completed=done, loss=loss)

        results = run_simulation(cfg, data, replicas, names, het_fraction, progress, save)

    table = Table(title=f"peer simulate — {cfg.preset}, M={replicas}, S={cfg.stages}, H={cfg.train.inner_steps}, "
                        f"T={cfg.train.outer_steps}, k/d={cfg.subspace.k_ratio}")
    for col in ("config", "k/d", "α", "train loss", "val loss", "Δ %", "PG bytes/replica", "act bytes/replica", "wall s"):
        table.add_column(col, justify="right" if col != "config" else "left")
    for r in results:
        table.add_row(r.name, r.k_ratio or "—", "—" if r.het_fraction is None else f"{r.het_fraction:.2f}",
                      f"{r.final_loss:.4f}", f"{r.final_val_loss:.4f}", f"{r.delta_pct:+.2f}",
                      _human_bytes(r.pg_bytes), _human_bytes(r.act_bytes), f"{r.wall_s:.1f}")
    console.print(table)
    plot_path = plot or (json_out.with_suffix(".png") if json_out else Path("simulate.png"))
    plot_curves(results, plot_path, title=f"peer simulate ({cfg.preset}, M={replicas}, S={cfg.stages})")
    console.print(f"loss curves: {plot_path}")
    if json_out:
        args = {"preset": cfg.preset, "replicas": replicas, "stages": cfg.stages, "k_ratio": cfg.subspace.k_ratio,
                "het_fraction": het_fraction, "inner_steps": cfg.train.inner_steps, "outer_steps": cfg.train.outer_steps,
                "batch_size": cfg.train.batch_size, "seq_len": cfg.train.seq_len, "seed": cfg.seed, "configs": names}
        _write_json(json_out, {"configs": [r.summary() for r in results], "args": args})
        console.print(f"results: {json_out}")


def _human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} TB"


@app.command()
def plan(
    preset: str = typer.Option("70B", help="Model preset (tiny … 1B, or 70B for the paper's Fig. 2)."),
    params: Optional[float] = typer.Option(None, help="Parameter count instead of a preset (e.g. 7e9)."),
    stages: int = typer.Option(4, help="Pipeline stages."),
    k_ratio: str = typer.Option("1/8", "--k-ratio", help="k/d of compressed boundaries."),
    inner_steps: int = typer.Option(50, "--inner-steps", help="H: inner steps per outer step."),
    microbatch_size: int = typer.Option(1, "--microbatch-size", help="Sequences per micro-batch."),
    microbatches: int = typer.Option(8, help="Micro-batches per inner step."),
    seq_len: int = typer.Option(2048, "--seq-len", help="Tokens per sequence."),
    flops: float = typer.Option(400e12, help="Sustained accelerator FLOP/s per stage (e.g. 4e14)."),
    bandwidth_mbps: str = typer.Option("10,30,100,300,1000", "--bandwidth-mbps", help="Inter-stage bandwidths in Mbit/s."),
    replicas: int = typer.Option(8, help="Holders of each stage in the pseudo-gradient round."),
    wire_dtype: str = typer.Option("bf16", "--wire-dtype", help="Boundary dtype on the wire: fp32, bf16, fp16."),
    png: Optional[Path] = typer.Option(Path("plan.png"), "--png", help="Utilisation plot."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the table as JSON."),
) -> None:
    """Will my link keep up? Compute utilisation of compressed vs uncompressed pipelines (paper Fig. 2/3)."""
    from peer.plan import PlanInputs, plan_rows, plot_plan

    bws = [float(b) for b in bandwidth_mbps.split(",") if b.strip()]
    inputs = PlanInputs(preset=preset, params=params, stages=stages, k_ratio=k_ratio, inner_steps=inner_steps,
                        microbatch_size=microbatch_size, microbatches=microbatches, seq_len=seq_len, flops=flops,
                        replicas=replicas, wire_dtype=wire_dtype)
    rows = plan_rows(inputs, bws)
    table = Table(title=f"peer plan — {rows[0]['model']}, {stages} stages, H={inner_steps}, k/d={k_ratio}")
    for col in ("Mbit/s", "util compressed", "util uncompressed", "s/outer compressed", "s/outer uncompressed",
                "PG round s", "boundary bytes/µbatch (c / u)"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(f"{r['bandwidth_mbps']:g}", f"{100 * r['util_compressed']:.1f} %",
                      f"{100 * r['util_uncompressed']:.1f} %", f"{r['outer_s_compressed']:.1f}",
                      f"{r['outer_s_uncompressed']:.1f}", f"{r['round_s']:.1f}",
                      f"{_human_bytes(r['boundary_bytes_compressed'])} / {_human_bytes(r['boundary_bytes_uncompressed'])}")
    console.print(table)
    if png:
        plot_plan(rows, png)
        console.print(f"plot: {png}")
    if json_out:
        _write_json(json_out, {"inputs": inputs.__dict__, "rows": rows})


@bench_app.command("payload")
def bench_payload_cmd(
    params: float = typer.Option(178e6, help="Approximate model size in parameters; a real model of that size is built."),
    seed: int = typer.Option(0),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the measurement as JSON."),
) -> None:
    """Serialized SparseLoCo payload bytes per parameter on a real model's pseudo-gradient."""
    from peer.bench_payload import bench_payload

    with console.status(f"building a ~{params:.3g}-parameter model and measuring its payload…"):
        result = bench_payload(int(params), seed=seed)
    table = Table(title="SparseLoCo payload")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        table.add_row(k, f"{v:.6g}" if isinstance(v, float) else str(v))
    console.print(table)
    if json_out:
        _write_json(json_out, result)


@app.command()
def export(
    checkpoint: Path = typer.Argument(..., help="Checkpoint folder written by `peer simulate --save` or a peer."),
    out: Path = typer.Option(..., "--out", help="Output folder for the Hugging Face LlamaForCausalLM files."),
) -> None:
    """Write a checkpoint as a Hugging Face `LlamaForCausalLM` folder (config.json + safetensors + tokenizer)."""
    from peer.export import export_hf

    path = export_hf(checkpoint, out)
    console.print(f"exported to {path} — load it with transformers.LlamaForCausalLM.from_pretrained('{path}')")


def main() -> None:
    try:
        app()
    except PeerError as exc:
        err_console.print(f"[red]error:[/red] {exc}", highlight=False)
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("interrupted")
        sys.exit(130)

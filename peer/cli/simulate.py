"""`peer simulate`: the body of the command (its flags are `SimulateArgs`, `peer/cli/args.py`).

Plans the sweep from the flags (`experiments.plan_sweep`), opens (or prepares) the corpus once, runs every
configuration × seed × k/d with one progress bar per run (replicas on `--workers` processes, on `--device`,
every run's state checkpointed after each outer step under `--checkpoint-dir`; `--resume` continues there),
then prints the loss table, the summary (and poisoning) tables, writes the loss-curve PNG and, if asked,
the JSON of every run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from peer.cli.plots import plot_curves
from peer.cli.render import loss_progress_columns, simulate_table
from peer.cli.simulate_tables import bias_table, poison_tables, settings_table, summary_table
from peer.core.data.loader import load_corpus
from peer.research.simulate import experiments as ex
from peer.research.simulate import experiments_budget as eb
from peer.research.simulate import paper_settings as ps
from peer.research.simulate.ablations import bias_rows
from peer.research.simulate.checkpoint import SweepCheckpoint
from peer.research.simulate.engine import ConfigResult, SimOptions
from peer.research.simulate.links import parse_schedule
from peer.research.simulate.pool import check_workers, default_workers
from peer.research.simulate.runtime import Runtime, check_device, session


def command(
    console: Console,
    args: Mapping[str, Any],
    plot_path: Path,
    write_json: Callable[[Path, dict[str, Any]], None],
) -> None:
    """Run `peer simulate` with the CLI's flag values `args` (names as in `peer.cli.simulate`)."""
    a = dict(args)
    settings = ps.settings_names(a["setting"], a["paper_settings"])
    cfg, names, seed_list, ratio_list, opts, resolved = ex.plan_sweep(
        a["config"],
        {
            "preset": a["preset"],
            "seed": a["seed"],
            "stages": a["stages"],
            "train.inner_steps": a["inner_steps"],
            "train.outer_steps": a["outer_steps"],
            "train.batch_size": a["batch_size"],
            "train.seq_len": a["seq_len"],
            "train.lr": a["lr"],
            "sparseloco.quant_bits": a["quant_bits"],
            "sparseloco.clip_median_factor": a["clip_median"],
            "data.dataset": a["dataset"],
        },
        a["configs"],
        a["k_ratio"],
        a["seeds"],
        settings,
        a["replicas"],
        SimOptions(
            0,
            a["het_fraction"],
            a["val_tokens"],
            a["te_adaptation"],
            a["weight_projection"],
            a["adamw_lr"],
            ex.attack_list(a["attacks"]),
            round_rule=a["round_rule"],
            grassmann=a["grassmann"],  # B: Table 5c / 5d switches
            modified_adamw=a["modified_adamw"],
            overlap=a["overlap"],
            links=parse_schedule(a["links"], a["links_change"], a["link_flops"]),  # issue 39
            **({} if a["grassmann_lr"] is None else {"grassmann_lr": a["grassmann_lr"]}),
        ),
        a["token_budget"],
    )
    if resolved.table:  # what --paper-settings / --setting set, and from where
        console.print(settings_table(resolved, settings))
    budgets = None if a["extend"] is None else eb.plan_budgets(cfg, opts, resolved.budget, a["extend"], names)
    cfg = cfg if budgets is None else budgets.long
    m = opts.replicas
    runtime = _session(a, m)
    with console.status("preparing data and tokenizer…"):
        data = load_corpus(cfg.data)
    with runtime:
        results, short = _run(console, cfg, data, (names, seed_list, ratio_list), opts, budgets, a["save"])
    console.print(simulate_table([*results, *short], cfg, m))
    rows = ex.summarize(results, short)
    title = (
        ex.summary_title(cfg, m, seed_list, opts.round_rule) if budgets is None else eb.budget_title(budgets, seed_list)
    )
    console.print(summary_table(rows, title), *poison_tables(results))
    bias = bias_rows(results)  # B: eq. 5
    if bias:
        console.print(bias_table(bias, seed_list))
    for line in [*ex.mode_lines(results), *ex.dropped_mass_lines(results)]:
        console.print(line)
    plot_curves([*results, *short], plot_path, title=f"peer simulate ({cfg.preset}, M={m}, S={cfg.stages})")
    console.print(f"loss curves: {plot_path}")
    json_out = a["json_out"]
    if json_out:
        sweep = ex.sweep_args(cfg, opts, names, seed_list, ratio_list, "paper" in settings, resolved, a["extend"])
        runs = [r.summary() for r in results] if budgets is None else eb.budget_json(budgets, results, short)
        write_json(json_out, {"configs": runs, "summary": rows, "args": sweep, "bias": bias})
        console.print(f"results: {json_out}")


def _run(
    console: Console,
    cfg: Any,
    data: Any,
    sweep: tuple[list[str], list[int], list[str]],
    opts: SimOptions,
    budgets: Any,
    save: Path | None,
) -> tuple[list[ConfigResult], list[ConfigResult]]:
    """The sweep (or Table 3's budgets) with one progress bar per run: (results, the baselines at N)."""
    names, seed_list, ratio_list = sweep
    with Progress(*loss_progress_columns(), console=console, transient=False) as bar:
        tasks: dict[str, Any] = {}

        def progress(name: str, done: int, total: int, loss: float) -> None:
            if name not in tasks:
                tasks[name] = bar.add_task(name, total=total, loss=float("nan"))
            bar.update(tasks[name], completed=done, loss=loss)

        if budgets is None:
            return ex.run_sweep(cfg, data, names, seed_list, ratio_list, opts, progress, save), []
        # Table 3: the baselines at N and F·N, the subspace configs at F·N
        return eb.run_budgets(budgets, data, names, seed_list, ratio_list, opts, progress, save)


# flags that do not change a result: a resumed sweep may differ in them
NOT_COMPARED = ("workers", "resume", "checkpoint_dir", "json_out", "plot", "save", "verbose")


def _session(a: dict[str, Any], replicas: int) -> AbstractContextManager[Runtime]:
    """The run's workers, device and checkpoint (checked, and the checkpoint opened, before any data)."""
    device = a.get("device", "cpu")
    check_workers(a.get("workers"))
    check_device(device, a.get("workers"))
    workers = a.get("workers") or (1 if device != "cpu" else default_workers(replicas))
    folder = a.get("checkpoint_dir")
    compared = {k: v for k, v in a.items() if k not in NOT_COMPARED and not callable(v)}
    checkpoint = SweepCheckpoint(Path(folder), compared, bool(a.get("resume"))) if folder else None
    return session(workers, device, checkpoint)

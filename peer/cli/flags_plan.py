"""The flags of `peer plan` (names, help, types; `peer/cli/flags.py` keeps the shared ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# --- peer plan -----------------------------------------------------------------------------------

PlanPreset = Annotated[str, typer.Option(help="Model preset (tiny … 1B, or 70B for the paper's Fig. 2).")]
PlanParams = Annotated[float | None, typer.Option(help="Parameter count instead of a preset (e.g. 7e9).")]
PlanStages = Annotated[int, typer.Option(help="Pipeline stages.")]
PlanKRatio = Annotated[
    str,
    typer.Option(
        "--k-ratio", help="k/d of compressed boundaries, comma-separated (1/8,1/16,1/32,1/64): one curve each."
    ),
]
PlanInnerSteps = Annotated[int, typer.Option("--inner-steps", help="H: inner steps per outer step.")]
MicrobatchSize = Annotated[int, typer.Option("--microbatch-size", help="Sequences per micro-batch.")]
Microbatches = Annotated[int, typer.Option(help="Micro-batches per inner step.")]
PlanSeqLen = Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")]
Flops = Annotated[float, typer.Option(help="Sustained accelerator FLOP/s per stage (e.g. 4e14).")]
BandwidthMbps = Annotated[str, typer.Option("--bandwidth-mbps", help="Inter-stage bandwidths in Mbit/s.")]
PlanReplicas = Annotated[int, typer.Option(help="Holders of each stage in the pseudo-gradient round.")]
PlanWireDtype = Annotated[str, typer.Option("--wire-dtype", help="Boundary dtype on the wire: fp32, bf16, fp16.")]
PlanTokens = Annotated[
    str | None,
    typer.Option(
        "--tokens",
        help="Token budget (3e9, 3B, 1.5T): hours to train it per bandwidth and k/d (Fig. 3, "
        "a second plot <png>-wallclock.png).",
    ),
]
Png = Annotated[
    Path | None,
    typer.Option(
        "--png", help="Utilisation plot, Fig. 2 (default: next to --json, else runs/plan.png); Fig. 3 beside it."
    ),
]
PlanJson = Annotated[Path | None, typer.Option("--json", help="Write the table as JSON.")]
PlanMemory = Annotated[
    bool, typer.Option("--memory", help="Peak memory per stage for every preset and stage count instead.")
]

"""The flags of `peer simulate` (names, help, types; `peer/cli/flags.py` keeps the shared ones)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# --- peer simulate -------------------------------------------------------------------------------

Replicas = Annotated[int, typer.Option(help="M: replicas trained side by side.")]
SimStages = Annotated[int | None, typer.Option(help="S: pipeline stages per replica (default 2).")]
HetFraction = Annotated[
    float, typer.Option("--het-fraction", help="α: fraction of uncompressed replicas in het-pp-compress.")
]
SimInnerSteps = Annotated[int | None, typer.Option("--inner-steps", help="H: inner steps per outer step (default 10).")]
SimOuterSteps = Annotated[int | None, typer.Option("--outer-steps", help="T: outer steps (default 20).")]
Lr = Annotated[float | None, typer.Option(help="Peak inner learning rate.")]
Configs = Annotated[str, typer.Option(help="Comma-separated configs to run.")]
SimDataset = Annotated[str | None, typer.Option(help="Local path or hub name; default: the embedded corpus.")]
SimPlot = Annotated[Path | None, typer.Option(help="Loss-curve PNG (default: next to --json, else runs/simulate.png).")]
Save = Annotated[Path | None, typer.Option(help="Write each config's final model checkpoint under DIR/<config>/.")]
Attacks = Annotated[
    str | None,
    typer.Option(
        "--attacks",
        help="Also run each SparseLoCo config with its last replica poisoning every round (random, flip, negate; "
        "comma-separated), with median clipping alone and with outlier screening, e.g. --replicas 8 --clip-median 2.",
    ),
]

# --- peer simulate (sweeps and the paper's switches) ----------------------------------------------

SimReplicas = Annotated[int | None, typer.Option(help="M: replicas trained side by side (default 4).")]
SimKRatios = Annotated[
    str | None, typer.Option("--k-ratio", help="Subspace widths k/d, comma-separated: a sweep (default 1/8).")
]
SimSeeds = Annotated[str | None, typer.Option(help="Seeds, comma-separated, e.g. 0,1,2 (default: --seed).")]
ValTokens = Annotated[int, typer.Option(help="Held-out tokens of every evaluation.")]
SimQuantBits = Annotated[int | None, typer.Option(help="Bits per sent value: 0 (float32), 2, 4, 8 (default 2).")]
ClipMedian = Annotated[
    float | None, typer.Option(help="Clip each Δ̂ to this × the round's median norm (default 0: off).")
]
AdamwLr = Annotated[float | None, typer.Option(help="Inner learning rate of the adamw* configs (default --lr).")]
SimRound = Annotated[
    str,
    typer.Option(
        "--round", help="Each stage's round: all (all-to-all, today's) or ranges (range-sharded owners' shards)."
    ),
]
TeAdaptation = Annotated[bool, typer.Option(help="Move the embedding's change outside Col(U) into T⊥.")]
WeightProjection = Annotated[bool, typer.Option(help="Keep W_o and W_2 outputs in Col(U) (Table 5).")]
Grassmann = Annotated[
    bool,
    typer.Option(
        help="Table 5c: train U on the Grassmann manifold, one Riemannian step of the compressed replicas' mean "
        "dL/dU per outer step (simulator only: the swarm keeps a fixed U).",
    ),
]
GrassmannLr = Annotated[
    float | None, typer.Option("--grassmann-lr", help="Table 5c: step size η_U of --grassmann (default 0.5).")
]
ModifiedAdamw = Annotated[
    bool,
    typer.Option(
        help="Table 5d: compressed replicas step T_S with AdamW in subspace coordinates Z = T_S·U "
        "instead of AdamW then projection.",
    ),
]
PaperSettings = Annotated[
    bool,
    typer.Option(
        help="The paper's Table 9 / §3 settings for the preset (= --setting paper): M=8, S=4, H=50, batch 32, "
        "context 2048 (tiny/small: their max_seq_len), lr 1e-3, AdamW lr 3e-4, warmup 500 (≤ 10 % of the run), "
        "the paper's round rule, outer steps from the token budget; printed before the run; flags still win."
    ),
]
Setting = Annotated[
    str | None,
    typer.Option(
        "--setting",
        help="Named settings, comma-separated, later wins: paper (Table 9 / §3, as --paper-settings), "
        "adamw-tuned (the AdamW baseline's tuned lr 3e-4, Table 9 *), or a TOML file of dotted keys "
        "(train.lr = 6e-4, replicas = 8, adamw_lr, token_budget); printed before the run; flags still win.",
    ),
]
TokenBudget = Annotated[
    float | None,
    typer.Option(
        "--token-budget",
        help="Tokens per run, N: outer steps = ceil(N / (M·H·batch·seq_len)) (not with --outer-steps).",
    ),
]
Extend = Annotated[
    float | None,
    typer.Option(
        "--extend",
        help="Table 3: F > 1; the baselines run at the budget N and F·N, the other configs at F·N; Δ % against "
        "the baseline at F·N and at its own budget N (N: --token-budget, a setting's, else the T outer steps').",
    ),
]

# --- peer simulate (how it runs: workers, device, checkpoint) -------------------------------------

SimWorkers = Annotated[
    int | None,
    typer.Option(
        help="Worker processes that run the replicas' inner steps (default: all cores, at most M; "
        "1: in this process). The results are the same bits for any count."
    ),
]
SimDevice = Annotated[
    str, typer.Option(help="Where the replicas train: cpu or cuda (the commit math stays on the CPU).")
]
SimResume = Annotated[
    bool,
    typer.Option(
        help="Continue the interrupted sweep in --checkpoint-dir: finished runs are not rerun, the interrupted "
        "one continues from its last outer step (the same settings are required)."
    ),
]
SimCheckpointDir = Annotated[
    Path | None,
    typer.Option(
        "--checkpoint-dir", help="Where every run's state after each outer step goes (default runs/simulate-ckpt)."
    ),
]

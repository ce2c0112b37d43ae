"""Headless matplotlib figures for the CLI's plots (`peer simulate`, `peer demo`, `peer plan`).

Every plot the CLI writes is drawn here, from the data the research and demo code returns (they never
draw). `figure` is the one place for the boilerplate every plot shares: the Agg backend (no display needed), one axes,
labels, title, grid and legend, a parent folder created on demand, the PNG written at 120 dpi and
the figure always closed (also when drawing fails), so repeated plots do not leak memory.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from peer.demo.summary import demo_curves
from peer.research.plan.figures import figure_curves

if TYPE_CHECKING:  # annotations only
    from peer.demo.summary import DemoResult
    from peer.research.simulate.results import ConfigResult

LOSS_LABEL = "loss (nats/token)"


@contextmanager
def figure(
    path: Path,
    title: str,
    xlabel: str = "inner step",
    ylabel: str = LOSS_LABEL,
    figsize: tuple[float, float] = (7, 4.5),
    legend_fontsize: float = 8,
) -> Iterator[Any]:
    """Yield a matplotlib Axes to draw on; on exit label it and save it as a PNG at `path`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    try:
        yield ax
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=legend_fontsize)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


def plot_curves(results: Sequence[ConfigResult], path: Path, title: str = "peer simulate") -> Path:
    """`peer simulate`: train (thin) and validation (markers) loss against the global inner step, one
    colour per config."""
    with figure(path, title) as ax:
        for i, r in enumerate(results):
            color = f"C{i % 10}"
            label = r.name if r.k_ratio is None else f"{r.name} {r.k_ratio}"
            label += f" s{r.seed}"
            steps, losses = zip(*r.train_curve, strict=True)
            window = max(1, len(losses) // 50)
            smooth = [
                sum(losses[max(0, j - window + 1) : j + 1]) / len(losses[max(0, j - window + 1) : j + 1])
                for j in range(len(losses))
            ]
            ax.plot(steps, smooth, color=color, alpha=0.6, linewidth=1, label=f"{label} train")
            if r.val_curve:
                vs, vl = zip(*r.val_curve, strict=True)
                ax.plot(vs, vl, "o-", color=color, markersize=3, label=f"{label} val")
    return Path(path)


def plot_demo(result: DemoResult, path: Path, inner_steps: int, title: str = "peer demo") -> Path:
    """`peer demo`: per-process train loss against the global inner step, round means and validation
    loss (the points: `peer.demo.summary.demo_curves`)."""
    curves = demo_curves(result, inner_steps)
    with figure(path, title) as ax:
        for c in curves.processes:
            xs, ys = zip(*c.points, strict=True)
            ax.plot(xs, ys, color=f"C{c.index}", alpha=0.6, linewidth=1, label=f"{c.name} train")
        if curves.round_train:
            ax.plot(
                *zip(*curves.round_train, strict=True), "s--", color="black", markersize=4, label="round mean train"
            )
        if curves.round_val:
            ax.plot(*zip(*curves.round_val, strict=True), "o-", color="crimson", markersize=4, label="round mean val")
    return Path(path)


def plot_pipeline(result: Mapping[str, Any], path: Path) -> Path:
    """`peer bench pipeline`: tokens/s per link setting, one line per (k/d, schedule), the one-device
    line for scale."""
    rows: list[dict[str, Any]] = result["rows"]
    labels = list(dict.fromkeys(r["rate"] + (f"+{r['rtt_ms']:g}ms" if r["rtt_ms"] else "") for r in rows))
    with figure(path, "peer bench pipeline (measured)", xlabel="link", ylabel="tokens/s") as ax:
        for key in dict.fromkeys((r["k_ratio"], r["schedule"]) for r in rows):
            ys = {
                r["rate"] + (f"+{r['rtt_ms']:g}ms" if r["rtt_ms"] else ""): r["tokens_per_s"]
                for r in rows
                if (r["k_ratio"], r["schedule"]) == key
            }
            xs = [i for i, lab in enumerate(labels) if lab in ys]
            ax.plot(xs, [ys[labels[i]] for i in xs], marker="o", label=f"k/d={key[0]}, {key[1]}")
        ax.axhline(result["one_device_tokens_per_s"], color="grey", linestyle="--", label="one device")
        ax.set_xticks(range(len(labels)), labels)
    return path


MARKERS = "o^vD"  # one per k/d curve of `peer plan` (they overlap where the round, not the boundary, sets the time)


def plot_utilisation(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """`peer plan`'s Fig. 2: utilisation against bandwidth (log x), one curve per k/d and the
    uncompressed pipeline."""
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
    """`peer plan`'s Fig. 3: hours to train `tokens` against bandwidth (log x, log y), one curve per
    k/d, the uncompressed pipeline and the compute-only bound."""
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

"""Headless matplotlib figures for the CLI's plots (`peer simulate`, `peer demo`, `peer plan`).

One place for the boilerplate every plot shares: the Agg backend (no display needed), one axes,
labels, title, grid and legend, a parent folder created on demand, the PNG written at 120 dpi and
the figure always closed (also when drawing fails), so repeated plots do not leak memory.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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

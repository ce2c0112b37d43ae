"""`peer data prepare SOURCE --out DIR`: a corpus into tokenized shards, with a progress bar.

Builds the `Source` from the flags, runs `peer.core.data.prepare.prepare` with a rich progress bar on
stderr (documents, tokens, tokens/s, elapsed), and prints what was made on stdout: documents and
tokens per split, shards, the two fingerprints the run's manifest will name, the time and the
rate. Ctrl-C stops it with a line saying how to continue (the same command resumes).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from peer.cli.args import PrepareArgs
from peer.core.data.prepare import SHARD_TOKENS, Source, prepare
from peer.core.data.shards import PreparedDataset, is_prepared
from peer.core.data.tokenizer import Tokenizer

__all__ = ["DEFAULT_VOCAB_SIZE", "command", "summary_lines"]

DEFAULT_VOCAB_SIZE = 1024  # the tiny preset's vocabulary (peer.core.model.decoder)


def _columns() -> list[Any]:
    """A stream has no known end: a spinner, the counts so far, the rate and the time."""
    return [
        SpinnerColumn(),
        TextColumn("{task.fields[documents]:,} documents, {task.completed:,.0f} tokens, {task.fields[rate]}"),
        TimeElapsedColumn(),
    ]


def summary_lines(ds: PreparedDataset, elapsed_s: float | None, new_tokens: int) -> list[str]:
    """What a prepared folder holds; with the time and rate of this run unless `elapsed_s` is None."""
    index = ds.index
    docs, train, val = index.documents, index.train, index.val
    lines = [
        f"documents    {sum(docs.values()):,} ({docs.get('train', 0):,} train, {docs.get('val', 0):,} val)",
        f"tokens       {index.tokens('train') + index.tokens('val'):,} ({index.tokens('train'):,} train, "
        f"{index.tokens('val'):,} val), {index.dtype}, vocabulary {index.vocab_size:,}",
        f"shards       {len(train) + len(val)} ({len(train)} train, {len(val)} val) in {ds.root}",
        f"fingerprint  {index.fingerprint}",
        f"val          {index.val_fingerprint}",
    ]
    if elapsed_s is not None:
        rate = new_tokens / elapsed_s if elapsed_s > 0 else 0.0
        lines.append(f"time         {elapsed_s:.1f} s, {rate:,.0f} tokens/s")
    return lines


def command(console: Console, err_console: Console, a: PrepareArgs) -> None:
    """Run `peer data prepare` with the parsed flags `a`."""
    source = Source(a.source, a.config, a.split, a.text_field, a.max_chars)
    tokenizer: Path | None = a.tokenizer
    vocab_size = a.vocab_size or (Tokenizer.load(tokenizer).vocab_size if tokenizer else DEFAULT_VOCAB_SIZE)
    out = Path(a.out).expanduser()
    finished_before = is_prepared(out) and not a.restart
    t0 = time.perf_counter()
    first: list[tuple[float, int]] = []  # (time, tokens) at the first progress report: a resumed run's start
    bar = Progress(*_columns(), console=err_console, transient=False)
    task = bar.add_task("prepare", total=None, documents=0, rate="… tokens/s")

    def progress(documents: int, tokens: int) -> None:
        now = time.perf_counter()
        if not first:  # the tokenizer is in place: tokenizing begins (the bar shows only from here)
            first.append((now, tokens))
            bar.start()
        t_start, tokens_start = first[0]
        rate = f"{(tokens - tokens_start) / (now - t_start):,.0f} tokens/s" if now > t_start else "… tokens/s"
        bar.update(task, completed=tokens, documents=documents, rate=rate)

    try:
        ds = prepare(
            source,
            out,
            vocab_size=vocab_size,
            tokenizer=tokenizer,
            val_fraction=a.val_fraction,
            seed=a.seed,
            shard_tokens=a.shard_tokens or SHARD_TOKENS,
            workers=a.workers,
            progress=progress,
            restart=a.restart,
        )
    except KeyboardInterrupt:
        if first:
            bar.stop()
        err_console.print(f"interrupted: run the same command again to continue where it stopped ({out})")
        raise typer.Exit(130) from None
    finally:
        if first:  # a bar that never started prints nothing (an error is then the only line)
            bar.stop()
    if finished_before:
        console.print(f"{out} is already prepared with these arguments; left as is", soft_wrap=True, highlight=False)
        lines = summary_lines(ds, None, 0)
    else:
        new_tokens = ds.index.tokens("train") + ds.index.tokens("val") - (first[0][1] if first else 0)
        console.print(f"prepared {ds.index.source}", soft_wrap=True, highlight=False)
        lines = summary_lines(ds, time.perf_counter() - t0, new_tokens)
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False)

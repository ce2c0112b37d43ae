"""`peer bench data`: the loader's budgets (issue 23) — speed, memory, and data's share of a step.

Three measurements on synthetic prepared corpora (random uint16 ids below the tiny model's
vocabulary, a valid index, written with `peer.core.data.shards.write_prepared` in chunks):

1. speed: tokens/s of `peer.core.data.loader.train_batch` on one core (torch.set_num_threads(1)) at a
   few (batch_size, seq_len) shapes, over enough steps that the permutation's chunks (computed
   `PERM_CHUNK` positions at a time) are part of the cost; the page cache is warm (the corpus was
   just written), so this is assembly, not the disk. Per second of the process's CPU time (the
   work of one core, robust to a busy machine) and of wall time. Target: ≥ 10 M tokens/s.
2. memory: for each corpus size (10 M and 1 B tokens by default), a fresh process opens the
   corpus, assembles `batches` batches of a head's claim (data shard 0 of `n_shards`) and the
   validation batches, then runs `steps` inner steps of the tiny model on them as a full replica
   does (`peer.node.replica.data_parallel.chain_step`); it reports its peak and final resident set
   (VmHWM, VmRSS), its anonymous part and the largest file-backed part seen (RssFile: shared
   libraries, and shard pages if the loader mapped them).
   Target: the peaks within 5 % of each other (resident memory does not grow with the corpus).
3. step share: the median time of one `train_batch` against one inner step of the default run
   (the tiny preset's full replica on one core) and of the small preset: data's fraction of a step.

Timings are wall-clock on whatever else the machine runs (noisy on a shared machine); RSS is not.
The corpora are deleted afterwards unless `keep`.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from peer.config import build_config
from peer.core.data.loader import open_corpus, train_batch, val_batches
from peer.core.data.shards import PreparedDataset, write_prepared
from peer.errors import ConfigError

SHAPES = ((8, 128), (32, 128), (8, 1024), (32, 1024))  # (batch_size, seq_len) timed for speed
VOCAB = 1024  # the tiny preset's vocabulary: the memory run trains the tiny model on these ids
CHUNK_TOKENS = 1 << 24  # tokens generated and written at a time
VAL_TOKENS = 1 << 20
TARGET_TOKENS_PER_S = 10e6
TARGET_RSS_SPREAD = 0.05

Show = Callable[[Any], None]


def parse_size(text: str) -> int:
    """'10M' → 10_000_000, '1B' / '1G' → 1_000_000_000, '500k', '123' (tokens)."""
    t = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "G": 10**9}.get(t[-1:], 1)
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise ConfigError(f"--sizes has {text!r}; give token counts like 10M,1B") from None
    if value < 1e5:
        raise ConfigError(f"--sizes has {text!r}: a corpus needs at least 100k tokens")
    return int(value)


def write_synthetic(root: Path, tokens: int, seed: int = 0) -> PreparedDataset:
    """A prepared corpus of `tokens` random train ids (+ VAL_TOKENS val ids), written in chunks."""

    def chunks(n: int, salt: int) -> Iterator[np.ndarray]:
        rng = np.random.default_rng([seed, salt])
        for start in range(0, n, CHUNK_TOKENS):
            yield rng.integers(0, VOCAB, min(CHUNK_TOKENS, n - start), dtype=np.uint16)

    splits = {"train": chunks(tokens, 0), "val": chunks(VAL_TOKENS, 1)}
    return write_prepared(root, splits, VOCAB, eos_id=2, source=f"synthetic:{tokens}")


def _check_disk(where: Path, sizes: list[int]) -> None:
    need = 2 * (sum(sizes) + len(sizes) * VAL_TOKENS)  # uint16
    free = shutil.disk_usage(where).free
    if need > 0.9 * free:
        raise ConfigError(
            f"the synthetic corpora need {need / 1e9:.1f} GB but {where} has {free / 1e9:.1f} GB free; "
            "pass smaller --sizes or another --workdir"
        )


# ---------------------------------------------------------------------------------------- 1. speed


def bench_speed(dataset: PreparedDataset, batches: int = 2000) -> list[dict[str, Any]]:
    """tokens/s of train_batch at each shape in SHAPES, one thread: per second of this process's
    CPU time (what one core does, whatever else the machine runs) and per second of wall time."""
    torch.set_num_threads(1)
    rows = []
    for b, L in SHAPES:
        corpus = open_corpus(dataset, seed=0)
        for s in range(20):  # maps opened, first permutation chunk computed
            train_batch(corpus, 0, 2, s, b, L)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        for s in range(20, 20 + batches):
            train_batch(corpus, 0, 2, s, b, L)
        cpu, wall = (time.process_time() - cpu0) / batches, (time.perf_counter() - wall0) / batches
        rows.append(
            {
                "batch_size": b,
                "seq_len": L,
                "us_per_batch": 1e6 * cpu,
                "tokens_per_s": b * L / cpu,
                "wall_us_per_batch": 1e6 * wall,
                "wall_tokens_per_s": b * L / wall,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------- 2. memory


def _status() -> dict[str, int]:
    """VmHWM, VmRSS, RssAnon, RssFile of this process, in bytes."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = 1024 * int(rest.split()[0])
    return out


def _inner_step(overrides: dict[str, Any]) -> Callable[[int, torch.Tensor, torch.Tensor], float]:
    """One inner step of a full replica of the run `overrides` names (every stage local, as
    `peer.node.trainer._Full` steps): h, x, y → the batch's loss."""
    from peer.node.replica.data_parallel import chain_loss, chain_step
    from peer.node.stage.worker import StageWorker

    cfg = build_config(overrides=overrides, environ={})
    chain = [StageWorker(cfg, s, compressed=False) for s in range(cfg.stages)]

    def step(h: int, x: torch.Tensor, y: torch.Tensor) -> float:
        return chain_step(chain, lambda mx, my: (chain_loss(chain, mx, my), 0), 0, h, x, y)

    return step


def rss_child(root: str, batches: int, batch_size: int, seq_len: int, n_shards: int, steps: int) -> dict[str, Any]:
    """In a fresh process: open the corpus, read a head's batches (and train `steps` inner steps)."""
    torch.set_num_threads(1)
    step = _inner_step({"train.seq_len": seq_len, "train.batch_size": batch_size}) if steps else None
    before = _status()
    corpus = open_corpus(PreparedDataset.open(root), seed=0)
    max_file = 0
    t0 = time.perf_counter()
    for s in range(batches):
        x, y = train_batch(corpus, 0, n_shards, s, batch_size, seq_len)
        if s % 50 == 0:
            max_file = max(max_file, _status()["RssFile"])
    read_s = time.perf_counter() - t0
    val_batches(corpus, batch_size, seq_len, max_batches=4)
    for h in range(steps):
        assert step is not None
        step(h, *train_batch(corpus, 0, n_shards, batches + h, batch_size, seq_len))
    after = _status()
    return {
        "tokens": corpus.dataset.index.tokens("train"),
        "sequences": corpus.sequences(seq_len),
        "hwm_bytes": after["VmHWM"],
        "rss_bytes": after["VmRSS"],
        "anon_bytes": after["RssAnon"],
        "max_file_bytes": max(max_file, after["RssFile"]),
        "hwm_before_open_bytes": before["VmHWM"],
        "read_s": read_s,
    }


def measure_rss(root: Path, batches: int, batch_size: int, seq_len: int, n_shards: int, steps: int) -> dict[str, Any]:
    code = (
        "import json, sys; from peer.research.bench.data import rss_child; "
        "print(json.dumps(rss_child(*json.loads(sys.argv[1]))))"
    )
    args = json.dumps([str(root), batches, batch_size, seq_len, n_shards, steps])
    out = subprocess.run([sys.executable, "-c", code, args], capture_output=True, text=True, env=os.environ)
    if out.returncode != 0:
        raise RuntimeError(f"the memory run on {root} failed: {out.stderr.strip().splitlines()[-1:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


# ---------------------------------------------------------------------------------------- 3. step share


STEP_RUNS = {"tiny": {}, "small": {"preset": "small", "train.seq_len": 128}}  # the default run, and small


def bench_step_share(
    dataset: PreparedDataset, presets: tuple[str, ...] = tuple(STEP_RUNS), repeats: int = 5
) -> list[dict[str, Any]]:
    """Median train_batch time against the median inner step of a full replica, one thread."""
    torch.set_num_threads(1)
    rows = []
    for preset in presets:
        overrides: dict[str, Any] = STEP_RUNS[preset]
        cfg = build_config(overrides=overrides, environ={})
        b, L = cfg.train.batch_size, cfg.train.seq_len
        corpus = open_corpus(dataset, seed=0)
        batch_s = []
        for s in range(200):
            t0 = time.perf_counter()
            x, y = train_batch(corpus, 0, 2, s, b, L)
            batch_s.append(time.perf_counter() - t0)
        step, step_s = _inner_step(overrides), []
        for h in range(repeats + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            step(h, x, y)
            step_s.append(time.perf_counter() - t0)
        batch, inner = statistics.median(batch_s[20:]), statistics.median(step_s[1:])
        rows.append({"preset": preset, "batch_size": b, "seq_len": L, "batch_s": batch, "step_s": inner})
        rows[-1]["fraction"] = batch / inner
    return rows


# ---------------------------------------------------------------------------------------- the command


def bench_data(
    sizes: list[int],
    workdir: Path | None = None,
    batches: int = 2000,
    batch_size: int = 8,
    seq_len: int = 128,
    n_shards: int = 4,
    steps: int = 3,
    keep: bool = False,
    show: Show = print,
    presets: tuple[str, ...] = tuple(STEP_RUNS),
) -> dict[str, Any]:
    """All three measurements; the corpora live under `workdir` (a fresh temporary folder by default)."""
    if batches < 1 or batch_size < 1 or seq_len < 1 or n_shards < 1 or steps < 0:
        raise ConfigError("--batches, --batch-size, --seq-len and --n-shards must be 1 or more, --steps 0 or more")
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="peer-bench-data-"))
    base.mkdir(parents=True, exist_ok=True)
    _check_disk(base, sizes)
    result: dict[str, Any] = {"sizes": sizes, "batches": batches, "batch_size": batch_size, "seq_len": seq_len}
    written = []
    try:
        memory = []
        for tokens in sorted(sizes):
            root = base / f"synthetic-{tokens}"
            written.append(root)
            t0 = time.perf_counter()
            dataset = write_synthetic(root, tokens)
            show(f"wrote {tokens:,} tokens to {root} in {time.perf_counter() - t0:.1f}s")
            if tokens == min(sizes):
                result["speed"] = bench_speed(dataset, batches)
                result["step_share"] = bench_step_share(dataset, presets)
            row = {"corpus_tokens": tokens, **measure_rss(root, batches, batch_size, seq_len, n_shards, steps)}
            memory.append(row)
        result["memory"] = memory
        peaks = [r["hwm_bytes"] for r in memory]
        result["rss_spread"] = (max(peaks) - min(peaks)) / min(peaks)
        result["min_tokens_per_s"] = min(r["tokens_per_s"] for r in result["speed"])
        result["targets_met"] = {
            "tokens_per_s": result["min_tokens_per_s"] >= TARGET_TOKENS_PER_S,
            "rss_spread": result["rss_spread"] <= TARGET_RSS_SPREAD,
        }
    finally:
        if not keep:
            for root in written:
                shutil.rmtree(root, ignore_errors=True)
            if workdir is None:
                shutil.rmtree(base, ignore_errors=True)
    return result

"""Outer steps of a `tiny` full replica over torchrun's ranks, without a swarm (run by test_sharded_replica).

`torchrun --nproc-per-node N tests/integration/replica_rounds.py MODE OUT [--microbatches M] [--rounds T]
[--save F [--save-after R]] [--resume F] [--gather-per-step] [--banded] [--banded-round]`:
MODE "sharded" (`ShardedChain`: gather → rank 0's round → scatter), "ddp" (`DataParallel`, rank 0's
state shared after each commit) or "plain" (one rank, `chain_step`); "sharded+ddp" runs both replicas,
one after the other in the same processes (one torchrun: its start-up, not the rounds, is most of a run's
time), and reports the later ones under "beside". Each rank draws its batches as a
replica's ranks do (`rank_batch_index`, synthetic tokens seeded by the batch's index); rank 0 commits
each round from its own payloads alone (`apply_round`). Rank r writes OUT-rank<r>.json: rank 0 the
committed param hash of every round and stage, every rank the bytes it holds. `--save`/`--resume`: rank 0's
stages' `state_dict()` (a checkpoint's content) after round R (default: the last) / before the first, as `--resume`
restores a replica: rank 0 loads it, the first scatter gives every rank its shards. `--banded` (sharded):
every rank also encodes each round from its bands of θ_start and the error buffer (`BandedStage`), and
rank 0 writes, per round and stage, whether that payload's bytes and the gathered error buffer are its
whole stages' own; every rank the bytes of its bands. `--banded-round` (sharded): the round runs on
the bands alone (`round_alone`: no rank holds a whole stage, nothing is gathered or scattered).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: this checkout's peer

from peer.core.sparseloco.algorithm import decompress  # noqa: E402
from peer.core.sparseloco.codec.format import Payload  # noqa: E402
from peer.core.sparseloco.commit import embedding_update  # noqa: E402
from peer.core.subspace.compression import make_basis  # noqa: E402
from peer.node.replica.bands import BandedStage, round_alone  # noqa: E402
from peer.node.replica.data_parallel import DataParallel, chain_loss, chain_step, rank_batch_index  # noqa: E402
from peer.node.replica.group import ReplicaGroup  # noqa: E402
from peer.node.replica.ranks import exit_now  # noqa: E402
from peer.node.replica.sharded import ShardedChain  # noqa: E402
from peer.node.stage.worker import StageWorker  # noqa: E402
from tests.configs import tiny_run  # noqa: E402


def batch(index: int, b: int, L: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic tokens (b, L + 1) seeded by the batch's index: inputs and next-token targets."""
    seq = torch.randint(vocab, (b, L + 1), generator=torch.Generator().manual_seed(1000 + index))
    return seq[:, :-1], seq[:, 1:]


def commit(chain: list[StageWorker], check: Callable[[list[Payload]], None] | None = None) -> dict[str, str]:
    """Rank 0's round from its own payloads alone (`check`ed first, if given); {stage: committed param hash}."""
    payloads = [w.contribute("full") for w in chain]
    if check is not None:
        check(payloads)
    embed = embedding_update([decompress(payloads[0])], chain[0].cfg.sparseloco)
    for w, p in zip(chain, payloads, strict=True):
        w.apply_round([p], None if w.stage == 0 else embed, ("full",))
    return {str(w.stage): w.param_hash() for w in chain}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", help="sharded, ddp or plain; several joined by + run one after another in one process")
    ap.add_argument("out")
    ap.add_argument("--microbatches", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--save", help="rank 0 saves its stages' state_dict() here after round --save-after")
    ap.add_argument("--save-after", type=int, default=-1, help="the round after which --save saves (default: the last)")
    ap.add_argument("--resume", help="rank 0 starts from the states saved here (then scatters them)")
    ap.add_argument("--gather-per-step", action="store_true", help="sharded: gather and reduce once per inner step")
    ap.add_argument("--banded", action="store_true", help="sharded: encode band by band too, and compare")
    ap.add_argument("--banded-round", action="store_true", help="sharded: the round on the bands alone")
    a = ap.parse_args()
    modes = a.mode.split("+")
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"mode: one or more of {', '.join(MODES)} joined by +, not {a.mode!r}")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    reports = [replica(m, a, first=i == 0) for i, m in enumerate(modes)]
    out = reports[0] | {"beside": dict(zip(modes[1:], reports[1:], strict=True))}
    Path(f"{a.out}-rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()  # no rank tears the group down while another still talks in it
    if "sharded" in modes:
        exit_now(0)  # as `peer join --sharded` exits (torch 2.13's exit after FSDP2 on gloo can abort)
    dist.destroy_process_group()


MODES = ("sharded", "ddp", "plain")


def replica(mode: str, a: argparse.Namespace, first: bool) -> dict:
    """One replica of `mode` over every rank, from the initial state (or `--resume`, the first mode only)
    through the last round: this rank's report (module docstring). `--save` too is the first mode's."""
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = tiny_run(**{"train.microbatches": a.microbatches, "train.outer_steps": a.rounds, "train.inner_steps": 2})
    train = cfg.train
    lead = rank == 0
    banded_round = mode == "sharded" and a.banded_round
    whole = mode != "sharded" or lead and not banded_round  # a sharded follower holds no whole stage
    chain = [StageWorker(cfg, s, compressed=False, precision="fp32") for s in range(cfg.stages)] if whole else []
    sharded = ShardedChain(cfg, "cpu", "fp32", a.gather_per_step) if mode == "sharded" else None
    ddp = DataParallel(chain, lambda x, y: chain_loss(chain, x, y)) if mode == "ddp" else None
    group = ReplicaGroup(rank, world, rank, connect=lambda: None)  # type: ignore[arg-type,return-value]
    if a.resume and lead and first:
        for w, st in zip(chain, torch.load(a.resume, weights_only=True), strict=True):
            w.load_state_dict(st)
    start = chain[0].outer_step if chain else 0
    if sharded is not None and not banded_round:  # banded: the shards start canonical, as rank 0 would
        start = sharded.scatter(chain if lead else None)["outer_step"]
    hashes: dict[int, dict[str, str]] = {}
    held: dict[str, int] = {}
    U = make_basis(cfg.model.d_model, cfg.k, cfg.seed)
    banding = sharded is not None and (a.banded or banded_round)
    bands = [BandedStage(m, cfg, U) for m in sharded.stages] if sharded is not None and banding else []
    same: dict[int, dict[str, list[bool]]] = {}
    for t in range(start, a.rounds):
        for h in range(train.inner_steps):
            index = rank_batch_index(t, h, train.inner_steps, world, rank)
            x, y = batch(index, train.batch_size, train.seq_len, cfg.model.vocab_size)
            if sharded is not None:
                sharded.step(t, h, x, y)
            elif ddp is not None:
                chain_step(chain, ddp.forward(), t, h, x, y)
            else:
                chain_step(chain, lambda mx, my: (chain_loss(chain, mx, my), 0), t, h, x, y)
        if sharded is not None and banded_round:
            held = sharded.held_bytes()
            committed = round_alone(bands, t)
            if committed is not None:
                hashes[t] = committed
            continue
        banded = [b.encode() for b in bands]
        errors = [b.whole_errors() for b in bands]
        if sharded is not None:
            held = sharded.held_bytes()
            sharded.gather(chain if lead else None)

        def check(payloads: list[Payload], t: int = t, banded: list = banded, errors: list = errors) -> None:
            """Rank 0's whole stages' payloads and error buffers against the bands'."""
            for w, p, b, e in zip(chain, payloads, banded, errors, strict=True):
                assert b is not None and e is not None and w.optim.errors is not None
                errs = w.optim.errors
                alike = e.keys() == errs.keys() and all(torch.equal(e[n], errs[n]) for n in e)
                same.setdefault(t, {})[str(w.stage)] = [p.to_bytes() == b.to_bytes(), alike]

        if lead:
            hashes[t] = commit(chain, check if bands else None)
        if sharded is not None:
            sharded.scatter(chain if lead else None)
        elif ddp is not None:
            for w, st in group.share_states({w.stage: w.state_dict() for w in chain} if lead else None).items():
                chain[w].load_state_dict(st)
        for b in bands:  # the committed state, scattered into the shards, is the next round's θ_start
            b.mark_start()
        if a.save and lead and first and t == (a.save_after if a.save_after >= 0 else a.rounds - 1):
            torch.save([w.state_dict() for w in chain], a.save)
    if not held:  # what a whole replica holds: its parameters and AdamW's two moments
        n = sum(p.numel() for w in chain for p in w.module.parameters())
        held = {"params": 4 * n, "grads": 0, "optimizer": 8 * n}
    out = {"hashes": hashes, "held": held, "world": world, "rss": _rss()}
    if bands:
        out |= {"banded": same, "band_bytes": sum(b.held_bytes() for b in bands)}
    ddp = None  # DDP's reducer goes before its process group (its teardown can hang)
    dist.barrier()  # the next replica starts on every rank at once
    return out


def _rss() -> int:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


if __name__ == "__main__":
    main()

"""Two gloo ranks of a bf16 full replica under DDP with the weights cast once per inner step.

Each micro-batch's backward flows through the shared cast (`peer.core.model.precision.CastWeights`) into
the float32 master parameters, so DDP's hooks on them still fire: after K micro-batches (all but
the last under `no_sync`) both ranks hold the average of what each rank's batch gives alone.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from peer.config import build_config
from peer.core.model.inner import accumulate
from peer.node.replica.data_parallel import DataParallel, chain_loss
from peer.node.stage.worker import StageWorker
from tests.unit.test_stage_checkpoint import BASE, SMALL


def _chain() -> list[StageWorker]:
    cfg = build_config(overrides={**BASE, **SMALL, "stages": 2, "train.microbatches": 2}, environ={})
    return [StageWorker(cfg, s, False, "cpu", "bf16") for s in range(cfg.stages)]


def _batch(chain: list[StageWorker], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    cfg = chain[0].cfg
    g = torch.Generator().manual_seed(500 + rank)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _grads(chain: list[StageWorker]) -> list[torch.Tensor]:
    return [p.grad.clone() for w in chain for p in w.module.parameters()]


def _rank(rank: int, store: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        chain = _chain()
        ddp = DataParallel(chain, lambda x, y: chain_loss(chain, x, y))
        accumulate(ddp.forward(), *_batch(chain, rank), ddp.n_micro)
        torch.save(_grads(chain), f"{out}/{rank}.pt")
        # both ranks are done before either tears gloo down: a rank that exits while its peer still
        # talks to it can abort in gloo's threads ("terminate called without an active exception")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_bf16_ranks_average_their_gradients_through_the_shared_cast(tmp_path):
    mp.spawn(_rank, args=(str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    alone = []
    for rank in (0, 1):
        chain = _chain()
        accumulate(lambda x, y: (chain_loss(chain, x, y), 0), *_batch(chain, rank), 2)  # noqa: B023
        alone.append(_grads(chain))
    got = [torch.load(tmp_path / f"{rank}.pt") for rank in (0, 1)]
    for g0, g1, a0, a1 in zip(*got, *alone, strict=True):
        assert torch.equal(g0, g1)  # the ranks agree: the all-reduce ran
        assert torch.allclose(g0, (a0 + a1) / 2, rtol=1e-5, atol=1e-8)  # and averaged both batches
    assert any(not torch.equal(g, a) for g, a in zip(got[0], alone[0], strict=True))

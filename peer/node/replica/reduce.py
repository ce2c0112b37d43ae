"""Gradient means over a replica's ranks in one fixed order, whatever the backend's algorithm.

A collective's sum is a float sum: gloo's and NCCL's reduce-scatter and all-reduce add the ranks'
gradients in an order of their own (ring, tree: chosen by size and topology), so the same N gradients
can average to other bits in DDP than in FSDP2, and on another machine. Here both average alike:

    mean = (((g_0 + g_1) + g_2) + … + g_{N−1}) / N        (rank order, float32, then one division)

- `peer.node.replica.sharded.RankOrderReduceScatter` (FSDP2's `set_custom_reduce_scatter`, beside the
  FSDP2 code it plugs into, so importing this module loads no FSDP2): an all-to-all sends each rank the
  chunks it owns, which it adds in rank order (`sum_in_rank_order`) — the traffic of a reduce-scatter,
  (N − 1)/N of the gradient per rank.
- `rank_order_mean` (a DDP communication hook): the same reduce-scatter on the bucket, the division,
  then an all-gather of the means — an all-reduce's traffic, 2(N − 1)/N of the bucket.

So a sharded replica (`peer.node.replica.sharded`) and a data-parallel one (`.data_parallel`) of the
same N ranks take the same inner steps bit for bit (tests/integration/test_sharded_replica.py at 2 and
4 ranks), and neither depends on the backend's reduction algorithm.
"""

# no `from __future__ import annotations`: DDP reads the hook's annotations as types

import torch
import torch.distributed as dist


def sum_in_rank_order(received: torch.Tensor, out: torch.Tensor) -> None:
    """out = received[0] + received[1] + … in that order (received: (N, n), out: (n,))."""
    out.copy_(received[0])
    for part in received[1:]:
        out.add_(part)


def rank_order_mean(group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's communication hook: the bucket's mean over the ranks in rank order (module docstring)."""
    buf = bucket.buffer()
    n = dist.get_world_size(group)
    if n == 1:
        done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        done.set_result(buf)
        return done
    per = -(-buf.numel() // n)  # each rank's chunk; the bucket padded to N of them
    padded = torch.zeros(n * per, dtype=buf.dtype, device=buf.device)
    padded[: buf.numel()] = buf
    received = torch.empty((n, per), dtype=buf.dtype, device=buf.device)
    dist.all_to_all_single(received.view(-1), padded, group=group)
    mine = torch.empty(per, dtype=buf.dtype, device=buf.device)
    sum_in_rank_order(received, mine)
    mine.div_(n)
    dist.all_gather_into_tensor(padded, mine, group=group)
    buf.copy_(padded[: buf.numel()])
    done = torch.futures.Future()
    done.set_result(buf)
    return done

"""Backward in two passes: the input gradient first, the weight gradients after it.

A pipeline stage's input gradient is what the stage before it waits for; its weight gradients are
needed only at the optimizer step. On the last micro-batch of an inner step the input gradient is
on the pipeline's critical path (the flush before the synchronous step), so a stage computes it
alone, sends it, and then computes its weight gradients while the gradient travels and the stages
before it run their own backward.

The two passes run the same autograd graph with the same operations, so the weight gradients
accumulated into `.grad` and the returned input gradient are the one-pass results bit for bit
(`tests/unit/test_split_backward.py`). The cost is the activation-gradient chain computed twice,
so stages use it only where the input gradient is on the critical path.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


def input_grad_first(
    root: torch.Tensor, root_grad: torch.Tensor | None, x_in: torch.Tensor, params: Iterable[torch.nn.Parameter]
) -> tuple[torch.Tensor, Callable[[], None]]:
    """(∂root/∂x_in, weights): the input gradient now; `weights()` accumulates the parameters'
    gradients into `.grad` later (once; it frees the graph). `root_grad` is the gradient of a
    non-scalar root (None for a scalar loss)."""
    (grad_in,) = torch.autograd.grad(root, x_in, root_grad, retain_graph=True)
    wanted = [p for p in params if p.requires_grad]

    def weights() -> None:
        if wanted:
            torch.autograd.backward(root, root_grad, inputs=wanted)

    return grad_in, weights

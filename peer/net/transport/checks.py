"""Cross-field checks of decoded replies (shared by the client and the server).

`check_forward_reply` says whether a ForwardReply is well formed on its own and, given the request,
whether it answers that request (a streamed request to an intermediate stage carries the targets
and is answered like the last stage's: loss and the gradient of its input).
"""

from __future__ import annotations

import math

import torch

from peer.net.transport.errors import TransportError
from peer.net.transport.messages import ForwardReply, ForwardRequest


def _same_bl(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    if tuple(a.shape[:2]) != tuple(b.shape[:2]):
        raise TransportError(f"invalid {what}: shape {list(a.shape)} does not match (b, L) = {list(b.shape[:2])}")


def check_forward_reply(reply: ForwardReply, request: ForwardRequest | None = None) -> None:
    """Check that a ForwardReply is one of: hidden only; loss only (eval); loss and grad (train).

    With the request, also check that the reply kind fits it (targets -> loss, plus grad when
    training; no targets -> hidden), that hidden keeps its (b, L) and grad the sent hidden's shape.
    """
    if (reply.hidden is None) == (reply.loss is None):
        raise TransportError(
            "invalid ForwardReply: exactly one of hidden (intermediate stage) or loss (last stage) must be set"
        )
    if reply.grad is not None and reply.loss is None:
        raise TransportError("invalid ForwardReply: grad is only sent together with the loss of the last stage")
    if reply.loss is not None and not math.isfinite(reply.loss):
        raise TransportError(f"invalid ForwardReply.loss: {reply.loss} is not finite; the last stage diverged")
    if request is None:
        return
    if request.targets is None and reply.hidden is None:
        raise TransportError(
            "invalid ForwardReply: a request without targets (intermediate stage) must be answered with hidden"
        )
    if request.targets is not None and reply.loss is None:
        raise TransportError("invalid ForwardReply: a request with targets (last stage) must be answered with the loss")
    if request.targets is not None and request.train and reply.grad is None:
        raise TransportError("invalid ForwardReply: a training request to the last stage must be answered with grad")
    if reply.hidden is not None:
        _same_bl(reply.hidden, request.tokens, "ForwardReply.hidden")
    if reply.grad is not None and tuple(reply.grad.shape) != tuple(request.hidden.shape):
        raise TransportError(
            f"invalid ForwardReply.grad: shape {list(reply.grad.shape)} differs from the sent hidden "
            f"{list(request.hidden.shape)}"
        )

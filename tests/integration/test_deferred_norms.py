"""`defer_norms`: the answer first, Σ‖g‖² after it on the same stream (real PeerServer and PeerClient).

On the last micro-batch of a pipelined inner step a stage answers the loss and its input gradient
before it computes its weight gradients; the norms the head needs for global clipping follow as a
second reply. The head must have the first reply while the stage is still computing."""

from __future__ import annotations

import threading

import pytest
import torch

from peer.errors import PeerError
from peer.net.transport import ForwardReply, ForwardRequest, PeerClient, PeerServer, RemoteError
from tests.integration.test_transport import ToyStage, _request

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


class LateStage(ToyStage):
    """The toy last stage; pipeline "late" sends its norms once `weights_done` is set, "broken" fails
    there, "eager" (an older peer) puts them in the answer."""

    def __init__(self):
        super().__init__()
        self.weights_done = threading.Event()

    def forward(self, req: ForwardRequest) -> ForwardReply:
        reply = super().forward(req)
        if req.pipeline_id == "eager":
            return ForwardReply(loss=reply.loss, grad=reply.grad, sq_norms=(2.0, 1.0))

        def late() -> tuple[float, ...]:
            if req.pipeline_id == "broken":
                raise PeerError("the weight gradients are gone: a replay started")
            assert self.weights_done.wait(20)
            return (4.0, 0.5)

        return ForwardReply(loss=reply.loss, grad=reply.grad, late=late if req.defer_norms else None)


@pytest.fixture
def late_stage():
    handler = LateStage()
    server = PeerServer(handler, host="127.0.0.1", port=0)
    yield server, handler
    handler.weights_done.set()
    server.stop(grace_s=1.0)


def _last(pipeline_id: str, defer: bool = True) -> ForwardRequest:
    req = _request(stage=2, targets=True, pipeline_id=pipeline_id)
    return ForwardRequest(**{**req.__dict__, "defer_norms": defer})


def test_the_answer_arrives_before_the_norms_are_computed(late_stage):
    server, handler = late_stage
    with PeerClient(server.address, timeout_s=10) as client:
        req = _last("late")
        reply = client.forward(req)  # would time out if the stage sent nothing before its norms
        assert not handler.weights_done.is_set()
        assert torch.equal(reply.grad, 3 * req.hidden) and reply.sq_norms == () and reply.late is not None
        handler.weights_done.set()
        assert reply.late() == (4.0, 0.5)
        # the stream is done: the next call on the channel works as usual
        plain = client.forward(_last("late", defer=False))
        assert plain.late is None and plain.loss is not None


def test_norms_in_the_answer_need_no_second_reply(late_stage):
    server, _ = late_stage
    with PeerClient(server.address, timeout_s=10) as client:
        reply = client.forward(_last("eager"))
        assert reply.late is None and reply.sq_norms == (2.0, 1.0)


def test_a_stage_that_fails_after_answering_raises_from_late(late_stage):
    server, _ = late_stage
    with PeerClient(server.address, timeout_s=10) as client:
        reply = client.forward(_last("broken"))
        assert reply.late is not None
        with pytest.raises(RemoteError, match="weight gradients are gone") as info:
            reply.late()
        assert info.value.code == "FAILED_PRECONDITION"

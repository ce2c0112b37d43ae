"""What a peer refuses before it touches its parameters (no network here).

- `payload_validator`: a round payload must be well formed AND fit the stage: every entry a
  parameter of the stage with its exact shape, once; stage 0's must carry embed.weight.
- `bound_to`: a payload announcement speaks for its replica only if the sender is the replica or
  the head's binding names it (its stage-0 announcement's "peers", else its record's "pipeline_peers").
- `max_request_bytes`: the server's request limit follows the run's largest legitimate request.
- `StageWorker.forward` on the last stage refuses a non-finite loss before backward, and the
  service turns that into a rejected request.
"""

from __future__ import annotations

import pytest
import torch

from peer.config import build_config
from peer.core.model.decoder import stage_shapes
from peer.core.sparseloco.algorithm import compress
from peer.core.sparseloco.codec.format import Payload, PayloadError
from peer.core.subspace.state import EMBED
from peer.net.records import Announcement, ReplicaRecord
from peer.net.transport import ForwardRequest, TransportError
from peer.node.round.agreement import bound_to
from peer.node.round.payloads import PayloadStore, payload_validator
from peer.node.service import PeerService
from peer.node.session import max_request_bytes
from peer.node.stage.worker import StageWorker

B, L = 2, 16


@pytest.fixture(scope="module")
def cfg():
    return build_config(
        overrides={"stages": 2, "train.batch_size": 4, "train.microbatches": 2, "train.seq_len": L}, environ={}
    )


def _encode(shapes: dict[str, tuple[int, ...]], cfg, seed: int = 0) -> bytes:
    gen = torch.Generator().manual_seed(seed)
    delta = {name: torch.randn(shape, generator=gen) * 1e-2 for name, shape in shapes.items()}
    return compress(delta, None, cfg.sparseloco)[0].to_bytes()


# ----------------------------------------------------------------------------- payloads


def test_an_honest_payload_of_each_stage_passes(cfg):
    for stage in range(cfg.stages):
        worker = StageWorker(cfg, stage)
        shapes = {name: tuple(v.shape) for name, v in worker.start.items()}
        assert shapes == stage_shapes(cfg.model, stage, cfg.stages)  # what an observer of the stage uses
        validate = payload_validator(shapes, cfg.sparseloco, required=[EMBED] if stage == 0 else [])
        validate(worker.encode_round().to_bytes())
        validate(_encode(shapes, cfg))


@pytest.mark.parametrize("change", ["(1,) entry", "transposed", "foreign name", "other stage's payload"])
def test_a_well_formed_payload_that_does_not_fit_the_stage_is_refused(cfg, change):
    shapes = stage_shapes(cfg.model, 1, cfg.stages)
    validate = payload_validator(shapes, cfg.sparseloco)
    name = "head.weight"
    bad = dict(shapes)
    if change == "(1,) entry":
        bad[name] = (1,)  # decompressed it would broadcast over the whole matrix in the outer step
    elif change == "transposed":
        bad[name] = shapes[name][::-1]
    elif change == "foreign name":
        bad["layers.99.ffn.w1.weight"] = (4, 4)
    else:
        bad = stage_shapes(cfg.model, 0, cfg.stages)
    data = _encode(bad, cfg)
    Payload.from_bytes(data, cfg=cfg.sparseloco)  # the format alone would let it through
    with pytest.raises(PayloadError, match="invalid SparseLoCo payload"):
        validate(data)


def test_stage_zero_payloads_must_carry_the_embedding(cfg):
    shapes = stage_shapes(cfg.model, 0, cfg.stages)
    validate = payload_validator(shapes, cfg.sparseloco, required=[EMBED])
    without = _encode({n: s for n, s in shapes.items() if n != EMBED}, cfg)
    with pytest.raises(PayloadError, match="missing \\['embed.weight'\\]"):
        validate(without)
    validate(_encode(shapes, cfg))


def test_a_payload_of_other_settings_or_oversized_is_refused(cfg):
    shapes = stage_shapes(cfg.model, 1, cfg.stages)
    validate = payload_validator(shapes, cfg.sparseloco)
    other = build_config(overrides={"stages": 2, "sparseloco.topk": 16}, environ={})
    with pytest.raises(PayloadError):
        validate(_encode(shapes, other))
    with pytest.raises(PayloadError):
        payload_validator({"norm.weight": (cfg.model.d_model,)}, cfg.sparseloco)(_encode(shapes, cfg))


# ----------------------------------------------------------------------------- bindings


def test_announcements_are_bound_to_their_replica_only_by_the_heads_binding():
    replicas = {
        "head-a": ReplicaRecord(kind="pipeline", pipeline_peers={"1": "stage-peer-p", "2": "stage-peer-q"}),
        "full-f": ReplicaRecord(kind="full"),
    }
    assert Announcement().replica_of("full-f") == "full-f"  # no claim: its own
    assert bound_to("full-f", "full-f", 1, {}, replicas)
    assert bound_to("head-a", "head-a", 0, {}, replicas)
    assert bound_to("stage-peer-p", "head-a", 1, {}, replicas)  # before the head announced: its record
    assert bound_to("stage-peer-q", "head-a", 2, {}, replicas)
    assert not bound_to("stage-peer-p", "head-a", 2, {}, replicas)  # not its stage
    assert not bound_to("stage-peer-p", "full-f", 1, {}, replicas)  # a full replica lists none
    assert not bound_to("stage-peer-p", "gone", 1, {}, replicas)  # no such replica
    # once the head announced, its announcement's binding (a replacement peer) replaces its record's
    announced = {"head-a": Announcement(replica="head-a", peers={"1": "stage-peer-r"})}
    assert bound_to("stage-peer-r", "head-a", 1, announced, replicas)
    assert not bound_to("stage-peer-p", "head-a", 1, announced, replicas)
    assert not bound_to("stage-peer-q", "head-a", 2, announced, replicas)  # it binds nobody for stage 2


# ----------------------------------------------------------------------------- request limit


def test_request_limit_follows_the_largest_boundary_of_the_run(cfg):
    assert max_request_bytes(cfg) == 4 << 20  # tiny runs: the 4 MiB floor
    big = build_config(overrides={"preset": "1B", "train.batch_size": 8}, environ={})
    b, Ls, d = 8, big.model.max_seq_len, big.model.d_model
    limit = max_request_bytes(big)
    assert b * Ls * d * 4 < limit < 1 << 30  # room for the real request, far below the old 1 GiB
    assert limit == 4 * (b * Ls * d * 4 + 2 * b * Ls * 4 + (64 << 10))


# ----------------------------------------------------------------------------- non-finite loss


def _poisoned_last_stage(cfg) -> StageWorker:
    worker = StageWorker(cfg, cfg.stages - 1)
    with torch.no_grad():
        worker.module.head.weight[0].fill_(3e38)  # logits overflow: the loss is NaN
    return worker


def test_last_stage_refuses_a_non_finite_loss_before_backward(cfg):
    worker = _poisoned_last_stage(cfg)
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.model.vocab_size, (B, L), generator=gen)
    hidden = torch.randn(B, L, cfg.k, generator=gen)  # (b, L, k)
    with pytest.raises(ValueError, match="loss of micro-batch 0 is nan"):
        worker.forward(("p", 0), tokens, hidden, tokens)
    assert all(p.grad is None for p in worker.module.parameters())
    assert worker.microbatches_seen == 0 and worker.seen == set()

    svc = PeerService(cfg, {worker.stage: worker}, PayloadStore(), "peer-0000", "stage")
    req = ForwardRequest("p", 0, 0, 0, worker.stage, tokens.to(torch.int32), hidden, targets=tokens.to(torch.int32))
    with pytest.raises(TransportError, match="refused before backward"):  # INVALID_ARGUMENT on the wire
        svc.forward(req)
    assert all(p.grad is None for p in worker.module.parameters())

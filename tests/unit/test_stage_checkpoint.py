"""Resumable stage checkpoints (peer.node.checkpoints.stage): bit-identical resume, corruption, disk full.

Peers here are StageWorkers trained in-process: a compressed pipeline (head stage 0 + stage 1,
activations crossing the subspace boundary as on the wire) and a full replica, each applying its
outer rounds alone (one participant). A pair restored from a checkpoint and continued must end
bit-identical to the pair that never stopped.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F

from peer.config import build_config
from peer.core.sparseloco.algorithm import decompress
from peer.core.sparseloco.commit import embedding_update
from peer.errors import CheckpointError, PeerError
from peer.node.checkpoints.stage import (
    checkpoint_fingerprint,
    list_stage_checkpoints,
    load_latest_stage_checkpoint,
    save_stage_checkpoint,
)
from peer.node.stage.worker import StageWorker

BASE = {
    "train.batch_size": 4,
    "train.microbatches": 2,
    "train.seq_len": 16,
    "train.inner_steps": 2,
    "train.outer_steps": 6,
    "train.warmup_steps": 2,
    "stages": 2,
}
SMALL = {
    "model.d_model": 32,
    "model.n_heads": 2,
    "model.head_dim": 16,
    "model.ffn_hidden": 32,
    "model.vocab_size": 128,
    "model.n_layers": 2,
}


def _cfg(**overrides):
    return build_config(overrides={**BASE, **overrides}, environ={})


def _batch(cfg, step):
    g = torch.Generator().manual_seed(1000 + step)  # data position = global inner step
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _pipeline_step(workers, x, y, t, h):
    """One inner step through a compressed 2-stage pipeline, micro-batch by micro-batch."""
    n = workers[0].cfg.train.microbatches
    for mb, (mx, my) in enumerate(zip(x.chunk(n), y.chunk(n), strict=True)):
        key = ("pipe", mb)
        hidden = workers[0].forward(key, mx.int(), None, None).hidden  # (b, L, k)
        out = workers[1].forward(key, mx.int(), hidden, my.int())
        workers[0].backward(key, out.grad)
    for w in workers:
        w.step(t, h)


def _full_step(workers, x, y, t, h):
    """One inner step of a full replica: stages chained in-process, no compression."""
    n = workers[0].cfg.train.microbatches
    for mx, my in zip(x.chunk(n), y.chunk(n), strict=True):
        hdn = mx
        for w in workers:
            hdn = w.module(hdn)
        (F.cross_entropy(hdn.flatten(0, 1), my.flatten()) / n).backward()
    for w in workers:
        w.step(t, h)


def _round(workers):
    """Every stage encodes its payload and applies it as the round's only committed one."""
    payloads = [w.encode_round() for w in workers]
    embed_update = embedding_update([decompress(payloads[0])], workers[0].cfg.sparseloco)
    for w, p in zip(workers, payloads, strict=True):
        w.apply_round([p], None if w.stage == 0 else embed_update)


def _train(workers, step_fn, outer_steps):
    cfg = workers[0].cfg
    H = cfg.train.inner_steps
    for _ in range(outer_steps):
        t = workers[0].outer_step
        for h in range(H):
            step_fn(workers, *_batch(cfg, t * H + h), t, h)
        _round(workers)


def _make(cfg, compressed):
    return [StageWorker(cfg, s, compressed=compressed) for s in range(cfg.stages)]


def _as_dict(workers):
    return {w.stage: w for w in workers}


def _assert_identical(a, b):
    for wa, wb in zip(a, b, strict=True):
        assert wa.outer_step == wb.outer_step
        assert wa.param_hash() == wb.param_hash()
        assert wa.perp_hash() == wb.perp_hash()
        for (na, pa), (nb, pb) in zip(wa.module.named_parameters(), wb.module.named_parameters(), strict=True):
            assert na == nb and torch.equal(pa, pb), na
        assert wa.optim.errors.keys() == wb.optim.errors.keys()
        for name in wa.optim.errors:
            assert torch.equal(wa.optim.errors[name], wb.optim.errors[name]), name
        oa, ob = wa.state_dict()["optimizer"], wb.state_dict()["optimizer"]
        (ta, ga), (tb, gb) = (oa["state"], oa["param_groups"]), (ob["state"], ob["param_groups"])
        assert ga == gb and ta.keys() == tb.keys()
        for key in ta:
            assert torch.equal(ta[key], tb[key]), key


@pytest.mark.parametrize("compressed", [True, False], ids=["pipeline", "full-replica"])
def test_resumed_peer_continues_bit_identically(tmp_path, compressed):
    cfg = _cfg()
    step_fn = _pipeline_step if compressed else _full_step
    ref = _make(cfg, compressed)
    _train(ref, step_fn, 2)
    path = save_stage_checkpoint(tmp_path, _as_dict(ref), {"shard": 3})
    assert path == tmp_path / "step-000002"
    _train(ref, step_fn, 2)

    resumed = _make(cfg, compressed)
    meta = load_latest_stage_checkpoint(tmp_path, _as_dict(resumed), checkpoint_fingerprint(cfg))
    assert meta["outer_step"] == 2 and meta["extra"] == {"outer_step": 2, "shard": 3}
    assert all(w.outer_step == 2 for w in resumed)
    _train(resumed, step_fn, 2)
    _assert_identical(ref, resumed)

    # the saved state matters: the same restore without the error buffer ends elsewhere
    forgetful = _make(cfg, compressed)
    load_latest_stage_checkpoint(tmp_path, _as_dict(forgetful), checkpoint_fingerprint(cfg))
    for w in forgetful:
        w.load_state_dict({**w.state_dict(), "errors": None})
    _train(forgetful, step_fn, 2)
    assert forgetful[0].param_hash() != ref[0].param_hash()


def test_mid_round_checkpoint_keeps_theta_start_apart(tmp_path):
    """Saved after an inner step (θ ≠ θ_start): both are stored and the round still ends identically."""
    cfg = _cfg()
    ref = _make(cfg, True)
    _train(ref, _pipeline_step, 1)
    H = cfg.train.inner_steps
    _pipeline_step(ref, *_batch(cfg, H), 1, 0)
    path = save_stage_checkpoint(tmp_path, _as_dict(ref), {})
    from safetensors import safe_open

    with safe_open(str(path / "state.safetensors"), "pt") as f:
        assert "s1/start/norm.weight" in set(f.keys())
    resumed = _make(cfg, True)
    load_latest_stage_checkpoint(tmp_path, _as_dict(resumed), checkpoint_fingerprint(cfg))
    for workers in (ref, resumed):
        _pipeline_step(workers, *_batch(cfg, H + 1), 1, 1)
        _round(workers)
    _assert_identical(ref, resumed)


def test_meta_records_steps_hashes_and_hyperparameters(tmp_path):
    cfg = _cfg()
    workers = _make(cfg, True)
    _train(workers, _pipeline_step, 1)
    path = save_stage_checkpoint(tmp_path, _as_dict(workers), {"shard": 0})
    meta = json.loads((path / "meta.json").read_text())
    assert meta["outer_step"] == 1 and meta["fingerprint"] == checkpoint_fingerprint(cfg)
    s0 = meta["stages"]["0"]
    assert s0["adamw_step"] == cfg.train.inner_steps
    assert s0["param_hash"] == workers[0].param_hash() and s0["perp_hash"] == workers[0].perp_hash()
    assert s0["adamw_param_groups"][0]["betas"] == [cfg.train.beta1, cfg.train.beta2]
    assert "embed.weight" in s0["adamw_param_groups"][0]["params"]
    from safetensors import safe_open

    with safe_open(str(path / "state.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {
        "s0/param/embed.weight",
        "s0/perp",
        "s0/err/embed.weight",
        "s0/opt/embed.weight/exp_avg",
        "s0/opt/embed.weight/exp_avg_sq",
        "s0/opt/embed.weight/step",
        "s1/perp",
        "s1/opt/layers.3.attn.wq.weight/exp_avg",
    } <= names
    assert not any("/start/" in n for n in names)  # θ_start == θ right after a commit


def test_keeps_the_newest_checkpoints_and_drops_stale_ones(tmp_path):
    cfg = _cfg()
    workers = _make(cfg, True)
    for _ in range(3):
        _train(workers, _pipeline_step, 1)
        save_stage_checkpoint(tmp_path, _as_dict(workers), {}, keep=2)
    assert [p.name for p in list_stage_checkpoints(tmp_path)] == ["step-000003", "step-000002"]
    # a fresh history in the same folder (a restart without --resume) replaces the stale newer ones
    fresh = _make(cfg, True)
    _train(fresh, _pipeline_step, 1)
    save_stage_checkpoint(tmp_path, _as_dict(fresh), {}, keep=2)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000001"]


def _two_checkpoints(tmp_path):
    cfg = _cfg()
    workers = _make(cfg, True)
    _train(workers, _pipeline_step, 1)
    older = save_stage_checkpoint(tmp_path, _as_dict(workers), {})
    hash_at_1 = workers[0].param_hash()
    _train(workers, _pipeline_step, 1)
    newer = save_stage_checkpoint(tmp_path, _as_dict(workers), {})
    return cfg, older, newer, hash_at_1


@pytest.mark.parametrize("damage", ["flip-tensor-bytes", "truncate-meta"])
def test_corrupt_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, caplog, damage):
    cfg, older, newer, hash_at_1 = _two_checkpoints(tmp_path)
    if damage == "flip-tensor-bytes":
        raw = bytearray((newer / "state.safetensors").read_bytes())
        raw[len(raw) // 2 : len(raw) // 2 + 8] = bytes(b ^ 0xFF for b in raw[len(raw) // 2 : len(raw) // 2 + 8])
        (newer / "state.safetensors").write_bytes(bytes(raw))
    else:
        text = (newer / "meta.json").read_text()
        (newer / "meta.json").write_text(text[: len(text) // 2])
    workers = _make(cfg, True)
    with caplog.at_level(logging.WARNING, logger="peer.node.checkpoints.stage"):
        meta = load_latest_stage_checkpoint(tmp_path, _as_dict(workers), checkpoint_fingerprint(cfg))
    assert meta["path"] == str(older) and meta["outer_step"] == 1
    assert workers[0].outer_step == workers[1].outer_step == 1
    assert workers[0].param_hash() == hash_at_1
    assert any("step-000002" in r.getMessage() for r in caplog.records)


def test_no_usable_checkpoint_is_a_one_line_error(tmp_path):
    cfg, older, newer, _ = _two_checkpoints(tmp_path)
    (older / "state.safetensors").write_bytes(b"\x00" * 64)
    (newer / "meta.json").write_text("{")
    fresh = _make(cfg, True)
    before = fresh[0].param_hash()
    with pytest.raises(CheckpointError) as info:
        load_latest_stage_checkpoint(tmp_path, _as_dict(fresh), checkpoint_fingerprint(cfg))
    msg = str(info.value)
    assert isinstance(info.value, PeerError) and "\n" not in msg
    assert "no usable checkpoint" in msg and "--resume" in msg
    assert fresh[0].param_hash() == before and fresh[0].outer_step == 0  # nothing half-loaded
    assert load_latest_stage_checkpoint(tmp_path / "empty", _as_dict(fresh), checkpoint_fingerprint(cfg)) is None


def test_checkpoint_of_another_run_or_role_is_refused(tmp_path):
    cfg = _cfg()
    workers = _make(cfg, True)
    _train(workers, _pipeline_step, 1)
    save_stage_checkpoint(tmp_path, _as_dict(workers), {})
    other = _cfg(seed=7)
    with pytest.raises(CheckpointError, match="another run configuration"):
        load_latest_stage_checkpoint(tmp_path, _as_dict(_make(other, True)), checkpoint_fingerprint(other))
    with pytest.raises(CheckpointError, match="holds stages"):
        load_latest_stage_checkpoint(tmp_path, {1: StageWorker(cfg, 1)}, checkpoint_fingerprint(cfg))
    with pytest.raises(CheckpointError, match="compressed pipeline"):
        load_latest_stage_checkpoint(tmp_path, _as_dict(_make(cfg, False)), checkpoint_fingerprint(cfg))
    # swarm deadlines are not part of the state
    assert checkpoint_fingerprint(_cfg(**{"swarm.round_timeout_s": 5})) == checkpoint_fingerprint(cfg)


def test_unwritable_root_is_a_checkpoint_error(tmp_path):
    cfg = _cfg()
    (tmp_path / "file").write_text("not a folder")
    with pytest.raises(CheckpointError, match="could not write checkpoint"):
        save_stage_checkpoint(tmp_path / "file", _as_dict(_make(cfg, True)), {})

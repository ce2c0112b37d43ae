"""A swarm's model out (`peer export`): per-stage checkpoints, a full replica's checkpoint and a served state
(`GetState` over real gRPC, checked like a state sync) give byte-identical model.safetensors, which
transformers loads with the loss of the chained stages; wrong inputs are refused in one line.

The swarm is two compressed-pipeline StageWorkers trained in-process for two outer rounds (each
applying its own payload as the round's committed set), and a full replica holding the same
committed state, as its holders do after a round.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from peer.config import build_config
from peer.core.model.chain import chain_forward, token_loss
from peer.core.sparseloco.algorithm import decompress
from peer.core.sparseloco.commit import embedding_update
from peer.errors import CheckpointError
from peer.export.checkpoints import export_folders
from peer.export.model import read_back, write_stages
from peer.net.pool import ClientPool
from peer.net.transport.server import PeerServer
from peer.node.checkpoints.stage import read_committed_states, read_stage_meta, save_stage_checkpoint
from peer.node.round.claims import Claim
from peer.node.round.payloads import PayloadStore
from peer.node.round.resync import download_claimed
from peer.node.service import PeerService
from peer.node.stage.worker import StageWorker

transformers = pytest.importorskip("transformers")
spm = pytest.importorskip("sentencepiece")

MODEL = {
    "model.d_model": 32,
    "model.n_heads": 2,
    "model.head_dim": 16,
    "model.ffn_hidden": 32,
    "model.vocab_size": 128,
    "model.n_layers": 2,
}
TRAIN = {"train.batch_size": 4, "train.microbatches": 2, "train.seq_len": 16, "train.inner_steps": 2, "stages": 2}


def _cfg(tokenizer: Path, **overrides):
    return build_config(overrides={**MODEL, **TRAIN, "data.tokenizer": str(tokenizer), **overrides}, environ={})


def _tokenizer(folder: Path) -> Path:
    """A 128-piece sentencepiece model (the run's tokenizer.model)."""
    text = "the quick brown fox jumps over the lazy dog. pack my box with five dozen liquor jugs. " * 40
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(text.split(". ")),
        model_prefix=str(folder / "sp"),
        vocab_size=128,
        model_type="bpe",
        bos_id=-1,
        eos_id=1,
        unk_id=0,
        pad_id=-1,
        minloglevel=2,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        hard_vocab_limit=False,
    )
    return folder / "sp.model"


def _batch(cfg, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _inner_step(workers, t: int, h: int) -> None:
    """One inner step through the compressed 2-stage pipeline, micro-batch by micro-batch."""
    x, y = _batch(workers[0].cfg, t * 10 + h)
    for mb, (mx, my) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
        hidden = workers[0].forward(("p", mb), mx.int(), None, None).hidden  # (b, L, k)
        out = workers[1].forward(("p", mb), mx.int(), hidden, my.int())
        workers[0].backward(("p", mb), out.grad)
    for w in workers:
        w.step(t, h)


def _round(workers) -> None:
    payloads = [w.encode_round() for w in workers]
    embed = embedding_update([decompress(payloads[0])], workers[0].cfg.sparseloco)
    for w, p in zip(workers, payloads, strict=True):
        w.apply_round([p], None if w.stage == 0 else embed)


def _holding(cfg, workers, compressed: bool = False) -> list[StageWorker]:
    """Fresh workers (a full replica: uncompressed) holding the committed state of `workers`."""
    out = []
    for w in workers:
        state = w.state_dict()
        held = StageWorker(cfg, w.stage, compressed=compressed)
        held.load_state_dict({k: state[k] for k in ("outer_step", "start", "perp", "bans", "link")})
        out.append(held)
    return out


def _save(data_dir: Path, workers, tokenizer: Path | None) -> None:
    save_stage_checkpoint(data_dir / "checkpoints", {w.stage: w for w in workers}, keep=5)
    if tokenizer is not None:
        shutil.copyfile(tokenizer, data_dir / "tokenizer.model")


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    """Data dirs s0, s1 (stage peers) and full (a full replica) with checkpoints at outer steps 1 and 2."""
    root = tmp_path_factory.mktemp("swarm")
    sp = _tokenizer(root)
    cfg = _cfg(sp)
    pipeline = [StageWorker(cfg, s) for s in range(cfg.stages)]
    for t in range(2):
        for h in range(cfg.train.inner_steps):
            _inner_step(pipeline, t, h)
        _round(pipeline)
        _save(root / "s0", pipeline[:1], sp)
        _save(root / "s1", pipeline[1:], None)  # its tokenizer is found in the other folder
        _save(root / "full", _holding(cfg, pipeline), sp)
    return {"root": root, "cfg": cfg, "pipeline": pipeline, "sp": sp}


def _served(cfg, workers, out: Path, tokenizer: Path) -> None:
    """The live path without the DHT: every stage downloaded over gRPC from a serving full replica
    into a fresh worker, checked against the holder's claim, and written like the other exports."""
    service = PeerService(cfg, {w.stage: w for w in workers}, PayloadStore(), "served-replica", "full")
    server = PeerServer(service, host="127.0.0.1", port=0, vocab_size=cfg.model.vocab_size)
    clients = ClientPool(5.0)
    try:
        stages = {}
        for w in workers:
            claim = Claim("served-replica", w.outer_step, w.state_id(), None)
            fresh = StageWorker(cfg, w.stage)
            assert download_claimed(clients, fresh, claim.peer, server.address, claim) is not None
            stages[w.stage] = read_back(fresh)
    finally:
        clients.close()
        server.stop(grace_s=0.5)
    write_stages(out, cfg, stages, tokenizer, "live", [server.address])


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_stages_a_replica_and_a_served_state_export_identical_bytes(swarm, tmp_path):
    root, cfg = swarm["root"], swarm["cfg"]
    stages = export_folders([root / "s0", root / "s1" / "checkpoints"], tmp_path / "stages")
    replica = export_folders([root / "full"], tmp_path / "replica")
    _served(cfg, _holding(cfg, swarm["pipeline"]), tmp_path / "live", swarm["sp"])
    assert (stages.outer_step, replica.outer_step) == (2, 2) and stages.tokenizer and replica.tokenizer
    got = {name: _files(tmp_path / name) for name in ("stages", "replica", "live")}
    for name in ("model.safetensors", "config.json", "tokenizer.model", "tokenizer_config.json"):
        assert got["stages"][name] == got["replica"][name] == got["live"][name], name
    infos = {name: json.loads(files["peer_export.json"]) for name, files in got.items()}
    assert {i["source"] for i in infos.values()} == {"stages", "replica", "live"}
    keys = ("outer_step", "run_id", "fingerprint", "model_sha256", "stages")
    assert len({json.dumps([i[k] for k in keys]) for i in infos.values()}) == 1, infos
    assert infos["live"]["fingerprint"] == cfg.fingerprint() and infos["live"]["stages"] == {
        str(w.stage): w.state_id() for w in swarm["pipeline"]
    }
    with safe_open(str(tmp_path / "stages" / "model.safetensors"), "pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = list(f.keys())
        assert {f.get_tensor(k).dtype for k in names} == {torch.float32}


def test_a_checkpoints_theta_after_a_commit_is_the_theta_start_getstate_serves(swarm, tmp_path):
    step = swarm["root"] / "full" / "checkpoints" / "step-000002"
    with safe_open(str(step / "state.safetensors"), "pt") as f:
        assert not any("/start/" in k for k in list(f.keys()))  # θ == θ_start right after a commit
    read = read_committed_states(step, read_stage_meta(step), [0, 1])
    for w in swarm["pipeline"]:
        served = w.snapshot()  # what GetState serves
        params = w.state_dict()["params"]
        assert read[w.stage]["start"].keys() == params.keys()
        for name, value in read[w.stage]["start"].items():
            assert torch.equal(value, params[name]) and torch.equal(value, served[name]), name
        assert torch.equal(read[w.stage]["perp"], served["perp"])
    # saved in the middle of an outer step (θ ≠ θ_start): the export is still the committed state
    cfg = swarm["cfg"]
    busy = _holding(cfg, swarm["pipeline"], compressed=True)
    _inner_step(busy, 2, 0)
    assert not torch.equal(busy[1].module.norm.weight, busy[1].start["norm.weight"])
    for name in ("s0", "s1"):
        shutil.copytree(swarm["root"] / name, tmp_path / name)
    _save(tmp_path / "s0", busy[:1], None)  # replaces step-000002 with θ ≠ θ_start
    _save(tmp_path / "s1", busy[1:], None)
    export_folders([tmp_path / "s0", tmp_path / "s1"], tmp_path / "busy")
    export_folders([swarm["root"] / "full"], tmp_path / "committed")
    busy_bytes = (tmp_path / "busy" / "model.safetensors").read_bytes()
    assert busy_bytes == (tmp_path / "committed" / "model.safetensors").read_bytes()


def test_the_export_loads_in_transformers_with_the_chained_stages_loss(swarm, tmp_path):
    cfg = swarm["cfg"]
    export_folders([swarm["root"] / "full"], tmp_path / "hf")
    hf = transformers.LlamaForCausalLM.from_pretrained(str(tmp_path / "hf"), dtype=torch.float32).eval()
    replica = _holding(cfg, swarm["pipeline"])
    x, y = _batch(cfg, 99)
    with torch.no_grad():
        ours = token_loss(chain_forward([w.module for w in replica], x), y).item()
        theirs = token_loss(hf(input_ids=x).logits, y).item()
    assert abs(ours - theirs) < 1e-4, (ours, theirs)
    embed = replica[0].module.embed
    assert embed is not None and embed.perp is not None and embed.perp.abs().sum() > 0
    assert torch.equal(hf.model.embed_tokens.weight, embed.weight + embed.perp)  # TE = T_S + T⊥, bit for bit
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    sp = spm.SentencePieceProcessor(model_file=str(swarm["sp"]))
    assert tokenizer("the lazy dog")["input_ids"] == sp.encode("the lazy dog")


def _other_state(swarm, tmp_path: Path, name: str, **overrides) -> Path:
    """A data dir holding stage 1 at outer step 2 in another state: of another run (`overrides`),
    or of this run with one parameter changed."""
    cfg = _cfg(swarm["sp"], **overrides) if overrides else swarm["cfg"]
    (held,) = _holding(cfg, swarm["pipeline"][1:]) if not overrides else [StageWorker(cfg, 1)]
    state = held.state_dict()
    start = {k: v + 1e-3 if k == "norm.weight" else v for k, v in state["start"].items()}
    held.load_state_dict({"outer_step": 2, "start": start, "perp": state["perp"], "bans": state["bans"]})
    _save(tmp_path / name, [held], None)
    return tmp_path / name


def _refused(paths, out: Path, outer_step: int | None = None) -> str:
    with pytest.raises(CheckpointError) as err:
        export_folders(paths, out, outer_step)
    assert not out.exists()
    msg = str(err.value)
    assert "\n" not in msg, msg
    return msg


def test_mismatched_steps_other_runs_missing_or_differing_stages_are_refused_in_one_line(swarm, tmp_path):
    root = swarm["root"]
    out = tmp_path / "hf"
    old = tmp_path / "old"
    shutil.copytree(root / "s1" / "checkpoints" / "step-000001", old / "checkpoints" / "step-000001")
    msg = _refused([root / "s0" / "checkpoints" / "step-000002", old], out)
    assert "no outer step in common" in msg and "has outer steps 2" in msg and "has outer steps 1" in msg
    msg = _refused([root / "s0", root / "s1"], out, outer_step=3)
    assert "no checkpoint at outer step 3" in msg and "has outer steps 1, 2" in msg
    assert "stage 1 of 2 is missing" in _refused([root / "s0"], out)
    assert "different runs" in _refused([root / "s0", _other_state(swarm, tmp_path, "other", seed=7)], out)
    msg = _refused([root / "full", _other_state(swarm, tmp_path, "forked")], out)
    assert "stage 1 differs between" in msg
    busy = tmp_path / "home"  # --out replaces its folder: never one that holds anything but an export
    (busy / "notes.txt").parent.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(CheckpointError, match="would be replaced"):
        export_folders([root / "full"], busy)
    assert (busy / "notes.txt").read_text() == "mine"
    meta_path = old / "checkpoints" / "step-000001" / "meta.json"
    meta = json.loads(meta_path.read_text())
    del meta["config"]  # as a peer before this version wrote it
    meta_path.write_text(json.dumps(meta))
    assert "does not record the run's config" in _refused([old, root / "s0"], out, outer_step=1)

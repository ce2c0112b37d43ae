"""Refactors that do not change the math keep results bit-identical (torchtitan's rule).

What is pinned is what is portable: the initial state (canonical integer initialisation, issue 20)
and the commit of a swarm round (sign-true quantizer and payload v3, T⊥ weight decay at each
commit, float64 fixed-order T_S/T⊥ split, `portable_cos`, clipped mass returned: issues 10 and 20).
Both are the same bits on every machine, whatever its kernels, so one set of pins holds for every
x86-64 host; the round starts from a portable step in place of training (integer multiples of
2⁻¹² added to every weight: IEEE additions, correctly rounded everywhere). If a pin changes, the
math changed: that must be a deliberate change of behaviour (say so in CHANGELOG.md and update the
pin), never a side effect of moving code.

Training is device-native by design: its bits depend on the CPU's kernels (torch picks AVX2 or
AVX-512 code, MKL dispatches differently on Intel and AMD), so the simulator's hash cannot be pinned
for "x86-64". An earlier version pinned it on "reference kernels" (torch's default capability,
MKL_CBWR=COMPATIBLE, one thread) in the belief that those give the same bits on every x86 host; an
Intel Xeon gave other bits (issue 34), so no pin relies on that. What the simulator's pin was for is
tested instead: (a) two runs in fresh processes on the same kernels give the same bits, and (b) a
refactor that keeps the math keeps them — pinned per machine kind, keyed by everything that picks
the kernels (CPU vendor, family, model and name, torch's version and CPU capability; one thread),
and skipped on a kind nobody has pinned. `python -m tests.integration.test_pinned_hashes` prints this
machine's key and hashes, to add a kind or to re-record one after a deliberate change.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from peer.config import build_config
from peer.core.model.state import state_hash
from peer.core.sparseloco.algorithm import decompress
from peer.core.sparseloco.commit import embedding_update
from peer.node.checkpoints.model import load_model_checkpoint
from peer.node.stage.worker import StageWorker
from peer.research.simulate.engine import simulate
from tests.corpora import pattern_corpus

ROOT = Path(__file__).resolve().parents[2]
INITIAL_PIN = {"0": "dc3d03d089af0bf3", "1": "629a3c7fac6ca48a"}  # issue 20's canonical initialisation
COMMIT_PIN = {"0": "1f1fa0d86a002587", "1": "f72247112363e577"}  # issue 34: the round after a portable step
PINNED_CPU_KINDS = ("x86_64", "amd64")  # platform.machine(), lower-cased, where the portable pins were checked
SIMULATOR_CONFIGS = ("sparseloco", "het-pp-compress")
# machine kind (`machine_kind()`) -> the simulator's hashes there, on one thread (issue 23's data order)
SIMULATOR_PINS: dict[str, dict[str, str]] = {
    "x86_64 / AuthenticAMD / 26 / 2 / AMD EPYC / torch 2.13.0+cpu / AVX512": {
        "sparseloco": "dfa7c209ad8af3ee",
        "het-pp-compress": "402722f22956441e",
    },
}

portable_only = pytest.mark.skipif(
    platform.machine().lower() not in PINNED_CPU_KINDS,
    reason=f"portable hashes are checked on {', '.join(PINNED_CPU_KINDS)} only, not {platform.machine()}",
)


def _cfg():
    overrides = {
        "train.batch_size": 4,
        "train.microbatches": 2,
        "train.seq_len": 16,
        "train.inner_steps": 3,
        "train.outer_steps": 2,
        "stages": 2,
        # float32 boundaries, as when the simulator was first pinned (bf16 is the default since)
        "subspace.wire_dtype": "fp32",
    }
    return build_config(overrides=overrides, environ={})


def _data(cfg, root):
    return pattern_corpus(root, cfg.model.vocab_size, tokens=20_000, period=89, val=2_000)


def machine_kind() -> str:
    """What picks this process's training kernels: CPU vendor, family, model and name (Linux's
    /proc/cpuinfo), torch's version and the CPU capability it dispatches to (ATEN_CPU_CAPABILITY
    lowers it)."""
    cpu: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() in ("vendor_id", "cpu family", "model", "model name") and key.strip() not in cpu:
                cpu[key.strip()] = value.strip()
    except OSError:
        cpu["processor"] = platform.processor()
    parts = [platform.machine(), *cpu.values(), f"torch {torch.__version__}", torch.backends.cpu.get_cpu_capability()]
    return " / ".join(parts)


def simulator_hashes() -> dict[str, str]:
    cfg = _cfg()
    names = list(SIMULATOR_CONFIGS)
    with tempfile.TemporaryDirectory() as tmp:
        data = _data(cfg, Path(tmp) / "corpus")
        results = simulate(cfg, data, replicas=2, configs=names, het_fraction=0.5, save_dir=Path(tmp))
        assert [r.name for r in results] == names
        return {name: state_hash(load_model_checkpoint(Path(tmp) / name)[0]) for name in names}


def _portable_step(worker: StageWorker, seed: int) -> None:
    """In place of training (device-native bits): every weight moves by k·2⁻¹², k in [−8, 8), drawn
    from torch's CPU generator (integers: the same on every machine); each addition is IEEE's,
    correctly rounded, so the moved weights are the same bits everywhere."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in worker.module.parameters():
            p.add_(torch.randint(-8, 8, p.shape, generator=g).float() * 2.0**-12)


def _commit(pipe: list[StageWorker], full: list[StageWorker]) -> None:
    """Commit one round for both stages the way peers do: a compressed pipeline's and a full
    replica's contributions, applied by each; afterwards they hold the same bits."""
    cfg = pipe[0].cfg
    payloads = {s: [pipe[s].encode_round(), full[s].encode_round()] for s in range(2)}
    embed_update = embedding_update([decompress(p) for p in payloads[0]], cfg.sparseloco)
    for s in range(2):
        pipe[s].apply_round(payloads[s], embed_update)
        full[s].apply_round(payloads[s], embed_update)
    for s in range(2):
        assert pipe[s].param_hash() == full[s].param_hash()
        assert pipe[s].perp_hash() == full[s].perp_hash()


def swarm_round_hashes() -> tuple[dict[str, str], dict[str, str]]:
    """({stage: initial hash}, {stage: the committed parameters' hash}) of a compressed 2-stage
    pipeline and a full replica that each take a portable step and commit the round."""
    cfg = _cfg()
    pipe = [StageWorker(cfg, s, compressed=True) for s in range(2)]
    full = [StageWorker(cfg, s, compressed=False) for s in range(2)]
    initial = {str(s): pipe[s].param_hash() for s in range(2)}
    assert initial == {str(s): full[s].param_hash() for s in range(2)}
    for s in range(2):
        _portable_step(pipe[s], 1 + s)
        _portable_step(full[s], 11 + s)
    _commit(pipe, full)
    return initial, {str(s): pipe[s].param_hash() for s in range(2)}


def _batch(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, cfg.model.vocab_size, (cfg.train.batch_size, cfg.train.seq_len + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def _in_fresh_process(fn: str) -> dict[str, str]:
    """`fn()` of this module in a fresh interpreter on this machine's kernels, one thread."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    code = (
        "import json, torch; torch.set_num_threads(1); "
        f"from tests.integration import test_pinned_hashes as m; print(json.dumps(m.{fn}()))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    got: dict[str, str] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


@portable_only
def test_the_initial_state_and_a_committed_round_keep_their_pinned_hashes():
    initial, committed = swarm_round_hashes()
    assert initial == INITIAL_PIN
    assert committed == COMMIT_PIN


def test_a_trained_pipeline_and_a_full_replica_commit_the_same_round():
    """With real inner steps (device-native bits, so nothing pinned): both hold the same bits after."""
    cfg = _cfg()
    pipe = [StageWorker(cfg, s, compressed=True) for s in range(2)]
    full = [StageWorker(cfg, s, compressed=False) for s in range(2)]
    x, y = _batch(cfg, 1)
    for mb, (mx, my) in enumerate(zip(x.chunk(2), y.chunk(2), strict=True)):
        hidden = pipe[0].forward(("p", mb), mx.int(), None, None).hidden
        out = pipe[1].forward(("p", mb), mx.int(), hidden, my.int())
        pipe[0].backward(("p", mb), out.grad)
    for w in pipe:
        w.step(0, 0)
    x, y = _batch(cfg, 2)
    for mx, my in zip(x.chunk(2), y.chunk(2), strict=True):
        logits = full[1].module(full[0].module(mx))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), my.flatten())
        (loss / 2).backward()
    for w in full:
        w.step(0, 0)
    before = [w.param_hash() for w in pipe]
    _commit(pipe, full)
    assert [w.param_hash() for w in pipe] != before


def test_a_short_simulator_run_is_deterministic_and_keeps_its_hash_on_this_machine_kind():
    with ThreadPoolExecutor(2) as pool:  # two fresh processes at once
        first, second = pool.map(_in_fresh_process, ["simulator_hashes"] * 2)
    assert set(first) == set(SIMULATOR_CONFIGS)
    assert second == first  # (a) the same kernels: the same bits
    kind = machine_kind()
    if kind not in SIMULATOR_PINS:
        record = "python -m tests.integration.test_pinned_hashes"
        pytest.skip(f"no simulator pin for {kind!r} (training is device-native); record it: {record}")
    assert first == SIMULATOR_PINS[kind]  # (b) a refactor that keeps the math keeps the bits


if __name__ == "__main__":  # this machine's kind and hashes (a new pin, or a deliberate re-record)
    print(json.dumps({machine_kind(): _in_fresh_process("simulator_hashes")}, indent=1))

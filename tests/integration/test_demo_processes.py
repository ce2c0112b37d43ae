"""The demo's process handling, for real: stand-in children (plain `python` scripts) are started through
the same spawning helper and `run_demo` as `peer demo` uses, then stopped, failed and interrupted."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import psutil
import pytest

from peer.demo.processes import Children
from peer.demo.run import DemoConfig, run_demo
from peer.errors import PeerError

# A stand-in for `peer bootstrap` / `peer join`: same flags, same address and metrics files.
FAKE_PEER = textwrap.dedent(r"""
    import json, os, signal, subprocess, sys, time
    from pathlib import Path
    args = sys.argv[1:]
    def opt(name):
        return args[args.index(name) + 1] if name in args else None
    mode = os.environ.get("FAKE_MODE", "ok")
    if os.environ.get("FAKE_IGNORE_TERM"):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if args[0] == "bootstrap":
        Path(opt("--address-file")).write_text(json.dumps(
            {"initial_peers": ["/ip4/127.0.0.1/tcp/1/p2p/QmFake"], "grpc": "127.0.0.1:2", "run_id": "fake",
             "min_replicas": os.environ.get("PEER_SWARM__MIN_REPLICAS")}))
        while True:
            time.sleep(1)
    data = Path(opt("--data-dir")); data.mkdir(parents=True, exist_ok=True)
    role = "full" if "--full-replica" in args else ("head" if opt("--stage") == "0" else "stage")
    stage = None if role == "full" else int(opt("--stage"))
    if role == "head" and not (data.parent / "p0-s1" / "metrics.jsonl").exists():
        print("head started before its stage-1 peer", file=sys.stderr); sys.exit(4)
    metrics = open(data / "metrics.jsonl", "a", buffering=1)
    def emit(**ev):
        metrics.write(json.dumps({**ev, "time": time.time()}) + "\n")
    emit(event="start", role=role, stage=stage, peer_id=data.name, address="127.0.0.1:0")
    if mode == "hang":
        if role == "full":  # a grandchild that leaves the process group: only the marker sweep finds it
            stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
            subprocess.Popen([sys.executable, "-c", stubborn], start_new_session=True)
        while True:
            time.sleep(1)
    if mode == "fail" and role == "head":
        time.sleep(0.3)
        print("boom: stage 1 did not answer", file=sys.stderr); sys.exit(3)
    T, H = int(os.environ.get("FAKE_T", "2")), int(os.environ.get("FAKE_H", "3"))
    held = ["0", "1"] if role == "full" else [str(stage)]
    for t in range(T):
        for h in range(H):
            if role != "stage":
                emit(event="step", role=role, t=t, h=h, loss=5.0 - t - 0.1 * h, tokens=256)
            time.sleep(0.01)
        emit(event="round", role=role, t=t, train_loss=None if role == "stage" else 5.0 - t, val_loss=None,
             stages={s: {"param_hash": f"h{t}-{s}", "perp_hash": "p", "participants": 2} for s in held},
             bytes={"activations": 10 * (t + 1) if role != "full" else 0,
                    "activations_uncompressed_equiv": 80 * (t + 1) if role != "full" else 0,
                    "pseudo_gradients": 5 * (t + 1)}, round_wall_s=0.1)
    emit(event="exit", reason="done")
""")


def _pids_with_env(tag: str) -> list[int]:
    """Live (non-zombie) processes, other than this one, that inherited DEMO_TEST_TAG=tag."""
    out = []
    for proc in psutil.process_iter():
        if proc.pid == os.getpid():
            continue
        try:
            if proc.environ().get("DEMO_TEST_TAG") == tag and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except psutil.Error:  # gone meanwhile, or another user's process
            continue
    return out


@pytest.fixture
def tag(monkeypatch):
    value = uuid.uuid4().hex
    monkeypatch.setenv("DEMO_TEST_TAG", value)
    yield value
    for pid in _pids_with_env(value):  # never leave anything behind, even when an assertion failed
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def fake(tmp_path) -> Path:
    path = tmp_path / "fake_peer.py"
    path.write_text(FAKE_PEER)
    return path


def _cmd(fake: Path):
    return lambda *args: [sys.executable, str(fake), *(str(a) for a in args)]


def _wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def _stop_within_grace(kids: Children) -> None:
    """`stop_all` with a 600 s grace returns long before it: the children ended on SIGTERM, so it
    never waited the grace out (no clock on this machine's speed: 60 s of slack against 600)."""
    stopper = threading.Thread(target=kids.stop_all, kwargs={"grace_s": 600.0}, daemon=True)
    stopper.start()
    stopper.join(60)
    assert not stopper.is_alive(), "stop_all waited out its grace period"


SLEEPER = "import time; print('sleeper up', flush=True); time.sleep(600)"
STUBBORN = (
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "time.sleep(600)']); print('stubborn up', flush=True); time.sleep(600)"
)


def test_stop_all_terminates_cooperative_children_fast(tmp_path, tag):
    kids = Children(tmp_path)
    for i in range(3):
        kids.spawn(f"sleeper{i}", [sys.executable, "-c", SLEEPER])
    _wait_for(lambda: len(_pids_with_env(tag)) == 3, 20, "three sleepers")
    _stop_within_grace(kids)  # SIGTERM was enough, no waiting out the grace period
    assert _pids_with_env(tag) == []
    assert all(c.poll() == -signal.SIGTERM for c in kids.children)


def test_stop_all_kills_a_group_that_ignores_sigterm(tmp_path, tag):
    kids = Children(tmp_path)
    child = kids.spawn("stubborn", [sys.executable, "-c", STUBBORN])
    _wait_for(lambda: len(_pids_with_env(tag)) == 2, 20, "the stubborn child and its grandchild")
    assert os.getpgid(child.pid) == child.pid != os.getpgid(0)  # its own process group
    grace = 1.0
    t0 = time.monotonic()
    kids.stop_all(grace_s=grace)
    took = time.monotonic() - t0
    assert grace <= took < grace + 30  # waited out the grace, then SIGKILL ended it (not a second grace)
    assert _pids_with_env(tag) == []
    assert child.poll() == -signal.SIGKILL
    assert "stubborn up" in child.log_path.read_text()
    kids.stop_all(grace_s=grace)  # idempotent


GRACEFUL = textwrap.dedent("""
    import signal, subprocess, sys, time
    helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])  # like hivemind's DHT process
    def on_term(*_):
        alive = helper.poll() is None
        print("helper alive at shutdown" if alive else f"helper already gone: {helper.poll()}", flush=True)
        helper.terminate(); helper.wait(); sys.exit(0)
    signal.signal(signal.SIGTERM, on_term)
    print("graceful up", flush=True)
    while True:
        time.sleep(1)
""")


def test_a_child_shuts_down_its_own_helpers_before_the_group_is_signalled(tmp_path, tag):
    kids = Children(tmp_path)
    child = kids.spawn("graceful", [sys.executable, "-c", GRACEFUL])
    _wait_for(
        lambda: "graceful up" in child.log_path.read_text() and len(_pids_with_env(tag)) == 2, 20, "child + helper"
    )
    _stop_within_grace(kids)
    assert child.poll() == 0
    assert "helper alive at shutdown" in child.log_path.read_text()  # the peer, not us, stopped its DHT process
    assert _pids_with_env(tag) == []


def test_early_nonzero_exit_is_a_peer_error_with_the_log_tail(tmp_path, tag):
    kids = Children(tmp_path)
    kids.spawn("sleeper", [sys.executable, "-c", SLEEPER])
    bad = kids.spawn(
        "p0-s1",
        [
            sys.executable,
            "-c",
            "import sys; print('loading'); print('fatal: no manifest', file=sys.stderr); sys.exit(7)",
        ],
    )
    bad.popen.wait(timeout=20)
    with pytest.raises(PeerError) as err:
        kids.check()
    msg = str(err.value)
    assert "p0-s1" in msg and "code 7" in msg and "fatal: no manifest" in msg and str(bad.log_path) in msg
    assert "\n" not in msg
    kids.stop_all(grace_s=1.0)
    assert _pids_with_env(tag) == []


def test_a_bootstrap_that_exits_at_all_is_an_error(tmp_path, tag):
    kids = Children(tmp_path)
    boot = kids.spawn("bootstrap", [sys.executable, "-c", "pass"], runs_until_stopped=True)
    done = kids.spawn("p0-s0", [sys.executable, "-c", "pass"])
    boot.popen.wait(timeout=20), done.popen.wait(timeout=20)
    with pytest.raises(PeerError, match="bootstrap .* code 0"):
        kids.check()


def test_run_demo_with_stand_in_peers(tmp_path, tag, fake, monkeypatch):
    monkeypatch.setenv("FAKE_T", "2")
    states = []
    cfg = DemoConfig(
        pipelines=1,
        stages=2,
        full_replicas=1,
        outer_steps=2,
        inner_steps=3,
        workdir=tmp_path / "w",
        timeout_s=60,
        startup_timeout_s=30,
        grace_s=1.0,
        poll_interval_s=0.05,
    )
    result = run_demo(cfg, states.append, command=_cmd(fake))
    assert _pids_with_env(tag) == []  # the bootstrap, which never exits by itself, was stopped
    s = result.summary
    assert [r["t"] for r in s["rounds"]] == [0, 1]
    assert s["params_consistent"] is True
    assert s["rounds"][1]["param_hash"] == {"0": "h1-0", "1": "h1-1"}
    assert s["rounds"][0]["train_loss"] == pytest.approx(5.0) and s["rounds"][1]["train_loss"] == pytest.approx(4.0)
    assert s["bytes"] == {"activations": 40, "activations_uncompressed_equiv": 320, "pseudo_gradients": 30}
    assert s["wall_s"] > 0
    assert sorted(result.metrics) == ["full0", "p0-s0", "p0-s1"]
    assert (result.workdir / "bootstrap.log").exists() and (result.workdir / "p0-s1.log").exists()
    # the manifest makes the pipeline and the full replica wait for each other before their first step
    assert json.loads((result.workdir / "bootstrap.json").read_text())["min_replicas"] == "2"
    phases = [st.phase for st in states]
    assert phases[0] == "starting bootstrap" and "training" in phases and phases[-1] == "stopping"
    last = states[-1]
    assert last.round == 2 and last.train_loss is not None and last.bytes["pseudo_gradients"] == 30
    assert all(v.exit_code == 0 for v in last.processes)


def test_run_demo_reports_a_failing_peer_and_cleans_up(tmp_path, tag, fake, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "fail")
    cfg = DemoConfig(workdir=tmp_path / "w", timeout_s=60, startup_timeout_s=30, grace_s=1.0, poll_interval_s=0.05)
    with pytest.raises(PeerError, match=r"p0-s0 \(pid \d+\) exited with code 3 .*boom: stage 1 did not answer"):
        run_demo(cfg, command=_cmd(fake))
    assert _pids_with_env(tag) == []


def test_run_demo_times_out_and_cleans_up(tmp_path, tag, fake, monkeypatch):
    monkeypatch.setenv("FAKE_MODE", "hang")
    monkeypatch.setenv("FAKE_IGNORE_TERM", "1")
    cfg = DemoConfig(workdir=tmp_path / "w", timeout_s=3, startup_timeout_s=30, grace_s=0.5, poll_interval_s=0.05)
    t0 = time.monotonic()
    with pytest.raises(PeerError, match="did not finish within 3 s"):
        run_demo(cfg, command=_cmd(fake))
    assert time.monotonic() - t0 < 3 + 0.5 + 5
    assert _pids_with_env(tag) == []  # including the grandchild that left its process group


DRIVER = textwrap.dedent("""
    import signal
    import sys
    from pathlib import Path
    from peer.demo.run import DemoConfig, run_demo
    signal.signal(signal.SIGINT, signal.default_int_handler)  # as in a terminal (a shell's `&` ignores SIGINT)
    fake, workdir = sys.argv[1], Path(sys.argv[2])
    run_demo(DemoConfig(workdir=workdir, timeout_s=120, grace_s=1.0, poll_interval_s=0.05),
             command=lambda *a: [sys.executable, fake, *map(str, a)])
""")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_demo_stops_every_process(tmp_path, tag, fake, sig):
    workdir = tmp_path / "w"
    env = {**os.environ, "FAKE_MODE": "hang", "FAKE_IGNORE_TERM": "1"}
    demo = subprocess.Popen(
        [sys.executable, "-c", DRIVER, str(fake), str(workdir)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )

    def heads_up() -> bool:
        return any('"start"' in p.read_text() for p in workdir.glob("p0-s0/metrics.jsonl"))

    try:
        _wait_for(lambda: heads_up() and len(_pids_with_env(tag)) >= 6, 90, "the stand-in swarm")
        # demo + bootstrap + p0-s1 + p0-s0 + full0 + full0's escaped grandchild
        demo.send_signal(sig)
        out, _ = demo.communicate(timeout=180)  # a deadline on a loaded CI machine, not a speed check
    finally:
        if demo.poll() is None:
            demo.kill()
    assert demo.returncode != 0
    text = out.decode()
    assert ("DemoInterrupted" in text) if sig == signal.SIGTERM else ("KeyboardInterrupt" in text), text[-2000:]
    assert _pids_with_env(tag) == []

"""The README's "Join a swarm" lines, run as written on three hosts, train a round (issue 26).

Three network namespaces joined by veth links stand for three machines (`peer.research.bench.netns`):
host 0 at 10.77.0.1 runs the bootstrap line; host 1 (10.77.0.2) the head and the full replica;
host 2 (10.77.1.2, routed through host 1) the stage-1 peer. The lines are read out of README.md,
so the README cannot drift from what is tested; only HOST and ID are replaced, by what the
bootstrap printed. The run's length comes from `PEER_*` variables in the bootstrap's environment
(one round of H = 2), which leave the lines as written.

Checked: the bootstrap prints the README's lines with its link address (not loopback); every join
exits 0 after the round; each stage's parameters are bit-identical across its holders; every
joiner announced its own host's address and was dialled back (connectivity "direct"); `peer status`
answers from another host; and the line pasted with the loopback address on another host fails
with one line that names the cause. Skipped with the reason when not root or without `ip netns`.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peer.node.metrics import read_events
from peer.research.bench.netns import ShapedChain

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

README = Path(__file__).resolve().parents[2] / "README.md"
PLACEHOLDER = "/ip4/HOST/tcp/31337/p2p/ID"
RUN = {  # the bootstrap's environment: a short run, the README's lines unchanged
    "PEER_TRAIN__INNER_STEPS": "2",
    "PEER_TRAIN__OUTER_STEPS": "1",
    "PEER_TRAIN__BATCH_SIZE": "4",
    "PEER_TRAIN__SEQ_LEN": "32",
    "PEER_DATA__MAX_CHARS": "200000",
    "PEER_SWARM__MIN_REPLICAS": "2",
    "PEER_SWARM__ANNOUNCE_INTERVAL_S": "0.5",
    "PEER_SWARM__ROUND_TIMEOUT_S": "60",
}
JOINS = (("stage1", 2, "stage-1"), ("head", 1, "head-0"), ("full", 1, "full"))  # README order: name, host, data dir
ADDRESS = {0: "10.77.0.1", 1: "10.77.0.2", 2: "10.77.1.2"}  # each host's address on its link toward host 0
READY_S = 90.0
JOIN_S = 120.0


def _unavailable() -> str | None:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the cross-host join test needs root (ip netns, veth)"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return None if probe.returncode == 0 else f"network namespaces are not available: {probe.stderr.strip()}"


def readme_join_lines() -> list[str]:
    """The commands of the README's "Join a swarm" block, comments removed."""
    section = README.read_text().split("## Join a swarm", 1)[1]
    block = section.split("```bash", 1)[1].split("```", 1)[0]
    return [line.split("#", 1)[0].strip() for line in block.splitlines() if line.strip()]


def _command(line: str) -> list[str]:
    """A README line as a process: `peer` is this environment's console script (else `python -m peer`)."""
    words = shlex.split(line)
    assert words[0] == "peer", line
    script = Path(sys.executable).with_name("peer")
    return [*([str(script)] if script.exists() else [sys.executable, "-m", "peer"]), *words[1:]]


def _spawn(net: ShapedChain, host: int, line: str, env: dict[str, str], log: Path) -> subprocess.Popen:
    cwd = log.parent / f"host{host}"  # where `runs/<role>` (the default --data-dir) lands
    cwd.mkdir(exist_ok=True)
    return subprocess.Popen(
        [*net.exec_prefix(host), *_command(line)],
        cwd=cwd,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _wait_banner(proc: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + READY_S
    while "running; Ctrl-C" not in log.read_text():
        assert proc.poll() is None, f"peer bootstrap exited {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no join lines within {READY_S:.0f} s:\n{log.read_text()[-3000:]}"
        time.sleep(0.2)
    return log.read_text()


def _stop(procs: dict[str, subprocess.Popen]) -> None:
    for proc in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
    for proc in procs.values():
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.skipif(_unavailable() is not None, reason=str(_unavailable()))
def test_readme_join_lines_train_a_round_across_hosts(tmp_path, reap_children):
    t0 = time.monotonic()
    lines = readme_join_lines()
    assert lines[0].startswith("peer bootstrap ") and len(lines) == len(JOINS) + 2, lines  # + the status line
    assert all(PLACEHOLDER in line for line in lines[1:]), lines
    env = {**os.environ, "PEER_LOG_LEVEL": "INFO", "OMP_NUM_THREADS": "1", "COLUMNS": "200"}
    procs: dict[str, subprocess.Popen] = {}
    logs = {name: tmp_path / f"{name}.log" for name in ("bootstrap", "loopback", *(j[0] for j in JOINS))}
    with ShapedChain(3, rate=None, tag="j") as net:
        try:
            procs["bootstrap"] = _spawn(net, 0, lines[0], {**env, **RUN}, logs["bootstrap"])
            banner = _wait_banner(procs["bootstrap"], logs["bootstrap"])
            found = re.search(r"--initial-peers /ip4/([^/]+)/tcp/31337/p2p/(\w+)", banner)
            assert found, banner
            host, peer_id = found.groups()
            assert host == ADDRESS[0], banner  # the bootstrap's link address, not 127.0.0.1
            assert "join this run (paste on another machine):" in banner, banner
            pasted = [line.replace(PLACEHOLDER, f"/ip4/{host}/tcp/31337/p2p/{peer_id}") for line in lines[1:]]
            printed = {ln.strip() for ln in banner.splitlines()}
            assert set(pasted) <= printed, (pasted, banner)  # the README's lines are the ones it prints
            # pasted with the loopback address on another machine: one line naming the cause
            loopback = lines[1].replace(PLACEHOLDER, f"/ip4/127.0.0.1/tcp/31337/p2p/{peer_id}")
            procs["loopback"] = _spawn(net, 2, loopback, env, logs["loopback"])
            for (name, where, _), line in zip(JOINS, pasted, strict=False):
                procs[name] = _spawn(net, where, line, env, logs[name])
            for name, _, _ in JOINS:
                rc = procs[name].wait(timeout=JOIN_S)
                assert rc == 0, f"{name} exited {rc}:\n{logs[name].read_text()[-4000:]}"
            status = subprocess.run(
                [*net.exec_prefix(2), *_command(pasted[-1])], env=env, capture_output=True, text=True, timeout=60
            )
            assert procs["loopback"].wait(timeout=60) == 2, logs["loopback"].read_text()
        finally:
            _stop(procs)
    took = time.monotonic() - t0
    printed_lines = "\n".join(ln for ln in banner.splitlines() if not re.match(r"\d{4}-\d\d-\d\d ", ln))
    print(f"\n{printed_lines}\nREADME lines on 3 hosts: one round trained in {took:.1f} s")

    assert status.returncode == 0, status.stderr
    assert "stage peers" in status.stdout and re.search(r"run peer-run-\w+", status.stdout), status.stdout
    said = " ".join(logs["loopback"].read_text().split())
    assert "error: --initial-peers /ip4/127.0.0.1/tcp/31337/" in said and "did not answer" in said, said
    assert "127.0.0.1 is a loopback address, which reaches only this machine" in said, said
    assert "Traceback" not in said

    metrics = {name: tmp_path / f"host{where}" / "runs" / data / "metrics.jsonl" for name, where, data in JOINS}
    hosts = {name: where for name, where, _ in JOINS}
    rounds = {name: {r["t"]: r for r in read_events(path, "round")} for name, path in metrics.items()}
    for name, done in rounds.items():
        assert sorted(done) == [0], f"{name} did rounds {sorted(done)}"
        (conn,) = read_events(metrics[name], "connectivity")
        assert conn["connectivity"] == "direct", (name, conn)  # dialled back across hosts
        assert conn["address"].rpartition(":")[0] == ADDRESS[hosts[name]], (name, conn)
    for stage, holders in (("0", ("head", "full")), ("1", ("stage1", "full"))):
        hashes = {rounds[n][0]["stages"][stage]["param_hash"] for n in holders}
        assert len(hashes) == 1, f"stage {stage} differs across {holders}: {hashes}"
        assert len(rounds["full"][0]["stages"][stage]["committed"]) == 2, rounds["full"][0]

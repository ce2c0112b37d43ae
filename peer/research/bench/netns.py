"""Network namespaces joined by shaped links, for `peer bench pipeline --rate` (Linux, as root).

`ShapedChain(S, rate)` makes namespaces `peerb<i>` for i = 0 .. S−1, joined in a chain (stage i to
stage i + 1) by veth pairs on 10.77.<i>.0/24 (stage i at .1, stage i + 1 at .2). Every veth end
gets a `tc tbf` qdisc at `rate` with a small burst (16 kbit by default), so each message pays its
serialization time; namespaces forward IP so stage 0 reaches every stage (the sequential head
calls them all, across every link in between). `address(i)` is where stage i listens and others
reach it. `exec_prefix(i)` is the command prefix that runs a process inside namespace i.
Everything is removed on `close()` (also after a failed setup). `netns_unavailable()` says why
shaping cannot run here (not root, no `ip`/`tc`), or None.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess

log = logging.getLogger(__name__)

PREFIX = "peerb"


def netns_unavailable() -> str | None:
    """Why namespaces with shaped links cannot be set up here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "shaped links need root (ip netns, veth and tc tbf); run as root or leave out --rate/--rtt-ms netns"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` (iproute2) is not installed"
    return None


def run_cmd(*cmd: str) -> None:
    """Run one `ip`/`tc`/`iptables` command; RuntimeError with its stderr when it fails."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")


class ShapedChain:
    """S namespaces in a chain of `rate`-shaped links (rate None: unshaped veth links)."""

    def __init__(self, stages: int, rate: str | None, burst: str = "16kbit", tag: str = "") -> None:
        self.stages, self.rate, self.burst = stages, rate, burst
        self.names = [f"{PREFIX}{tag}{i}" for i in range(stages)]
        self._made: list[str] = []

    def __enter__(self) -> ShapedChain:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _setup(self) -> None:
        for name in self.names:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)  # a leftover
            run_cmd("ip", "netns", "add", name)
            self._made.append(name)
            run_cmd("ip", "-n", name, "link", "set", "lo", "up")
            run_cmd("ip", "netns", "exec", name, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for i in range(self.stages - 1):
            left, right = f"{self.names[i]}r", f"{self.names[i + 1]}l"
            run_cmd(
                "ip",
                "link",
                "add",
                left,
                "netns",
                self.names[i],
                "type",
                "veth",
                "peer",
                right,
                "netns",
                self.names[i + 1],
            )
            for ns, dev, host in ((self.names[i], left, 1), (self.names[i + 1], right, 2)):
                run_cmd("ip", "-n", ns, "addr", "add", f"10.77.{i}.{host}/24", "dev", dev)
                run_cmd("ip", "-n", ns, "link", "set", dev, "up")
                if self.rate:
                    run_cmd("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                         "burst", self.burst, "latency", "400ms")  # fmt: skip
        for i, ns in enumerate(self.names):  # routes to the subnets beyond the neighbours
            for j in range(self.stages - 1):
                if j > i:
                    run_cmd("ip", "-n", ns, "route", "add", f"10.77.{j}.0/24", "via", f"10.77.{i}.2")
                elif j < i - 1:
                    run_cmd("ip", "-n", ns, "route", "add", f"10.77.{j}.0/24", "via", f"10.77.{i - 1}.1")

    def address(self, stage: int) -> str:
        """The IP stage `stage` listens on (reachable from every namespace of the chain)."""
        return f"10.77.{stage - 1}.2" if stage > 0 else "10.77.0.1"

    def exec_prefix(self, stage: int) -> list[str]:
        return ["ip", "netns", "exec", self.names[stage]]

    def close(self) -> None:
        for name in self._made:
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self._made = []

"""A small internet in network namespaces: a public net and home routers that NAT (Linux, root).

`NatLab(tag, homes)` makes:
- `<tag>pub`: the public net, a bridge at 10.200.0.1/24 (public peers and relays listen here);
- per home i: a router `<tag>r<i>` (WAN 10.200.0.<10+i> on the bridge, LAN 192.168.<i+1>.1/24) doing
  iptables MASQUERADE out of its WAN and dropping every NEW connection coming in from it (only
  replies to connections opened from inside pass), and a host `<tag>h<i>` at 192.168.<i+1>.2 behind it.
The public net routes 192.168.<i+1>.0/24 to router i, so a dial from outside reaches the router
and is dropped there, as by a home router without port forwarding.

`exec_prefix(ns)` runs a command inside a namespace; `close()` removes every namespace (and with
them every veth and rule), also after a failed setup. `unavailable()` says why the lab cannot run.
"""

from __future__ import annotations

import os
import shutil
import subprocess

from peer.research.bench.netns import run_cmd as _run

PUBLIC_IP = "10.200.0.1"


def unavailable() -> str | None:
    """Why namespaces with a NAT router cannot be set up here, or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the NAT tests need root (ip netns, veth, iptables); run them as root"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (apt-get install -y iproute2 iptables)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    if probe.returncode != 0:
        return f"network namespaces are not available here: {probe.stderr.strip()}"
    return None


class NatLab:
    """The public namespace and `homes` NATed homes (see the module docstring)."""

    def __init__(self, tag: str, homes: int) -> None:
        self.tag, self.homes = tag, homes
        self.public = f"{tag}pub"
        self._made: list[str] = []

    def router(self, i: int) -> str:
        return f"{self.tag}r{i}"

    def home(self, i: int) -> str:
        return f"{self.tag}h{i}"

    def home_ip(self, i: int) -> str:
        return f"192.168.{i + 1}.2"

    def exec_prefix(self, ns: str) -> list[str]:
        return ["ip", "netns", "exec", ns]

    def __enter__(self) -> NatLab:
        try:
            self._setup()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _ns(self, name: str) -> None:
        subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)  # a leftover
        _run("ip", "netns", "add", name)
        self._made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _setup(self) -> None:
        pub = self.public
        self._ns(pub)
        _run("ip", "-n", pub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", pub, "addr", "add", f"{PUBLIC_IP}/24", "dev", "br0")
        _run("ip", "-n", pub, "link", "set", "br0", "up")
        for i in range(self.homes):
            rtr, host, wan_ip, lan = self.router(i), self.home(i), f"10.200.0.{10 + i}", f"192.168.{i + 1}"
            self._ns(rtr)
            self._ns(host)
            _run("ip", "link", "add", f"p{i}", "netns", pub, "type", "veth", "peer", "wan", "netns", rtr)
            _run("ip", "-n", pub, "link", "set", f"p{i}", "master", "br0", "up")
            _run("ip", "-n", rtr, "addr", "add", f"{wan_ip}/24", "dev", "wan")
            _run("ip", "-n", rtr, "link", "set", "wan", "up")
            _run("ip", "link", "add", "lan", "netns", rtr, "type", "veth", "peer", "eth0", "netns", host)
            _run("ip", "-n", rtr, "addr", "add", f"{lan}.1/24", "dev", "lan")
            _run("ip", "-n", rtr, "link", "set", "lan", "up")
            _run("ip", "-n", host, "addr", "add", f"{lan}.2/24", "dev", "eth0")
            _run("ip", "-n", host, "link", "set", "eth0", "up")
            _run("ip", "-n", host, "route", "add", "default", "via", f"{lan}.1")
            _run("ip", "-n", pub, "route", "add", f"{lan}.0/24", "via", wan_ip)
            _run("ip", "netns", "exec", rtr, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            ipt = ["ip", "netns", "exec", rtr, "iptables"]
            _run(*ipt, "-t", "nat", "-A", "POSTROUTING", "-o", "wan", "-j", "MASQUERADE")
            _run(*ipt, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-m", "conntrack", "--ctstate",
                 "ESTABLISHED,RELATED", "-j", "ACCEPT")  # fmt: skip
            _run(*ipt, "-A", "FORWARD", "-i", "wan", "-o", "lan", "-j", "DROP")  # inbound NEW: dropped

    def close(self) -> None:
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True, check=False)
        self._made = []

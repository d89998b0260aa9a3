"""Hosts on one machine for multi-node tests: network namespaces on one bridge (issue 15).

``hosts(n)`` makes ``n`` namespaces ``zt<tag><i>``, each with one end of a veth pair whose other
end is on a bridge in the root namespace; host ``i`` has address ``10.213.8.<i+1>/24`` on its
interface, so every host reaches every other (and no host reaches another through loopback).
The filesystem is shared: every host sees the same working directory and Python, as the nodes of
a cluster with a shared home do. Everything made is deleted on exit, also when a test fails.

Needs root (or CAP_NET_ADMIN) and the ``ip`` tool; the fixture skips with the reason where the
kernel refuses namespaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBNET = "10.213.8"


@dataclass(frozen=True)
class Host:
    """One namespace: its name, address, and the interface that reaches the other hosts."""

    netns: str
    addr: str
    link: str

    def argv(self, *command: str) -> list[str]:
        """``command`` run inside this host's network namespace."""
        return ["ip", "netns", "exec", self.netns, *command]

    def python(self, *args: str) -> list[str]:
        """This interpreter (the same one on every host) inside the namespace."""
        return self.argv(sys.executable, *args)


def ip(*args: str) -> None:
    """Run ``ip ARGS``; a failure raises with ip's own message."""
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """``n`` hosts on one bridge (see the module docstring); skips the test where refused."""
    if shutil.which("ip") is None:
        pytest.skip("the ip tool (iproute2) is not installed")
    tag = str(os.getpid())
    bridge = f"zb{tag}"
    made: list[str] = []
    bridge_made = False
    try:
        try:
            ip("link", "add", bridge, "type", "bridge")
        except subprocess.CalledProcessError as e:
            pytest.skip(f"network namespaces refused here (ip link add bridge: {e.stderr.strip()})")
        bridge_made = True
        ip("link", "set", bridge, "up")
        result = []
        for i in range(n):
            host = Host(netns=f"zt{tag}{i}", addr=f"{SUBNET}.{i + 1}", link=f"zv{tag}{i}")
            ip("netns", "add", host.netns)
            made.append(host.netns)
            ip("link", "add", host.link, "type", "veth", "peer", "name", f"zp{tag}{i}")
            ip("link", "set", f"zp{tag}{i}", "master", bridge, "up")
            ip("link", "set", host.link, "netns", host.netns)
            ip("-n", host.netns, "addr", "add", f"{host.addr}/24", "dev", host.link)
            ip("-n", host.netns, "link", "set", host.link, "up")
            ip("-n", host.netns, "link", "set", "lo", "up")
            result.append(host)
        yield result
    finally:
        # Deleting a namespace deletes the veth end inside it, and so the pair.
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        if bridge_made:
            subprocess.run(["ip", "link", "del", bridge], capture_output=True)

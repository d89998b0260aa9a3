"""Hosts on one machine for multi-node tests: network namespaces on one bridge (issue 15).

``hosts(n)`` makes ``n`` namespaces ``zt<tag><i>``, each with one end of a veth pair whose other
end is on a bridge in the root namespace; host ``i`` has address ``10.213.8.<i+1>/24`` on its
interface, so every host reaches every other (and no host reaches another through loopback).
The filesystem is shared: every host sees the same working directory and Python, as the nodes of
a cluster with a shared home do. Everything made is deleted on exit, also when a test fails;
what a killed run left (its process gone) is deleted by the next ``hosts()``.

``sshd(hosts, tmp)`` starts a real OpenSSH server on each host's address (Debian's
openssh-server, ``make multihost-deps`` installs it) with a throwaway host key, and a throwaway
client key that root may log in with; it gives an ssh client config (``ssh -F CONFIG``) that
uses that key and skips host key checks, and the servers' process ids. Every server is stopped
on exit.

Needs root (or CAP_NET_ADMIN) and the ``ip`` tool; the fixture skips with the reason where the
kernel refuses namespaces.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
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

    def pids(self) -> set[int]:
        """The processes running in this host's network namespace."""
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True)
        return {int(p) for p in out.stdout.split()}


def ip(*args: str) -> None:
    """Run ``ip ARGS``; a failure raises with ip's own message."""
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def sweep_stale() -> list[str]:
    """Delete the namespaces and bridges a killed test run left (``zt<pid><i>``, ``zb<pid>``:
    its pid no longer runs), which no ``finally`` could; returns their names. Hosts are numbered
    0-9, so a namespace's last digit is its host and the digits before it the run's pid."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(
        ["ip", "-o", "link", "show", "type", "bridge"], capture_output=True, text=True
    ).stdout
    stale = []
    for name in (line.split()[0] for line in names.splitlines() if line.strip()):
        digits = name[2:]
        ours = name.startswith("zt") and digits.isdigit() and len(digits) > 1
        if ours and not _alive(int(digits[:-1])):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            stale.append(name)
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith("zb") and name[2:].isdigit() and not _alive(int(name[2:])):
            subprocess.run(["ip", "link", "del", name], capture_output=True)
            stale.append(name)
    return stale


@contextmanager
def hosts(n: int) -> Iterator[list[Host]]:
    """``n`` hosts on one bridge (see the module docstring); skips the test where refused."""
    if shutil.which("ip") is None:
        pytest.skip("the ip tool (iproute2) is not installed")
    if n > 10:
        raise ValueError("hosts(n): at most 10 hosts (their namespaces end in one digit)")
    sweep_stale()
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


SSHD = "/usr/sbin/sshd"
SSHD_READY_S = 20.0


def need(*tools: str) -> None:
    """Fail, saying how to install them, where ``tools`` are missing (``make test`` installs
    them; only without root, where the namespaces are refused anyway, does a test skip)."""
    missing = [tool for tool in tools if shutil.which(tool) is None]
    if missing and os.geteuid() != 0:
        pytest.skip(f"{', '.join(missing)} missing, and installing them needs root")
    if missing:
        pytest.fail(f"{', '.join(missing)} missing: run `make multihost-deps` (apt-get)")


def _config(path: str, lines: list[str]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


@dataclass(frozen=True)
class Sshd:
    """The servers of :func:`sshd`: the client config file (``ssh -F``), the servers' pids."""

    config: str
    pids: frozenset[int]


@contextmanager
def sshd(on: list[Host], tmp: str) -> Iterator[Sshd]:
    """A real sshd on every host of ``on`` (see the module docstring).

    Keys and configs live in ``tmp``. The servers run in the foreground (``-D``), one per host,
    and are stopped (with whatever they still run) on exit.
    """
    need(SSHD, "ssh", "ssh-keygen")
    host_key, client_key = os.path.join(tmp, "host_key"), os.path.join(tmp, "client_key")
    for key in (host_key, client_key):
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True, timeout=30
        )
    os.makedirs("/run/sshd", exist_ok=True)  # sshd's privilege separation directory
    client = os.path.join(tmp, "ssh_config")
    _config(client, [
        "Host *",
        f"  IdentityFile {client_key}",
        "  IdentitiesOnly yes",
        "  StrictHostKeyChecking no",
        "  UserKnownHostsFile /dev/null",
        "  BatchMode yes",
        "  ConnectTimeout 10",
        "  LogLevel ERROR",
    ])  # fmt: skip
    servers: list[subprocess.Popen] = []
    try:
        for host in on:
            config = os.path.join(tmp, f"sshd_config.{host.addr}")
            _config(config, [
                f"ListenAddress {host.addr}",
                f"HostKey {host_key}",
                f"AuthorizedKeysFile {client_key}.pub",
                "PidFile none",
                "StrictModes no",  # the keys live in a test's tmp directory
                "UsePAM no",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                "MaxStartups 100",
                "MaxSessions 100",
                "LogLevel ERROR",
            ])  # fmt: skip
            log = open(os.path.join(tmp, f"sshd.{host.addr}.log"), "wb")  # noqa: SIM115
            servers.append(subprocess.Popen(host.argv(SSHD, "-D", "-e", "-f", config), stderr=log))
            log.close()
        for host in on:
            _wait_for_ssh(on[0], host, client, servers)
        yield Sshd(client, frozenset(s.pid for s in servers))  # ip netns exec execs sshd
    finally:
        for server in servers:  # sshd -D ends its sessions with it
            server.terminate()
        for server in servers:
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def _wait_for_ssh(src: Host, dst: Host, client: str, servers: list[subprocess.Popen]) -> None:
    """Until ``ssh dst true`` from ``src`` works (sshd takes a moment to listen)."""
    deadline = time.monotonic() + SSHD_READY_S
    while True:
        r = subprocess.run(
            src.argv("ssh", "-F", client, dst.addr, "true"),
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        if r.returncode == 0:
            return
        dead = [s.args for s in servers if s.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"sshd on {dst.addr} did not answer: {r.stderr.strip()} {dead}")
        time.sleep(0.1)

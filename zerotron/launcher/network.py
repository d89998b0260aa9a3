"""Which network interface a multi-node job's workers talk on.

Gloo (and NCCL's bootstrap) pick the address each rank advertises to its peers from the host
name unless ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` name an interface. Where the host
name resolves to a loopback address (a common ``/etc/hosts`` default), every rank advertises
127.x and the other nodes cannot connect (``Gloo connectFullMesh failed ... remote=[127.0.0.1]``).
The launcher therefore finds the interface whose address reaches ``--master_addr`` and names it
in the workers' environment, and refuses a remote master that only loopback reaches.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Callable, Mapping

from zerotron.errors import ConfigError

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
LOOPBACK_IFNAMES = ("lo", "lo0")


def route_source(master_addr: str, port: int) -> str:
    """The local IP address the kernel would send from to reach ``master_addr:port``.

    A UDP ``connect`` only consults the routing table; no packet leaves the host.
    """
    family, _, _, _, sockaddr = socket.getaddrinfo(master_addr, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect(sockaddr)
        return s.getsockname()[0]


def interface_of(addr: str, interfaces: Mapping[str, list] | None = None) -> str | None:
    """The name of the interface that holds ``addr`` (psutil.net_if_addrs() layout), or None."""
    if interfaces is None:
        import psutil

        interfaces = psutil.net_if_addrs()
    for name, addrs in interfaces.items():
        for a in addrs:
            if a.address.split("%")[0] == addr:  # IPv6 link-local carries a %scope
                return name
    return None


def _is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(addr.split("%")[0]).is_loopback
    except ValueError:
        return False


def _master_ips(master_addr: str, port: int) -> set[str]:
    return {info[4][0] for info in socket.getaddrinfo(master_addr, port, type=socket.SOCK_DGRAM)}


def socket_ifname(
    master_addr: str,
    port: int,
    *,
    source: Callable[[str, int], str] = route_source,
    interfaces: Mapping[str, list] | None = None,
    master_ips: Callable[[str, int], set[str]] = _master_ips,
) -> str | None:
    """The interface this node's workers should talk on to reach ``master_addr``.

    Returns None where no interface holds the route's source address (nothing is set then).
    Raises ConfigError where only loopback reaches a master that is not on loopback: the other
    nodes could never connect back to this one.
    """
    try:
        addr = source(master_addr, port)
    except OSError as e:
        raise ConfigError(
            f"no route from this host to --master_addr {master_addr!r}: "
            f"{e.strerror or type(e).__name__}",
            fix="check that --master_addr is node 0's address on a network this node is on",
        ) from e
    name = interface_of(addr, interfaces)
    master_local = all(_is_loopback(ip) for ip in master_ips(master_addr, port))
    if not master_local and (_is_loopback(addr) or name in LOOPBACK_IFNAMES):
        host = socket.gethostname()
        raise ConfigError(
            f"host {host!r} reaches --master_addr {master_addr!r} only through loopback "
            f"({addr}{', interface ' + name if name else ''}); the other nodes could not "
            "connect back to it",
            fix="check that --master_addr is node 0's address on the network the nodes share "
            f"and that {host!r} does not resolve to 127.x in /etc/hosts, or set "
            "GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME to that network's interface (e.g. eth0)",
        )
    return name


def plan_ifname(
    master_addr: str, port: int, nnodes: int, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The interface the launcher sets for its workers, or None to leave the environment alone:
    one node (loopback is fine), or the user named the interfaces already."""
    if nnodes <= 1 or all(var in environ for var in IFNAME_VARS):
        return None
    return socket_ifname(master_addr, port)

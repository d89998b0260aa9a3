"""zerotron.launcher.network: the interface that reaches --master_addr, and the refusal of a
remote master that only loopback reaches (inputs monkeypatched; real namespaces:
tests/distributed/test_netns.py)."""

from __future__ import annotations

import socket
from types import SimpleNamespace

import pytest

from zerotron.errors import ConfigError
from zerotron.launcher import launch, network

IFACES = {
    "lo": [SimpleNamespace(address="127.0.0.1"), SimpleNamespace(address="::1")],
    "eth0": [SimpleNamespace(address="10.0.0.5"), SimpleNamespace(address="fe80::1%eth0")],
}


def _ifname(source_addr: str, master_ips: set[str], master: str = "node0") -> str | None:
    return network.socket_ifname(
        master,
        29500,
        source=lambda addr, port: source_addr,
        interfaces=IFACES,
        master_ips=lambda addr, port: master_ips,
    )


def test_interface_of_finds_the_interface_holding_the_address():
    assert network.interface_of("10.0.0.5", IFACES) == "eth0"


def test_interface_of_ignores_the_ipv6_scope():
    assert network.interface_of("fe80::1", IFACES) == "eth0"


def test_interface_of_an_unknown_address_is_none():
    assert network.interface_of("192.168.1.1", IFACES) is None


def test_remote_master_reached_through_eth0_gives_eth0():
    assert _ifname("10.0.0.5", {"10.0.0.1"}) == "eth0"


def test_remote_master_reached_through_loopback_is_refused_naming_host_and_fix():
    with pytest.raises(ConfigError) as e:
        _ifname("127.0.0.1", {"10.0.0.1"})
    msg = str(e.value)
    assert socket.gethostname() in msg and "'node0'" in msg and "loopback" in msg
    assert "GLOO_SOCKET_IFNAME" in msg and "NCCL_SOCKET_IFNAME" in msg and "/etc/hosts" in msg


def test_remote_master_reached_through_lo_with_a_non_127_address_is_refused():
    ifaces = {"lo": [SimpleNamespace(address="10.9.9.9")]}
    with pytest.raises(ConfigError, match="only through loopback"):
        network.socket_ifname(
            "node0",
            1,
            source=lambda a, p: "10.9.9.9",
            interfaces=ifaces,
            master_ips=lambda a, p: {"10.0.0.1"},
        )


def test_loopback_master_gives_lo_without_error():
    assert _ifname("127.0.0.1", {"127.0.0.1"}, master="localhost") == "lo"


def test_no_route_to_master_is_a_config_error():
    def unreachable(addr, port):
        raise OSError(101, "Network is unreachable")

    with pytest.raises(ConfigError, match="no route .* Network is unreachable"):
        network.socket_ifname(
            "node0", 1, source=unreachable, interfaces=IFACES, master_ips=lambda a, p: {"10.0.0.1"}
        )


def test_route_source_of_localhost_is_loopback():
    assert network.route_source("127.0.0.1", 29500) == "127.0.0.1"


def test_one_node_leaves_the_environment_alone(monkeypatch):
    monkeypatch.setattr(network, "socket_ifname", lambda *a: pytest.fail("looked up"))
    assert network.plan_ifname("10.0.0.1", 29500, 1, {}) is None


def test_interfaces_the_user_named_are_left_alone(monkeypatch):
    monkeypatch.setattr(network, "socket_ifname", lambda *a: pytest.fail("looked up"))
    env = {"GLOO_SOCKET_IFNAME": "ib0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert network.plan_ifname("10.0.0.1", 29500, 2, env) is None


def test_many_nodes_look_the_interface_up(monkeypatch):
    monkeypatch.setattr(network, "socket_ifname", lambda addr, port: f"if-{addr}-{port}")
    assert network.plan_ifname("10.0.0.1", 29500, 2, {"GLOO_SOCKET_IFNAME": "x"}) == (
        "if-10.0.0.1-29500"
    )


def _plan(**kw) -> launch.LaunchPlan:
    base = dict(
        nproc_per_node=1,
        nnodes=2,
        node_rank=0,
        master_addr="10.0.0.1",
        master_port=29500,
        port_given=True,
        entrypoint="python",
        worker_args=[],
        log_dir=None,
        max_restarts=0,
        shutdown_timeout=1,
        rdzv_timeout=1,
        omp_num_threads=1,
    )
    return launch.LaunchPlan(**{**base, **kw})


def test_banner_names_the_interface_set(monkeypatch):
    for var in network.IFNAME_VARS:
        monkeypatch.delenv(var, raising=False)
    banner = launch._banner(_plan(socket_ifname="eth0"))
    assert banner.endswith(", GLOO_SOCKET_IFNAME/NCCL_SOCKET_IFNAME=eth0")


def test_banner_without_interface_is_unchanged():
    assert launch._banner(_plan()).endswith("OMP_NUM_THREADS=1")


def test_workers_get_the_interface_and_the_users_setting_stays(monkeypatch):
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "ib0")
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    with launch._launcher_state(_plan(socket_ifname="eth0")):
        seen = {v: launch.os.environ.get(v) for v in network.IFNAME_VARS}
    assert seen == {"GLOO_SOCKET_IFNAME": "eth0", "NCCL_SOCKET_IFNAME": "ib0"}
    assert "GLOO_SOCKET_IFNAME" not in launch.os.environ

"""The launchers' rendezvous: static (a fixed node count) or elastic (``--nnodes MIN:MAX``).

Static
------

Node ``i`` of ``N`` is group rank ``i`` (torchrun's ``--node_rank``), and node 0's launcher hosts
a TCPStore that the other launchers and every worker connect to. torch's own static rendezvous
keeps one store for the whole job; workers started again after a failure then read the previous
attempt's keys (addresses of processes that are gone) and cannot connect. Here attempt ``k``
opens a new store on its own port, which every node derives without talking to the others:
``master_port + k`` (or, on one node with a port the launcher picked, any free port).

Nothing waits silently: a node whose rendezvous host is not listening yet, and node 0 waiting
for the others, say every ``progress_every`` seconds who they wait for ("waiting for node 1 of
2 at host:port, 30 s of 900"), and the timeout ends in a :class:`LaunchError` naming the nodes
that never came. The other nodes probe node 0's port with a plain socket before torch's store
client connects, so torch's retry loop (warnings with C++ stack frames) never runs.

Elastic
-------
:class:`ElasticRendezvous` is torch's own dynamic rendezvous on a c10d store (torchrun's
``--rdzv_backend c10d``) hosted by node 0's launcher: every round admits between ``min_nodes``
and ``max_nodes`` nodes, a node whose launcher stops sending heartbeats is dropped, and torch
numbers the nodes of each round. On top of it every node writes a label (``node 1
(10.213.8.2)``: its ``--node_rank`` and the address the others reach it at) into the round's
store and reads the others', so a restart says by name which nodes left or joined since the
previous round (:attr:`ElasticRendezvous.lost` keeps them for the launcher's last word).
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
)

from zerotron.errors import LaunchError


class StaticRendezvous(RendezvousHandler):
    """``nnodes`` nodes with fixed ranks meeting at ``master_addr``; see the module docstring."""

    def __init__(
        self,
        master_addr: str,
        port_of_attempt: Callable[[int], int],
        node_rank: int,
        nnodes: int,
        run_id: str,
        timeout_s: float,
    ):
        self.master_addr = master_addr
        self.port_of_attempt = port_of_attempt
        self.node_rank = node_rank
        self.nnodes = nnodes
        self.run_id = run_id
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.attempt = -1
        self._store: TCPStore | None = None
        self.say: Callable[[str], None] = lambda text: None
        self.progress_every = min(30.0, max(1.0, timeout_s / 10))

    def get_backend(self) -> str:
        return "static"

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to this store (TORCHELASTIC_USE_AGENT_STORE)

    def next_rendezvous(self) -> RendezvousInfo:
        self.attempt += 1
        port = self.port_of_attempt(self.attempt)
        self._store = None  # the previous attempt's server closes with its last reference
        deadline = time.monotonic() + self.timeout.total_seconds()
        if self.node_rank != 0:
            self._wait_for_host(port, deadline)
        # Node 0 serves; every node then counts itself in and waits for the others.
        self._store = TCPStore(
            self.master_addr,
            port,
            self.nnodes,
            self.node_rank == 0,
            self.timeout,
            wait_for_workers=False,
            multi_tenant=True,
        )
        self._store.set(f"{_NODE_KEY}{self.node_rank}", "1")
        self._store.add(_JOINED_KEY, 1)
        self._wait_for_nodes(self._store, port, deadline)
        return RendezvousInfo(
            PrefixStore(self.run_id, self._store),
            self.node_rank,
            self.nnodes,
            RendezvousStoreInfo(self.master_addr, port),
        )

    def _wait_for_host(self, port: int, deadline: float) -> None:
        """Until node 0 listens at the rendezvous port (a plain socket: no torch retry noise)."""
        progress = _Progress(self.say, self.progress_every, self.timeout.total_seconds())
        where = f"{self.master_addr}:{port}"
        while not _probe(self.master_addr, port):
            if time.monotonic() >= deadline:
                raise _timed_out(self, [0], port)
            progress.tick(lambda: f"node 0 of {self.nnodes} at {where} (not listening yet)")
            time.sleep(0.25)

    def _wait_for_nodes(self, store: TCPStore, port: int, deadline: float) -> None:
        """Until every node has counted itself in, saying which ones are missing."""
        progress = _Progress(self.say, self.progress_every, self.timeout.total_seconds())

        def missing() -> list[int]:
            return [i for i in range(self.nnodes) if not store.check([f"{_NODE_KEY}{i}"])]

        while store.add(_JOINED_KEY, 0) < self.nnodes:
            if time.monotonic() >= deadline:
                raise _timed_out(self, missing(), port)
            progress.tick(
                lambda: f"{_nodes(missing())} of {self.nnodes} at {self.master_addr}:{port}"
            )
            time.sleep(0.1)

    def is_closed(self) -> bool:
        return False

    def set_closed(self) -> None:
        pass

    def num_nodes_waiting(self) -> int:
        return 0

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        self._store = None
        return True


_NODE_KEY = "zerotron/rdzv/node"
_JOINED_KEY = "zerotron/rdzv/joined"


class _Progress:
    """Says what a wait is waiting for, every ``every`` seconds."""

    def __init__(self, say: Callable[[str], None], every: float, total: float) -> None:
        self.say, self.every, self.total = say, every, total
        self.start = time.monotonic()
        self.next = self.start + every

    def tick(self, waiting_for: Callable[[], str]) -> None:
        now = time.monotonic()
        if now >= self.next:
            self.next = now + self.every
            self.say(f"waiting for {waiting_for()}, {now - self.start:.0f} s of {self.total:g}")


def _probe(addr: str, port: int) -> bool:
    """Whether something accepts connections at addr:port (unresolvable: LaunchError)."""
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except socket.gaierror as e:
        raise LaunchError(
            f"--master_addr {addr!r} does not resolve: {e.strerror}",
            fix="give node 0's host name or IP address, as every node can reach it",
        ) from None
    except OSError:  # refused, unreachable, timed out: not up yet
        return False


def _nodes(ranks: list[int]) -> str:
    if not ranks:
        return "some nodes"
    return f"node {ranks[0]}" if len(ranks) == 1 else "nodes " + ", ".join(map(str, ranks))


def _timed_out(handler: StaticRendezvous, missing: list[int], port: int) -> LaunchError:
    return LaunchError(
        f"rendezvous timed out after {handler.timeout.total_seconds():g} s: {_nodes(missing)} "
        f"of {handler.nnodes} never joined at {handler.master_addr}:{port}",
        where=f"node {handler.node_rank}",
        fix="start `zerotron launch` on every node with the same --nnodes, --master_addr and "
        "--master_port, and a distinct --node_rank; raise --rdzv_timeout if nodes start late",
    )


# Elastic rounds: torch's defaults, except a quicker last call (a job that names its node counts
# does not need half a minute to notice that every node is there).
ELASTIC_DEFAULTS = {
    "last_call_timeout": "10",
    "keep_alive_interval": "5",
    "keep_alive_max_attempt": "3",
}
_LABEL_KEY = "zerotron/node_label/"


class ElasticRendezvous(RendezvousHandler):
    """torch's dynamic c10d rendezvous for ``min_nodes .. max_nodes`` nodes, saying who came and
    went at every restart; see the module docstring."""

    def __init__(
        self,
        master_addr: str,
        port: int,
        node_rank: int,
        local_addr: str,
        min_nodes: int,
        max_nodes: int,
        run_id: str,
        timeout_s: float,
        conf: Mapping[str, str] | None = None,
        max_restarts: int = 0,
        say: Callable[[str], None] = lambda text: None,
    ):
        from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
        from torch.distributed.elastic.rendezvous import dynamic_rendezvous

        self.master_addr, self.port, self.node_rank = master_addr, port, node_rank
        self.min_nodes, self.max_nodes, self.max_restarts = min_nodes, max_nodes, max_restarts
        self.label = f"node {node_rank} ({local_addr})"
        self.say = say
        self.attempt = -1
        self.members: list[str] = []  # the labels of the current round, by torch's node rank
        self.lost: list[tuple[int, str]] = []  # (restart, label) of every node that left
        self._round: int | None = None  # torch's round number of the current round
        self._told_gone = False  # whether this round's dropped members were announced
        config = {**ELASTIC_DEFAULTS, "join_timeout": str(int(timeout_s)), **(conf or {})}
        config["is_host"] = str(node_rank == 0)  # node 0's launcher serves the store
        params = RendezvousParameters(
            backend="c10d",
            endpoint=f"{master_addr}:{port}",
            run_id=run_id,
            min_nodes=min_nodes,
            max_nodes=max_nodes,
            local_addr=local_addr,  # what the workers of the others connect to, never 127.x
            **config,
        )
        if node_rank != 0:  # node 0 may start later: wait without torch's retry warnings
            progress = _Progress(self.say, min(30.0, max(1.0, timeout_s / 10)), timeout_s)
            deadline = time.monotonic() + timeout_s
            while not _probe(master_addr, port):
                if time.monotonic() >= deadline:
                    raise LaunchError(
                        f"rendezvous timed out after {timeout_s:g} s: node 0 never listened "
                        f"at {master_addr}:{port}",
                        where=self.label,
                        fix="start node 0's launcher (--node_rank 0) with the same "
                        "--master_addr/--master_port; raise --rdzv_timeout if it starts late",
                    )
                progress.tick(lambda: f"node 0 at {master_addr}:{port} (not listening yet)")
                time.sleep(0.25)
        backend, store = c10d.create_backend(params)
        self._inner = dynamic_rendezvous.create_handler(store, backend, params)

    def next_rendezvous(self) -> RendezvousInfo:
        self.attempt += 1
        if self.attempt > 0:
            self.say(
                f"restart {self.attempt} of {self.max_restarts}: rejoining the rendezvous at "
                f"{self.master_addr}:{self.port} ({_span(self.min_nodes, self.max_nodes)})"
            )
        info = self._inner.next_rendezvous()
        state = self._torch_state()
        self._round = None if state is None else state.round
        self._told_gone = False
        info.store.set(f"{_LABEL_KEY}{info.rank}", self.label)
        members = [
            info.store.get(f"{_LABEL_KEY}{rank}").decode() for rank in range(info.world_size)
        ]
        gone = [m for m in self.members if m not in members]
        came = [m for m in members if m not in self.members] if self.members else []
        self.lost += [(self.attempt, m) for m in gone]
        self.members = members
        for line in round_report(
            self.attempt, gone, came, len(members), self.min_nodes, self.max_nodes
        ):
            self.say(line)
        return info

    def get_backend(self) -> str:
        return self._inner.get_backend()

    @property
    def use_agent_store(self) -> bool:
        return self._inner.use_agent_store

    def is_closed(self) -> bool:
        return self._inner.is_closed()

    def set_closed(self) -> None:
        self._inner.set_closed()

    def num_nodes_waiting(self) -> int:
        """Nodes waiting to join, plus the members of this round that the rendezvous dropped
        (their launchers stopped sending heartbeats, or left to meet again): torch's agent
        stops this node's ranks and meets again when this is above 0.

        torch counts only the nodes waiting to join and leaves a lost node to the ranks'
        backend, whose collectives with the lost node's ranks are to fail. gloo does not always
        fail them: a receive posted after the peer's connection closed waits for the
        process-group timeout. Counting the dropped members restarts the nodes left within the
        keep-alive limit (``keep_alive_interval`` × ``keep_alive_max_attempt``) on any backend.
        """
        waiting = self._inner.num_nodes_waiting()  # syncs the state, which drops dead nodes
        gone = self.members_gone()
        if gone and not self._told_gone:
            self._told_gone = True
            self.say(
                f"{', '.join(gone)} left the round (stopped answering, or meeting again): "
                "stopping the ranks here to meet again"
            )
        return waiting + len(gone)

    def members_gone(self) -> list[str]:
        """The labels of this round's members that torch's rendezvous state no longer lists
        (as of its last sync); [] when the state is not torch's as expected, or a newer round
        began."""
        state = self._torch_state()
        if state is None or state.round != self._round:
            return []
        here = set(state.participants.values())  # torch's node ranks of the round
        return [label for rank, label in enumerate(self.members) if rank not in here]

    def _torch_state(self) -> Any:
        """torch's rendezvous state as its last sync left it (a private attribute of its
        dynamic handler), or None where this torch lays it out otherwise."""
        state = getattr(getattr(self._inner, "_state_holder", None), "state", None)
        if not hasattr(state, "round") or not isinstance(
            getattr(state, "participants", None), dict
        ):
            return None
        return state

    def get_run_id(self) -> str:
        return self._inner.get_run_id()

    def shutdown(self) -> bool:
        return self._inner.shutdown()


def round_report(
    attempt: int, gone: list[str], came: list[str], size: int, min_nodes: int, max_nodes: int
) -> list[str]:
    """What a restart's round changed, one line each (nothing for the first round)."""
    if attempt == 0 and not came:
        return []
    lines = [f"{m} left the job (its launcher stopped answering)" for m in gone]
    lines += [f"{m} joined the job" for m in came]
    change = "" if gone or came else ", the same nodes as before"
    lines.append(
        f"{'restart ' + str(attempt) if attempt else 'round'}: going on with {size} node(s) of "
        f"{_span(min_nodes, max_nodes)}{change}; the program resumes from its newest checkpoint"
    )
    return lines


def lost_report(lost: list[tuple[int, str]]) -> str:
    """The launcher's last word on the nodes that left during the job ('' if none did)."""
    return "; ".join(f"{label} was lost (restart {attempt})" for attempt, label in lost)


def _span(min_nodes: int, max_nodes: int) -> str:
    return f"{min_nodes} node(s)" if min_nodes == max_nodes else f"{min_nodes}..{max_nodes} nodes"

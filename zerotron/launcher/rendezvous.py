"""Static rendezvous with a fresh store for every attempt, so ``--max_restarts`` works.

Node ``i`` of ``N`` is group rank ``i`` (torchrun's ``--node_rank``), and node 0's launcher hosts
a TCPStore that the other launchers and every worker connect to. torch's own static rendezvous
keeps one store for the whole job; workers started again after a failure then read the previous
attempt's keys (addresses of processes that are gone) and cannot connect. Here attempt ``k``
opens a new store on its own port, which every node derives without talking to the others:
``master_port + k`` (or, on one node with a port the launcher picked, any free port).
"""

from __future__ import annotations

import datetime
from collections.abc import Callable

from torch.distributed import PrefixStore, TCPStore
from torch.distributed.elastic.rendezvous import (
    RendezvousHandler,
    RendezvousInfo,
    RendezvousStoreInfo,
)


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

    def get_backend(self) -> str:
        return "static"

    @property
    def use_agent_store(self) -> bool:
        return True  # workers connect to this store (TORCHELASTIC_USE_AGENT_STORE)

    def next_rendezvous(self) -> RendezvousInfo:
        self.attempt += 1
        port = self.port_of_attempt(self.attempt)
        self._store = None  # the previous attempt's server closes with its last reference
        # Node 0 serves and waits until every node's launcher has connected; the others retry
        # connecting until the timeout.
        self._store = TCPStore(
            self.master_addr,
            port,
            self.nnodes,
            self.node_rank == 0,
            self.timeout,
            multi_tenant=True,
        )
        return RendezvousInfo(
            PrefixStore(self.run_id, self._store),
            self.node_rank,
            self.nnodes,
            RendezvousStoreInfo(self.master_addr, port),
        )

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

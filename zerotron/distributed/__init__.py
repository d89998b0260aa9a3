"""Distributed foundations: the rank grid today; process groups, comm and RNG tracker next.

- :mod:`zerotron.distributed.topology`: :class:`ProcessTopology`, the pure (pp, dp, tp) rank
  grid every process group is built from.
"""

from zerotron.distributed.topology import AXES, GROUP_NAMES, Coords, ProcessTopology

__all__ = ["AXES", "GROUP_NAMES", "Coords", "ProcessTopology"]

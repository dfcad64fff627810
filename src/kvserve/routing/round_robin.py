"""Round-robin over the live replicas: the cache-blind baseline a plain load balancer gives."""
from __future__ import annotations

from kvserve.routing.base import Replica, RoutingPolicy, alive


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def choose(self, block_hashes: list[bytes], replicas: list[Replica]) -> int:
        live = alive(replicas)
        pick = live[self._next % len(live)]
        self._next += 1
        return pick.rank

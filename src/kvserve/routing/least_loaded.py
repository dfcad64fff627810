"""Least loaded (outstanding requests: running, waiting and on their way), blind to the cache."""
from __future__ import annotations

from kvserve.routing.base import Replica, RoutingPolicy, alive, least_loaded


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def choose(self, block_hashes: list[bytes], replicas: list[Replica]) -> int:
        return least_loaded(alive(replicas)).rank

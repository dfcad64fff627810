"""Cache-aware routing weighed against load, the rule of SGLang's router (and vllm-router's
cache_aware policy), on exact block hashes instead of an approximate text tree:

1. When the load is out of balance (the busiest replica's load exceeds the idlest's by more than
   `balance_abs` and by a factor over `balance_rel`), send to the least loaded: this is what keeps
   a hot prefix from piling every request onto the replica that caches it.
2. Otherwise send to the replica holding the longest cached prefix, if it covers at least
   `cache_threshold` of the prompt's blocks (ties: the less loaded).
3. Otherwise (a prefix nobody holds, or only a sliver of it) to the least loaded, so new prefixes
   spread over the replicas.
"""
from __future__ import annotations

from kvserve.routing.base import Replica, RoutingPolicy, alive, least_loaded


class CacheAware(RoutingPolicy):
    name = "cache_aware"

    def __init__(self, cache_threshold: float = 0.5, balance_abs: int = 8, balance_rel: float = 1.5) -> None:
        self.cache_threshold = cache_threshold
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel

    def choose(self, block_hashes: list[bytes], replicas: list[Replica]) -> int:
        live = alive(replicas)
        idlest = least_loaded(live)
        busiest = max(r.load for r in live)
        if busiest - idlest.load > self.balance_abs and busiest > self.balance_rel * idlest.load:
            return idlest.rank
        if block_hashes:
            best = max(live, key=lambda r: (r.index.match(block_hashes), -r.load, -r.rank))
            if best.index.match(block_hashes) >= max(1, self.cache_threshold * len(block_hashes)):
                return best.rank
        return idlest.rank

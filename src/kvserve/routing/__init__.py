"""Which data-parallel replica serves a request: the policies a front end routes by (torch-free,
so `kvserve simulate` drives the same code without weights)."""
from kvserve.routing.base import Replica, RoutingPolicy
from kvserve.routing.cache_aware import CacheAware
from kvserve.routing.least_loaded import LeastLoaded
from kvserve.routing.round_robin import RoundRobin

POLICIES: dict[str, type[RoutingPolicy]] = {p.name: p for p in (CacheAware, LeastLoaded, RoundRobin)}


def make_policy(name: str) -> RoutingPolicy:
    return POLICIES[name]()


__all__ = ["POLICIES", "Replica", "RoutingPolicy", "make_policy"]

"""The routing interface: a policy picks one live replica for a request from what the front end
knows of each (its load, and the prefix-cache blocks its KV events announced)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

from kvserve.routing.prefix_index import PrefixIndex

# Load counts outstanding requests, as SGLang's and vllm-router's do. vLLM's data-parallel score
# weighs a waiting request as four running ones; here that tipped the balance rule on every short
# burst and cost prefix hits (82.5 % against 85.2 % in bench/scale_out.py: bench/NOTES.md).
WAITING_WEIGHT = 1


@dataclass
class Replica:
    rank: int
    num_running: int = 0  # as of the replica's last step
    num_waiting: int = 0
    num_pending: int = 0  # sent to it and not yet admitted (not in its stats yet)
    alive: bool = True
    index: PrefixIndex = field(default_factory=PrefixIndex)

    @property
    def load(self) -> int:
        return self.num_running + WAITING_WEIGHT * (self.num_waiting + self.num_pending)


class RoutingPolicy(ABC):
    name: str

    @abstractmethod
    def choose(self, block_hashes: list[bytes], replicas: list[Replica]) -> int:
        """The rank to send a request to. `block_hashes`: the prefix-cache hashes of the prompt's
        full blocks (empty where the front end cannot compute them); `replicas`: at least one alive."""


def alive(replicas: list[Replica]) -> list[Replica]:
    live = [r for r in replicas if r.alive]
    if not live:
        raise RuntimeError("no data-parallel replica is alive")
    return live


def least_loaded(replicas: list[Replica]) -> Replica:
    """Lowest load; ties go to the replica holding the fewest cached blocks (the most room), then
    the lowest rank."""
    return min(replicas, key=lambda r: (r.load, len(r.index), r.rank))

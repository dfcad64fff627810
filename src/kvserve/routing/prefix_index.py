"""What one replica has cached, rebuilt from its KV events (kv/events.py): the set of block hashes
each medium (device pool, host, disk, Redis) holds. The hashes are the cache's own salted chain
hashes, so matching a prompt's hashes against them finds the longest cached prefix exactly."""
from __future__ import annotations

from kvserve.kv.events import AllBlocksCleared, BlockRemoved, BlockStored


class PrefixIndex:
    def __init__(self) -> None:
        self._media: dict[str, set[bytes]] = {}

    def apply(self, events: list) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self._media.setdefault(e.medium, set()).update(e.block_hashes)
            elif isinstance(e, BlockRemoved):
                held = self._media.get(e.medium)
                if held:
                    held.difference_update(e.block_hashes)
            elif isinstance(e, AllBlocksCleared):
                if e.medium is None:
                    self._media.clear()
                else:
                    self._media.pop(e.medium, None)

    def __len__(self) -> int:
        return sum(len(s) for s in self._media.values())

    def __contains__(self, block_hash: bytes) -> bool:
        return any(block_hash in s for s in self._media.values())

    def match(self, block_hashes: list[bytes]) -> int:
        """Leading blocks of `block_hashes` held in any medium (a chain: a gap ends the prefix)."""
        n = 0
        for h in block_hashes:
            if h not in self:
                break
            n += 1
        return n

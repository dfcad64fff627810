"""StreamingLLM: the blocks holding the first sink_tokens and the last window tokens stay; every
block between them is released as the window passes it."""
from __future__ import annotations

from typing import Sequence

from kvserve.kv.compression.base import CompressionMethod, ceil_blocks


class Streaming(CompressionMethod):
    def blocks_to_release(self, logical: Sequence[int], next_pos: int, block_size: int, prompt_len: int,
                          scores: Sequence[float]) -> list[int]:
        sinks = ceil_blocks(self.c.sink_tokens, block_size)
        return [i for i in self.older_than_window(logical, next_pos, block_size) if logical[i] >= sinks]

"""SnapKV by whole blocks: the prompt is compressed once, when its prefill ends. The queries of
its last observation_tokens vote: each prompt block older than the recent window receives the
attention those queries pay it (summed over layers and heads), and the heavy_tokens / block_size
blocks with the most votes stay with the sink blocks and the window; the other prompt blocks go.
While decoding, the chosen blocks stay and the window slides as in streaming: the blocks it
leaves are released.

The prompt is held whole until its last chunk has run (the vote needs it), so the bound applies
from the first output token on.
"""
from __future__ import annotations

from typing import Sequence

from kvserve.kv.compression.base import CompressionMethod, ceil_blocks


class SnapKV(CompressionMethod):
    def blocks_to_release(self, logical: Sequence[int], next_pos: int, block_size: int, prompt_len: int,
                          scores: Sequence[float]) -> list[int]:
        if next_pos < prompt_len:
            return []  # the vote comes with the prompt's last chunk
        sinks = ceil_blocks(self.c.sink_tokens, block_size)
        # Blocks wholly before the window at the vote compete; after it they are the chosen ones.
        voted = (prompt_len - self.c.window) // block_size  # logical blocks 0 .. voted - 1
        old = [i for i in self.older_than_window(logical, next_pos, block_size) if logical[i] >= sinks]
        drop = [i for i in old if logical[i] >= voted]  # left the window since the vote
        candidates = [i for i in old if logical[i] < voted]
        keep = ceil_blocks(self.c.heavy_tokens, block_size)
        if len(candidates) > keep:
            ranked = sorted(candidates, key=lambda i: (scores[i] if i < len(scores) else 0.0, i))
            drop += ranked[:len(candidates) - keep]
        return sorted(drop)

    def score_rows(self, start_pos: int, num_new_tokens: int, prompt_len: int) -> tuple[int, int] | None:
        if not start_pos < prompt_len <= start_pos + num_new_tokens:
            return None  # only the chunk that ends the prompt votes
        return (min(self.c.observation_tokens, num_new_tokens), 1)

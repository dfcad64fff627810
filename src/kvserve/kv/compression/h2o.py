"""H2O (Heavy-Hitter Oracle) by whole blocks: the blocks holding the last window tokens stay, and
of the older blocks the heavy_tokens / block_size that have received the most attention so far;
whenever more are held, the least-attended go.

Scores accumulate from every decode step's query and from prompt chunks. A prompt chunk's rows
are scored every PROMPT_ROW_STRIDE-th (each counted that many times): an even sample of the
chunk estimates the same sum, and scoring every row of a 512-token chunk would cost about as much
again as the chunk's attention, in a step that other requests share.
"""
from __future__ import annotations

from typing import Sequence

from kvserve.kv.compression.base import CompressionMethod, ceil_blocks

PROMPT_ROW_STRIDE = 8


class H2O(CompressionMethod):
    def blocks_to_release(self, logical: Sequence[int], next_pos: int, block_size: int, prompt_len: int,
                          scores: Sequence[float]) -> list[int]:
        old = self.older_than_window(logical, next_pos, block_size)
        keep = ceil_blocks(self.c.heavy_tokens, block_size)
        if len(old) <= keep:
            return []
        ranked = sorted(old, key=lambda i: (scores[i] if i < len(scores) else 0.0, i))
        return sorted(ranked[:len(old) - keep])

    def score_rows(self, start_pos: int, num_new_tokens: int, prompt_len: int) -> tuple[int, int] | None:
        return (num_new_tokens, 1 if num_new_tokens == 1 else PROMPT_ROW_STRIDE)

"""The interface every KV compression method implements: which held blocks a sequence releases,
and which of its query rows the forward scores (attention per block) for that decision.

A method sees the logical index of each block the sequence still holds (block j holds positions
j*bs .. j*bs + bs - 1, ascending), the position of the next token to compute, the prompt length
and, for score-based methods, the attention each held block has received so far (the runner sums
it in the layer loop, see attention/base.py's score_blocks). One decision covers every layer:
they share the block table. Plain integers, no torch.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

from kvserve.core.kv_compression import KVCompression


def ceil_blocks(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


class CompressionMethod(ABC):
    def __init__(self, c: KVCompression) -> None:
        self.c = c

    @abstractmethod
    def blocks_to_release(self, logical: Sequence[int], next_pos: int, block_size: int, prompt_len: int,
                          scores: Sequence[float]) -> list[int]:
        """Indices into `logical` of the blocks to release before the token at `next_pos`."""

    def score_rows(self, start_pos: int, num_new_tokens: int, prompt_len: int) -> tuple[int, int] | None:
        """(last, stride): score the chunk's last `last` query rows, every stride-th of them
        (each counted stride times); None: this chunk computes no scores."""
        return None

    def older_than_window(self, logical: Sequence[int], next_pos: int, block_size: int) -> list[int]:
        """Indices of the held blocks wholly before the recent window of the next token."""
        recent_from = next_pos - self.c.window
        return [i for i, j in enumerate(logical) if (j + 1) * block_size <= recent_from]

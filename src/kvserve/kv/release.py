"""Which of a running sequence's blocks no future token will attend to, so they can leave it.

A policy looks at the logical index of each block the sequence still holds (block j holds
positions j*bs .. j*bs + bs - 1) and the position of the next token to compute, and names the
blocks to release. The KV cache manager drops them from the block table (the runner then sees a
shorter table and a position offset for the new tokens, see kv/manager.py).

- sliding window W (the model's): the next query at position p sees keys p - W + 1 .. p, so a
  block whose last position is <= p - W is never read again; exact, nothing changes in the output.
- KV compression: the request's method (kv/compression/: streaming, h2o, snapkv) decides.
Plain integers, no torch.
"""
from __future__ import annotations

from typing import Sequence

from kvserve.core.kv_compression import KVCompression, active
from kvserve.kv.compression import method_for

SLIDING_WINDOW = "sliding_window"


def release_reason(compression: KVCompression | None, sliding_window: int | None) -> str | None:
    """The policy a sequence runs under (a metric label), or None when it never releases."""
    if active(compression) is not None:
        return compression.method
    return SLIDING_WINDOW if sliding_window else None


def blocks_to_release(reason: str, logical: Sequence[int], next_pos: int, block_size: int,
                      compression: KVCompression | None, sliding_window: int | None,
                      scores: Sequence[float] = (), prompt_len: int = 0) -> list[int]:
    """Indices into `logical` (the held blocks' logical indices, ascending) of the blocks to
    release before the token at `next_pos` is computed."""
    if reason == SLIDING_WINDOW:
        last_needed = next_pos - sliding_window + 1  # first key position the next query sees
        return [i for i, j in enumerate(logical) if (j + 1) * block_size <= last_needed]
    return method_for(compression).blocks_to_release(logical, next_pos, block_size, prompt_len, scores)

"""CUDA graphs of the decode step: `LlamaModel.forward` captured once per batch size, replayed.

A 30-layer model's decode step is ~450 small kernels; launched one by one from Python, the GPU
waits on the CPU. Replaying a captured graph launches them all at once. A decode-only step of n
sequences replays the graph of the smallest captured size b >= n; rows n..b-1 are padding:
slot -1 (the cache write skips it) and context length 0 (the decode kernel reads no key and
writes zeros), so they touch no real sequence.

Everything a replay reads lives in static device buffers that the graph captured by address:
per row the input id, position, slot and context length (one [4, B] tensor) and the block
table (a [B, max_blocks] tensor). Each step fills a pinned host copy of both and sends them in
two copies. Block-table columns past a row's context hold stale ids that no kernel reads.

Under tensor parallelism each rank captures its own graphs, all-reduces included (NCCL
collectives are capturable), after the group is joined; every rank replays the graph of the same
size at the same step, since they all run the same step.

Only the Triton backend over a full-precision `PagedKVCache` is captured: its kernels take every
per-step quantity from device memory. The torch backend and the quantized caches plan each step
on the host (gathers sized by the step), which a graph cannot replay; they run eagerly.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from kvserve.attention.base import AttentionMetadata
from kvserve.model.llama import LlamaModel

logger = logging.getLogger(__name__)

# Rows of the [4, B] per-token buffer.
_IDS, _POS, _SLOT, _LEN = range(4)


def capture_sizes(max_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 up to max_size, and max_size itself (vLLM's list, without
    its step to multiples of 16 past 256: one graph is cheap here, and padding up to 15 rows is not)."""
    sizes = [s for s in (1, 2, 4) if s <= max_size] + list(range(8, max_size + 1, 8))
    if max_size not in sizes:
        sizes.append(max_size)
    return sizes


def graphs_unsupported(model: LlamaModel, kv_cache: object) -> str | None:
    """Why this model and cache cannot run decode steps as graphs, or None when they can."""
    from kvserve.attention.triton import TritonAttentionBackend
    from kvserve.cache.paged import PagedKVCache

    if model.device.type != "cuda":
        return f"CUDA graphs need a CUDA device (the model is on {model.device})"
    if not isinstance(model.attn, TritonAttentionBackend) or model.attn.mode != "cuda":
        return "CUDA graphs need the triton attention backend (--attention-backend triton)"
    if type(kv_cache) is not PagedKVCache:
        return "CUDA graphs need a full-precision KV cache (--kv-cache-dtype auto)"
    return None


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [b, hidden] written by every replay


class DecodeGraphs:
    """Decode graphs for every size in `sizes`, sharing one memory pool (largest captured first)."""

    def __init__(self, model: LlamaModel, kv_cache: object, block_size: int, max_blocks_per_seq: int,
                 sizes: list[int]) -> None:
        reason = graphs_unsupported(model, kv_cache)
        if reason:
            raise ValueError(reason)
        if not sizes or min(sizes) < 1:
            raise ValueError(f"capture sizes must be positive batch sizes, got {sizes}")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.max_blocks = max_blocks_per_seq
        dev = model.device
        b, w = self.max_size, max_blocks_per_seq
        self._host_rows = torch.zeros(4, b, dtype=torch.long, pin_memory=True)
        self._host_tables = torch.zeros(b, w, dtype=torch.long, pin_memory=True)
        self._rows = torch.zeros(4, b, dtype=torch.long, device=dev)
        self._tables = torch.zeros(b, w, dtype=torch.long, device=dev)
        self._arange = torch.arange(b, dtype=torch.long, device=dev)
        self._rows[_SLOT].fill_(-1)
        self._copied = torch.cuda.Event()  # the last step's host buffers have been sent
        self._graphs: dict[int, _Graph] = {}
        self.replays = 0

    def _metadata(self, b: int) -> AttentionMetadata:
        """The step metadata every replay of size b reads: views of the static buffers."""
        rows = self._rows[:, :b]
        return AttentionMetadata(
            block_size=self.block_size, positions=rows[_POS], slot_mapping=rows[_SLOT],
            query_start_loc=list(range(b + 1)), query_lens=[1] * b, start_pos=[0] * b,
            seq_lens=[1] * b, seq_lens_tensor=rows[_LEN], block_tables=self._tables[:b],
            decode_seq_ids=self._arange[:b], decode_token_ids=self._arange[:b], prefill_seq_ids=[])

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every size. Before each capture one eager run compiles the kernels and
        fills `backend_state` (the step plan), so the capture itself does no host work."""
        pool = None
        stream = torch.cuda.Stream(self.model.device)
        for b in reversed(self.sizes):
            meta = self._metadata(b)
            ids = self._rows[_IDS, :b]
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self.model.forward(ids, meta.positions, meta, self.kv_cache)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            mode = "global"
            if self.model.all_reduce is not None:
                # Under tensor parallelism the graph holds NCCL all-reduces, which every rank
                # captures in the same order (the eager run above met all of them). NCCL's
                # watchdog thread queries the events of collectives already issued, which a
                # global capture forbids on any thread: none may be in flight, and only this
                # thread's calls are checked.
                torch.cuda.synchronize(self.model.device)
                mode = "thread_local"
            with torch.cuda.graph(graph, pool=pool, capture_error_mode=mode):
                hidden = self.model.forward(ids, meta.positions, meta, self.kv_cache)
            pool = graph.pool()
            self._graphs[b] = _Graph(graph, hidden)
        torch.cuda.synchronize(self.model.device)

    def size_for(self, num_seqs: int) -> int | None:
        """The captured size a decode step of num_seqs sequences replays, or None (run eagerly)."""
        if num_seqs > self.max_size:
            return None
        return next(b for b in self.sizes if b >= num_seqs)

    def run(self, token_ids: np.ndarray, positions: np.ndarray, block_tables: list[list[int]]) -> torch.Tensor:
        """One decode step: sequence i feeds token_ids[i] at positions[i] (its context so far)
        with block_tables[i]. Returns the hidden states [n, hidden] (valid until the next run)."""
        n = len(token_ids)
        b = self.size_for(n)
        if b is None:
            raise ValueError(f"a decode step of {n} sequences exceeds the largest captured size {self.max_size}")
        # The pinned buffers may still be on their way to the device from the previous step.
        self._copied.synchronize()
        host = self._host_rows.numpy()
        tables = self._host_tables.numpy()
        widths = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=n)
        if n and int(widths.max()) > self.max_blocks:
            raise ValueError(f"a block table of {int(widths.max())} blocks exceeds the captured width "
                             f"{self.max_blocks} (max_model_len / block_size)")
        for i, t in enumerate(block_tables):  # per sequence, not per token
            tables[i, :len(t)] = t
        host[_IDS, :n] = token_ids
        host[_POS, :n] = positions
        host[_SLOT, :n] = tables[np.arange(n), positions // self.block_size] * self.block_size \
            + positions % self.block_size
        host[_LEN, :n] = positions + 1
        host[_SLOT, n:b] = -1
        host[_LEN, n:b] = 0
        self._rows[:, :b].copy_(self._host_rows[:, :b], non_blocking=True)
        self._tables[:n].copy_(self._host_tables[:n], non_blocking=True)
        self._copied.record()
        g = self._graphs[b]
        g.graph.replay()
        self.replays += 1
        return g.hidden[:n]

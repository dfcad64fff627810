"""Paged attention with Triton kernels: the CUDA drop-in for `CPUAttentionBackend`.

Same interface and semantics as the torch backend (see base.py): every layer first writes the
step's K/V into the pool (`reshape_and_cache_kernel`), then all 1-token chunks go through ONE
decode launch (a small batch splits each decode's keys into ranges, flash-decoding, and a
second launch combines them) and all longer chunks through ONE varlen prefill launch; both read
K/V through the block tables in place, with no gather copy. Sliding window: a key at `kp` is
visible from a query at `qp` only when `0 <= qp - kp < window`.

This module imports without triton and without CUDA; `triton_support(device)` says whether the
backend can run and, if not, what to change. On CPU the kernels run only under triton's
interpreter (`TRITON_INTERPRET=1`, set before triton is imported): slow, meant for testing.

Quantized caches (fp8 / int8 / int4): the cache's own write quantizes (and keeps the KIVI
residual), then the blocks this step reads - and only those - are dequantized once per layer
into a step-sized scratch pool that the same kernels walk through remapped block tables. No
full-precision copy of the cache exists; the cost is one dequantized copy of the step's working
set per layer (what the torch backend's gather also pays). A kernel that dequantizes inside its
K/V loads would save that copy; it needs a GPU to measure and is not built yet.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from types import ModuleType

import torch

from kvserve import envs
from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.cache.base import KVCache
from kvserve.cache.paged import PagedKVCache
from kvserve.config import ConfigError

TRITON_INTERPRET_ENV = "TRITON_INTERPRET"
KERNELS_MODULE = "kvserve.attention.triton_kernels"
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
# tl.dot needs every dimension >= 16 on NVIDIA GPUs; tiles are padded up to it.
_MIN_DOT_DIM = 16
# Flash-decoding: split a decode's keys until the batch has this many (sequence, kv head,
# split) programs per SM, at most MAX_DECODE_SPLITS ranges (bench/NOTES.md, "Flash-decoding on
# CUDA: split a decode's keys until 4 programs per SM, at most 32 ranges").
DECODE_PROGRAMS_PER_SM = 4
MAX_DECODE_SPLITS = 32


@dataclass(frozen=True)
class TritonSupport:
    available: bool
    mode: str  # "cuda" | "interpreter" | "" when unavailable
    reason: str  # when unavailable: what is missing and what to change


def interpreter_enabled() -> bool:
    # Same truthy spellings as triton's own knob parsing.
    return envs.TRITON_INTERPRET


def triton_support(device: torch.device | str) -> TritonSupport:
    """Whether the triton backend can run on `device` in this process, and how."""
    dev = torch.device(device)
    if importlib.util.find_spec("triton") is None:
        return TritonSupport(False, "", "the triton attention backend needs the `triton` package "
                                        "(pip install triton), or use --attention-backend torch")
    if interpreter_enabled():
        return TritonSupport(True, "interpreter", "")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            return TritonSupport(False, "", f"device {dev} was requested but torch sees no CUDA GPU; "
                                            f"use --device cpu with --attention-backend torch")
        return TritonSupport(True, "cuda", "")
    return TritonSupport(False, "", (
        f"the triton attention backend compiles for CUDA GPUs, and device {dev} is not one; on CPU "
        f"it runs only under triton's interpreter: set the environment variable "
        f"{TRITON_INTERPRET_ENV}=1 before starting (very slow, for testing), or use "
        f"--attention-backend torch"))


def _load_kernels(support: TritonSupport) -> ModuleType:
    kernels = importlib.import_module(KERNELS_MODULE)
    interpreted = type(kernels.paged_decode_kernel).__name__ == "InterpretedFunction"
    if support.mode == "interpreter" and not interpreted:
        raise ConfigError(f"{TRITON_INTERPRET_ENV}=1 was set after {KERNELS_MODULE} had been "
                          f"imported (compiled kernels); set it before the process imports triton")
    return kernels


def _pow2_at_least(n: int, floor: int = 1) -> int:
    return max(floor, 1 << max(0, (n - 1).bit_length()))


@dataclass
class _StepPlan:
    """Per-step launch inputs, shared by every layer (cached in `meta.backend_state`)."""
    num_decodes: int
    decode_seq_ids: torch.Tensor  # [Nd]
    decode_token_rows: torch.Tensor  # [Nd]
    num_prefills: int
    prefill_seq_ids: torch.Tensor  # [Np]
    max_prefill_len: int
    query_start_loc: torch.Tensor  # [S+1]


@dataclass
class _WorkingSet:  # a quantized cache's blocks read by one step (see _dequantized_pools)
    block_ids: torch.Tensor  # [n] sorted unique block ids the step's sequences cover
    block_tables: torch.Tensor  # the step's tables renumbered into 0 .. n-1
    fresh_rows: torch.Tensor  # token rows of chunks that start their sequence
    fresh_slots: torch.Tensor  # their slots in the scratch pools


class TritonAttentionBackend(AttentionBackend):

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, *, device: torch.device | str = "cuda",
                 block_m: int | None = None, block_n: int | None = None,
                 max_decode_splits: int = MAX_DECODE_SPLITS) -> None:
        """`block_m` query rows and `block_n` keys per prefill tile (powers of two >= 16; the
        decode tile uses `block_n`). Defaults: 64, or 32 for head_dim > 128 (shared memory).
        `max_decode_splits`: most key ranges a decode is split over (1: never split)."""
        super().__init__(num_heads, num_kv_heads, head_dim, scale, sliding_window)
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        support = triton_support(device)
        if not support.available:
            raise ConfigError(support.reason)
        self.mode = support.mode
        self._kernels = _load_kernels(support)
        self.group = num_heads // num_kv_heads
        self.group_pad = _pow2_at_least(self.group, _MIN_DOT_DIM)
        self.d_pad = _pow2_at_least(head_dim, _MIN_DOT_DIM)
        default_tile = 64 if self.d_pad <= 128 else 32
        self.block_m = block_m or default_tile
        self.block_n = block_n or default_tile
        for name, val in (("block_m", self.block_m), ("block_n", self.block_n)):
            if val < _MIN_DOT_DIM or val & (val - 1):
                raise ValueError(f"{name} must be a power of two >= {_MIN_DOT_DIM}, got {val}")
        if max_decode_splits < 1:
            raise ValueError(f"max_decode_splits must be >= 1, got {max_decode_splits}")
        self.max_decode_splits = max_decode_splits
        # Under the interpreter there is no GPU to size for: 16 stands in, so small test batches split.
        dev = torch.device(device)
        self.num_sms = (torch.cuda.get_device_properties(dev).multi_processor_count
                        if self.mode == "cuda" else 16)
        self.window = sliding_window or 0  # 0: no window (constexpr-friendly)
        self.qk_scale_log2 = float(scale) * _LOG2E

    # -- interface --

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        if isinstance(kv_cache, PagedKVCache):
            k_pool, v_pool = self._pools(kv_cache, layer)
            self.write_kv(k, v, k_pool, v_pool, meta.slot_mapping)
            block_tables = meta.block_tables
        else:
            kv_cache.write(layer, meta.slot_mapping, k, v)
            k_pool, v_pool, block_tables = self._dequantized_pools(kv_cache, layer, meta, k, v)
        out = torch.empty_like(q)
        plan = self._plan(meta)
        if q.dtype != k_pool.dtype:  # tl.dot wants matching operand types
            q = q.to(k_pool.dtype)
        if plan.num_decodes:
            self.decode(out, q, k_pool, v_pool, block_tables, meta.seq_lens_tensor,
                        plan.decode_seq_ids, plan.decode_token_rows)
        if plan.num_prefills:
            self.prefill(out, q, k_pool, v_pool, block_tables, meta.seq_lens_tensor,
                         plan.query_start_loc, plan.prefill_seq_ids, plan.max_prefill_len)
        return out

    def _dequantized_pools(self, kv_cache: KVCache, layer: int, meta: AttentionMetadata,
                           k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(k_pool, v_pool, block_tables): the step's blocks of one layer dequantized into
        `[n, block_size, H, D]` scratch pools, and the block tables renumbered into them."""
        ws = self._working_set(meta)
        k_all, v_all = kv_cache.gather(layer, ws.block_ids)
        if ws.fresh_rows.numel():
            k_all[ws.fresh_slots] = k[ws.fresh_rows].to(k_all.dtype)
            v_all[ws.fresh_slots] = v[ws.fresh_rows].to(v_all.dtype)
        shape = (ws.block_ids.numel(), meta.block_size, self.num_kv_heads, self.head_dim)
        return k_all.view(shape), v_all.view(shape), ws.block_tables

    @staticmethod
    def _working_set(meta: AttentionMetadata) -> _WorkingSet:
        key = "triton_working_set"  # the same for every layer: planned once per step
        if key not in meta.backend_state:
            bs = meta.block_size
            used = torch.arange(meta.block_tables.shape[1], device=meta.block_tables.device)[None, :] \
                < (meta.seq_lens_tensor[:, None] + bs - 1) // bs
            ids = torch.unique(meta.block_tables[used])
            # Unused table entries (padding) point at scratch block 0: never read past seq_lens.
            tables = torch.where(used, torch.searchsorted(ids, meta.block_tables).clamp_(max=ids.numel() - 1), 0)
            # A chunk that starts its sequence attends to its own K/V as computed, not as stored
            # (as the torch backend does): those rows go into the scratch unquantized.
            rows = [torch.arange(meta.query_start_loc[i], meta.query_start_loc[i + 1])
                    for i in range(meta.num_seqs) if meta.start_pos[i] == 0]
            rows = torch.cat(rows).to(meta.slot_mapping.device) if rows else \
                torch.empty(0, dtype=torch.long, device=meta.slot_mapping.device)
            slots = meta.slot_mapping[rows]
            meta.backend_state[key] = _WorkingSet(ids, tables, rows,
                                                  torch.searchsorted(ids, slots // bs) * bs + slots % bs)
        return meta.backend_state[key]

    # -- kernel launches (public so the tests drive each kernel on its own) --

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
        """k, v `[T, num_kv_heads, head_dim]` -> pools `[num_blocks, block_size, H, D]` at slots."""
        num_tokens = k.shape[0]
        if num_tokens == 0:
            return
        self._kernels.reshape_and_cache_kernel[(num_tokens,)](
            k, v, k_pool, v_pool, slot_mapping,
            *k.stride(), *v.stride(), *k_pool.stride(),
            NUM_KV_HEADS=self.num_kv_heads, HEAD_DIM=self.head_dim, BLOCK_SIZE=k_pool.shape[1],
            H_PAD=_pow2_at_least(self.num_kv_heads), D_PAD=_pow2_at_least(self.head_dim))

    def decode_splits(self, num_decodes: int) -> int:
        """Key ranges each decode's attention is split over (flash-decoding): enough programs
        for DECODE_PROGRAMS_PER_SM on every SM, a power of two up to max_decode_splits. It
        depends on the batch size alone, not on the contexts, so a CUDA graph can hold it."""
        programs = num_decodes * self.num_kv_heads
        want = max(1, self.num_sms * DECODE_PROGRAMS_PER_SM // max(programs, 1))
        return min(1 << (want.bit_length() - 1), self.max_decode_splits)

    def decode(self, out: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
               block_tables: torch.Tensor, seq_lens: torch.Tensor, seq_ids: torch.Tensor,
               token_rows: torch.Tensor) -> None:
        """Attention of the single query row `token_rows[i]` of each sequence `seq_ids[i]`
        (at position `seq_lens[seq] - 1`) over keys `0 .. seq_lens[seq] - 1`."""
        n = seq_ids.numel()
        common = dict(GROUP=self.group, GROUP_PAD=self.group_pad, HEAD_DIM=self.head_dim, D_PAD=self.d_pad,
                      BLOCK_SIZE=k_pool.shape[1], BLOCK_N=self.block_n, SLIDING_WINDOW=self.window,
                      **self._dot_options(q))
        splits = self.decode_splits(n)
        if splits == 1:
            self._kernels.paged_decode_kernel[(n, self.num_kv_heads)](
                out, q, k_pool, v_pool, block_tables, seq_lens, seq_ids, token_rows,
                self.qk_scale_log2, *q.stride(), *out.stride(), *k_pool.stride(), block_tables.stride(0),
                **common)
            return
        parts = (n, self.num_kv_heads, splits, self.group_pad)
        m = torch.empty(parts, dtype=torch.float32, device=q.device)
        l_sum = torch.empty(parts, dtype=torch.float32, device=q.device)
        acc = torch.empty(*parts, self.d_pad, dtype=torch.float32, device=q.device)
        self._kernels.paged_decode_split_kernel[(n, self.num_kv_heads, splits)](
            m, l_sum, acc, q, k_pool, v_pool, block_tables, seq_lens, seq_ids, token_rows,
            self.qk_scale_log2, *q.stride(), *k_pool.stride(), block_tables.stride(0),
            NUM_SPLITS=splits, **common)
        self._kernels.paged_decode_reduce_kernel[(n, self.num_kv_heads)](
            out, m, l_sum, acc, token_rows, *out.stride(),
            GROUP=self.group, GROUP_PAD=self.group_pad, HEAD_DIM=self.head_dim, D_PAD=self.d_pad,
            NUM_SPLITS=splits, SPLITS_PAD=_pow2_at_least(splits, 2))

    def prefill(self, out: torch.Tensor, q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                seq_ids: torch.Tensor, max_query_len: int) -> None:
        """Causal attention of the rows `query_start_loc[s] .. query_start_loc[s+1]-1` of each
        sequence `s` in `seq_ids` (the last positions before `seq_lens[s]`) over the cache."""
        grid = (seq_ids.numel(), _cdiv(max_query_len, self.block_m), self.num_heads)
        self._kernels.paged_prefill_kernel[grid](
            out, q, k_pool, v_pool, block_tables, seq_lens, query_start_loc, seq_ids,
            self.qk_scale_log2, *q.stride(), *out.stride(), *k_pool.stride(), block_tables.stride(0),
            GROUP=self.group, HEAD_DIM=self.head_dim, D_PAD=self.d_pad, BLOCK_SIZE=k_pool.shape[1],
            BLOCK_M=self.block_m, BLOCK_N=self.block_n, SLIDING_WINDOW=self.window,
            **self._dot_options(q))

    # -- helpers --

    def _dot_options(self, q: torch.Tensor) -> dict:
        # fp32 inputs would otherwise go through TF32 tensor cores (~1e-3 relative error).
        # DOT_FP32: the interpreter cannot multiply bfloat16 (see triton_kernels._dot).
        return dict(PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
                    DOT_FP32=self.mode == "interpreter" and q.dtype == torch.bfloat16)

    def _pools(self, kv_cache: PagedKVCache, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        if kv_cache.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"the triton attention backend supports float32/float16/bfloat16 "
                              f"KV, got {kv_cache.dtype}; use --attention-backend torch")
        return kv_cache.kv[layer, 0], kv_cache.kv[layer, 1]

    def _plan(self, meta: AttentionMetadata) -> _StepPlan:
        key = "triton"
        if key not in meta.backend_state:
            dev = meta.block_tables.device
            prefill_ids = meta.prefill_seq_ids
            meta.backend_state[key] = _StepPlan(
                num_decodes=meta.num_decodes,
                decode_seq_ids=meta.decode_seq_ids,
                decode_token_rows=meta.decode_token_ids,
                num_prefills=len(prefill_ids),
                prefill_seq_ids=torch.tensor(prefill_ids, dtype=torch.long, device=dev),
                max_prefill_len=max((meta.query_lens[i] for i in prefill_ids), default=0),
                query_start_loc=torch.tensor(meta.query_start_loc, dtype=torch.long, device=dev))
        return meta.backend_state[key]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)

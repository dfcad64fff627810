"""Paged attention on CPU: the compiled kernels (ops/cpu_kernels.py) where they apply, torch's
`F.scaled_dot_product_attention` elsewhere (`--attention-backend torch`: it runs anywhere torch runs,
and is the reference the kernels are tested against).

Prefill chunks are attended one sequence at a time over that sequence's gathered blocks, with a
causal mask offset by the chunk's start position. All decodes of a step share ONE SDPA call over
their gathered block tables (padded to the longest), with a per-row length mask.

On CPU, attention over the full-precision cache goes through compiled kernels (ops/cpu_kernels.py)
that read each sequence's blocks in place instead of gathering a padded copy: for bf16 on
AVX512-BF16 CPUs one varlen call covers every sequence of the step, decodes and prefill chunks
alike, over a cache in the "pairs" layout it asks for (`kv_cache_layout`); for float32 (and bf16
elsewhere) a decode-only kernel covers the decodes over the "tokens" layout; quantized caches
(fp8, int8, int4) under a bf16 model are dequantized block by block into a bf16 pairs scratch
that the same varlen kernel reads (staging.py), except the decodes of a step over int8 / int4 / fp8
codes, which a kernel reads in place with the dequantization folded into its arithmetic
(csrc/decode_quantized.cpp); only the prompt chunks of such a step are staged, and decodes that
share a cached prefix (staged so that the bf16 kernel reads the shared blocks once for all of
them). SDPA is the fallback (no compiler, other devices or dtypes) and the reference.

A sliding window (Mistral) means a key at `kp` is visible from a query at `qp` only when
`0 <= qp - kp < window`; blocks wholly left of every query's window are not gathered at all.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvserve.attention.base import AttentionBackend, AttentionMetadata
from kvserve.attention.cascade import NO_GROUPS, PrefixGroups, shared_prefix_groups
from kvserve.attention.staging import STAGE_BYTES, StagePart, StageScratch, plan_stage_parts, step_token_slots
from kvserve.cache.base import KVCache
from kvserve.cache.paged import PagedKVCache
from kvserve.ops.cpu_kernels import decode_kernel_for, quantized_decode_kernel_for, varlen_kernel_for

log = logging.getLogger(__name__)


@dataclass
class _PrefillPlan:
    rows: slice  # token rows of this sequence
    block_ids: torch.Tensor | None  # blocks to gather; None: the chunk is the whole context
    key_len: int  # keys taken from the gathered (or fresh) K/V
    mask: torch.Tensor | None  # [n, key_len] bool; None: plain causal over a square chunk


@dataclass
class _DecodePlan:
    token_ids: torch.Tensor  # [Nd] token rows of the decodes
    block_ids: torch.Tensor  # [Nd * nb] blocks to gather, row-major
    keys_per_row: int  # nb * block_size
    mask: torch.Tensor  # [Nd, 1, 1, keys_per_row] bool


@dataclass
class VarlenPlan:  # every sequence of the step, as the varlen kernel takes them (int64, contiguous)
    q_start: torch.Tensor  # [S]
    q_len: torch.Tensor  # [S]
    block_tables: torch.Tensor  # [S, max_blocks]
    seq_lens: torch.Tensor  # [S]
    groups: PrefixGroups  # decodes sharing leading blocks, attended to them together (cascade.py)


@dataclass
class _StagedPlan:  # one part of a step over a quantized cache (staging.py)
    part: StagePart
    varlen: VarlenPlan  # over the part's renumbered tables
    rows: slice | torch.Tensor  # the part's token rows in q / k / v (a tensor when not contiguous)
    slots: torch.Tensor  # [rows] int64: their slots in the scratch


@dataclass
class _KernelDecodePlan:
    token_ids: torch.Tensor  # [Nd] long, contiguous: token rows of the decodes
    block_tables: torch.Tensor  # [Nd, max_blocks] long, contiguous
    seq_lens: torch.Tensor  # [Nd] long, contiguous


@dataclass
class _CodesSplit:  # a step over a quantized cache: what goes over the codes, what is staged
    codes: _KernelDecodePlan  # decodes attended over the codes in place
    staged_seqs: np.ndarray  # int64, ascending: prompt chunks, and decodes in shared-prefix groups


class CPUAttentionBackend(AttentionBackend):

    def __init__(self, *args, use_cpu_kernel: bool = True, cascade: bool = True,
                 decode_on_codes: bool = True, **kwargs) -> None:
        """`use_cpu_kernel=False` keeps every decode on the SDPA path (reference for tests);
        `cascade=False` has the varlen kernel read shared prefixes once per sequence;
        `decode_on_codes=False` stages the decodes over a quantized cache too."""
        super().__init__(*args, **kwargs)
        self.use_cpu_kernel = use_cpu_kernel
        self.cascade = cascade
        self.decode_on_codes = decode_on_codes
        self._kernels: dict[tuple[str, torch.dtype, torch.device], object] = {}
        self._scratch: StageScratch | None = None
        self._codes_unreadable: object | None = None  # the cache whose layout the codes kernel declined

    def kv_cache_layout(self, kv_cache_dtype: str, dtype: torch.dtype, block_size: int,
                        device: torch.device) -> str:
        """The "pairs" layout where the bf16 varlen kernel will read the cache in place; quantized
        caches keep their own layout (the kernel reads them through the staging scratch)."""
        if not self.use_cpu_kernel or varlen_kernel_for(dtype, self.head_dim, torch.device(device)) is None:
            return "tokens"
        if block_size % 16:
            path = ("SDPA over dequantized copies (several times slower)" if kv_cache_dtype != "auto"
                    else "the slower decode-kernel + SDPA path")
            log.warning("--block-size %d: the bf16 attention kernel reads blocks of a multiple of 16 "
                        "tokens, so attention takes %s; use --block-size 16 (the default) or 32 for "
                        "the fast one", block_size, path)
            return "tokens"
        return "pairs" if kv_cache_dtype == "auto" else "tokens"

    def varlen_kernel_over(self, kv_cache: KVCache):
        """The varlen kernel that `forward` runs at every layer of every step over kv_cache (a bf16
        "pairs" cache, written by `store_kv_pairs`), or None where steps take another path. With
        `varlen_plan(meta)` it is what a compiled layer loop (model/cpu_decoder.py) calls in
        place of `forward`."""
        if not self.use_cpu_kernel or not isinstance(kv_cache, PagedKVCache) or kv_cache.layout != "pairs":
            return None
        return varlen_kernel_for(kv_cache.dtype, self.head_dim, kv_cache.device)

    def _kernel(self, kind: str, q: torch.Tensor, kv_cache: KVCache):
        """The compiled kernel `kind` when it applies to this step's tensors and the cache, else
        None: "varlen" over a pairs-layout cache, "decode" over a tokens-layout one, "staged"
        (the varlen kernel over a bf16 scratch) over a quantized cache with blocks of 16k."""
        if (not self.use_cpu_kernel or q.dtype != kv_cache.dtype
                or q.stride(2) != 1 or q.stride(1) != self.head_dim):
            return None
        if kind == "staged":
            if isinstance(kv_cache, PagedKVCache) or kv_cache.block_size % 16:
                return None
        elif not isinstance(kv_cache, PagedKVCache) or kv_cache.layout != ("pairs" if kind == "varlen" else "tokens"):
            return None
        key = (kind, q.dtype, q.device)
        if key not in self._kernels:
            find = decode_kernel_for if kind == "decode" else varlen_kernel_for
            self._kernels[key] = find(q.dtype, self.head_dim, q.device)
        if kind == "staged" and self._kernels[key] is not None and self._scratch is None:
            self._scratch = StageScratch()
        return self._kernels[key]

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        kv_cache.write(layer, meta.slot_mapping, k, v)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        varlen = self._kernel("varlen", q, kv_cache)
        if varlen is not None:
            k_cache, v_cache = kv_cache.layer_blocks(layer)
            self._varlen(varlen, self.varlen_plan(meta), q, out, k_cache, v_cache, kv_cache.block_size)
            return out
        staged = self._kernel("staged", q, kv_cache)
        if staged is not None:
            on_codes = self._decode_on_codes(layer, q, out, kv_cache, meta)
            staged_seqs = self._codes_split(meta).staged_seqs if on_codes else None
            if staged_seqs is not None and not len(staged_seqs):
                return out
            for plan in self._staged_plans(meta, kv_cache, staged_seqs):
                k_cache, v_cache = self._scratch.fill(kv_cache, layer, plan.part.block_ids)
                self._scratch.overlay(k[plan.rows], v[plan.rows], plan.slots, kv_cache.block_size)
                self._varlen(staged, plan.varlen, q, out, k_cache, v_cache, kv_cache.block_size)
            return out
        kernel = self._kernel("decode", q, kv_cache) if meta.num_decodes else None
        prefills, decode = self._plans(meta, kernel is not None)
        for plan in prefills:
            out[plan.rows] = self._prefill(layer, plan, q, k, v, kv_cache)
        if isinstance(decode, _KernelDecodePlan):
            self._kernel_decode(kernel, layer, decode, q, out, kv_cache)
        elif decode is not None:
            out[decode.token_ids] = self._decode(layer, decode, q, kv_cache)
        return out

    def _decode_on_codes(self, layer: int, q: torch.Tensor, out: torch.Tensor, kv_cache: KVCache,
                         meta: AttentionMetadata) -> bool:
        """The step's decodes over a quantized cache, attended over the codes in place
        (csrc/decode_quantized.cpp) instead of staged; False when that does not apply."""
        # The step's own tokens must still be at full precision in the residual pool when the
        # kernel runs, as the staged path's overlay has them: so only caches with a residual pool
        # (not static fp8 scales, not per-token int keys) that seal at step end.
        if (not self.decode_on_codes or self.sliding_window is not None or meta.num_decodes == 0
                or kv_cache is self._codes_unreadable or not getattr(kv_cache, "staged", False)
                or not getattr(kv_cache, "seal_at_step_end", False)):
            return False
        key = ("codes", q.dtype, q.device)
        if key not in self._kernels:
            self._kernels[key] = quantized_decode_kernel_for(self.head_dim, q.device)
        kernel = self._kernels[key]
        if kernel is None:
            return False
        plan = self._codes_split(meta).codes
        if not plan.token_ids.numel():  # every decode is in a shared-prefix group: all staged
            return True
        kf, vf, res, block_res = self._scratch.described.layer(kv_cache, layer)
        rc = kernel(ctypes.byref(kf), ctypes.byref(vf), res, block_res, q.data_ptr(), out.data_ptr(),
                    plan.token_ids.data_ptr(), q.stride(0), out.stride(0), plan.block_tables.data_ptr(),
                    plan.block_tables.shape[1], plan.seq_lens.data_ptr(), plan.token_ids.numel(), self.num_heads,
                    self.num_kv_heads, kv_cache.block_size, self.scale)
        if rc == 2:  # not now (e4m3 codes while a thread flushes denormals): stage this step
            return False
        if rc != 0:  # a layout it does not read (short key groups), or no build: stage from now on
            self._codes_unreadable = kv_cache
            return False
        return True

    # -- per-step planning (same for every layer, so built once and cached in the metadata) --

    def _plans(self, meta: AttentionMetadata, use_kernel: bool = False
               ) -> tuple[list[_PrefillPlan], _DecodePlan | _KernelDecodePlan | None]:
        key = ("cpu", use_kernel)
        if key not in meta.backend_state:
            prefills = [self._plan_prefill(meta, i) for i in meta.prefill_seq_ids]
            if not meta.num_decodes:
                decode = None
            elif use_kernel:
                decode = self._kernel_decode_plan(meta)
            else:
                decode = self._plan_decode(meta)
            meta.backend_state[key] = (prefills, decode)
        return meta.backend_state[key]

    @staticmethod
    def _kernel_decode_plan(meta: AttentionMetadata, seqs: torch.Tensor | None = None) -> _KernelDecodePlan:
        """The decode kernels' arguments for the step's decodes (or decode sequences `seqs`)."""
        if seqs is None:
            seqs, rows = meta.decode_seq_ids, meta.decode_token_ids
        else:
            rows = torch.tensor(meta.query_start_loc[:-1], dtype=torch.long)[seqs]
        return _KernelDecodePlan(rows.contiguous(), meta.block_tables[seqs].contiguous(),
                                 meta.seq_lens_tensor[seqs].contiguous())

    def _codes_split(self, meta: AttentionMetadata) -> _CodesSplit:
        """Decodes in shared-prefix groups are staged with the prompt chunks: the bf16 kernel then
        attends to the shared blocks once for the whole group (cascade), where the codes kernel
        would read them once per sequence. At 64 decodes over a shared 1,024-token prefix, int8:
        attention 48 ms per step over the codes against ~24 staged with cascade (bench/NOTES.md,
        "Decodes sharing a prefix: staged for cascade, not read over codes"). The other decodes go over the codes."""
        if "codes_split" not in meta.backend_state:
            prefills = np.asarray(meta.prefill_seq_ids, dtype=np.int64)
            decodes = meta.decode_seq_ids.cpu().numpy()
            grouped = np.zeros(0, np.int64)
            if self.cascade and self.sliding_window is None:
                grouped = shared_prefix_groups(meta.block_tables.cpu().numpy(), np.asarray(meta.seq_lens),
                                               np.asarray(meta.query_lens), meta.block_size).members
            codes = decodes[~np.isin(decodes, grouped)]
            plan = self._kernel_decode_plan(meta, None if len(codes) == len(decodes) else torch.from_numpy(codes))
            meta.backend_state["codes_split"] = _CodesSplit(plan, np.sort(np.concatenate([prefills, grouped])))
        return meta.backend_state["codes_split"]

    def varlen_plan(self, meta: AttentionMetadata) -> VarlenPlan:
        """The varlen kernel's arguments for every sequence of the step, built once per step."""
        if "varlen" not in meta.backend_state:
            meta.backend_state["varlen"] = self._make_varlen_plan(
                meta, slice(0, meta.num_seqs), meta.block_tables.contiguous())
        return meta.backend_state["varlen"]

    def _make_varlen_plan(self, meta: AttentionMetadata, seqs: slice | np.ndarray,
                          tables: torch.Tensor) -> VarlenPlan:
        """The kernel's arguments for sequences `seqs` of the step (a slice or indices), reading
        `tables`."""
        query_lens = np.asarray(meta.query_lens, dtype=np.int64)[seqs]
        seq_lens = np.asarray(meta.seq_lens, dtype=np.int64)[seqs]
        groups = NO_GROUPS
        if self.cascade and self.sliding_window is None and 1 in query_lens:
            groups = shared_prefix_groups(tables.numpy(), seq_lens, query_lens, meta.block_size)
        return VarlenPlan(torch.from_numpy(np.asarray(meta.query_start_loc, dtype=np.int64)[:-1][seqs]),
                          torch.from_numpy(query_lens), tables, torch.from_numpy(seq_lens), groups)

    def _staged_plans(self, meta: AttentionMetadata, kv_cache: KVCache,
                      seqs_subset: np.ndarray | None = None) -> list[_StagedPlan]:
        """Parts of the step (or of sequences `seqs_subset` only, ascending, when the other decodes
        were attended over the codes) whose blocks fit the scratch, each with its kernel arguments
        over the scratch (the blocks left of a sliding window are neither staged nor read)."""
        key = "staged" if seqs_subset is None else "staged_subset"
        if key not in meta.backend_state:
            bs = meta.block_size
            ids = np.arange(meta.num_seqs, dtype=np.int64) if seqs_subset is None else seqs_subset
            seq_lens = np.asarray(meta.seq_lens, dtype=np.int64)[ids]
            start = np.asarray(meta.start_pos, dtype=np.int64)[ids]
            first = np.zeros_like(seq_lens)
            if self.sliding_window is not None:
                first = np.maximum(start - self.sliding_window + 1, 0) // bs
            block_bytes = 2 * kv_cache.num_kv_heads * self.head_dim * bs * 2  # bf16 K + V
            parts = plan_stage_parts(meta.block_tables.numpy()[ids], first, -(-seq_lens // bs),
                                     max(1, STAGE_BYTES // block_bytes))
            qsl = np.asarray(meta.query_start_loc, dtype=np.int64)
            plans = []
            for p in parts:
                seqs = ids[p.seqs]
                if seqs[-1] - seqs[0] + 1 == len(seqs):  # consecutive sequences: consecutive rows
                    rows = slice(int(qsl[seqs[0]]), int(qsl[seqs[-1] + 1]))
                else:
                    rows = torch.from_numpy(np.concatenate([np.arange(qsl[i], qsl[i + 1]) for i in seqs]))
                slots = step_token_slots(p.tables, start[p.seqs], np.asarray(meta.query_lens, dtype=np.int64)[seqs], bs)
                plans.append(_StagedPlan(p, self._make_varlen_plan(meta, seqs, torch.from_numpy(p.tables)),
                                         rows, torch.from_numpy(slots)))
            meta.backend_state[key] = plans
        return meta.backend_state[key]

    def _first_visible_block(self, first_query_pos: int, block_size: int) -> int:
        if self.sliding_window is None:
            return 0
        return max(0, first_query_pos - self.sliding_window + 1) // block_size

    def _plan_prefill(self, meta: AttentionMetadata, i: int) -> _PrefillPlan:
        start, seq_len, bs = meta.start_pos[i], meta.seq_lens[i], meta.block_size
        rows = slice(meta.query_start_loc[i], meta.query_start_loc[i + 1])
        dev = meta.positions.device
        if start == 0:
            # The chunk is the whole context: attend to the fresh K/V, no gather needed.
            block_ids, first_key = None, 0
        else:
            first_blk = self._first_visible_block(start, bs)
            last_blk = -(-seq_len // bs)
            block_ids = meta.block_tables[i, first_blk:last_blk]
            first_key = first_blk * bs
        key_len = seq_len - first_key
        if start == 0 and self.sliding_window is None:
            return _PrefillPlan(rows, None, key_len, None)
        q_pos = torch.arange(start, seq_len, device=dev)
        k_pos = torch.arange(first_key, seq_len, device=dev)
        dist = q_pos[:, None] - k_pos[None, :]
        mask = dist >= 0
        if self.sliding_window is not None:
            mask &= dist < self.sliding_window
        return _PrefillPlan(rows, block_ids, key_len, mask)

    def _plan_decode(self, meta: AttentionMetadata) -> _DecodePlan:
        bs = meta.block_size
        # From the host-side lists, so planning never waits on the device.
        seqs_np = np.nonzero(np.asarray(meta.query_lens) == 1)[0]
        seq_lens = np.asarray(meta.seq_lens, dtype=np.int64)[seqs_np]
        q_pos = seq_lens - 1
        if self.sliding_window is None:
            first_blk = np.zeros_like(seq_lens)
        else:
            first_blk = np.maximum(q_pos - self.sliding_window + 1, 0) // bs
        nb = int((-(-seq_lens // bs) - first_blk).max())
        dev = meta.block_tables.device
        col = torch.from_numpy(first_blk).to(dev)[:, None] + torch.arange(nb, device=dev)  # [Nd, nb]
        tables = meta.block_tables[meta.decode_seq_ids]
        # Columns past a row's table are clamped to a real block; their keys are masked below.
        block_ids = tables.gather(1, col.clamp(max=tables.shape[1] - 1))
        k_pos = (col[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(len(seqs_np), nb * bs)
        dist = torch.from_numpy(q_pos).to(dev)[:, None] - k_pos
        mask = dist >= 0
        if self.sliding_window is not None:
            mask &= dist < self.sliding_window
        return _DecodePlan(meta.decode_token_ids, block_ids.reshape(-1), nb * bs,
                           mask[:, None, None, :])

    # -- attention --

    def _prefill(self, layer: int, plan: _PrefillPlan, q: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        qs = q[plan.rows].transpose(0, 1)  # [Hq, n, D]
        if plan.block_ids is None:
            ks, vs = k[plan.rows], v[plan.rows]
        else:
            ks, vs = kv_cache.gather(layer, plan.block_ids)
            ks, vs = ks[:plan.key_len], vs[:plan.key_len]
        ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)  # [Hkv, L, D]
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0), ks.unsqueeze(0), vs.unsqueeze(0), attn_mask=plan.mask,
            is_causal=plan.mask is None, scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads)
        return o[0].transpose(0, 1)  # [n, Hq, D]

    def _varlen(self, kernel, plan: VarlenPlan, q: torch.Tensor, out: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, block_size: int) -> None:
        rc = kernel(q.data_ptr(), out.data_ptr(), plan.q_start.data_ptr(), plan.q_len.data_ptr(),
                    q.stride(0), out.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                    plan.block_tables.data_ptr(), plan.block_tables.shape[1], plan.seq_lens.data_ptr(),
                    plan.q_len.numel(), self.num_heads, self.num_kv_heads, block_size,
                    self.scale, self.sliding_window or 0, plan.groups.num_groups,
                    plan.groups.start.ctypes.data, plan.groups.members.ctypes.data,
                    plan.groups.prefix_len.ctypes.data)
        if rc != 0:
            raise RuntimeError("paged_attention_bf16 kernel has no instance for this build")

    def _kernel_decode(self, kernel, layer: int, plan: _KernelDecodePlan, q: torch.Tensor,
                       out: torch.Tensor, kv_cache: PagedKVCache) -> None:
        k_cache, v_cache = kv_cache.layer_blocks(layer)
        kernel(q.data_ptr(), out.data_ptr(), plan.token_ids.data_ptr(), q.stride(0), out.stride(0),
               k_cache.data_ptr(), v_cache.data_ptr(), plan.block_tables.data_ptr(),
               plan.block_tables.shape[1], plan.seq_lens.data_ptr(), plan.token_ids.numel(),
               self.num_heads, self.num_kv_heads, kv_cache.block_size, self.scale,
               self.sliding_window or 0, self.head_dim)

    def _decode(self, layer: int, plan: _DecodePlan, q: torch.Tensor, kv_cache: KVCache) -> torch.Tensor:
        nd = plan.token_ids.numel()
        qd = q[plan.token_ids].unsqueeze(2)  # [Nd, Hq, 1, D]
        ks, vs = kv_cache.gather(layer, plan.block_ids)
        ks = ks.view(nd, plan.keys_per_row, self.num_kv_heads, self.head_dim).transpose(1, 2)
        vs = vs.view(nd, plan.keys_per_row, self.num_kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(qd, ks, vs, attn_mask=plan.mask, scale=self.scale,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return o[:, :, 0]  # [Nd, Hq, D]

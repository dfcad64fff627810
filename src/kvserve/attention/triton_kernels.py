"""Triton kernels for paged attention over `PagedKVCache` pools.

Imported only by `triton.py` once it has established that triton is importable (so this
module may import triton at the top). Set `TRITON_INTERPRET=1` *before* this module is first
imported to run the kernels on CPU through triton's interpreter: `triton.jit` picks the
interpreter at decoration time.

Cache layout (one layer, K or V): `[num_blocks, block_size, num_kv_heads, head_dim]`. A key at
position `p` of a sequence lives in block `block_table[p // block_size]`, slot `p % block_size`.
The kernels tile keys by `BLOCK_N` positions, independent of the cache block size, and look up
the block of every key position; that keeps `tl.dot` shapes legal for block sizes below 16 and
lets one compiled kernel serve every block size's table walk.

The block tables' row stride (the step's longest table) changes from step to step; it is not
specialised on (`do_not_specialize`), or each new value divisible by 16 would compile again.

Softmax is the online (flash) form in float32 with base-2 exponentials: the caller passes
`scale * log2(e)`. Running maxima start at a large finite negative, not -inf, so a tile where a
row sees no key yields exp2(-inf - finite) = 0 instead of NaN.
"""
from __future__ import annotations

import triton
import triton.language as tl

# Finite stand-in for -inf as the initial running max (see module docstring).
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def reshape_and_cache_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_kd, stride_vt, stride_vh, stride_vd,
    stride_cb, stride_cs, stride_ch, stride_cd,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    """One program per new token: its `[num_kv_heads, head_dim]` K and V go to its slot."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    if slot < 0:  # vLLM's convention for padding tokens that own no slot
        return
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    m = (h < NUM_KV_HEADS) & (d < HEAD_DIM)
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d * stride_cd
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d * stride_kd, mask=m)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d * stride_vd, mask=m)
    tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=m)
    tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=m)


@triton.jit
def _dot(a, b, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr):
    """`a @ b` accumulated in fp32. DOT_FP32 upcasts the operands first: triton's interpreter
    multiplies bfloat16 operands as their raw uint16 bits (triton-lang/triton#11584), and a
    bf16 x bf16 product is exact in fp32, so the upcast changes nothing numerically."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head,
    k_start, q_pos, num_keys,
    stride_cb, stride_cs, stride_ch, stride_cd,
    qk_scale_log2,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Fold keys `k_start .. k_start+BLOCK_N-1` into the running (max, sum, acc) of `q` rows.

    q `[M, D_PAD]`, q_pos `[M]` positions of the rows; keys at or past `num_keys` are absent.
    """
    k_pos = k_start + tl.arange(0, BLOCK_N)
    k_valid = k_pos < num_keys
    blk = tl.load(table_row_ptr + k_pos // BLOCK_SIZE, mask=k_valid, other=0).to(tl.int64)
    slot_base = blk * stride_cb + (k_pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    # K loaded already transposed, [D_PAD, BLOCK_N], for q @ K^T.
    kt = tl.load(k_cache_ptr + slot_base[None, :] + d[:, None] * stride_cd,
                 mask=d_valid[:, None] & k_valid[None, :], other=0.0)
    qk = _dot(q, kt, PRECISION, DOT_FP32) * qk_scale_log2  # [M, BLOCK_N] fp32
    dist = q_pos[:, None] - k_pos[None, :]
    visible = (dist >= 0) & k_valid[None, :]
    if SLIDING_WINDOW > 0:
        visible = visible & (dist < SLIDING_WINDOW)
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1))
    p = tl.exp2(qk - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(v_cache_ptr + slot_base[:, None] + d[None, :] * stride_cd,
                mask=k_valid[:, None] & d_valid[None, :], other=0.0)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, PRECISION, DOT_FP32)
    return m_new, l_i, acc


@triton.jit
def _decode_range(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, seq_ids_ptr, token_rows_ptr,
    qk_scale_log2, stride_qt, stride_qh, stride_qd, stride_cb, stride_cs, stride_ch, stride_cd,
    stride_bt, split,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Program (decode i, kv head)'s attention over key range `split` of NUM_SPLITS (1: every
    key): the GROUP query heads sharing that kv head are the rows of one tile, so each K/V block
    is read once for all of them (GQA). Returns the query's token row and the rows' running
    (max, sum, unnormalised output)."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(seq_ids_ptr + i).to(tl.int64)
    row = tl.load(token_rows_ptr + i).to(tl.int64)
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    q_last = seq_len - 1

    r = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + r
    d = tl.arange(0, D_PAD)
    q_mask = (r < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=q_mask, other=0.0)
    q_pos = tl.zeros([GROUP_PAD], dtype=tl.int64) + q_last

    m_i = tl.zeros([GROUP_PAD], dtype=tl.float32) + NEG_BIG
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(q_last - SLIDING_WINDOW + 1, 0)
    # Whole BLOCK_N tiles per split, so splits never share a tile; one split ends at seq_len.
    per_split = tl.cdiv(tl.cdiv(tl.maximum(seq_len - lo, 0), NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)
    table_row = block_tables_ptr + seq * stride_bt
    for k_start in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head, k_start, q_pos,
            end, stride_cb, stride_cs, stride_ch, stride_cd, qk_scale_log2,
            HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, SLIDING_WINDOW, PRECISION, DOT_FP32)
    return row, m_i, l_i, acc


@triton.jit(do_not_specialize=["stride_bt"])
def paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    seq_ids_ptr, token_rows_ptr,
    qk_scale_log2,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One program per (decode sequence, kv head), over all its keys (`_decode_range`)."""
    row, m_i, l_i, acc = _decode_range(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, seq_ids_ptr, token_rows_ptr,
        qk_scale_log2, stride_qt, stride_qh, stride_qd, stride_cb, stride_cs, stride_ch, stride_cd,
        stride_bt, 0, GROUP, GROUP_PAD, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, SLIDING_WINDOW, 1,
        PRECISION, DOT_FP32)
    r = tl.arange(0, GROUP_PAD)
    heads = tl.program_id(1) * GROUP + r
    d = tl.arange(0, D_PAD)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=(r < GROUP)[:, None] & (d < HEAD_DIM)[None, :])


@triton.jit(do_not_specialize=["stride_bt"])
def paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, seq_ids_ptr,
    qk_scale_log2,
    stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One program per (prefill sequence, BLOCK_M query rows of its chunk, query head).

    The chunk's rows sit at positions `seq_len - query_len ..  seq_len - 1`; its own K/V are
    already in the cache, so every key (earlier context and the chunk alike) is read through
    the block table, and chunked prefill is the same code as a first prefill.
    """
    i = tl.program_id(0)
    tile = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    seq = tl.load(seq_ids_ptr + i).to(tl.int64)
    q_begin = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_begin
    if tile * BLOCK_M >= q_len:  # grid is sized for the longest chunk of the step
        return
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    context = seq_len - q_len

    r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    r_valid = r < q_len
    rows = q_begin + r
    d = tl.arange(0, D_PAD)
    mask = r_valid[:, None] & (d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
                mask=mask, other=0.0)
    q_pos = context + r

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) + NEG_BIG
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    # Keys up to the tile's last real query; causal masking inside _attend_tile does the rest.
    hi = tl.minimum(context + (tile + 1) * BLOCK_M, seq_len)
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(context + tile * BLOCK_M - SLIDING_WINDOW + 1, 0)
    table_row = block_tables_ptr + seq * stride_bt
    for k_start in range(lo, hi, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, k_cache_ptr, v_cache_ptr, table_row, kv_head, k_start, q_pos,
            hi, stride_cb, stride_cs, stride_ch, stride_cd, qk_scale_log2,
            HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, SLIDING_WINDOW, PRECISION, DOT_FP32)
    acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["stride_bt"])
def paged_decode_split_kernel(
    m_ptr, l_ptr, acc_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    seq_ids_ptr, token_rows_ptr,
    qk_scale_log2,
    stride_qt, stride_qh, stride_qd,
    stride_cb, stride_cs, stride_ch, stride_cd, stride_bt,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SLIDING_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """Flash-decoding: `paged_decode_kernel` over one of NUM_SPLITS consecutive key ranges.
    One program per (decode sequence, kv head, split); it writes its running max, sum and
    unnormalised output rows to the partials, which `paged_decode_reduce_kernel` combines.
    Splitting gives a small batch enough programs to keep every SM reading K/V."""
    split = tl.program_id(2)
    _, m_i, l_i, acc = _decode_range(
        q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, seq_ids_ptr, token_rows_ptr,
        qk_scale_log2, stride_qt, stride_qh, stride_qd, stride_cb, stride_cs, stride_ch, stride_cd,
        stride_bt, split, GROUP, GROUP_PAD, HEAD_DIM, D_PAD, BLOCK_SIZE, BLOCK_N, SLIDING_WINDOW,
        NUM_SPLITS, PRECISION, DOT_FP32)
    r = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    part = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * NUM_SPLITS + split
    keep = r < GROUP
    tl.store(m_ptr + part * GROUP_PAD + r, m_i, mask=keep)
    tl.store(l_ptr + part * GROUP_PAD + r, l_i, mask=keep)
    tl.store(acc_ptr + (part * GROUP_PAD + r[:, None]) * D_PAD + d[None, :], acc, mask=keep[:, None])


@triton.jit
def paged_decode_reduce_kernel(
    out_ptr, m_ptr, l_ptr, acc_ptr, token_rows_ptr,
    stride_ot, stride_oh, stride_od,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """Combine one (decode sequence, kv head)'s split partials: each split's sum and output
    rescaled by 2^(its max - the overall max). An empty split (max NEG_BIG, sum 0) adds 0."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    row = tl.load(token_rows_ptr + i).to(tl.int64)
    first = (i * tl.num_programs(1) + kv_head) * NUM_SPLITS
    r = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    s = tl.arange(0, SPLITS_PAD)
    m_all = tl.load(m_ptr + (first + s[:, None]) * GROUP_PAD + r[None, :],
                    mask=(s < NUM_SPLITS)[:, None] & (r < GROUP)[None, :], other=NEG_BIG)
    m = tl.max(m_all, axis=0)  # [GROUP_PAD]
    l_sum = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], dtype=tl.float32)
    keep = r < GROUP
    for split in range(NUM_SPLITS):
        part = first + split
        m_s = tl.load(m_ptr + part * GROUP_PAD + r, mask=keep, other=NEG_BIG)
        w = tl.exp2(m_s - m)
        l_sum += tl.load(l_ptr + part * GROUP_PAD + r, mask=keep, other=0.0) * w
        acc += tl.load(acc_ptr + (part * GROUP_PAD + r[:, None]) * D_PAD + d[None, :],
                       mask=keep[:, None], other=0.0) * w[:, None]
    acc = acc / tl.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    heads = kv_head * GROUP + r
    tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
             acc.to(out_ptr.dtype.element_ty), mask=keep[:, None] & (d < HEAD_DIM)[None, :])

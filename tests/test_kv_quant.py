"""Quantized KV: quantizer error bounds, paged round trips, attention accuracy, byte accounting.

Every bound below is derived from the number format, not fitted to observed errors:
- fp8 round-to-nearest keeps half an ulp: e4m3 (3 mantissa bits) |dx| <= 2^-4 |x| for scaled
  values in the normal range, and half the smallest subnormal step (2^-9 / 2) times the scale
  below it; e5m2 (2 mantissa bits) 2^-3 |x| and 2^-17 * scale.
- asymmetric int min/max groups: the stored (float16, outward-rounded) scale covers the group, so
  rounding to the nearest code errs by at most scale / 2.
A slack of 1e-6 relative covers float32 arithmetic in the (de)quantize itself.
"""
from __future__ import annotations

import math

import pytest
import torch
from kv_cases import TINY, samples, write_seq

from kvserve.attention.base import build_attention_metadata
from kvserve.attention.cpu import CPUAttentionBackend
from kvserve.cache import quantizers as quant
from kvserve.cache.factory import create_kv_cache, kv_cache_bytes_per_block
from kvserve.cache.fp8 import Fp8PagedKVCache
from kvserve.cache.kivi import IntPagedKVCache
from kvserve.cache.paged import PagedKVCache
from kvserve.cache.quantized import QuantizedKVCache
from kvserve.cache.quantizers import KVScales
from kvserve.config import ConfigError, ModelConfig
from kvserve.core.step import BlockCopy
from kvserve.kv.hashing import extend_block_hashes, root_hash

FP8_BOUNDS = {"fp8_e4m3": (2.0 ** -4, 2.0 ** -10), "fp8_e5m2": (2.0 ** -3, 2.0 ** -17)}
QUANT_DTYPES = ["fp8", "fp8_e5m2", "int8", "int4"]
SMOL = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192)  # SmolLM2-135M shapes
def fp8_ok(x, y, kind, scale):
    rel, sub = FP8_BOUNDS[kind]
    bound = torch.maximum(rel * x.abs(), sub * scale) * (1 + 1e-6)
    return bool(((x - y).abs() <= bound).all())


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("dims", [None, (0, 2)])  # per tensor, per head
def test_fp8_round_trip_bound(kind, outliers, dims):
    x = samples(1, outliers=outliers)
    q = quant.quantize_fp8(x, kind, reduce_dims=dims)
    assert q.data.dtype == quant.FP8_DTYPES[kind]
    assert q.scale.numel() == (1 if dims is None else x.shape[1])
    y = quant.dequantize_fp8(q)
    assert fp8_ok(x, y, kind, q.scale.expand_as(x))
    # The largest magnitude maps onto the format's max finite value exactly (no clipping).
    assert float(q.data.float().abs().max()) == quant.fp8_max(kind)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_centered_bound_and_offset_channels(kind):
    """Centered: the format's bound applies to x minus the stored mean, so a channel sitting at a
    large offset (LLM keys) keeps its token-to-token variation instead of rounding it away."""
    x = samples(11, (16, 4, 64))
    x[..., 3] += 80.0  # an outlier channel: offset 80, variation ~1
    x[..., 7] -= 1000.0  # beyond e4m3's 448: the stored mean clamps and centering is partial
    q = quant.quantize_fp8(x, kind, reduce_dims=(0, 1, 2), center_dims=(0,))
    assert q.mean.dtype == quant.FP8_MEAN_DTYPE and q.mean.shape == (1, 4, 64)
    y = quant.dequantize_fp8(q)
    assert fp8_ok(x - q.mean.float(), y - q.mean.float(), kind, q.scale.expand_as(x))
    assert bool(torch.isfinite(y).all())
    plain = quant.dequantize_fp8(quant.quantize_fp8(x, kind, reduce_dims=(0, 1, 2)))
    rel = FP8_BOUNDS[kind][0]
    spread = (x[..., 3] - x[..., 3].mean(0)).abs().max()
    # Residual offset after the mean's own e4m3 rounding is <= 2^-4 * 80 = 5: bound 2^-4 * (spread + 5).
    assert (y[..., 3] - x[..., 3]).abs().max() <= rel * (spread + 80 * 2.0 ** -4) * (1 + 1e-6)
    assert (y[..., 3] - x[..., 3]).abs().max() < 0.5 * (plain[..., 3] - x[..., 3]).abs().max()


def test_fp8_static_scale_saturates_instead_of_nan():
    x = torch.tensor([1.0, -1000.0, 1000.0, 0.0])
    q = quant.quantize_fp8(x, "fp8_e4m3", scale=1.0)
    y = quant.dequantize_fp8(q)
    assert torch.equal(y, torch.tensor([1.0, -448.0, 448.0, 0.0]))
    with pytest.raises(quant.QuantError, match="> 0"):
        quant.quantize_fp8(x, "fp8_e4m3", scale=0.0)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("axis,group", [(0, 16), (0, 64), (2, 32), (2, 64)])
def test_int_group_round_trip_bound(bits, outliers, axis, group):
    x = samples(2, outliers=outliers)
    q = quant.quantize_groups(x, bits, group, axis)
    assert q.codes.dtype == torch.uint8 and q.codes.shape[-1] == x.shape[-1] * bits // 8
    y = quant.dequantize_groups(q)
    step = q.scale.float().repeat_interleave(group, dim=axis)
    assert bool(((x - y).abs() <= step / 2 * (1 + 1e-6) + 1e-7).all())
    # The scale is the group's range over the code range (to float16 precision), no wider.
    grouped = x.unflatten(axis, (x.shape[axis] // group, group))
    rng = grouped.amax(axis + 1) - grouped.amin(axis + 1)
    assert torch.allclose(q.scale.float(), rng / (2 ** bits - 1), rtol=2e-3)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("magnitude", [1e-3, 1.0, 1e3])  # exponents below, at and above e4m3's range
@pytest.mark.parametrize("axis,group", [(0, 16), (2, 64)])
def test_int4_compact_round_trip_bound(symmetric, magnitude, axis, group):
    """Compact: e4m3 scale (and zero) rounded outward in the 2^-e scaled domain, so the stored
    scale still covers the group and the error is <= scale * 2^e / 2."""
    x = samples(12, outliers=True) * magnitude
    q = quant.quantize_groups(x, 4, group, axis, compact=True, symmetric=symmetric, exponent_dims=(1, 2))
    assert q.scale.dtype == quant.COMPACT_META_DTYPE and q.exponent.shape == (x.shape[0], 1, 1)
    assert (q.zero is None) == symmetric
    y = quant.dequantize_groups(q)
    step = q.scale.float().repeat_interleave(group, dim=axis) * torch.exp2(q.exponent.float())
    assert bool(((x - y).abs() <= step / 2 * (1 + 1e-6)).all())
    # Not much coarser than needed: outward rounding moves the zero down by at most one e4m3 ulp
    # (<= 2^-3 |min|, or 2^-9 among subnormals) and the scale up by at most one more, all in the
    # 2^-e scaled domain.
    p2 = torch.exp2(q.exponent.float())
    grouped = (x / p2).unflatten(axis, (x.shape[axis] // group, group))
    mn, mx = grouped.amin(axis + 1), grouped.amax(axis + 1)
    need = (torch.maximum(mx, -mn) / 7 if symmetric
            else (mx - mn + mn.abs() / 8 + 2.0 ** -9) / 15)
    most = (need * (1 + 2.0 ** -3) + 2.0 ** -9).repeat_interleave(group, dim=axis) * p2
    assert bool((step <= most * (1 + 1e-6)).all())


def test_fp8_round_outward_is_the_nearest_e4m3_on_the_right_side():
    all_codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = all_codes[torch.isfinite(all_codes)].unique()  # sorted, every e4m3 value once
    t = torch.cat([torch.randn(4000) * 30, torch.randn(1000) * 1e-3, grid, torch.tensor([0.0, -0.0, 448.0])])
    up, down = quant.fp8_round_outward(t, True).float(), quant.fp8_round_outward(t, False).float()
    assert bool((up >= t).all()) and bool((down <= t).all())
    # Nearest: no grid value lies strictly between t and the result.
    idx_up = torch.searchsorted(grid, t, side="left")  # first grid value >= t
    idx_down = torch.searchsorted(grid, t, side="right") - 1  # last grid value <= t
    assert torch.equal(up, grid[idx_up]) and torch.equal(down, grid[idx_down])


def test_int_constant_group_is_exact_and_int4_packing_round_trips():
    x = torch.full((4, 2, 8), 0.37)
    for bits in (4, 8):
        y = quant.dequantize_groups(quant.quantize_groups(x, bits, 4, axis=0))
        assert torch.allclose(y, x, atol=1e-4)  # float16 zero point: 2^-11 relative
    codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16) % 16
    assert torch.equal(quant.unpack_int4(quant.pack_int4(codes)), codes)


def test_quantizer_errors_name_the_setting():
    with pytest.raises(quant.QuantError, match="group size 24 must divide"):
        quant.quantize_groups(torch.randn(16, 64), 4, 24, axis=0)
    for bad in (float("nan"), float("inf"), float("-inf")):  # caught from the group ranges
        for compact in (False, True):
            with pytest.raises(quant.QuantError, match="non-finite"):
                quant.quantize_groups(torch.tensor([[1.0, bad, 0.5, 2.0]]), 8, 2, axis=1, compact=compact)
    with pytest.raises(quant.QuantError, match="int4"):
        quant.bytes_per_block_per_layer("int4", 1, 63, 16, 63)
    with pytest.raises(ConfigError, match="group_size 3 must divide"):
        IntPagedKVCache(TINY, num_blocks=4, block_size=8, dtype=torch.float32, group_size=3)
    odd = ModelConfig("llama", 100, 6, 128, 2, 2, 2, 3, 1024)  # head_dim 3: int4 cannot pack it
    with pytest.raises(ConfigError, match="even head_dim"):
        IntPagedKVCache(odd, num_blocks=4, block_size=16, dtype=torch.float32, compact=False, group_size=1)


# ---------------------------------------------------------------------------- byte accounting

def test_bytes_per_block_match_allocation_and_ratios():
    for dt in QUANT_DTYPES:
        for bs in (16, 32):
            c = create_kv_cache(TINY, num_blocks=2, block_size=bs, kv_cache_dtype=dt)
            assert c.block_bytes == kv_cache_bytes_per_block(TINY, bs, dt, torch.float32)
    f32 = kv_cache_bytes_per_block(SMOL, 16, "auto", torch.float32)
    bf16 = kv_cache_bytes_per_block(SMOL, 16, "auto", torch.bfloat16)
    ratio = {dt: (f32 / kv_cache_bytes_per_block(SMOL, 16, dt, torch.float32),
                  bf16 / kv_cache_bytes_per_block(SMOL, 16, dt, torch.bfloat16)) for dt in QUANT_DTYPES}
    # fp8: one byte per element, two float32 scales per block, layer and kv head, and one e4m3
    # key mean per channel per block (centering): 2 + 1/16 bytes per K/V element pair at block 16.
    assert ratio["fp8"][1] == pytest.approx(4 / (2 + 1 / 16 + 8 / (16 * 64)))
    assert 1.93 < ratio["fp8"][1] < 1.94 and 3.86 < ratio["fp8"][0] < 3.87
    plain = Fp8PagedKVCache(TINY, num_blocks=2, block_size=16, dtype=torch.float32, center_keys=False,
                            scale_granularity="tensor")
    assert plain.block_bytes == 2 * quant.bytes_per_block_per_layer("fp8", 2, 16, 16)
    assert 2 * 4 * (2 - 1) == quant.bytes_per_block_per_layer("fp8", 2, 16, 16, fp8_scale_granularity="head") \
        - quant.bytes_per_block_per_layer("fp8", 2, 16, 16)
    assert quant.bytes_per_block_per_layer("fp8", 3, 64, 16, fp8_center_keys=True) == \
        quant.bytes_per_block_per_layer("fp8", 3, 64, 16) + 3 * 64
    # int8 at group 32, block 16: keys 8 bits + fp16 scale and zero per 16 tokens (2 bits),
    # values 8 bits + the same per 32 channels (1 bit): 9.5 bits on average.
    assert ratio["int8"][1] == pytest.approx(16 / 9.5)
    # int4 (compact), per layer and block: codes (4 bits, K and V), keys an e4m3 scale and zero
    # per channel per 16 tokens, values one e4m3 scale per token and head (group 64 = head_dim),
    # two int8 exponents: 3506 bytes against bfloat16's 12288 (3.50x).
    assert kv_cache_bytes_per_block(SMOL, 16, "int4", torch.bfloat16) == 30 * (16 * 3 * 64 + 3 * 64 * 2 + 16 * 3 + 2)
    assert ratio["int4"][1] >= 3.5 and ratio["int4"][0] >= 7.0
    # Block 64: the key metadata is amortized over 64 tokens (3.82x).
    assert kv_cache_bytes_per_block(SMOL, 64, "int4", torch.bfloat16) == 30 * (64 * 3 * 64 + 3 * 64 * 2 + 64 * 3 + 2)
    # The float16-metadata format: (4 + 2 + 4 + 2) / 2 = 6 bits (TINY's head_dim 16 clips group 32).
    old = IntPagedKVCache(TINY, num_blocks=2, block_size=16, dtype=torch.float32, group_size=32, compact=False)
    assert old.block_bytes * 8 / (16 * 2 * 2 * 16 * 2) == pytest.approx(6)
    assert old.block_bytes == 2 * quant.bytes_per_block_per_layer("int4", 2, 16, 16, 32)
    assert quant.bytes_per_token_per_layer("int4", 3, 64, 64, 64) * 8 / (3 * 64 * 2) == pytest.approx(4.5)
    # Same budget -> proportionally more blocks.
    budget = 1 << 30
    assert budget // kv_cache_bytes_per_block(SMOL, 16, "fp8", torch.bfloat16) >= 1.93 * (budget // bf16)
    assert QuantizedKVCache.residual_bytes(SMOL, 16, "int4", torch.float32, 8) == \
        8 * 30 * (2 * 16 * 3 * 64 * 4 + 16)


# ------------------------------------------------------------------------- paged round trips

def reference_block(cache, k_blk, v_blk):
    """What a sealed block must dequantize to: the quantizer applied to the whole block."""
    if isinstance(cache, Fp8PagedKVCache):
        dims = (1, 3) if cache.scale_granularity == "head" else (1, 2, 3)
        centers = ((1,) if cache.center_keys else None, None)  # keys over the block's tokens
        return [quant.dequantize_fp8(quant.quantize_fp8(x, cache.kind, reduce_dims=dims, center_dims=c))
                for x, c in zip((k_blk, v_blk), centers)]
    g, fmt = cache.groups, dict(compact=cache.compact, exponent_dims=(1, 2, 3))
    return [quant.dequantize_groups(quant.quantize_groups(k_blk, cache.bits, g.key_tokens, 1,
                                                          symmetric=cache.symmetric["k"], **fmt)),
            quant.dequantize_groups(quant.quantize_groups(v_blk, cache.bits, g.value_channels, 3,
                                                          symmetric=cache.symmetric["v"], **fmt))]


@pytest.mark.parametrize("dt", QUANT_DTYPES)
def test_paged_write_gather_exact_against_block_quantizer(dt):
    bs, n = 8, 29  # 3 full blocks + a 5-token partial block
    cache = create_kv_cache(TINY, num_blocks=12, block_size=bs, kv_cache_dtype=dt)
    k, v = samples(3, (n, 2, 16), outliers=True), samples(4, (n, 2, 16))
    table = [9, 2, 11, 5]  # scattered, out of order
    write_seq(cache, table, k, v, [13, 1, 1, 3, 11])  # chunked prefill + decodes
    for layer in range(2):
        gk, gv = cache.gather(layer, torch.tensor(table))
        kb, vb = (x * (layer + 1) for x in (k, v))
        full = 3 * bs
        rk, rv = reference_block(cache, kb[:full].view(3, bs, 2, 16), vb[:full].view(3, bs, 2, 16))
        assert torch.equal(gk[:full], rk.reshape(full, 2, 16))
        assert torch.equal(gv[:full], rv.reshape(full, 2, 16))
        # The open block is still the residual: exact.
        assert torch.equal(gk[full:n], kb[full:]) and torch.equal(gv[full:n], vb[full:])
    # Filling the last block seals it; gathering a subset returns only those blocks.
    k2, v2 = samples(5, (3, 2, 16)), samples(6, (3, 2, 16))
    p = torch.arange(n, n + 3)
    slots = torch.tensor(table)[p // bs] * bs + p % bs
    for layer in range(2):
        cache.write(layer, slots, k2 * (layer + 1), v2 * (layer + 1))
    assert int((cache.block_res >= 0).sum()) == 0
    gk, _ = cache.gather(0, torch.tensor([5]))
    rk, _ = reference_block(cache, torch.cat([k[24:], k2]).view(1, bs, 2, 16), torch.zeros(1, bs, 2, 16))
    assert torch.equal(gk, rk.reshape(bs, 2, 16))


def test_fp8_per_head_and_static_scales():
    k, v = samples(7, (16, 2, 16), outliers=True), samples(8, (16, 2, 16))
    c = Fp8PagedKVCache(TINY, num_blocks=4, block_size=16, dtype=torch.float32, scale_granularity="head")
    write_seq(c, [3], k, v, [16])
    assert c.fields["k_scale"].shape == (2, 4, 2)
    gk, _ = c.gather(0, torch.tensor([3]))
    assert torch.equal(gk, reference_block(c, k[None], v[None])[0][0])
    scales = KVScales.from_weights({f"model.layers.{i}.self_attn.{n}_scale": torch.tensor(0.05)
                                    for i in range(2) for n in "kv"}, 2)
    s = Fp8PagedKVCache(TINY, num_blocks=4, block_size=16, dtype=torch.float32, kv_scales=scales)
    assert not s.staged and s.block_bytes == 2 * 2 * 16 * 2 * 16  # no per-block scales stored
    write_seq(s, [1], k[:5], v[:5], [2, 3])
    gk, _ = s.gather(0, torch.tensor([1]))
    ref = quant.dequantize_fp8(quant.quantize_fp8(k[:5], "fp8_e4m3", scale=0.05))
    assert torch.equal(gk[:5], ref)
    with pytest.raises(quant.QuantError, match="only one of"):
        KVScales.from_weights({"model.layers.0.self_attn.k_scale": torch.tensor(1.0)}, 2)
    assert KVScales.from_weights({}, 2) is None


@pytest.mark.parametrize("dt", ["int8", "int4"])
def test_int_without_residual_quantizes_each_token_when_written(dt):
    c = IntPagedKVCache(TINY, num_blocks=6, block_size=8, dtype=torch.float32, kv_cache_dtype=dt,
                        residual=False)
    assert not c.staged and c.residual_pool_bytes == 0
    k, v = samples(50, (11, 2, 16), outliers=True), samples(51, (11, 2, 16))
    write_seq(c, [5, 0], k, v, [3, 1, 7])
    gk, gv = c.gather(0, torch.tensor([5, 0]))
    bits, g = quant.INT_BITS[dt], c.groups.value_channels
    for got, x, name in ((gk, k, "k"), (gv, v, "v")):  # keys per token too: final when written
        ref = quant.quantize_groups(x, bits, g, 2, compact=c.compact, symmetric=c.symmetric[name],
                                    exponent_dims=(1, 2))
        assert torch.equal(got[:11], quant.dequantize_groups(ref))
    c.copy_blocks([BlockCopy(0, 3, 2)])
    g3, _ = c.gather(0, torch.tensor([3]))
    assert torch.equal(g3[:2], gk[8:10])


def test_residual_pool_eviction_reopen_and_growth():
    bs = 8
    c = IntPagedKVCache(TINY, num_blocks=16, block_size=bs, dtype=torch.float32,
                        kv_cache_dtype="int8", num_residual_blocks=2)
    seqs = {0: [1, 4], 1: [7, 3], 2: [10, 12]}
    data = {i: (samples(10 + i, (12, 2, 16)), samples(20 + i, (12, 2, 16))) for i in seqs}
    for t in range(12):  # three sequences decode in turn: 3 open blocks, 2 residual entries
        for i, table in seqs.items():
            p = torch.tensor([t])
            slot = torch.tensor(table)[p // bs] * bs + p % bs
            for layer in range(2):
                c.write(layer, slot, data[i][0][t:t + 1], data[i][1][t:t + 1])
    for i, table in seqs.items():
        gk, gv = c.gather(1, torch.tensor(table))
        k, v = data[i]
        # More open blocks than entries thrash: a block is evicted (quantized as it stands) and
        # re-opened (dequantized) once per decode of another sequence, so a token is quantized up
        # to block_size times, each within half a step of a group no wider than the channel's range.
        step_k = (k.amax(0) - k.amin(0)) / 255
        assert bool(((gk[:12] - k).abs() <= bs * step_k * 0.5 * 1.01 + 1e-6).all())
        step_v = (v.amax(2, keepdim=True) - v.amin(2, keepdim=True)) / 255
        assert bool(((gv[:12] - v).abs() <= bs * step_v * 0.5 * 1.01 + 1e-6).all())
    assert c.residual_evictions > 0
    # More open blocks in one write than the pool has entries: the pool grows (it used to fail).
    entries = c.num_residual_blocks
    c.write(0, torch.tensor([13 * bs, 14 * bs, 15 * bs]), torch.ones(3, 2, 16), torch.ones(3, 2, 16))
    assert c.num_residual_blocks > entries
    assert torch.equal(c.gather(0, torch.tensor([13, 14, 15]))[0][::bs], torch.ones(3, 2, 16))


@pytest.mark.parametrize("dt", ["fp8", "int4"])
def test_copy_blocks_partial_full_and_chain(dt):
    bs = 8
    c = create_kv_cache(TINY, num_blocks=10, block_size=bs, kv_cache_dtype=dt)
    k, v = samples(30, (13, 2, 16)), samples(31, (13, 2, 16))
    write_seq(c, [4, 6], k, v, [13])  # block 4 full (sealed), block 6 open with 5 tokens
    before = {n: t[:, 4].clone() for n, t in c.fields.items()}
    g4, _ = c.gather(0, torch.tensor([4]))
    c.copy_blocks([BlockCopy(4, 1, bs), BlockCopy(6, 2, 3), BlockCopy(1, 3, bs)])
    for n, t in c.fields.items():  # full copy of a sealed block copies its codes bit for bit
        assert torch.equal(t[:, 1], before[n])
    gk, _ = c.gather(0, torch.tensor([1, 2, 3]))
    assert torch.equal(gk[:bs], g4)
    assert torch.equal(gk[bs:bs + 3], k[8:11])  # partial copy of an open block: residual, exact
    assert torch.equal(gk[2 * bs:], torch.zeros(bs, 2, 16))  # chain reads block 1's old contents


# ------------------------------------------------------------------------ attention accuracy

def attention_f64(q, k, v, scale):
    """Causal decode attention of each query row (last position) in float64, GQA by repeat."""
    rep = q.shape[0] // k.shape[1]
    kk, vv = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    logits = torch.einsum("hd,lhd->hl", q.double(), kk) * scale
    return torch.einsum("hl,lhd->hd", logits.softmax(-1), vv)


@pytest.mark.parametrize("dt", QUANT_DTYPES)
def test_paged_attention_with_quantized_kv_vs_float64(dt):
    """Decode attention through the torch backend over a quantized cache, versus float64 over
    the original K/V. Bound: the output is a convex combination of V rows, so V error adds at
    most max|dV|; a logit error of at most d per key moves the softmax weights by
    sum|p' - p| <= e^{2d} - 1, which moves the output by at most that times max|V|.
    d = scale * max_j |q . dk_j| is computed from the block quantizer's own error."""
    bs, H, Hq, D, n = 8, 2, 4, 16, 37
    cache = create_kv_cache(TINY, num_blocks=12, block_size=bs, kv_cache_dtype=dt)
    k, v, q = samples(40, (n, H, D), outliers=True), samples(41, (n, H, D)), samples(42, (1, Hq, D))
    table = [3, 8, 1, 10, 6]
    write_seq(cache, table, k, v, [n - 1, 1])
    backend = CPUAttentionBackend(Hq, H, D, scale=D ** -0.5)
    meta = build_attention_metadata([n - 1], [1], [table], bs)
    out = backend.forward(0, q, k[-1:], v[-1:], cache, meta)[0]  # rewrites the last token
    ref = attention_f64(q[0], k, v, D ** -0.5)
    gk, gv = cache.gather(0, torch.tensor(table))
    dk, dv = (gk[:n] - k).double(), (gv[:n] - v).double()
    rep = Hq // H
    d = (torch.einsum("hd,lhd->hl", q[0].double(), dk.repeat_interleave(rep, 1)).abs().max() * D ** -0.5)
    bound = dv.abs().max() + math.expm1(2 * float(d)) * v.abs().max()
    err = (out.double() - ref).abs().max()
    assert 0 < err <= bound + 1e-5, (float(err), float(bound))
    # And the backend attends exactly to what the cache dequantizes (float32 rounding only).
    exact = attention_f64(q[0], gk[:n], gv[:n], D ** -0.5)
    assert (out.double() - exact).abs().max() < 1e-5


def test_quantized_cache_factory_and_prefix_hash_separation():
    for dt, cls in (("fp8", Fp8PagedKVCache), ("fp8_e4m3", Fp8PagedKVCache), ("fp8_e5m2", Fp8PagedKVCache),
                    ("int8", IntPagedKVCache), ("int4", IntPagedKVCache), ("auto", PagedKVCache)):
        assert type(create_kv_cache(TINY, num_blocks=2, block_size=8, kv_cache_dtype=dt)) is cls
    tokens = list(range(64))
    hashes = {dt: set(extend_block_hashes([], root_hash(dt), tokens, 16))
              for dt in ("auto", "fp8_e4m3", "fp8_e5m2", "int8", "int4")}
    names = list(hashes)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            assert not hashes[a] & hashes[b], (a, b)


@pytest.mark.parametrize("dt", ["auto", "int8"])
def test_quantized_cache_copies_prefixes_from_full_blocks_only(dt):
    """A partial block of a quantized cache is exact while open in the residual pool and padded
    codes once evicted (by other requests' writes): a prefix served from one would depend on
    what else ran. Full blocks are quantized once, so their leading tokens are still served."""
    from kvserve.core.request import Request
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.kv.manager import KVCacheManager
    kv = KVCacheManager(16, 8, kv_cache_dtype=dt)
    tokens = list(range(100, 113))  # one full block, then 5 tokens of a partial one
    first = Request("a", tokens, SamplingParams())
    assert kv.allocate_slots(first, len(tokens), kv.get_computed_blocks(first))
    first.num_computed_tokens = len(tokens)
    kv.commit(first)
    kv.free(first)
    hit = kv.get_computed_blocks(Request("b", tokens, SamplingParams()))
    assert (hit.num_tokens, hit.partial_tokens) == ((12, 4) if dt == "auto" else (8, 0))
    hit = kv.get_computed_blocks(Request("c", tokens[:5], SamplingParams()))  # inside the full block
    assert (hit.num_tokens, hit.partial_tokens) == (4, 4)


def test_fp8_alias_shares_prefix_cache_keys():
    from kvserve.config import EngineArgs
    a, b = EngineArgs(kv_cache_dtype="fp8"), EngineArgs(kv_cache_dtype="fp8_e4m3")
    a.validate()
    b.validate()
    from kvserve.kv.hashing import root_hash
    assert root_hash(a.kv_cache_dtype) == root_hash(b.kv_cache_dtype) != root_hash("fp8_e5m2")


@pytest.mark.parametrize("dt", ["fp8_e4m3", "int8", "int4"])
def test_sealing_at_step_end_gives_the_same_codes_for_all_layers_at_once(dt):
    """The engine's setting: a block filled by a write stays in the residual (read at full
    precision) until finish_step seals every layer's filled blocks in one quantization, which
    must store exactly the codes sealing inside each write stores."""
    bs = 8
    eager = create_kv_cache(TINY, num_blocks=6, block_size=bs, kv_cache_dtype=dt)
    late = create_kv_cache(TINY, num_blocks=6, block_size=bs, kv_cache_dtype=dt, seal_at_step_end=True)
    k, v = samples(50, (20, 2, 16)), samples(51, (20, 2, 16))
    for c in (eager, late):
        write_seq(c, [4, 1, 3], k, v, [5] + [1] * 15)  # decodes fill blocks 4 and 1 one token at a time
    assert int((eager.block_res[:, [4, 1]] >= 0).sum()) == 0  # sealed inside the writes
    assert bool((late.block_res[:, [4, 1]] >= 0).all())  # still open: read back exactly
    for layer in range(2):
        gk, gv = late.gather(layer, torch.tensor([4, 1]))
        assert torch.equal(gk, (k[:16] * (layer + 1)).to(gk.dtype)) and torch.equal(gv, (v[:16] * (layer + 1)).to(gv.dtype))
    late.finish_step()
    assert int((late.block_res[:, [4, 1]] >= 0).sum()) == 0 and bool((late.block_res[:, 3] >= 0).all())
    for name, t in late.fields.items():
        assert torch.equal(t.view(torch.uint8), eager.fields[name].view(torch.uint8)), name
    for layer in range(2):  # the written slots (block 3 holds 4 tokens; past them, any old rows)
        for got, want in zip(late.gather(layer, torch.tensor([4, 1, 3])), eager.gather(layer, torch.tensor([4, 1, 3]))):
            assert torch.equal(got[:20], want[:20])


def test_a_write_plan_is_reused_across_layers_but_not_after_an_in_place_edit():
    """The block placement of a write is worked out once per slot tensor (every layer of a step
    writes the same one); editing the tensor in place between writes must not reuse it."""
    bs = 8
    c = create_kv_cache(TINY, num_blocks=6, block_size=bs, kv_cache_dtype="int8")
    ref = create_kv_cache(TINY, num_blocks=6, block_size=bs, kv_cache_dtype="int8")
    k, v = samples(60, (3, 2, 16)), samples(61, (3, 2, 16))
    slots = torch.tensor([8, 9, 40])
    c.write(0, slots, k, v)
    ref.write(0, torch.tensor([8, 9, 40]), k, v)
    slots[2] = 17  # another block
    c.write(1, slots, k, v)
    ref.write(1, torch.tensor([8, 9, 17]), k, v)
    for layer in range(2):
        assert torch.equal(c.gather(layer, torch.arange(6))[0], ref.gather(layer, torch.arange(6))[0])


@pytest.mark.parametrize("dt", ["int8", "fp8_e4m3", "int4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seal_at_step_end", [False, True])
@pytest.mark.needs("cpu_kernels")
def test_compiled_residual_write_leaves_the_cache_as_the_torch_ops_do(dt, dtype, seal_at_step_end):
    """The compiled decode-time residual write and block quantizers (whole prompt blocks, seals
    read in the residual pool) must leave every tensor of the cache (codes, metadata, residual
    rows, masks, entries, LRU clocks) exactly as the torch path does, through prefill chunks,
    decodes filling and starting blocks, K/V given as strided views, a pool too small for the
    open blocks (evictions, re-opened blocks) and sealing."""
    from kvserve.ops.cpu_kernels import residual_write_kernel
    assert residual_write_kernel() is not None
    bs, g = 8, torch.Generator().manual_seed(7)
    caches = [create_kv_cache(TINY, num_blocks=24, block_size=bs, kv_cache_dtype=dt, dtype=dtype,
                              num_residual_blocks=4, seal_at_step_end=seal_at_step_end) for _ in range(2)]
    caches[1]._row_write = caches[1]._block_quantizers = False  # the torch ops
    kernel, ran = residual_write_kernel(), []
    quantize, quantized = caches[0]._quantize_compiled, []

    def logged(dst, source):
        quantized.append(source.src is not None)  # True: a seal read in the residual pool
        return quantize(dst, source)
    caches[0]._quantize_compiled = logged

    def counted(*args):  # the compiled calls that did write (returned 0)
        rc = kernel(*args)
        ran.append(rc == 0)
        return rc
    caches[0]._row_write = counted
    # Sequences end mid-block (21 tokens), leaving open blocks; the second generation starts in
    # the last blocks of the first (its first chunk inside the block), so a block with a stale
    # entry starts fresh.
    tables = {0: [3, 9, 14], 1: [5, 2, 20], 2: [11, 7, 1], 3: [16, 4, 22], 4: [0, 8, 17], 5: [6, 13, 19],
              6: [17, 10, 12], 7: [19, 15, 18], 8: [1, 21, 23]}
    end = 3 * bs - 3
    pos = {i: 0 for i in tables}
    fresh_fast = 0
    turns = [(0, 1), (2, 3), (4, 5)] * 6 + [(6, 7)] * 6 + [(8,)] * 6
    for step in range(5 * len(turns)):  # turns of 5 steps: 6 open blocks for 4 entries at first
        seqs = [i for i in turns[step // 5] if pos[i] < end]
        if not seqs:
            continue
        lens = {i: min(end - pos[i], int(torch.randint(1, 12 if i < 6 else 8, (1,), generator=g))
                       if pos[i] == 0 else 1) for i in seqs}
        slots = torch.cat([torch.tensor(tables[i])[torch.arange(pos[i], pos[i] + lens[i]) // bs] * bs
                           + torch.arange(pos[i], pos[i] + lens[i]) % bs for i in seqs])
        qkv = torch.randn(slots.numel(), 3 * 2 * 16, generator=g).to(dtype)  # K and V as views, as the model's
        k, v = qkv[:, 32:64].view(-1, 2, 16), qkv[:, 64:].view(-1, 2, 16)
        for layer in range(TINY.num_hidden_layers):
            plan = caches[0]._write_plan(slots)
            fast = plan.part is not None and bool((caches[0].block_res[layer, plan.part.blocks] >= 0).all())
            fresh_fast += fast and bool(plan.part.fresh.any())
            for c in caches:
                c.write(layer, slots, k, v)
        for c in caches:
            c.finish_step()
        for i in seqs:
            pos[i] += lens[i]
        a, b = caches  # after every step: a wrong clock shows at once, not only in a later eviction
        for name in ("res_kv", "res_mask", "res_owner", "res_clock", "block_res", "sealed_fill"):
            assert torch.equal(getattr(a, name), getattr(b, name)), (step, name)
        for name, t in a.fields.items():
            assert torch.equal(t.view(torch.uint8), b.fields[name].view(torch.uint8)), (step, name)
    assert fresh_fast > 0 and sum(ran) > 20 and not all(ran)  # both paths taken
    assert any(quantized) and not all(quantized)  # seals and whole prompt blocks
    # A block sealed while partly written (as an eviction leaves it) re-opens from its codes.
    k, v = torch.randn(1, 2, 16, generator=g).to(dtype), torch.randn(1, 2, 16, generator=g).to(dtype)
    for c in caches:
        for layer in range(TINY.num_hidden_layers):
            c._seal(layer, c.block_res[layer, 23:24])
            assert int(c.block_res[layer, 23]) == -1 and int(c.sealed_fill[layer, 23]) == end - 2 * bs
            c.write(layer, torch.tensor([23 * bs + end - 2 * bs]), k, v)
    for name in ("res_kv", "res_mask", "res_owner", "res_clock", "block_res", "sealed_fill"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a._clock == b._clock and a.residual_evictions == b.residual_evictions > 0


@pytest.mark.parametrize("dt", ["int8", "fp8", "int4"])
def test_a_write_opening_more_blocks_than_the_residual_pool_holds_grows_it(dt):
    """Four prompt chunks that each start and end inside a block open eight blocks in one write;
    a pool of 2 entries grows (all layers, indices kept) instead of failing the step, and every
    token reads back as written."""
    bs = 8
    c = create_kv_cache(TINY, num_blocks=32, block_size=bs, kv_cache_dtype=dt, dtype=torch.float32,
                        num_residual_blocks=2, seal_at_step_end=True)
    ref = create_kv_cache(TINY, num_blocks=32, block_size=bs, kv_cache_dtype="auto", dtype=torch.float32)
    g = torch.Generator().manual_seed(11)
    slots = torch.cat([torch.arange(b * bs + 3, b * bs + bs + 5) for b in (2, 6, 12, 20)])  # 4 x 10 tokens
    k, v = torch.randn(slots.numel(), 2, 16, generator=g), torch.randn(slots.numel(), 2, 16, generator=g)
    for layer in range(TINY.num_hidden_layers):
        c.write(layer, slots, k, v)
        ref.write(layer, slots, k, v)
    assert c.num_residual_blocks >= 8 and c.residual_generation >= 1
    for layer in range(TINY.num_hidden_layers):  # open blocks: read from the residual, exact
        ids = torch.tensor([2, 3, 6, 7, 12, 13, 20, 21])
        assert torch.equal(c.gather(layer, ids)[0], ref.gather(layer, ids)[0])
    c.finish_step()


def test_a_slot_out_of_range_is_an_index_error_not_a_stray_write():
    """The compiled residual write checks its indices and leaves such a write to the torch path,
    which raises, as it did before the compiled write existed."""
    c = create_kv_cache(TINY, num_blocks=4, block_size=8, kv_cache_dtype="int8", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 16).to(torch.bfloat16)
    c.write(0, torch.tensor([9]), k, k)  # block 1 gets an entry
    before = [t.clone() for t in (c.res_kv, c.res_mask, c.block_res)]
    with pytest.raises(IndexError):
        c.write(0, torch.tensor([10, 4 * 8 + 1]), torch.cat([k, k]), torch.cat([k, k]))  # block 4 of 4
    assert all(torch.equal(a, b) for a, b in zip(before, (c.res_kv, c.res_mask, c.block_res)))


def _compiled_vs_torch(kind: str, dtype: torch.dtype, heads: int = 2, head_dim: int = 64, block_size: int = 16,
                       **kw) -> tuple[list[QuantizedKVCache], list[bool]]:
    """Two caches alike but for the block quantizer: [0] compiled (its calls' results logged), [1] torch."""
    from kvserve.ops.cpu_kernels import block_quantizers
    assert block_quantizers() is not None
    cfg = ModelConfig("llama", 100, heads * head_dim, 128, 2, heads, heads, head_dim, 1024)
    caches = [create_kv_cache(cfg, num_blocks=40, block_size=block_size, kv_cache_dtype=kind, dtype=dtype, **kw)
              for _ in range(2)]
    caches[1]._block_quantizers = False  # the torch ops
    compiled, ran = caches[0]._quantize_compiled, []

    def logged(dst, source):
        ok = compiled(dst, source)
        ran.append(ok)
        return ok
    caches[0]._quantize_compiled = logged
    return caches, ran


def _assert_same_fields(a: QuantizedKVCache, b: QuantizedKVCache) -> None:
    for name, t in a.fields.items():
        assert torch.equal(t.view(torch.uint8), b.fields[name].view(torch.uint8)), name


BLOCK_FORMATS = [("int8", {}), ("int4", {}), ("int4", {"compact": False}), ("int8", {"compact": True}),
                 ("fp8", {}), ("fp8", {"scale_granularity": "tensor"}), ("fp8", {"center_keys": False})]


@pytest.mark.parametrize("kind,kw", BLOCK_FORMATS, ids=[f"{k}-{'-'.join(map(str, kw.values())) or 'default'}"
                                                         for k, kw in BLOCK_FORMATS])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads,head_dim", [(2, 64), (3, 8)], ids=["vector", "scalar"])
@pytest.mark.needs("cpu_kernels")
def test_compiled_block_quantizer_stores_what_the_torch_path_does(kind, kw, dtype, heads, head_dim):
    """The compiled quantizers (whole blocks: prefill and sealing) must store the torch path's
    codes and metadata bit for bit: tiers and swap carry them between engines. Values span tiny to
    huge magnitudes (beyond float16 only where the metadata is exponent-shifted or fp8), constant
    and all-zero blocks and groups, and exact float16 boundaries; per-entry layers as a seal gives
    them. A non-finite value goes to the torch path, which raises (int) or stores it (fp8). Heads of
    8 channels (rows of 24) take the scalar loops, which CPUs without AVX-512 run."""
    caches, ran = _compiled_vs_torch(kind, dtype, heads, head_dim, **kw)
    wide = kind == "fp8" or caches[0].compact
    g = torch.Generator().manual_seed(3)
    scales = (1e-4, 0.3, 1.0, 40.0, 8e3, 1e-30) + ((3e5, 1e30) if wide else ())
    shape, D = (6, 16, heads, head_dim), head_dim
    for trial, scale in enumerate(scales):
        k = (torch.randn(shape, generator=g) * scale).to(dtype)
        v = (torch.randn(shape, generator=g) * scale).to(dtype)
        k[0, :, 0, :5] = 0.5  # constant groups (scale 0)
        v[1, 3, 1, :D // 2] = -2.0
        k[2, :, 1, 7] = torch.tensor(65504.0 / 3).to(dtype)  # near a float16 step
        k[3, :, 0, D - 1] = torch.linspace(-1e-9, 1e-9, 16).to(dtype)  # zero point and scale below float16's
        v[2, 5, 0, :D // 2] = torch.linspace(0, 2e-9, D // 2).to(dtype)   # smallest step: stepped off 0
        k[4], v[5] = 0.0, 0.0  # all-zero blocks (exponent 0, scale 1)
        if wide:  # a block maximum of exactly 448 * 2^e: the compact exponent's edge
            k[1, 0, 0, 0] = v[1, 0, 0, 0] = -448.0 * 2.0 ** (round(math.log2(scale)) + 3)
        ids = torch.randperm(40, generator=g)[:6]
        for c in caches:
            c._store_blocks(trial % 2, ids, k, v)
    per_entry = torch.tensor([0, 1, 1]), torch.tensor([5, 6, 7])  # a seal's per-entry layers
    k, v = torch.randn(3, *shape[1:], generator=g).to(dtype), torch.randn(3, *shape[1:], generator=g).to(dtype)
    for c in caches:
        c._store_blocks(per_entry[0], per_entry[1], k, v)
    assert ran == [True] * (len(scales) + 1)
    _assert_same_fields(*caches)
    k[0, 0, 0, 0] = float("nan")
    if kind == "fp8":  # quantize_fp8 has no check: NaN is stored as e4m3's NaN, as before
        for c in caches:
            c._store_blocks(0, torch.tensor([1, 2, 3]), k, v)
        _assert_same_fields(*caches)
    else:
        with pytest.raises(quant.QuantError, match="non-finite"):
            caches[0]._store_blocks(0, torch.tensor([1, 2, 3]), k, v)
        if not wide:
            k[0, 0, 0, 0] = 7e4
            with pytest.raises(quant.QuantError, match="float16 range"):
                caches[0]._store_blocks(0, torch.tensor([1, 2, 3]), k, v)
    assert not any(ran[len(scales) + 1:])


@pytest.mark.parametrize("heads,head_dim", [(2, 64), (3, 8)], ids=["vector", "scalar"])
@pytest.mark.parametrize("kind,kw", [("int8", {}), ("int8", {"group_size": 8}), ("int4", {}),
                                     ("int4", {"compact": False}), ("fp8", {})],
                         ids=["int8", "int8-g8", "int4", "int4-f16", "fp8"])
@pytest.mark.slow
@pytest.mark.needs("cpu_kernels")
def test_compiled_block_quantizer_edge_cases_match_the_torch_path(kind, kw, heads, head_dim):
    """Bit-equal at the edges too: mixed-sign zeros in a group (which zero the range reports decides
    a metadata sign bit), a float32 maximum so small that amax / 448 underflows (fp8 stored NaN
    before), 32-token blocks whose key channel spans 2^40 (the float64 key mean, summed in order),
    key groups shorter than the block, int32 block ids, and a call large enough for the OpenMP
    branch. An id outside the cache is the torch path's IndexError, not a stray write."""
    caches, ran = _compiled_vs_torch(kind, torch.float32, heads, head_dim, block_size=32, **kw)
    g = torch.Generator().manual_seed(5)
    shape = (40, 32, heads, head_dim)  # 40 x 32 x 128 elements: past the OpenMP threshold
    k, v = torch.randn(shape, generator=g), torch.randn(shape, generator=g)
    k[0, :, 0, :] = 0.0
    for t in range(32):  # zeros of both signs, the -0 moving through the lanes, beside ones
        k[0, t, 0, t % head_dim] = -0.0  # keys: down a channel
        v[0, t, 0, :] = 1.0
        c = t % (head_dim - 1)
        v[0, t, 0, c:c + 2] = torch.tensor([-0.0, 0.0] if t < 16 else [0.0, -0.0])  # values: in a group
    k[1, :, 0, :] = 1.0
    k[1, :8, 0, :] = -0.0
    k[1, 8:16, 0, :] = 0.0
    k[2], v[2] = 0.0, 0.0
    k[2, 5, 0, 0] = v[2, 7, 1, 1] = 1e-44  # float32 subnormal: amax / 448 underflows to 0
    # The mean is 17/32 + 2^-21, just above an e4m3 midpoint; summed other than in order, the
    # 2^-16 is lost to the 2^40 and it rounds to even, below.
    big = 2.0 ** 40 if kind == "fp8" else 2.0 ** 15  # float16 metadata stops at 6e4
    k[3, :, 0, 0] = torch.tensor([big, 17.0, *[0.0] * 14, -big, 2.0 ** -16, *[0.0] * 14])
    ids = torch.randperm(40, generator=g).to(torch.int32)
    for c in caches:
        c._store_blocks(1, ids, k, v)
    assert ran == [True]
    _assert_same_fields(*caches)
    if kind == "fp8":
        assert not caches[0].fields["k"].view(torch.uint8).eq(0x7F).any()  # no NaN codes
    for c in caches:
        with pytest.raises(IndexError):
            c._store_blocks(1, torch.tensor([3, 40]), k[:2], v[:2])
    assert ran[-1] is False


@pytest.mark.parametrize("heads,head_dim", [(2, 64), (3, 8)], ids=["vector", "scalar"])
@pytest.mark.needs("cpu_kernels")
def test_compiled_fp8_cast_rounds_every_e4m3_midpoint_as_torch_does(heads, head_dim):
    """The compiled float32 -> e4m3 cast against torch's at every code's neighbourhood: the code
    itself, the midpoints to its neighbours (ties to even) and one float32 ulp either side of
    them, subnormals included. One value of 448 per head makes its scale exactly 1, so each value
    reaches the cast unchanged (uncentered V; float32 in)."""
    caches, ran = _compiled_vs_torch("fp8", torch.float32, heads, head_dim, center_keys=False)
    codes = torch.arange(0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()  # +0 .. 448
    mids = (codes[:-1] + codes[1:]) / 2
    vals = torch.cat([codes, mids, torch.nextafter(mids, torch.zeros_like(mids)),
                      torch.nextafter(mids, torch.full_like(mids, 1e9))])
    vals = torch.cat([vals, -vals])
    per_block = 16 * heads * head_dim
    n = -(-vals.numel() // (per_block - heads))
    x = torch.zeros(n, per_block)
    x.view(-1)[:vals.numel()] = vals  # then the 448s, one per head
    x = x.view(n, 16, heads, head_dim)
    x[:, 15, :, head_dim - 1] = 448.0
    for c in caches:
        c._store_blocks(0, torch.arange(n), x, x)
    assert ran == [True]
    assert bool((caches[0].fields["v_scale"][0, :n] == 1.0).all())
    _assert_same_fields(*caches)

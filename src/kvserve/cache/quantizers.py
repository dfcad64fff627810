"""KV quantizers: fp8 (e4m3 / e5m2) with scales, and KIVI-style asymmetric int8 / int4 groups.

Pure torch, no cache layout here: the paged caches (kvserve.cache.fp8 / kivi)
decide which axis a group runs along (KIVI: keys per channel, i.e. groups along the token axis;
values per token, i.e. groups along head_dim) and this module only quantizes along the axis it is
given.

Formats and the error each admits (the tests check exactly these bounds):
  fp8_e4m3  3 mantissa bits: |x - x'| <= 2^-4 |x| for scaled values in the normal range
            [2^-6, 448], <= 2^-10 * scale below it (half the subnormal step 2^-9).
  fp8_e5m2  2 mantissa bits: <= 2^-3 |x| in [2^-14, 57344], <= 2^-17 * scale below.
            Centered (`center_dims`): the same bounds hold for x - mean, where mean is the mean over
            center_dims as stored beside the codes (e4m3, unscaled); x' = data * scale + mean.
  int8/int4 asymmetric: x' = q * scale + zero, q in [0, 2^bits - 1]; |x - x'| <= scale / 2, where
            scale = (max - min) / (2^bits - 1) of the group. Scale and zero are stored in float16
            rounded *outward* (zero down, scale up) so the group's [min, max] always stays inside
            the representable range and the scale/2 bound holds for the stored scale.
  compact   (int4's default) scale and zero in fp8 e4m3, still rounded outward, so the same
            scale/2 bound holds for the stored scale. e4m3 tops out at 448, so each row (a block
            or a token, `exponent_dims`) is first divided by a power of two 2^e (exact) that brings
            its largest |x| into [224, 448]; e is stored as int8 and x' is multiplied back.
            Symmetric groups (values): x' = (q - 2^(bits-1)) * scale, scale = amax / (2^(bits-1) - 1),
            no zero point stored; |x - x'| <= scale / 2.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
INT_BITS: dict[str, int] = {"int8": 8, "int4": 4}
QUANT_KINDS = (*FP8_DTYPES, *INT_BITS)
FULL_PRECISION_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# float16 keeps 11 significant bits: scale/zero rounding costs < 0.05 % of a step, and halves
# the overhead of float32 metadata (KIVI stores them in fp16 too).
GROUP_META_DTYPE = torch.float16
GROUP_META_BYTES = 2
# Compact metadata (int4): one byte per scale / zero. Outward rounding makes an e4m3 scale at most
# 2^-3 larger than needed (a step 12 % coarser) instead of clipping; measured +2 % perplexity on
# SmolLM2 for 3.5x instead of 2.9x at block 16 (bench/NOTES.md, "KV formats: fp8 e4m3 with centered
# keys and per-head scales; int4 KIVI with e4m3 metadata").
COMPACT_META_DTYPE = torch.float8_e4m3fn
COMPACT_META_MAX = 448.0
FP8_SCALE_BYTES = 4  # fp8 scales are float32: a few per block, precision is free there
# Key centering means are stored in e4m3 themselves (1 byte per channel per block): the codes
# encode x minus the *stored* mean, so its rounding adds no error of its own; it only leaves up to
# 2^-4 |mean| of offset in what is quantized, 16x less than without centering. Measured the same
# as float16 means (bench/NOTES.md) for half the bytes.
FP8_MEAN_DTYPE = torch.float8_e4m3fn
FP8_MEAN_BYTES = 1


class QuantError(ValueError):
    """A quantization setting is invalid; the message names it and what to change."""


def canonical_kind(kind: str) -> str:
    """'fp8' is vLLM's alias of fp8_e4m3; everything else is taken as spelled."""
    kind = "fp8_e4m3" if kind == "fp8" else kind
    if kind not in QUANT_KINDS and kind not in FULL_PRECISION_BYTES:
        raise QuantError(f"kv cache dtype {kind!r} is not supported; use one of "
                         f"auto, fp8, {', '.join(QUANT_KINDS)}")
    return kind


# ----------------------------------------------------------------------------------------- fp8

class Fp8Quantized(NamedTuple):
    data: torch.Tensor  # float8 tensor, same shape as the input
    scale: torch.Tensor  # float32, broadcastable against `data` (x ~= data * scale + mean)
    mean: torch.Tensor | None = None  # per-channel offset subtracted before the cast (centered)


def fp8_max(kind: str) -> float:
    return float(torch.finfo(FP8_DTYPES[canonical_kind(kind)]).max)


def fp8_dynamic_scale(x: torch.Tensor, kind: str, reduce_dims: tuple[int, ...]) -> torch.Tensor:
    """Scale mapping the absolute maximum over `reduce_dims` onto the format's largest finite
    value (the dims stay, with size 1, so the result broadcasts against `x`)."""
    xf = x.detach().float()  # a no-op for float32 input
    amax = xf.abs().amax(dim=reduce_dims, keepdim=True) if reduce_dims else xf.abs()
    # An all-zero group gets scale 1: any scale represents zeros exactly, and 0 would divide by 0.
    # So does one whose scale underflows (float32 amax below ~3e-43): 0 / 0 would store NaN.
    scale = amax / fp8_max(kind)
    return torch.where(scale > 0, scale, torch.ones_like(scale))


def _mean_in_order(x: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """The float64 mean over `dims` (kept), for one dim summed from +0 in index order: what the
    compiled quantizer computes, bit for bit (torch's own reduction order is its business)."""
    if len(dims) != 1:
        return x.double().mean(dim=dims, keepdim=True)
    xd = x.double()
    acc = torch.zeros_like(xd.select(dims[0], 0))
    for row in xd.unbind(dims[0]):
        acc += row
    return (acc / x.shape[dims[0]]).unsqueeze(dims[0])


def quantize_fp8(x: torch.Tensor, kind: str = "fp8_e4m3", scale: torch.Tensor | float | None = None,
                 reduce_dims: tuple[int, ...] | None = None,
                 center_dims: tuple[int, ...] | None = None) -> Fp8Quantized:
    """x -> float8 with `scale` (static, e.g. a checkpoint's k_scale) or a dynamic one computed
    over `reduce_dims` (default: all dims = one per-tensor scale).

    `center_dims`: first subtract the mean over these dims (kept, as FP8_MEAN_DTYPE, in the result).
    fp8's error is relative to the value, so a channel that sits at a large offset (LLM keys
    have such outlier channels) loses its small token-to-token variation - which is all that
    attention scores see - to rounding of the offset. Centered, only the variation is rounded."""
    kind = canonical_kind(kind)
    if kind not in FP8_DTYPES:
        raise QuantError(f"quantize_fp8 needs fp8_e4m3 or fp8_e5m2, got {kind!r}")
    mean = None
    xf = x.detach().float()  # once: each conversion of a 2,048-token layer write costs a full pass
    if center_dims is not None:
        mean_max = float(torch.finfo(FP8_MEAN_DTYPE).max)
        # Clamped: e4m3fn has no infinity. A clamped mean still centers, only less.
        mean = _mean_in_order(xf, center_dims).float().clamp(-mean_max, mean_max).to(FP8_MEAN_DTYPE)
        xf = xf - mean.float()
    if scale is None:
        dims = tuple(range(xf.dim())) if reduce_dims is None else reduce_dims
        scale_t = fp8_dynamic_scale(xf, kind, dims)
    else:
        scale_t = torch.as_tensor(scale, dtype=torch.float32, device=x.device)
        if not bool((scale_t > 0).all()):
            raise QuantError("fp8 scales must be > 0 (a checkpoint k_scale/v_scale of 0 or less is invalid)")
    fmax = fp8_max(kind)
    # Clamp before the cast: e4m3fn has no infinity, an out-of-range cast is NaN on some backends.
    scaled = (xf / scale_t).clamp_(-fmax, fmax)
    return Fp8Quantized(scaled.to(FP8_DTYPES[kind]), scale_t, mean)


def dequantize_fp8(q: Fp8Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    x = q.data.float() * q.scale
    return (x if q.mean is None else x + q.mean.float()).to(dtype)


# ------------------------------------------------------------------------- int8 / int4 groups

class GroupQuantized(NamedTuple):
    codes: torch.Tensor  # uint8; for int4 two codes per byte along the last dim (packed)
    scale: torch.Tensor  # float16 or e4m3, the group axis reduced to n_groups (see quantize_groups)
    zero: torch.Tensor | None  # same shape and dtype as scale; x ~= code * scale + zero.
    #                            None: symmetric, x ~= (code - 2^(bits-1)) * scale
    bits: int
    axis: int  # the axis the groups run along (non-negative)
    group_size: int
    exponent: torch.Tensor | None = None  # compact: int8 e per row (keepdim), x ~= 2^e * (...)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes in [0, 15], last dim even -> half as many bytes (even index in the low nibble)."""
    if codes.shape[-1] % 2:
        raise QuantError(f"int4 packing needs an even last dimension (head_dim), got {codes.shape[-1]}")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 0x0F, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def fp8_round_outward(t: torch.Tensor, up: bool) -> torch.Tensor:
    """e4m3 value >= t (up) or <= t (down), the nearest such; |t| <= 448 expected. torch has no
    nextafter for float8, so step the bit pattern: sign-magnitude, one code = one ulp."""
    r = t.clamp(-COMPACT_META_MAX, COMPACT_META_MAX).to(COMPACT_META_DTYPE)
    rf = r.float()
    bad = rf < t if up else rf > t
    bits = r.view(torch.uint8).to(torch.int16)
    neg = bits >= 0x80
    away = neg != up  # moving away from zero: magnitude + 1 ulp
    step = torch.where(away, bits + 1, bits - 1)
    # A zero that must move: +0 down -> -2^-9 (0x81), -0 up -> +2^-9 (0x01).
    step = torch.where((bits & 0x7F) == 0, torch.where(torch.tensor(up), 0x01, 0x81), step)
    out = torch.where(bad, step, bits).to(torch.uint8).view(COMPACT_META_DTYPE)
    return out


def _round_meta(t: torch.Tensor, up: bool, dtype: torch.dtype) -> torch.Tensor:
    if dtype == COMPACT_META_DTYPE:
        return fp8_round_outward(t, up)
    r = t.to(dtype)
    nxt = torch.nextafter(r, torch.full_like(r, float("inf") if up else float("-inf")))
    return torch.where(r.float() < t if up else r.float() > t, nxt, r)


def _outward_meta(mn: torch.Tensor, mx: torch.Tensor, qmax: int,
                  dtype: torch.dtype = GROUP_META_DTYPE) -> tuple[torch.Tensor, torch.Tensor]:
    """Stored zero <= mn and scale with zero + qmax*scale >= mx, so no value of the group clips."""
    zero = _round_meta(mn, False, dtype)
    scale = _round_meta((mx - zero.float()) / qmax, True, dtype)
    return scale, zero


def _group_range(grouped: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """min and max over `dim`; + 0.0 turns -0 into +0, so which zero a group of mixed-sign zeros
    reports does not depend on reduction order (it decides the sign bit of stored metadata)."""
    return grouped.amin(dim=dim) + 0.0, grouped.amax(dim=dim) + 0.0


def _ceil_log2(t: torch.Tensor) -> torch.Tensor:
    """ceil(log2(t)) for t > 0, exactly: a float log2 can land on the wrong side of a power of two."""
    mantissa, e = torch.frexp(t)  # t = mantissa * 2^e, mantissa in [0.5, 1)
    return torch.where(mantissa == 0.5, e - 1, e)


def quantize_groups(x: torch.Tensor, bits: int, group_size: int, axis: int, compact: bool = False,
                    symmetric: bool = False, exponent_dims: tuple[int, ...] | None = None) -> GroupQuantized:
    """Asymmetric min/max quantization of groups of `group_size` consecutive elements along
    `axis` (symmetric: absmax, no zero point). scale/zero have x's shape with that axis divided
    by group_size; compact: stored in e4m3 instead of float16, with a power-of-two exponent per
    slice over `exponent_dims` (default: all dims, one for the whole tensor)."""
    if bits not in (4, 8):
        raise QuantError(f"group quantization supports 4 or 8 bits, got {bits}")
    axis = axis % x.dim()
    n = x.shape[axis]
    if group_size < 1 or n % group_size:
        raise QuantError(f"group size {group_size} must divide the quantized axis length {n}; "
                         f"pick a group size that divides both block_size and head_dim")
    qmax = (1 << bits) - 1
    xf = x.float()
    grouped = xf.unflatten(axis, (n // group_size, group_size))
    mn, mx = _group_range(grouped, axis + 1)
    # amin / amax propagate NaN and inf, so the group ranges show a non-finite value: checking
    # them costs a few percent of checking every element (0.5 ms per 2,048-token layer write).
    if not bool(torch.isfinite(mx - mn).all()):
        raise QuantError("cannot quantize non-finite KV values (the model produced inf/NaN)")
    amax = float(mx.abs().max().clamp_min(mn.abs().max()))
    if amax > 6.0e4 and not compact:  # compact metadata is exponent-shifted, any range fits
        raise QuantError("KV values exceed float16 range (|x| > 6e4); int KV quantization stores "
                         "scales in float16 - use --kv-cache-dtype fp8_e5m2 or auto for this model")
    exponent = None
    if compact:
        dims = tuple(range(x.dim())) if exponent_dims is None else exponent_dims
        row_max = xf.abs().amax(dim=dims, keepdim=True)
        # Up to 120 for the largest float32, so the scaled block always fits e4m3's 448 (a top
        # clamp of 100 made blocks beyond 448 * 2^100 store NaN metadata); below -100 the block
        # is so small that coarser steps lose nothing the model can see.
        e = _ceil_log2(row_max / COMPACT_META_MAX).clamp(-100, 126)
        exponent = torch.where(row_max > 0, e, torch.zeros_like(e)).to(torch.int8)
        # Powers of two: exact in float32, so the scaled group keeps its exact min/max.
        factor = torch.exp2(-exponent.float())
        grouped = (xf * factor).unflatten(axis, (n // group_size, group_size))
        mn, mx = _group_range(grouped, axis + 1)
    meta_dtype = COMPACT_META_DTYPE if compact else GROUP_META_DTYPE
    if symmetric:
        half = 1 << (bits - 1)
        scale = _round_meta(torch.maximum(mx, -mn) / (half - 1), True, meta_dtype)
        s = scale.float().unsqueeze(axis + 1)
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))  # all-zero group: every code is `half`
        codes = ((grouped * inv).round_() + half).clamp_(1, qmax).to(torch.uint8).flatten(axis, axis + 1)
        zero = None
    else:
        scale, zero = _outward_meta(mn, mx, qmax, meta_dtype)
        s, z = scale.float().unsqueeze(axis + 1), zero.float().unsqueeze(axis + 1)
        inv = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))  # constant group: every code is 0 (= zero)
        codes = ((grouped - z) * inv).round_().clamp_(0, qmax).to(torch.uint8).flatten(axis, axis + 1)
    if bits == 4:
        codes = pack_int4(codes)
    return GroupQuantized(codes, scale, zero, bits, axis, group_size, exponent)


def dequantize_groups(q: GroupQuantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    codes = unpack_int4(q.codes) if q.bits == 4 else q.codes
    n = codes.shape[q.axis]
    grouped = codes.unflatten(q.axis, (n // q.group_size, q.group_size)).float()
    if q.zero is None:
        x = (grouped - (1 << (q.bits - 1))) * q.scale.float().unsqueeze(q.axis + 1)
    else:
        x = grouped * q.scale.float().unsqueeze(q.axis + 1) + q.zero.float().unsqueeze(q.axis + 1)
    x = x.flatten(q.axis, q.axis + 1)
    if q.exponent is not None:
        x = x * torch.exp2(q.exponent.float())
    return x.to(dtype)


@dataclass(frozen=True)
class KVScales:
    """Static fp8 scales per layer (`[L]`, or `[L, num_kv_heads]` per head), as vLLM's fp8
    checkpoints ship them (`model.layers.{i}.self_attn.k_scale` / `.v_scale`)."""
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    @classmethod
    def from_weights(cls, weights: dict[str, torch.Tensor], num_layers: int) -> KVScales | None:
        """The checkpoint's scales, or None when it has none. Older vLLM checkpoints store one
        `kv_scale` for both K and V."""
        ks, vs = [], []
        for i in range(num_layers):
            p = f"model.layers.{i}.self_attn."
            k = weights.get(p + "k_scale", weights.get(p + "kv_scale"))
            v = weights.get(p + "v_scale", weights.get(p + "kv_scale"))
            if k is None and v is None:
                if ks:
                    raise QuantError(f"checkpoint has fp8 k_scale/v_scale for layers 0..{i - 1} "
                                      f"but not layer {i}; it is incomplete - re-export its KV scales")
                return None
            if k is None or v is None:
                raise QuantError(f"layer {i}: checkpoint has only one of k_scale/v_scale")
            ks.append(k.float().reshape(-1))
            vs.append(v.float().reshape(-1))
        return cls(torch.stack(ks).squeeze(-1), torch.stack(vs).squeeze(-1))


# ------------------------------------------------------------------------------ byte accounting

class KVGroupSizes(NamedTuple):
    key_tokens: int  # keys: tokens per group (per channel, along the token axis of a block)
    value_channels: int  # values: channels per group (per token, along head_dim)


def effective_group_sizes(group_size: int, block_size: int, head_dim: int) -> KVGroupSizes:
    """A key group cannot outgrow its block (the block is the unit that is written and freed),
    nor a value group its head; the configured size is clipped to both and must divide them."""
    k, v = min(group_size, block_size), min(group_size, head_dim)
    if block_size % k or head_dim % v:
        raise QuantError(f"the int KV cache's group_size {group_size} must divide block_size ({block_size}) "
                         f"and head_dim ({head_dim}) or exceed them; try 16, 32 or 64")
    return KVGroupSizes(k, v)


def bytes_per_block_per_layer(kind: str, num_kv_heads: int, head_dim: int, block_size: int,
                              group_size: int = 64, fp8_scale_granularity: str = "tensor",
                              fp8_center_keys: bool = False, int_compact: bool = False) -> int:
    """Exact bytes one block of one layer holds for K and V, scales, zero points and key means
    included."""
    kind = canonical_kind(kind)
    elems = block_size * num_kv_heads * head_dim
    if kind in FULL_PRECISION_BYTES:
        return 2 * elems * FULL_PRECISION_BYTES[kind]
    if kind in FP8_DTYPES:
        scales_per_block = num_kv_heads if fp8_scale_granularity == "head" else 1
        key_means = num_kv_heads * head_dim * FP8_MEAN_BYTES if fp8_center_keys else 0
        return 2 * (elems + scales_per_block * FP8_SCALE_BYTES) + key_means
    bits = INT_BITS[kind]
    if bits == 4 and head_dim % 2:
        raise QuantError(f"int4 KV packs two values per byte along head_dim; head_dim {head_dim} is odd")
    g = effective_group_sizes(group_size, block_size, head_dim)
    codes = elems * bits // 8
    # Keys: scale + zero per group; values: scale + zero, or (compact: symmetric) a scale only.
    # Compact adds one int8 exponent per block for K and one for V.
    meta_bytes, value_fields, exponents = (1, 1, 2) if int_compact else (GROUP_META_BYTES, 2, 0)
    key_meta = (block_size // g.key_tokens) * num_kv_heads * head_dim * 2 * meta_bytes
    value_meta = block_size * num_kv_heads * (head_dim // g.value_channels) * value_fields * meta_bytes
    return 2 * codes + key_meta + value_meta + exponents


def bytes_per_token_per_layer(kind: str, num_kv_heads: int, head_dim: int, block_size: int = 16,
                              group_size: int = 64, fp8_scale_granularity: str = "tensor",
                              fp8_center_keys: bool = False, int_compact: bool = False) -> float:
    """K+V bytes per token per layer, with per-block metadata amortized over the block's tokens."""
    return bytes_per_block_per_layer(kind, num_kv_heads, head_dim, block_size, group_size,
                                     fp8_scale_granularity, fp8_center_keys, int_compact) / block_size

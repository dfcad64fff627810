"""KIVI-style int8 / int4 paged KV cache: the format; the residual and block machinery is in
quantized.py."""
from __future__ import annotations

import torch

from kvserve.cache import quantizers as quant
from kvserve.cache.quantized import DequantField, QuantizedKVCache, meta_ref
from kvserve.config import ConfigError, ModelConfig

# Measured (bench/kv_quality.py --quick, SmolLM2-135M): int4 perplexity +0.21 % at 32 vs +1.03 % at
# 64 for 4 % more bytes per token (value groups; key groups are clipped to the block anyway).
DEFAULT_GROUP_SIZE = 32
# int4 defaults to compact metadata (e4m3 scales/zeros, symmetric value groups of a whole head):
# 3.5x fewer bytes than bfloat16 at block 16 instead of 2.9x (bench/NOTES.md, "KV formats: fp8 e4m3
# with centered keys and per-head scales; int4 KIVI with e4m3 metadata").
COMPACT_GROUP_SIZE = 64
COMPACT_BY_DEFAULT = {"int8": False, "int4": True}


def _int_defaults(kind: str, group_size: int | None, compact: bool | None) -> tuple[int, bool]:
    compact = COMPACT_BY_DEFAULT[kind] if compact is None else compact
    if group_size is None:
        group_size = COMPACT_GROUP_SIZE if compact else DEFAULT_GROUP_SIZE
    return group_size, compact


class IntPagedKVCache(QuantizedKVCache):
    """KIVI: asymmetric int8/int4 groups, keys per channel (groups of tokens within a block,
    so the block passes through the residual), values per token (groups along head_dim).
    `residual=False` quantizes keys per token too, so each token is final when written.
    `compact` (int4's default): scales and zero points in e4m3, values symmetric (scale only);
    group_size defaults to 64 then, 32 otherwise."""

    def __init__(self, model_config: ModelConfig, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", kv_cache_dtype: str = "int4",
                 group_size: int | None = None, residual: bool = True,
                 num_residual_blocks: int | None = None, compact: bool | None = None,
                 seal_at_step_end: bool = False) -> None:
        self.kind = quant.canonical_kind(kv_cache_dtype)
        if self.kind not in quant.INT_BITS:
            raise ConfigError(f"IntPagedKVCache takes int8 or int4, got {kv_cache_dtype!r}")
        self.bits = quant.INT_BITS[self.kind]
        group_size, self.compact = _int_defaults(self.kind, group_size, compact)
        self.staged = residual
        self._init_common(model_config, num_blocks, block_size, dtype, device, num_residual_blocks,
                          seal_at_step_end)
        H, D = self.num_kv_heads, self.head_dim
        if self.bits == 4 and D % 2:
            raise ConfigError(f"int4 KV packs two channels per byte and needs an even head_dim, got {D}; "
                              f"use --kv-cache-dtype int8 or fp8")
        try:
            self.groups = quant.effective_group_sizes(group_size, block_size, D)
        except quant.QuantError as e:
            raise ConfigError(str(e)) from None
        packed = D * self.bits // 8
        meta = quant.COMPACT_META_DTYPE if self.compact else quant.GROUP_META_DTYPE
        self._add_field("k", (block_size, H, packed), torch.uint8)
        self._add_field("v", (block_size, H, packed), torch.uint8)
        if residual:
            k_meta = (block_size // self.groups.key_tokens, H, D)
        else:
            k_meta = (block_size, H, D // self.groups.value_channels)
        v_meta = (block_size, H, D // self.groups.value_channels)
        # Compact values are symmetric (no zero point); so are compact keys quantized per token.
        self.symmetric = {"k": self.compact and not residual, "v": self.compact}
        for name, shape in (("k", k_meta), ("v", v_meta)):
            self._add_field(name + "_scale", shape, meta)
            if not self.symmetric[name]:
                self._add_field(name + "_zero", shape, meta)
            if self.compact:  # power-of-two exponent: per block (staged) or per token (direct)
                self._add_field(name + "_exp", (1,) if residual else (block_size,), torch.int8)

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, kv_cache_dtype: str,
                        model_dtype: torch.dtype) -> int:
        group_size, compact = _int_defaults(quant.canonical_kind(kv_cache_dtype), None, None)
        return model_config.num_hidden_layers * quant.bytes_per_block_per_layer(
            kv_cache_dtype, model_config.num_key_value_heads, model_config.head_dim, block_size,
            group_size, int_compact=compact)

    def _quantize(self, name: str, x: torch.Tensor, group: int, axis: int) -> quant.GroupQuantized:
        rows = tuple(range(1, x.dim()))  # one exponent per block [nb, bs, H, D] or token [T, H, D]
        return quant.quantize_groups(x, self.bits, group, axis, compact=self.compact,
                                     symmetric=self.symmetric[name], exponent_dims=rows)

    def _put(self, layer: int, name: str, idx: torch.Tensor | tuple[torch.Tensor, torch.Tensor],
             q: quant.GroupQuantized) -> None:
        """idx: block ids (whole blocks) or (block ids, offsets) (single tokens)."""
        at = (layer, *idx) if isinstance(idx, tuple) else (layer, idx)
        self.fields[name][at] = q.codes
        self.fields[name + "_scale"][at] = q.scale
        if q.zero is not None:
            self.fields[name + "_zero"][at] = q.zero
        if q.exponent is not None:
            self.fields[name + "_exp"][at] = q.exponent.reshape(q.exponent.shape[0], -1).squeeze(-1) \
                if isinstance(idx, tuple) else q.exponent.reshape(q.exponent.shape[0], 1)

    def _store_blocks(self, layer, block_ids, k, v):
        if self._store_blocks_compiled(layer, block_ids, k, v):
            return
        self._put(layer, "k", block_ids, self._quantize("k", k, self.groups.key_tokens, axis=1))
        self._put(layer, "v", block_ids, self._quantize("v", v, self.groups.value_channels, axis=3))

    def _quantize_compiled(self, dst, source):
        q = self._quantizers()
        if not q or not self.staged:
            return False
        f = self.fields

        def ptr(name: str) -> int | None:
            return f[name].data_ptr() if name in f else None
        rc = q.int_blocks(source.k, source.v, source.is_bf16, source.n, source.src_ptr, source.stride,
                          dst.data_ptr(), self.num_layers * self.num_blocks, self.block_size, self.num_kv_heads,
                          self.head_dim, self.groups.key_tokens, self.groups.value_channels, self.bits, int(self.compact),
                          int(self.symmetric["v"]), ptr("k"), ptr("k_scale"), ptr("k_zero"), ptr("k_exp"),
                          ptr("v"), ptr("v_scale"), ptr("v_zero"), ptr("v_exp"))
        return rc == 0

    def _store_tokens(self, layer, slots, k, v):
        bs = self.block_size
        idx = (slots // bs, slots % bs)
        for name, x in (("k", k), ("v", v)):
            self._put(layer, name, idx, self._quantize(name, x, self.groups.value_channels, axis=2))

    def _get(self, layer: int, name: str, block_ids: torch.Tensor, group: int, axis: int) -> torch.Tensor:
        zero, exp = self.fields.get(name + "_zero"), self.fields.get(name + "_exp")
        if exp is not None:
            exp = exp[layer, block_ids][:, :, None, None]  # [nb, 1 or bs] -> against [nb, bs, H, D]
        q = quant.GroupQuantized(self.fields[name][layer, block_ids], self.fields[name + "_scale"][layer, block_ids],
                                 None if zero is None else zero[layer, block_ids], self.bits, axis, group, exp)
        return quant.dequantize_groups(q, self.dtype)

    def _load_blocks(self, layer, block_ids):
        if self.staged:
            k = self._get(layer, "k", block_ids, self.groups.key_tokens, axis=1)
        else:
            k = self._get(layer, "k", block_ids, self.groups.value_channels, axis=3)
        return k, self._get(layer, "v", block_ids, self.groups.value_channels, axis=3)

    def dequant_fields(self, layer):
        nb, bs, H, D = self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        out = []
        for name in ("k", "v"):
            # Groups of tokens per channel (staged keys) or of channels per token (the rest).
            gt, gd = (self.groups.key_tokens, 1) if name == "k" and self.staged else (1, self.groups.value_channels)
            shape = (nb, bs // gt, H, D // gd)
            scale = meta_ref(self.fields[name + "_scale"][layer], gt, gd, shape)
            zero = self.fields.get(name + "_zero")
            zero = None if zero is None else meta_ref(zero[layer], gt, gd, shape)
            exp = self.fields.get(name + "_exp")
            if exp is not None:  # one per block (staged) or per token
                per = exp.shape[-1]
                exp = meta_ref(exp[layer].view(nb, per, 1, 1), bs // per, D, (nb, per, H, 1))
            offset = float(1 << (self.bits - 1)) if self.symmetric[name] else 0.0
            out.append(DequantField(self.fields[name][layer], "int4" if self.bits == 4 else "uint8",
                                    offset, scale, zero, exp))
        return out[0], out[1]

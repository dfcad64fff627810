"""fp8 paged KV cache (e4m3 / e5m2): the format; the residual and block machinery is in
quantized.py."""
from __future__ import annotations

import torch

from kvserve.cache import quantizers as quant
from kvserve.cache.quantized import DequantField, QuantizedKVCache, meta_ref
from kvserve.cache.quantizers import KVScales
from kvserve.config import ConfigError, ModelConfig


class Fp8PagedKVCache(QuantizedKVCache):
    """float8 K/V. Dynamic scales: per block and kv head (default) or one per block, computed
    when the block is sealed - per block because a per-tensor scale that grows would have to
    rescale every block already written. Static scales (`kv_scales`): per layer, from the
    checkpoint, applied at write time (no residual needed).

    `center_keys` (dynamic scales only, default on): each sealed block also stores the e4m3 mean
    of every key channel over its tokens and quantizes K minus that mean (quant.quantize_fp8).
    Measured on SmolLM2 (bench/NOTES.md, 2026-11-21 "fp8 key centering"): keys carry almost all
    of fp8's error; centering halves the KL to float32 KV and per-head scales (the head's largest
    key then lands exactly on e4m3's max) take a further third off."""

    def __init__(self, model_config: ModelConfig, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", kv_cache_dtype: str = "fp8",
                 scale_granularity: str = "head", kv_scales: KVScales | None = None,
                 num_residual_blocks: int | None = None, center_keys: bool = True,
                 seal_at_step_end: bool = False) -> None:
        self.kind = quant.canonical_kind(kv_cache_dtype)
        if self.kind not in quant.FP8_DTYPES:
            raise ConfigError(f"Fp8PagedKVCache takes fp8, fp8_e4m3 or fp8_e5m2, got {kv_cache_dtype!r}")
        if scale_granularity not in ("tensor", "head"):
            raise ConfigError(f"fp8 scale granularity must be 'tensor' or 'head' (got {scale_granularity!r})")
        self.scale_granularity = scale_granularity
        self.staged = kv_scales is None
        # Centering needs the block's statistics, i.e. the residual; static scales write per token.
        self.center_keys = center_keys and self.staged
        self._init_common(model_config, num_blocks, block_size, dtype, device, num_residual_blocks,
                          seal_at_step_end)
        H, D, fp8 = self.num_kv_heads, self.head_dim, quant.FP8_DTYPES[self.kind]
        for name in ("k", "v"):
            self._add_field(name, (block_size, H, D), fp8)
        if self.staged:
            n_scales = H if scale_granularity == "head" else 1
            self._add_field("k_scale", (n_scales,), torch.float32)
            self._add_field("v_scale", (n_scales,), torch.float32)
            if self.center_keys:
                self._add_field("k_mean", (H, D), quant.FP8_MEAN_DTYPE)
        else:
            self.static = {}
            for name, s in (("k", kv_scales.k_scale), ("v", kv_scales.v_scale)):
                s = s.to(torch.float32).to(self.device)
                if s.shape[0] != self.num_layers or s.dim() > 2 or (s.dim() == 2 and s.shape[1] != H):
                    raise ConfigError(f"static {name}_scale must be [num_layers] or [num_layers, "
                                      f"num_kv_heads] = [{self.num_layers}, {H}], got {list(s.shape)}")
                self.static[name] = s

    @staticmethod
    def bytes_per_block(model_config: ModelConfig, block_size: int, kv_cache_dtype: str,
                        model_dtype: torch.dtype) -> int:
        # The engine's default construction: dynamic per-head scales with centered keys.
        return model_config.num_hidden_layers * quant.bytes_per_block_per_layer(
            kv_cache_dtype, model_config.num_key_value_heads, model_config.head_dim, block_size,
            fp8_scale_granularity="head", fp8_center_keys=True)

    def _scale_view(self, s: torch.Tensor) -> torch.Tensor:
        # [nb, n_scales] -> broadcast over [nb, bs, H, D]
        return s[:, None, :, None]

    def _quantize_compiled(self, dst, source):
        q = self._quantizers()
        if not q or not self.staged or self.kind != "fp8_e4m3":  # e5m2: the torch path
            return False
        f = self.fields
        rc = q.fp8_blocks(source.k, source.v, source.is_bf16, source.n, source.src_ptr, source.stride,
                          dst.data_ptr(), self.num_layers * self.num_blocks, self.block_size, self.num_kv_heads,
                          self.head_dim, int(self.scale_granularity == "head"), int(self.center_keys), f["k"].data_ptr(),
                          f["k_scale"].data_ptr(), f["k_mean"].data_ptr() if self.center_keys else None,
                          f["v"].data_ptr(), f["v_scale"].data_ptr())
        return rc == 0

    def _store_blocks(self, layer, block_ids, k, v):
        if self._store_blocks_compiled(layer, block_ids, k, v):
            return
        dims = (1, 3) if self.scale_granularity == "head" else (1, 2, 3)
        for name, x in (("k", k), ("v", v)):
            center = (1,) if name == "k" and self.center_keys else None  # over the block's tokens
            q = quant.quantize_fp8(x, self.kind, reduce_dims=dims, center_dims=center)
            self.fields[name][layer, block_ids] = q.data
            self.fields[name + "_scale"][layer, block_ids] = q.scale.reshape(block_ids.numel(), -1)
            if center:
                self.fields["k_mean"][layer, block_ids] = q.mean.squeeze(1)

    def _static_scale(self, name: str, layer: int) -> torch.Tensor:
        s = self.static[name][layer]
        return s[:, None] if s.dim() == 1 else s  # per head: [H, 1] against [..., H, D]

    def _store_tokens(self, layer, slots, k, v):
        flat = self.num_blocks * self.block_size
        for name, x in (("k", k), ("v", v)):
            q = quant.quantize_fp8(x, self.kind, scale=self._static_scale(name, layer))
            # Viewed as bytes: CPU index_copy_ has no float8 kernel.
            dst = self.fields[name][layer].view(torch.uint8).view(flat, self.num_kv_heads, self.head_dim)
            dst.index_copy_(0, slots, q.data.view(torch.uint8))

    def _load_blocks(self, layer, block_ids):
        out = []
        for name in ("k", "v"):
            data = self.fields[name][layer, block_ids]
            mean = None
            if self.staged:
                scale = self._scale_view(self.fields[name + "_scale"][layer, block_ids])
                if name == "k" and self.center_keys:
                    mean = self.fields["k_mean"][layer, block_ids][:, None]  # [nb, 1, H, D]
            else:
                scale = self._static_scale(name, layer)
            out.append(quant.dequantize_fp8(quant.Fp8Quantized(data, scale, mean), self.dtype))
        return out[0], out[1]

    def dequant_fields(self, layer):
        nb, bs, H, D = self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        fmt = "e4m3" if self.kind == "fp8_e4m3" else "e5m2"
        out = []
        for name in ("k", "v"):
            s = self.fields[name + "_scale"][layer] if self.staged else self.static[name][layer]
            scale = meta_ref(s.reshape(-1, 1, s.shape[-1] if s.dim() else 1, 1), bs, D, (nb, 1, H, 1))
            zero = None
            if name == "k" and self.center_keys:
                zero = meta_ref(self.fields["k_mean"][layer][:, None], bs, 1, (nb, 1, H, D))
            out.append(DequantField(self.fields[name][layer].view(torch.uint8), fmt, 0.0, scale, zero, None))
        return out[0], out[1]

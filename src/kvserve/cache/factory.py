"""Which cache class a `--kv-cache-dtype` builds, how many bytes its blocks take, and how many
blocks a memory budget buys (the engine's start-up and `kvserve plan` share this arithmetic)."""
from __future__ import annotations

import torch

from kvserve.cache import quantized
from kvserve.cache.base import KVCache
from kvserve.cache.fp8 import Fp8PagedKVCache
from kvserve.cache.kivi import IntPagedKVCache
from kvserve.cache.paged import PagedKVCache
from kvserve.config import KV_CACHE_DTYPES, ConfigError, ModelConfig

KV_CACHE_CLASSES: dict[str, type[KVCache]] = {
    "auto": PagedKVCache, "fp8": Fp8PagedKVCache, "fp8_e4m3": Fp8PagedKVCache, "fp8_e5m2": Fp8PagedKVCache,
    "int8": IntPagedKVCache, "int4": IntPagedKVCache}


def kv_cache_class(kv_cache_dtype: str) -> type[KVCache]:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} "
                          f"(got {kv_cache_dtype!r})")
    return KV_CACHE_CLASSES[kv_cache_dtype]


def kv_cache_bytes_per_block(model_config: ModelConfig, block_size: int, kv_cache_dtype: str,
                             model_dtype: torch.dtype) -> int:
    """Bytes per block for sizing the pool before the cache exists."""
    cls = kv_cache_class(kv_cache_dtype)
    return cls.bytes_per_block(model_config, block_size, kv_cache_dtype, model_dtype)


def kv_cache_reserved_bytes(model_config: ModelConfig, block_size: int, kv_cache_dtype: str,
                            model_dtype: torch.dtype, max_num_seqs: int) -> int:
    """Memory a cache allocates besides its blocks (a quantized cache's full-precision residual
    pool, about one open block per running sequence): taken off the KV budget before it buys blocks."""
    residual = getattr(kv_cache_class(kv_cache_dtype), "residual_bytes", None)
    if residual is None:
        return 0
    return residual(model_config, block_size, kv_cache_dtype, model_dtype,
                    quantized.residual_blocks_for(max_num_seqs))


def blocks_in_budget(memory: int, bytes_per_block: int, reserved_bytes: int, max_num_seqs: int) -> int:
    """Blocks `memory` buys beside a quantized cache's residual pool, `reserved_bytes` being the full
    pool of kv_cache_reserved_bytes. The cache gives the pool at most one entry per block, so where
    the full pool would leave fewer blocks than it has entries, blocks and pool are sized together
    (at 100 MiB, int8, SmolLM2: 178 blocks and a 62.7 MiB pool instead of 45 and 90.5)."""
    num_blocks = max(0, memory - reserved_bytes) // bytes_per_block
    if reserved_bytes:
        entries = quantized.residual_blocks_for(max_num_seqs)
        if num_blocks < entries:
            num_blocks = max(0, memory) // (bytes_per_block + reserved_bytes // entries)
    return num_blocks


def residual_pool_bytes(reserved_bytes: int, max_num_seqs: int, num_blocks: int) -> int:
    """The pool a cache of `num_blocks` actually builds (one entry per block at most)."""
    if not reserved_bytes:
        return 0
    entries = quantized.residual_blocks_for(max_num_seqs)
    return min(entries, num_blocks) * (reserved_bytes // entries)


def create_kv_cache(model_config: ModelConfig, *, num_blocks: int, block_size: int,
                    kv_cache_dtype: str = "auto", dtype: torch.dtype = torch.float32,
                    device: torch.device | str = "cpu", layout: str = "tokens", **options) -> KVCache:
    """Build the cache for `kv_cache_dtype`; `dtype` is the model (compute) dtype, `layout` the
    element order the attention backend reads (`AttentionBackend.kv_cache_layout`). `options` go
    to the class as they are (e.g. a quantized cache's num_residual_blocks or kv_scales)."""
    cls = kv_cache_class(kv_cache_dtype)
    if cls is PagedKVCache:
        options["layout"] = layout
    elif layout != "tokens":
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype} stores the 'tokens' layout only, "
                          f"not {layout!r}")
    # Every registered class takes this constructor signature.
    return cls(model_config, num_blocks=num_blocks, block_size=block_size,  # type: ignore[call-arg]
               dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype, **options)

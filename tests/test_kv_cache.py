"""PagedKVCache: slot-addressed writes, block gathers, copy-on-write copies, byte accounting."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.cache.factory import KV_CACHE_CLASSES, create_kv_cache, kv_cache_bytes_per_block, kv_cache_class
from kvserve.cache.paged import PagedKVCache
from kvserve.config import KV_CACHE_DTYPES, ConfigError, ModelConfig
from kvserve.core.step import BlockCopy

BS = 4


def cfg(layers: int = 2, kv_heads: int = 2, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(architecture="llama", vocab_size=32, hidden_size=32, intermediate_size=64,
                       num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=kv_heads,
                       head_dim=head_dim, max_position_embeddings=128)


def filled(num_blocks: int = 6) -> PagedKVCache:
    """Every slot of every layer holds a value that names (layer, K/V, slot)."""
    cache = PagedKVCache(cfg(), num_blocks=num_blocks, block_size=BS, dtype=torch.float32)
    slots = torch.arange(num_blocks * BS)
    for layer in range(2):
        k = (1000 * layer + slots).float()[:, None, None].expand(-1, 2, 8)
        cache.write(layer, slots, k, -k)
    return cache


def test_write_then_gather_only_the_requested_blocks_in_order():
    cache = PagedKVCache(cfg(), num_blocks=8, block_size=BS, dtype=torch.float32)
    slots = torch.tensor([5 * BS + 2, 1 * BS + 0, 5 * BS + 3, 7 * BS + 1])
    k = torch.randn(4, 2, 8)
    v = torch.randn(4, 2, 8)
    cache.write(1, slots, k, v)
    gk, gv = cache.gather(1, torch.tensor([5, 1, 7]))
    assert gk.shape == gv.shape == (3 * BS, 2, 8) and gk.is_contiguous()
    # block 5 -> rows 0..3, block 1 -> rows 4..7, block 7 -> rows 8..11
    torch.testing.assert_close(gk[[2, 4, 3, 9]], k, rtol=0, atol=0)
    torch.testing.assert_close(gv[[2, 4, 3, 9]], v, rtol=0, atol=0)
    untouched = torch.ones(3 * BS, dtype=torch.bool)
    untouched[[2, 4, 3, 9]] = False
    assert (gk[untouched] == 0).all() and (gv[untouched] == 0).all()
    # other layers untouched
    assert (cache.gather(0, torch.arange(8))[0] == 0).all()


def test_write_casts_to_cache_dtype():
    cache = PagedKVCache(cfg(), num_blocks=2, block_size=BS, dtype=torch.bfloat16)
    cache.write(0, torch.tensor([3]), torch.full((1, 2, 8), 1.5), torch.full((1, 2, 8), 2.5))
    k, v = cache.gather(0, torch.tensor([0]))
    assert k.dtype == torch.bfloat16 and k[3].eq(1.5).all() and v[3].eq(2.5).all()


def test_copy_blocks_copies_first_num_tokens_slots_in_every_layer():
    cache = filled()
    before = cache.kv.clone()
    cache.copy_blocks([BlockCopy(src=1, dst=4, num_tokens=3), BlockCopy(src=2, dst=0, num_tokens=1)])
    for layer in range(2):
        k, v = cache.gather(layer, torch.tensor([4, 0]))
        base = 1000 * layer
        assert k[:, 0, 0].tolist() == [base + 1 * BS + 0, base + 1 * BS + 1, base + 1 * BS + 2,
                                       base + 4 * BS + 3,  # slot 3 of dst not covered: kept
                                       base + 2 * BS + 0, base + 1, base + 2, base + 3]
        assert torch.equal(v, -k)
    changed = (cache.kv != before).flatten(3).any(-1)  # [layers, 2, blocks]
    assert changed[:, :, [0, 4]].all() and not changed[:, :, [1, 2, 3, 5]].any()


def test_copy_blocks_chain_reads_before_writes():
    cache = filled()
    cache.copy_blocks([BlockCopy(1, 2, BS), BlockCopy(2, 3, BS)])
    k, _ = cache.gather(0, torch.tensor([2, 3]))
    assert k[:, 0, 0].tolist() == list(range(1 * BS, 2 * BS)) + list(range(2 * BS, 3 * BS))


def test_copy_blocks_rejects_bad_copies():
    cache = filled()
    with pytest.raises(IndexError, match="dst out of range"):
        cache.copy_blocks([BlockCopy(0, 6, 1)])
    with pytest.raises(ValueError, match="num_tokens"):
        cache.copy_blocks([BlockCopy(0, 1, BS + 1)])
    cache.copy_blocks([])  # no-op


def test_bytes_per_block_counts_k_and_v_of_every_layer():
    c = cfg(layers=3, kv_heads=2, head_dim=8)
    assert PagedKVCache.bytes_per_block(c, 16, "auto", torch.float32) == 2 * 3 * 16 * 2 * 8 * 4
    assert PagedKVCache.bytes_per_block(c, 16, "auto", torch.bfloat16) == 2 * 3 * 16 * 2 * 8 * 2
    assert kv_cache_bytes_per_block(c, 32, "auto", torch.float16) == 2 * 3 * 32 * 2 * 8 * 2
    cache = create_kv_cache(c, num_blocks=5, block_size=16, dtype=torch.bfloat16)
    actual = cache.kv.numel() * cache.kv.element_size()
    assert actual == 5 * cache.bytes_per_block(c, 16, "auto", torch.bfloat16)
    # SmolLM2-135M: 30 layers x 3 kv heads x 64 dims, bf16, block 16 -> 368,640 bytes
    smol = ModelConfig("llama", 49152, 576, 1536, 30, 9, 3, 64, 8192)
    assert kv_cache_bytes_per_block(smol, 16, "auto", torch.bfloat16) == 368_640


def test_factory_auto_and_unsupported_dtypes():
    cache = create_kv_cache(cfg(), num_blocks=3, block_size=8, kv_cache_dtype="auto", dtype=torch.float32)
    assert isinstance(cache, PagedKVCache) and cache.num_blocks == 3 and cache.block_size == 8
    with pytest.raises(ConfigError, match="--kv-cache-dtype must be one of"):
        create_kv_cache(cfg(), num_blocks=3, block_size=8, kv_cache_dtype="fp4")
    with pytest.raises(ConfigError, match="num_blocks=0"):
        create_kv_cache(cfg(), num_blocks=0, block_size=8)


def test_every_kv_cache_dtype_builds_its_class():
    """--kv-cache-dtype's choices and the factory's table name the same formats."""
    assert set(KV_CACHE_CLASSES) == set(KV_CACHE_DTYPES)
    for name in KV_CACHE_DTYPES:
        cache = create_kv_cache(cfg(), num_blocks=3, block_size=16, kv_cache_dtype=name, dtype=torch.float32)
        assert type(cache) is kv_cache_class(name)


# -- the "pairs" layout (what the bf16 CPU kernel reads): same tokens, different element order --

def _twins(dtype=torch.bfloat16, num_blocks=7, block_size=16, head_dim=8):
    c = cfg(kv_heads=3, head_dim=head_dim)
    return (PagedKVCache(c, num_blocks=num_blocks, block_size=block_size, dtype=dtype),
            PagedKVCache(c, num_blocks=num_blocks, block_size=block_size, dtype=dtype, layout="pairs"))


@pytest.mark.slow
@settings(max_examples=25, deadline=None)
@given(st.data())
def test_pairs_layout_holds_the_same_tokens(data):
    """Writes (compiled store and the torch fallback, from strided views as the model passes
    them), copy-on-write copies and offload round trips: the pairs cache gathers exactly what the
    token-major cache does, and its memory is the documented permutation of it."""
    block_size = data.draw(st.sampled_from([16, 32]))
    tokens, pairs = _twins(block_size=block_size)
    torch_store = data.draw(st.booleans())
    if torch_store:
        pairs._store_pairs = None
    n = 7 * block_size
    for layer in range(2):
        slots = torch.tensor(data.draw(st.permutations(range(n)))[:data.draw(st.integers(1, n))])
        qkv = torch.randn(len(slots), 4 * 8 + 2 * 3 * 8).bfloat16()  # q | k | v columns, like llama.py
        k, v = qkv[:, 32:56].view(-1, 3, 8), qkv[:, 56:].view(-1, 3, 8)
        tokens.write(layer, slots, k, v)
        pairs.write(layer, slots, k, v)
    src = data.draw(st.lists(st.integers(0, 6), min_size=1, max_size=3))
    copies = [BlockCopy(s, data.draw(st.integers(0, 6)), data.draw(st.integers(0, block_size))) for s in src]
    tokens.copy_blocks(copies)
    pairs.copy_blocks(copies)
    ids = torch.arange(7)
    for layer in range(2):
        for a, b in zip(tokens.gather(layer, ids), pairs.gather(layer, ids)):
            assert torch.equal(a, b)
        k_tok, v_tok = tokens.layer_blocks(layer)
        k_pairs, v_pairs = pairs.layer_blocks(layer)
        assert torch.equal(k_pairs.view(7, 3, 4, block_size, 2),
                           k_tok.view(7, block_size, 3, 4, 2).permute(0, 2, 3, 1, 4))
        assert torch.equal(v_pairs.view(7, 3, block_size // 2, 8, 2),
                           v_tok.view(7, block_size // 2, 2, 3, 8).permute(0, 3, 1, 4, 2))
    moved = pairs.read_blocks(torch.tensor([2, 5]))
    restored = PagedKVCache(cfg(kv_heads=3), num_blocks=7, block_size=block_size, dtype=torch.bfloat16,
                            layout="pairs")
    restored.write_blocks(torch.tensor([0, 1]), moved)
    for a, b in zip(pairs.gather(1, torch.tensor([2, 5])), restored.gather(1, torch.tensor([0, 1]))):
        assert torch.equal(a, b)


def test_pairs_layout_rejects_what_it_cannot_hold():
    with pytest.raises(ConfigError, match="multiple of 16"):
        PagedKVCache(cfg(), num_blocks=2, block_size=8, dtype=torch.bfloat16, layout="pairs")
    with pytest.raises(ConfigError, match="layout must be one of"):
        PagedKVCache(cfg(), num_blocks=2, block_size=16, dtype=torch.bfloat16, layout="heads")
    with pytest.raises(ConfigError, match="'tokens' layout only"):
        create_kv_cache(cfg(), num_blocks=2, block_size=16, kv_cache_dtype="int8", dtype=torch.bfloat16,
                        layout="pairs")
    # Stored blocks of the two layouts differ byte for byte: the tiers' fingerprint tells them apart.
    tokens, pairs = _twins()
    assert tokens.layout_tag != pairs.layout_tag

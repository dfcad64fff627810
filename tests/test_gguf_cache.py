"""The dequantized-GGUF disk cache: same model back, invalidated by a changed file, damage is a miss."""
from __future__ import annotations

import os

import pytest
import torch
from tiny_models import make_tiny_gguf

from kvserve.model import gguf_cache
from kvserve.model.loader import load_gguf


@pytest.mark.slow
def test_cache_round_trip_invalidation_and_damage(tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = make_tiny_gguf(tmp_path, "llama_gqa")
    fresh = load_gguf(path, torch.float32, use_cache=False)
    assert gguf_cache.load_cached(path) is None
    first = load_gguf(path, torch.float32)  # stores
    entry = gguf_cache.entry_dir(path)
    assert (entry / "complete").is_file()
    second = load_gguf(path, torch.bfloat16)  # served from the cache, cast on the way out
    assert second.config == fresh.config
    for k, v in fresh.weights.items():
        assert torch.equal(first.weights[k], v)
        assert torch.equal(second.weights[k], v.to(torch.bfloat16))
    text = "Hello <|im_start|> 12  34 émoji"
    assert second.tokenizer.encode(text) == fresh.tokenizer.encode(text)
    assert second.tokenizer.eos_token_ids == fresh.tokenizer.eos_token_ids

    # A changed file gets a new entry (key includes size and mtime).
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert gguf_cache.entry_dir(path) != entry and gguf_cache.load_cached(path) is None

    # A damaged entry is a miss, removed, and rebuilt by the next load.
    load_gguf(path, torch.float32)
    entry = gguf_cache.entry_dir(path)
    (entry / "model.safetensors").write_bytes(b"not safetensors")
    assert gguf_cache.load_cached(path) is None and not entry.exists()
    again = load_gguf(path, torch.float32)
    assert all(torch.equal(again.weights[k], v) for k, v in fresh.weights.items())

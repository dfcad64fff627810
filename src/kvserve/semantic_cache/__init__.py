"""A response cache above the KV cache: a repeated question, by meaning, answered without the model.

A hit must match exactly on everything that changes the answer (model or adapter, tenant salt,
the conversation before the last user message, sampling settings: key.py) and by embedding only on
the last user message (embedder.py); entries live in SQLite with an HNSW index beside it
(store.py), behind a TTL and a size cap (cache.py).
"""
from kvserve.semantic_cache.cache import Hit, SemanticCache
from kvserve.semantic_cache.key import CacheKey

__all__ = ["CacheKey", "Hit", "SemanticCache"]

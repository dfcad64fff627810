"""Prefix-cache block hashes.

A block's hash is SHA-256 over (parent block hash, its token ids), so equal hashes mean equal
prefixes from the first token on. The chain starts at a root hash over the request's extra keys —
anything that changes the K/V of the same tokens (KV dtype, LoRA adapter name and content digest,
a tenant's cache salt) —
so requests that differ in any of them never share a block. SHA-256 makes a collision a practical
impossibility; the manager still compares token ids on every hit, so even a broken hash could not
serve wrong K/V. Digests are stable across processes, which the offload tiers rely on.
"""
from __future__ import annotations

import hashlib
import json
import struct
from typing import Sequence

_VERSION = b"kvserve-block-hash-v1"


def root_hash(kv_cache_dtype: str = "auto", cache_salt: str | None = None,
              lora_id: str | None = None) -> bytes:
    extras = json.dumps({"kv_dtype": kv_cache_dtype, "salt": cache_salt, "lora": lora_id},
                        sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(_VERSION + extras.encode()).digest()


def hash_block(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    h = hashlib.sha256(parent_hash)
    h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    return h.digest()


def extend_block_hashes(hashes: list[bytes], root: bytes, token_ids: Sequence[int],
                        block_size: int, num_tokens: int | None = None) -> list[bytes]:
    """Append the hashes of every full block of `token_ids[:num_tokens]` (default: all) not yet
    in `hashes` (in place). `num_tokens` spares the caller a copy of a long token list."""
    num_full = (len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))) // block_size
    parent = hashes[-1] if hashes else root
    for i in range(len(hashes), num_full):
        parent = hash_block(parent, token_ids[i * block_size:(i + 1) * block_size])
        hashes.append(parent)
    return hashes

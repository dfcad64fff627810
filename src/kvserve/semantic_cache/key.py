"""What a hit must match exactly: one digest of everything but the last user message."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass


def _digest(value) -> str:
    # sort_keys + default=str: the same settings give the same digest whatever their dict order
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()


@dataclass(frozen=True)
class CacheKey:
    """model: the served name or LoRA adapter; salt: the tenant-salted KV-cache salt (None without
    auth or client salt); history: the messages before the last user message, compared exactly
    (an earlier turn changes what the question means, and embedding it would let two different
    conversations that merely read alike share an answer); sampling: every setting that changes
    the output."""
    model: str
    salt: str | None
    history: list
    sampling: dict

    @property
    def digest(self) -> str:
        return _digest(["kvserve-semantic-cache", self.model, self.salt, self.history, self.sampling])


def tenant_id(tenant: str | None) -> str:
    """The tenant an entry is listed and cleared under (the default tenant without auth)."""
    return _digest(["kvserve-tenant", tenant])[:32]

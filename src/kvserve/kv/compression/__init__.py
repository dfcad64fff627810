"""KV compression methods, one file each (base.py: the interface)."""
from __future__ import annotations

from kvserve.core.kv_compression import KVCompression
from kvserve.kv.compression.base import CompressionMethod
from kvserve.kv.compression.h2o import H2O
from kvserve.kv.compression.snapkv import SnapKV
from kvserve.kv.compression.streaming import Streaming

_METHODS: dict[str, type[CompressionMethod]] = {"streaming": Streaming, "h2o": H2O, "snapkv": SnapKV}


def method_for(c: KVCompression) -> CompressionMethod:
    return _METHODS[c.method](c)

"""KV offload tiers below the device pool: host RAM, local disk, Redis.

`base` holds the interface, the engine fingerprint and the entry framing shared by all tiers;
`chain` the lookup order; `writer` moves evicted blocks down off the decode path. Tiers store
bytes and know nothing of tensors: kvserve.cache.codec packs a block's tensors into the bytes,
kvserve.cache.offload runs the moves. The Redis tier is imported lazily by name
(`kvserve.kv.tiers.redis_tier`) so that an engine without `--kv-redis-url` does not need the redis
client at import time.
"""
from kvserve.kv.tiers.base import EngineFingerprint, FrameError, KVTier, TierStats, TierUsage, frame_header, open_frame
from kvserve.kv.tiers.disk import DiskTier
from kvserve.kv.tiers.host import HostTier
from kvserve.kv.tiers.writer import AsyncWriter, WriterStats

__all__ = [
    "AsyncWriter", "DiskTier", "EngineFingerprint", "FrameError", "HostTier",
    "KVTier", "TierStats", "TierUsage", "WriterStats", "frame_header", "open_frame",
]

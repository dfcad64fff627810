"""An engine's EngineStats: the scheduler's, the KV pool's, the adapters' and the tiers' counters
gathered into one plain record (the metrics, the stats log and the dashboard read it)."""
from __future__ import annotations

from kvserve.engine.outputs import EngineStats


def engine_stats(engine) -> EngineStats:
    u = engine.kv.usage()
    s = engine.kv.stats
    total = max(u.num_blocks, 1)
    stats = EngineStats(
        num_running=engine.scheduler.num_running, num_waiting=engine.scheduler.num_waiting,
        num_waiting_deferred=min(engine.scheduler.num_waiting_deferred, engine.scheduler.num_waiting),
        num_blocks_total=u.num_blocks, num_blocks_free=u.num_free, num_blocks_used=u.num_used,
        num_blocks_cached=u.num_cached, kv_usage=u.num_used / total, cached_usage=u.num_cached / total,
        token_occupancy=u.token_occupancy, prefix_cache_queries=s.queries, prefix_cache_hits=s.hits,
        resume_prefix_cache_queries=s.resume_queries, resume_prefix_cache_hits=s.resume_hits,
        num_preemptions=engine.scheduler.num_preemptions, num_cached_block_evictions=u.num_evictions,
        prompt_tokens_total=engine.prompt_tokens_total,
        prompt_tokens_cached_total=engine.scheduler.num_cached_prompt_tokens,
        prompt_tokens_computed_total=engine.scheduler.num_computed_prompt_tokens,
        generation_tokens_total=engine.generation_tokens_total,
        tier_hits={"device": s.hits + s.resume_hits - sum(s.tier_hits.values()), **s.tier_hits},
        num_swapped_preemptions=engine.scheduler.num_swaps, num_steps=engine.num_steps,
        last_step_tokens=engine.last_step_tokens, spec_decode_num_drafts=engine.scheduler.num_drafts,
        spec_decode_num_draft_tokens=engine.scheduler.num_draft_tokens,
        spec_decode_num_accepted_tokens=engine.scheduler.num_accepted_tokens,
        kv_released_blocks=dict(engine.kv.num_released), evictions_by_class=engine.kv.pool.evictions())
    stats.num_pinned_blocks = engine.kv.pins.num_blocks
    stats.pinned_bytes = stats.num_pinned_blocks * engine.pins.bytes_per_block
    if engine.runner.lora is not None:
        def names(reqs) -> tuple[str, ...]:
            return tuple(sorted({r.lora_id.rpartition("@")[0] for r in reqs if r.lora_id is not None}))
        stats.running_lora_adapters = names(engine.scheduler.running)
        stats.waiting_lora_adapters = names(engine.scheduler.waiting)
        stats.lora_slot_loads = engine.runner.lora.num_slot_loads
    if engine.kv_tiers is not None:
        _tier_stats(engine.kv_tiers, stats)
    return stats


def _tier_stats(chain, stats: EngineStats) -> None:
    for name, usage in chain.usage().items():
        stats.tier_usage[name] = usage.fraction
        stats.tier_used_bytes[name] = usage.used_bytes
    for tier in chain.tiers:
        t = tier.stats()
        stats.tier_hits.setdefault(tier.name, 0)
        stats.tier_lookup_hits[tier.name] = t.hits
        stats.tier_misses[tier.name] = t.misses
        stats.tier_corrupt[tier.name] = t.corrupt
        stats.tier_incompatible[tier.name] = t.incompatible
        stats.tier_errors[tier.name] = t.errors
        stats.tier_bytes_read[tier.name] = t.bytes_read
        stats.tier_bytes_written[tier.name] = t.bytes_written
    c = chain.stats
    if c.decode_failures:
        stats.tier_corrupt["decode"] = c.decode_failures
    stats.tier_token_mismatches = dict(c.token_mismatches)
    stats.host_tier_usage = stats.tier_usage.get("host", 0.0)
    stats.kv_restored_blocks = sum(c.restored_blocks.values())
    stats.kv_restore_seconds = c.lookup_seconds + c.restore_seconds
    stats.kv_offloaded_blocks = c.offloaded_blocks
    stats.kv_offload_below_priority_blocks = c.offload_below_priority
    stats.kv_offload_seconds = c.offload_seconds
    stats.kv_offload_dropped_blocks = chain.writer.stats().dropped if chain.writer is not None else 0
    stats.num_swap_fallbacks = c.swap_fallbacks

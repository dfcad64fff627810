"""Prometheus metrics: vLLM's names (dashboards and scripts work unchanged) plus native kvserve ones.

Every metric is documented in docs/metrics.md. Updated on the engine thread after every loop
iteration from the EngineStats snapshot (gauges; counters advance by the delta of the cumulative
stats) and from the step's RequestOutputs (latency and length histograms).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from prometheus_client import (CollectorRegistry, Counter, Gauge, GCCollector, Histogram, Info, PlatformCollector,
                               ProcessCollector)

from kvserve.core.cache_retention import DEFAULT as DEFAULT_RETENTION
from kvserve.core.request_log import format_request_log_record
from kvserve.engine.async_engine import StepEvent
from kvserve.engine.outputs import RequestProgress

logger = logging.getLogger("kvserve.stats")

# vLLM's buckets, so existing dashboards' bucket-based panels line up.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10**exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


@dataclass
class _RequestProgress:
    last_token_time: float | None
    num_tokens: int


class ServerMetrics:
    """Owns its own CollectorRegistry (no process-global state, several servers per process in tests)."""

    def __init__(self, model_name: str, max_model_len: int, engine_args=None, initial_stats=None):
        """initial_stats: the engine's stats before its first step. Without them the pool gauges
        read 0 until the first request, and a fresh server would report an empty KV pool."""
        self.registry = r = CollectorRegistry()
        # process_* / python_* as on vLLM's /metrics (its default registry): memory and CPU panels, restarts
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        self.model_name = model_name
        # vLLM V1's labels: the model, and the engine (data-parallel replica) that reported.
        L = ["model_name", "engine"]
        if isinstance(initial_stats, list):
            num_engines = len(initial_stats)
        else:
            num_engines = engine_args.data_parallel_size if engine_args is not None else 1
            initial_stats = None if initial_stats is None else [initial_stats] * num_engines
        self._engines = [str(i) for i in range(num_engines)]

        def gauge(name, doc, labels=L):
            return Gauge(name, doc, labels, registry=r)

        def counter(name, doc, labels=L):
            return Counter(name, doc, labels, registry=r)

        def hist(name, doc, buckets):
            return Histogram(name, doc, L, buckets=buckets, registry=r)

        # --- vLLM names ---
        self.running = gauge("vllm:num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (incl. preempted).")
        self.waiting_by_reason = gauge("vllm:num_requests_waiting_by_reason",
                                       "Waiting requests by reason: capacity (no room or budget), deferred (held "
                                       "back on purpose: an n > 1 sequence until the first one's prompt is cached, "
                                       "a request whose next block another is computing this step).", L + ["reason"])
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc",
                                     "Fraction (0..1) of KV blocks held by requests (ref>0); cached-only blocks not counted.")
        self.kv_cache_usage = gauge("vllm:kv_cache_usage_perc", "Same value as vllm:gpu_cache_usage_perc (vLLM V1 name).")
        self.cpu_cache_usage = gauge("vllm:cpu_cache_usage_perc", "Fraction (0..1) of the host KV tier in use; 0 without one.")
        self.gpu_hit_rate = gauge("vllm:gpu_prefix_cache_hit_rate",
                                  "Prompt tokens served from device-resident cached blocks / prompt tokens queried, since start.")
        self.cpu_hit_rate = gauge("vllm:cpu_prefix_cache_hit_rate",
                                  "Prompt tokens served from the host tier / prompt tokens queried, since start.")
        self.pc_queries = counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache (new requests).")
        self.pc_hits = counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache (new requests).")
        self.preemptions = counter("vllm:num_preemptions", "Requests preempted to free KV blocks.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of admitted requests, as counted by the engine (see docs/metrics.md).")
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Prompt tokens of admitted requests served from the prefix cache (any tier).")
        self.prompt_tokens_by_source = counter("vllm:prompt_tokens_by_source",
                                               "Prompt tokens by source: local_compute, local_cache_hit "
                                               "(kvserve has no external KV transfer).", L + ["source"])
        self.generation_tokens = counter("vllm:generation_tokens", "Tokens generated.")
        self.request_success = counter("vllm:request_success", "Finished requests by finish reason.",
                                       L + ["finished_reason"])
        self.ttft = hist("vllm:time_to_first_token_seconds", "Arrival to first generated token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between two steps' tokens of a request.", ITL_BUCKETS)
        self.tpot = hist("vllm:time_per_output_token_seconds",
                         "Same observations as vllm:inter_token_latency_seconds (vLLM V1 alias).", ITL_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Per request: (last token - first token) / (output tokens - 1).", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.", REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds", "First scheduled to first token.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds", "First token to last token.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds", "First scheduled to last token.", REQUEST_LATENCY_BUCKETS)
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.req_prompt_tokens = hist("vllm:request_prompt_tokens", "Prompt length per finished request.", token_buckets)
        self.req_prefill_computed = hist("vllm:request_prefill_kv_computed_tokens",
                                         "Per finished request: prompt tokens prefilled (not from the prefix cache).",
                                         token_buckets)
        self.req_gen_tokens = hist("vllm:request_generation_tokens", "Generated tokens per finished request (all n).", token_buckets)
        self.req_max_gen_tokens = hist("vllm:request_max_num_generation_tokens",
                                       "Per finished request: tokens of its longest sequence.", token_buckets)
        self.req_params_n = hist("vllm:request_params_n", "The n of each finished request.", [1, 2, 5, 10, 20])
        self.req_params_max_tokens = hist("vllm:request_params_max_tokens", "The max_tokens of each finished request.",
                                          token_buckets)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Tokens computed per engine step.",
                                     [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384])
        # --- native ---
        self.blocks_total = gauge("kvserve:kv_blocks_total", "KV blocks in the device pool.")
        self.blocks_free = gauge("kvserve:kv_blocks_free", "Blocks holding nothing reusable (ref==0, no cached content).")
        self.blocks_used = gauge("kvserve:kv_blocks_used", "Blocks referenced by at least one request (ref>0).")
        self.blocks_cached = gauge("kvserve:kv_blocks_cached", "Blocks with ref==0 kept only as reusable prefix cache (evictable).")
        self.cached_usage = gauge("kvserve:kv_cached_usage_perc", "kv_blocks_cached / kv_blocks_total (0..1).")
        self.token_occupancy = gauge("kvserve:kv_token_occupancy_perc",
                                     "KV slots holding tokens / slots in referenced blocks (0..1); 1 - internal fragmentation.")
        self.host_usage = gauge("kvserve:host_tier_usage_perc", "Fraction (0..1) of the host KV tier in use.")
        self.evictions = counter("kvserve:cached_block_evictions", "Cached-only blocks evicted to make room.")
        self.pinned_blocks = gauge("kvserve:kv_cache_pinned_blocks",
                                   "KV blocks held by pinned prefixes (POST /v1/cache/pins); never evicted.")
        self.pinned_bytes = gauge("kvserve:kv_cache_pinned_bytes",
                                  "Bytes of the KV cache held by pinned prefixes (capped by --max-pinned-kv-bytes).")
        self.evictions_by_class = counter(
            "kvserve:kv_cache_evictions", "Cached blocks evicted, by retention class (cache_retention priority "
            "below / at / above the default 50, or past its TTL).", L + ["retention_class"])
        self.ttl_expiries = counter("kvserve:kv_cache_ttl_expiries",
                                    "Cached blocks evicted after their cache_retention TTL ran out.")
        self.tier_hits = counter("kvserve:prefix_cache_hits_by_tier", "Prefix-cache hit tokens by source tier.",
                                 L + ["tier"])
        self.resume_queries = counter("kvserve:resume_prefix_cache_queries",
                                      "Tokens looked up when preempted requests resume.")
        self.resume_hits = counter("kvserve:resume_prefix_cache_hits",
                                   "Tokens found in the cache when preempted requests resume.")
        self.step_errors = counter("kvserve:engine_step_errors", "Engine steps that raised (requests failed).")
        # --- offload tiers (host / disk / redis; series appear once a tier is configured) ---
        T = L + ["tier"]
        self.tier_usage = gauge("kvserve:kv_tier_usage_perc", "Fraction (0..1) of an offload tier's capacity in use.", T)
        self.tier_used_bytes = gauge("kvserve:kv_tier_used_bytes", "Bytes stored in an offload tier.", T)
        self.tier_lookups = counter("kvserve:kv_tier_lookups", "Block lookups in an offload tier by result (hit | miss).",
                                    T + ["result"])
        self.tier_faults = counter("kvserve:kv_tier_faults", "Entries refused or backend failures by kind "
                                   "(corrupt | incompatible | error | token_mismatch); each is a miss, never served.", T + ["kind"])
        self.tier_bytes = counter("kvserve:kv_tier_bytes", "Bytes moved to (written) and from (read) an offload tier.",
                                  T + ["direction"])
        self.restored_blocks = counter("kvserve:kv_restored_blocks", "Blocks restored into the device pool from offload tiers.")
        self.restore_seconds = counter("kvserve:kv_restore_seconds", "Time spent looking up and restoring tier blocks "
                                       "(divide by kv_restored_blocks for the mean per block).")
        self.offloaded_blocks = counter("kvserve:kv_offloaded_blocks", "Evicted device blocks copied down to the tiers.")
        self.offload_dropped = counter("kvserve:kv_offload_dropped_blocks", "Evicted blocks dropped: the tier writer queue was full.")
        self.offload_below_priority = counter("kvserve:kv_offload_below_priority_blocks", "Evicted blocks not written "
                                              "down: below --kv-offload-min-priority, or past their cache_retention TTL.")
        self.swapped_preemptions = counter("kvserve:num_swapped_preemptions", "Preemptions whose KV went to the host tier.")
        self.released_blocks = counter("kvserve:kv_released_blocks", "Blocks released from running sequences by "
                                       "reason (sliding_window | streaming | h2o | snapkv).", L + ["reason"])
        # vLLM's speculative decoding counters (acceptance rate = accepted / draft tokens).
        self.spec_drafts = counter("vllm:spec_decode_num_drafts", "Request-steps that carried speculated tokens.")
        self.spec_draft_tokens = counter("vllm:spec_decode_num_draft_tokens", "Speculated tokens fed to the model.")
        self.spec_accepted = counter("vllm:spec_decode_num_accepted_tokens", "Speculated tokens the model agreed with.")
        if engine_args is not None:
            info = Info("kvserve:cache_config", "KV cache configuration.", ["model_name"], registry=r)
            info.labels(model_name).info({
                "block_size": str(engine_args.block_size), "kv_cache_dtype": str(engine_args.kv_cache_dtype),
                "enable_prefix_caching": str(engine_args.enable_prefix_caching),
                "max_num_seqs": str(engine_args.max_num_seqs), "max_model_len": str(max_model_len)})
        if engine_args is not None and initial_stats is not None:
            # vLLM's info gauge (value 1, the settings as labels): dashboards read the pool size here.
            labels = {"block_size": str(engine_args.block_size), "cache_dtype": str(engine_args.kv_cache_dtype),
                      "enable_prefix_caching": str(engine_args.enable_prefix_caching),
                      "gpu_memory_utilization": str(engine_args.gpu_memory_utilization),
                      "num_gpu_blocks": str(initial_stats[0].num_blocks_total),
                      "num_gpu_blocks_override": str(engine_args.num_gpu_blocks_override),
                      "swap_space": str(engine_args.swap_space), "cpu_offload_gb": str(engine_args.cpu_offload_gb)}
            Gauge("vllm:cache_config_info", "Information of the engine's cache configuration.", list(labels),
                  registry=r).labels(**labels).set(1)
        self.lora_info = None
        if engine_args is not None and engine_args.enable_lora:
            # vLLM's: one series, the adapters as comma-separated labels, its value the time of the update.
            self.max_lora = str(engine_args.max_loras)
            self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on lora requests.",
                                   ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
            self.lora_slot_loads = Counter("kvserve:lora_slot_loads", "LoRA adapters copied into a device slot "
                                           "(first loads and LRU swaps beyond --max-loras)", L,
                                           registry=r)
        # Export every series from the start (zeros), as vLLM does: rate() and greps need them to exist.
        for engine in self._engines:
            for metric in vars(self).values():
                if isinstance(metric, (Gauge, Counter, Histogram)) and metric._labelnames == tuple(L):
                    metric.labels(model_name, engine)
            for reason in ("stop", "length", "abort"):
                self.request_success.labels(model_name, engine, reason)
        self._last: dict[tuple[int, str], float] = {}
        self._progress: dict[str, _RequestProgress] = {}
        for rank, stats in enumerate(initial_stats or []):
            self.observe_stats(stats, rank)

    # ----- updates (engine thread) -----

    def _m(self, rank: int) -> tuple[str, str]:
        return self.model_name, str(rank)

    def _advance(self, rank: int, key: str, counter, value: float) -> None:
        delta = value - self._last.get((rank, key), 0)
        if delta > 0:
            counter.inc(delta)
        self._last[rank, key] = value

    def observe_stats(self, s, rank: int = 0) -> None:
        m = self._m(rank)
        self.running.labels(*m).set(s.num_running)
        self.waiting.labels(*m).set(s.num_waiting)
        self.waiting_by_reason.labels(*m, "capacity").set(s.num_waiting - s.num_waiting_deferred)
        self.waiting_by_reason.labels(*m, "deferred").set(s.num_waiting_deferred)
        self.gpu_cache_usage.labels(*m).set(s.kv_usage)
        self.kv_cache_usage.labels(*m).set(s.kv_usage)
        self.cpu_cache_usage.labels(*m).set(s.host_tier_usage)
        self.host_usage.labels(*m).set(s.host_tier_usage)
        # tier_hits counts resumes after preemption too, so the denominator does as well (vLLM V0's
        # allocator-level hit rate counted every lookup the same way).
        lookups = s.prefix_cache_queries + s.resume_prefix_cache_queries
        device_hits = s.tier_hits.get("device", s.prefix_cache_hits + s.resume_prefix_cache_hits)
        self.gpu_hit_rate.labels(*m).set(min(1.0, device_hits / lookups) if lookups else 0.0)
        self.cpu_hit_rate.labels(*m).set(min(1.0, s.tier_hits.get("host", 0) / lookups) if lookups else 0.0)
        self.blocks_total.labels(*m).set(s.num_blocks_total)
        self.blocks_free.labels(*m).set(s.num_blocks_free)
        self.blocks_used.labels(*m).set(s.num_blocks_used)
        self.blocks_cached.labels(*m).set(s.num_blocks_cached)
        self.cached_usage.labels(*m).set(s.cached_usage)
        self.token_occupancy.labels(*m).set(s.token_occupancy)
        self.pinned_blocks.labels(*m).set(s.num_pinned_blocks)
        self.pinned_bytes.labels(*m).set(s.pinned_bytes)
        self._advance(rank, "pcq", self.pc_queries.labels(*m), s.prefix_cache_queries)
        self._advance(rank, "pch", self.pc_hits.labels(*m), s.prefix_cache_hits)
        self._advance(rank, "rq", self.resume_queries.labels(*m), s.resume_prefix_cache_queries)
        self._advance(rank, "rh", self.resume_hits.labels(*m), s.resume_prefix_cache_hits)
        self._advance(rank, "pre", self.preemptions.labels(*m), s.num_preemptions)
        if s.num_steps > self._last.get((rank, "steps"), 0):  # a forward ran since the last look (one per loop pass)
            self.iteration_tokens.labels(*m).observe(s.last_step_tokens)
        self._last[rank, "steps"] = s.num_steps
        self._advance(rank, "ev", self.evictions.labels(*m), s.num_cached_block_evictions)
        by_class = getattr(s, "evictions_by_class", {})
        for cls, n in by_class.items():
            self._advance(rank, "evc:" + cls, self.evictions_by_class.labels(*m, cls), n)
        self._advance(rank, "ttl", self.ttl_expiries.labels(*m), by_class.get("expired", 0))
        self._advance(rank, "pt", self.prompt_tokens.labels(*m), s.prompt_tokens_total)
        self._advance(rank, "ptc", self.prompt_tokens_cached.labels(*m), s.prompt_tokens_cached_total)
        self._advance(rank, "pts:hit", self.prompt_tokens_by_source.labels(*m, "local_cache_hit"), s.prompt_tokens_cached_total)
        self._advance(rank, "pts:compute", self.prompt_tokens_by_source.labels(*m, "local_compute"),
                      s.prompt_tokens_computed_total)
        self._advance(rank, "gt", self.generation_tokens.labels(*m), s.generation_tokens_total)
        for tier, hits in s.tier_hits.items():
            self._advance(rank, "tier:" + tier, self.tier_hits.labels(*m, tier), hits)
        self._observe_tiers(s, rank)
        if self.lora_info is not None:
            self._advance(rank, "lora_loads", self.lora_slot_loads.labels(*m), s.lora_slot_loads)
            self.lora_info.clear()
            self.lora_info.labels(self.max_lora, ",".join(s.waiting_lora_adapters),
                                  ",".join(s.running_lora_adapters)).set_to_current_time()

    def _observe_tiers(self, s, rank: int) -> None:
        m = self._m(rank)
        for tier, frac in getattr(s, "tier_usage", {}).items():
            self.tier_usage.labels(*m, tier).set(frac)
            self.tier_used_bytes.labels(*m, tier).set(s.tier_used_bytes.get(tier, 0))
        for result, values in (("hit", getattr(s, "tier_lookup_hits", {})), ("miss", getattr(s, "tier_misses", {}))):
            for tier, v in values.items():
                self._advance(rank, f"tl:{tier}:{result}", self.tier_lookups.labels(*m, tier, result), v)
        for kind, values in (("corrupt", getattr(s, "tier_corrupt", {})), ("incompatible", getattr(s, "tier_incompatible", {})),
                             ("error", getattr(s, "tier_errors", {})),
                             ("token_mismatch", getattr(s, "tier_token_mismatches", {}))):
            for tier, v in values.items():
                self._advance(rank, f"tf:{tier}:{kind}", self.tier_faults.labels(*m, tier, kind), v)
        for direction, values in (("read", getattr(s, "tier_bytes_read", {})), ("written", getattr(s, "tier_bytes_written", {}))):
            for tier, v in values.items():
                self._advance(rank, f"tb:{tier}:{direction}", self.tier_bytes.labels(*m, tier, direction), v)
        self._advance(rank, "krb", self.restored_blocks.labels(*m), getattr(s, "kv_restored_blocks", 0))
        self._advance(rank, "krs", self.restore_seconds.labels(*m), getattr(s, "kv_restore_seconds", 0.0))
        self._advance(rank, "kob", self.offloaded_blocks.labels(*m), getattr(s, "kv_offloaded_blocks", 0))
        self._advance(rank, "kod", self.offload_dropped.labels(*m), getattr(s, "kv_offload_dropped_blocks", 0))
        self._advance(rank, "kop", self.offload_below_priority.labels(*m),
                      getattr(s, "kv_offload_below_priority_blocks", 0))
        self._advance(rank, "nsp", self.swapped_preemptions.labels(*m), getattr(s, "num_swapped_preemptions", 0))
        for reason, n in getattr(s, "kv_released_blocks", {}).items():
            self._advance(rank, "rel:" + reason, self.released_blocks.labels(*m, reason), n)
        self._advance(rank, "sdd", self.spec_drafts.labels(*m), getattr(s, "spec_decode_num_drafts", 0))
        self._advance(rank, "sdt", self.spec_draft_tokens.labels(*m), getattr(s, "spec_decode_num_draft_tokens", 0))
        self._advance(rank, "sda", self.spec_accepted.labels(*m), getattr(s, "spec_decode_num_accepted_tokens", 0))

    def observe_progress(self, p: RequestProgress, now: float, rank: int = 0) -> None:
        """Per-token metrics of a request that gained tokens: TTFT once, then inter-token gaps."""
        m = self._m(rank)
        prog = self._progress.get(p.request_id)
        if prog is None:
            prog = self._progress[p.request_id] = _RequestProgress(None, 0)
        if p.num_tokens > prog.num_tokens:
            token_time = p.last_token_time if p.last_token_time is not None else now
            if prog.last_token_time is None:
                if p.first_token_time is not None:
                    self.ttft.labels(*m).observe(max(0.0, p.first_token_time - p.arrival_time))
            else:
                gap = max(0.0, token_time - prog.last_token_time)
                self.itl.labels(*m).observe(gap)
                self.tpot.labels(*m).observe(gap)
            prog.last_token_time, prog.num_tokens = token_time, p.num_tokens

    def observe_output(self, out, now: float, rank: int = 0) -> None:
        """A request's output: per-token metrics (when no RequestProgress reported them), and
        request-level metrics once it has finished."""
        t = out.metrics
        self.observe_progress(RequestProgress(out.request_id, sum(len(o.token_ids) for o in out.outputs),
                                              t.arrival_time, t.first_token_time, t.last_token_time), now, rank)
        if out.finished:
            self.observe_finished(out, now, rank)

    def observe_finished(self, out, now: float, rank: int = 0) -> None:
        m, t = self._m(rank), out.metrics
        self._progress.pop(out.request_id, None)
        reasons = [o.finish_reason for o in out.outputs if o.finish_reason]
        self.request_success.labels(*m, reasons[0] if reasons else "abort").inc()
        self.req_prompt_tokens.labels(*m).observe(len(out.prompt_token_ids))
        self.req_prefill_computed.labels(*m).observe(len(out.prompt_token_ids) - cached_prompt_tokens(out))
        self.req_gen_tokens.labels(*m).observe(sum(len(o.token_ids) for o in out.outputs))
        longest = max((len(o.token_ids) for o in out.outputs), default=0)
        self.req_max_gen_tokens.labels(*m).observe(longest)
        self.req_params_n.labels(*m).observe(len(out.outputs))
        if t.max_tokens is not None:
            self.req_params_max_tokens.labels(*m).observe(t.max_tokens)
        end = t.finished_time if t.finished_time is not None else now
        self.e2e.labels(*m).observe(max(0.0, end - t.arrival_time))
        if t.first_scheduled_time is not None:
            self.queue_time.labels(*m).observe(max(0.0, t.first_scheduled_time - t.arrival_time))
            if t.first_token_time is not None:
                self.prefill_time.labels(*m).observe(max(0.0, t.first_token_time - t.first_scheduled_time))
            if t.last_token_time is not None:
                self.inference_time.labels(*m).observe(max(0.0, t.last_token_time - t.first_scheduled_time))
        if t.first_token_time is not None and t.last_token_time is not None:
            self.decode_time.labels(*m).observe(max(0.0, t.last_token_time - t.first_token_time))
            if longest > 1:
                self.request_tpot.labels(*m).observe((t.last_token_time - t.first_token_time) / (longest - 1))

    def __call__(self, event: StepEvent) -> None:
        """StepListener entry point."""
        rank = event.rank
        if event.stats is not None:
            self.observe_stats(event.stats, rank)
        reported = set()
        for p in event.progress:
            self.observe_progress(p, event.now, rank)
            reported.add(p.request_id)
        for out in event.outputs:
            if out.request_id not in reported:
                self.observe_output(out, event.now, rank)
            elif out.finished:
                self.observe_finished(out, event.now, rank)
        for request_id in event.aborted:
            self._progress.pop(request_id, None)
            self.request_success.labels(*self._m(rank), "abort").inc()
        self._advance(rank, "step_errors", self.step_errors.labels(*self._m(rank)), event.num_step_errors)


class StatLogger:
    """The periodic log line (vLLM's format): throughput, running/waiting, KV usage, hit rate."""

    def __init__(self, interval_s: float = 10.0):
        self.interval_s = interval_s
        self._last: dict[int, tuple[float, object]] = {}  # per data-parallel replica: (time, stats)

    def __call__(self, event: StepEvent) -> None:
        s, now = event.stats, event.now
        if s is None:
            return
        if event.rank not in self._last:
            self._last[event.rank] = now, s
            return
        last_time, p = self._last[event.rank]
        elapsed = now - last_time
        if elapsed < self.interval_s:
            return
        queries = s.prefix_cache_queries - p.prefix_cache_queries
        hits = s.prefix_cache_hits - p.prefix_cache_hits
        logger.info(
            "Engine %03d: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%% (cached-only %.1f%%, "
            "token occupancy %.1f%%), Prefix cache hit rate: %.1f%%, Preemptions: %d",
            event.rank, (s.prompt_tokens_total - p.prompt_tokens_total) / elapsed,
            (s.generation_tokens_total - p.generation_tokens_total) / elapsed,
            s.num_running, s.num_waiting, 100 * s.kv_usage, 100 * s.cached_usage,
            100 * s.token_occupancy, 100 * hits / queries if queries else 0.0,
            s.num_preemptions - p.num_preemptions)
        self._last[event.rank] = now, s


def cached_prompt_tokens(out) -> int:
    """A finished RequestOutput's prompt tokens served from the prefix cache, within [0, prompt]."""
    return min(max(out.num_cached_tokens, 0), len(out.prompt_token_ids))


def request_log_fields(out) -> dict:
    """The fields of kvserve's request log for one finished RequestOutput."""
    t = out.metrics
    end = t.finished_time if t.finished_time is not None else t.last_token_time or t.arrival_time
    return dict(request_id=out.request_id, prompt_tokens=len(out.prompt_token_ids),
                output_tokens=sum(len(o.token_ids) for o in out.outputs),
                cached_tokens=cached_prompt_tokens(out),
                cache_write_tokens=out.num_cache_write_tokens,
                cache_retention=(t.cache_retention or DEFAULT_RETENTION).as_dict(),
                ttft=None if t.first_token_time is None else t.first_token_time - t.arrival_time,
                e2e=end - t.arrival_time,
                finish_reason=next((o.finish_reason for o in out.outputs if o.finish_reason), None),
                prompt_token_ids=list(out.prompt_token_ids), time=time.time())


class RequestLogWriter:
    """--request-log PATH: one JSON line per request that ended, finished or aborted (a step
    listener, on the engine thread).

    The line format is kvserve.core.request_log's, which `kvserve analyze` reads.
    """

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # line-buffered: tail -f works

    def __call__(self, event: StepEvent) -> None:
        for out in event.outputs:
            if out.finished:
                self._file.write(format_request_log_record(**request_log_fields(out)) + "\n")
        for out, why in event.ended:  # aborted: the client left, the drain ended, a step failed
            self._file.write(format_request_log_record(**request_log_fields(out), abort_reason=why) + "\n")

    def close(self) -> None:
        self._file.close()

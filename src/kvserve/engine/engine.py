"""LLMEngine: requests in, token outputs out, one `step()` at a time.

    step = scheduler.schedule() -> model_runner.execute() -> scheduler.update_from_output()
           -> detokenize, stop strings -> RequestOutputs

n > 1 is served as n requests ("<id>#<i>"): the first computes the prompt, the others wait until
it is in the prefix cache and then share its blocks by reference (the partial last block by
copy-on-write). Sequence i of a seeded request samples with seed + i, so it equals an n=1 run
with that seed.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import numbers
import os
import time
import weakref
from typing import Iterable

from kvserve.cache.offload import build_kv_tiers
from kvserve.config import ConfigError, EngineArgs, SchedulerConfig
from kvserve.core.kv_compression import KVCompressionError, check_kv_compression, parse_kv_compression
from kvserve.core.lora import LoRARequest
from kvserve.core.request import Request, RequestStatus
from kvserve.core.sampling_params import RequestOutputKind, SamplingParams, SamplingParamsError
from kvserve.engine.detokenizer import IncrementalDetokenizer, token_text_cache
from kvserve.engine.outputs import CompletionOutput, EngineStats, RequestError, RequestOutput, RequestProgress
from kvserve.engine.pins import EnginePins
from kvserve.engine.sequences import Sequence, SequenceGroup, build_output, logprobs_entry, progress
from kvserve.engine.stats import engine_stats
from kvserve.kv.events import KVEventSink
from kvserve.kv.manager import KVCacheManager
from kvserve.model.lora import LoRAError
from kvserve.runner.build import EngineSetup, build_engine_parts
from kvserve.sched.scheduler import Scheduler

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "RequestError", "RequestOutput", "CompletionOutput", "EngineStats"]


KV_EXPORT_SECONDS = 10  # a prefill server's wait for its prompt blocks to reach Redis
SHUTDOWN_WRITE_SECONDS = 60  # the write-back's limit, its queueing included (KVOffloader.persist)


def _shutdown_tiers(kv: KVCacheManager, offloader, tiers) -> None:
    """The engine's tiers at shutdown: the blocks still in the pool are written to disk / Redis
    (they only go down on eviction otherwise), then the tiers close. Holds no engine reference."""
    handed, refused_before, finished = 0, {}, True
    if offloader is not None and tiers.lower:
        refused_before = {t.name: t.stats().rejected for t in tiers.lower}
        try:
            handed = offloader.persist(kv.cached_blocks(), timeout=SHUTDOWN_WRITE_SECONDS)
        except Exception as e:  # a tensor-parallel rank gone: its heads cannot be read
            logger.warning("shutdown: the cached KV blocks were not written to the lower tiers: %s", e)
            handed = 0
        finished = not handed or tiers.flush(SHUTDOWN_WRITE_SECONDS)
        if not finished:
            logger.warning("shutdown: the KV tier writer did not finish within %d s; some of the %d cached "
                           "blocks handed down will be recomputed after a restart", SHUTDOWN_WRITE_SECONDS, handed)
    tiers.close()
    for t in tiers.lower if handed and finished else ():
        refused = t.stats().rejected - refused_before[t.name]  # queued evictions' included
        if refused:
            logger.warning("shutdown: the %s tier refused %d of the blocks written to it at shutdown (%d cached "
                           "blocks handed down; unavailable or full: see its warnings above); a restart will "
                           "recompute them", t.name, refused, handed)
        else:
            logger.info("shutdown: %d cached KV blocks written to the %s tier", handed, t.name)


class LLMEngine:
    def __init__(self, args: EngineArgs, setup: EngineSetup | None = None) -> None:
        args.validate()
        self.args = args
        if setup is None:
            from kvserve.engine import tp_executor
            setup = build_engine_parts(args, start_ranks=tp_executor.start)
        self.setup = setup
        self.model_config = setup.model_config
        self.tokenizer = setup.tokenizer
        self.runner = setup.runner
        # Tensor parallelism: the other ranks stop with the engine (close(), collection, or exit).
        self._close_runner = weakref.finalize(self, self.runner.close) if hasattr(self.runner, "close") else None
        self.max_model_len = setup.max_model_len
        self.sampling_defaults = self._sampling_defaults(args)
        # A token's own text: logprobs' decoded_token, the server's /tokenize token strings.
        self.token_text = token_text_cache(self.tokenizer)
        self.kv_tiers, self.kv_offloader = None, None
        self.kv_export_blocks, self.kv_export_seconds = 0, 0.0  # disaggregated prefill's writes
        self._loading: dict[str, tuple] = {}  # disaggregated decode: request id -> (req, keys, read)
        self._kv_loader = None
        if args.has_kv_tiers:
            if setup.fingerprint is None:
                raise ConfigError("KV offload tiers need the engine fingerprint: build the setup with "
                                  "build_engine_parts, or set EngineSetup.fingerprint")
            self.kv_tiers, self.kv_offloader = build_kv_tiers(args, setup.fingerprint, self.runner.kv_cache)
        # KV events (--kv-events-config): every block stored in and dropped from each tier; a
        # data-parallel front end routes by them too.
        events = args.kv_events
        wanted = (events is not None and events.enable_kv_cache_events) or args.data_parallel_size > 1
        self.kv_events = KVEventSink() if wanted else None
        if self.kv_events is not None and self.kv_tiers is not None:
            for tier in self.kv_tiers.tiers:
                tier.events, tier.block_size = self.kv_events, args.block_size
        self.kv = KVCacheManager(setup.num_blocks, args.block_size, args.enable_prefix_caching,
                                 args.kv_cache_dtype, tiers=self.kv_tiers, events=self.kv_events,
                                 sliding_window=self.model_config.sliding_window,
                                 offload_min_priority=args.kv_offload_min_priority)
        self.kv_compression = self._kv_compression_default(args)
        if self.kv_tiers is not None:
            # close(), or an engine dropped without it (garbage collection, interpreter exit):
            # the pool's cached blocks go down too, the writer drains, the directory unlocks.
            self._close_tiers = weakref.finalize(self, _shutdown_tiers, self.kv, self.kv_offloader, self.kv_tiers)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_args(args, self.max_model_len), self.kv)
        self._groups: dict[str, SequenceGroup] = {}
        self._seq_of: dict[str, Sequence] = {}
        self._group_of: dict[str, SequenceGroup] = {}
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_steps = 0  # forwards run, and the tokens the last one computed (vllm:iteration_tokens_total)
        self.last_step_tokens = 0
        # The requests the last step gave tokens to, outputs or not (server metrics read it).
        self.last_step_progress: list[RequestProgress] = []
        # Outputs carry only what is new (delta fields; no prompt, no cumulative text or ids):
        # the engine core process sends these, and the front end, which knows each request's
        # prompt, rebuilds the cumulative outputs (engine/core_client.py). Saves copying every
        # request's whole output into every step's message.
        self.send_deltas = False
        bpb = setup.budget.bytes_per_block
        cap = args.max_pinned_kv_bytes
        self.pins = EnginePins(self, setup.num_blocks * bpb // 2 if cap is None else cap, bpb, args.kv_disk_path)
        self.pins.restore()

    def _sampling_defaults(self, args: EngineArgs) -> dict:
        """The generation_config.json sampling values: the model's (--generation-config auto), a
        folder's (--generation-config DIR), or none (vllm)."""
        from kvserve.model.loader import SAMPLING_KEYS, read_generation_config, sampling_defaults
        if args.generation_config == "auto":
            defaults, source = dict(self.model_config.sampling_defaults), "the model's generation_config.json"
        elif args.generation_config == "vllm":
            defaults, source = {}, "vLLM's defaults"
        else:
            defaults = sampling_defaults(read_generation_config(os.path.join(args.generation_config,
                                                                             "generation_config.json")))
            source = f"{args.generation_config}/generation_config.json"
        if defaults:
            try:
                SamplingParams(**defaults)
            except (SamplingParamsError, TypeError) as e:
                raise ConfigError(f"{source} gives sampling defaults kvserve cannot use ({e}); fix the file or "
                                  f"start with --generation-config vllm") from None
        override = args.override_generation_config or {}
        if override:
            ignored = sorted(set(override) - set(SAMPLING_KEYS))
            if ignored:  # vLLM drops them silently; a misspelt key should not be
                logger.warning("--override-generation-config: %s ignored; the keys that set sampling defaults "
                               "are %s", ", ".join(ignored), ", ".join(SAMPLING_KEYS))
            used = sampling_defaults(override)
            try:
                SamplingParams(**used)
            except (SamplingParamsError, TypeError) as e:
                raise ConfigError(f"--override-generation-config {override}: {e}; fix the value") from None
            for key, field in SAMPLING_KEYS.items():  # as vLLM's dict update: null drops the default
                if key in override and override[key] is None:
                    defaults.pop(field, None)
            defaults.update(used)
            source += " and --override-generation-config"
        if defaults:
            logger.info("Default sampling parameters have been overridden by %s: %s (--generation-config vllm "
                        "ignores the model's)", source, defaults)
        return defaults

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "LLMEngine":
        return cls(args)

    @property
    def max_logprobs(self) -> int:
        """--max-logprobs, where -1 (vLLM's "no cap") means the vocabulary."""
        m = self.args.max_logprobs
        return self.model_config.vocab_size if m == -1 else m

    # -- requests ---------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    *, priority: int = 0, cache_salt: str | None = None,
                    arrival_time: float | None = None, lora_request: LoRARequest | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self._groups:
            raise RequestError(f"request id {request_id!r} is already in use", "request_id")
        try:
            params.validate(max_logprobs=self.max_logprobs)
        except SamplingParamsError as e:
            raise RequestError(str(e), str(e).split()[0]) from None
        params = self._with_kv_compression(params)
        prompt_text, prompt_ids = self._tokenize_prompt(prompt)
        params = self._resolve_max_tokens(params, len(prompt_ids))
        lora_id = self._resolve_lora(lora_request, params.n)  # held until each sequence ends
        arrival = time.monotonic() if arrival_time is None else arrival_time
        eos = frozenset(self.tokenizer.eos_token_ids)
        seqs: list[Sequence] = []
        for i in range(params.n):
            seed = None if params.seed is None else params.seed + i
            # Sequence 0 computes the prompt logprobs (without prefix-cache reads); the others
            # share its prompt blocks as usual.
            p = dataclasses.replace(params, n=1, seed=seed, best_of=None,
                                    prompt_logprobs=params.prompt_logprobs if i == 0 else None)
            rid = request_id if params.n == 1 else f"{request_id}#{i}"
            req = Request(rid, prompt_ids, p, eos_token_ids=eos, arrival_time=arrival,
                          priority=priority, cache_salt=cache_salt, lora_id=lora_id,
                          parent_id=None if i == 0 or not self.args.enable_prefix_caching
                          else f"{request_id}#0")
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids, p.skip_special_tokens, p.stop,
                                           p.include_stop_str_in_output)
            seq = Sequence(req, i, detok, [] if p.logprobs is not None else None)
            if p.prompt_logprobs is not None:
                seq.prompt_logprobs = [None] * len(prompt_ids)
                req.skip_prefix_cache = len(prompt_ids) > 1
            seqs.append(seq)
        group = SequenceGroup(request_id, prompt_text, prompt_ids, seqs, arrival, params.output_kind)
        self._groups[request_id] = group
        for s in seqs:
            self._seq_of[s.req.request_id] = s
            self._group_of[s.req.request_id] = group
            if not self._load_remote_kv(s.req):
                self.scheduler.add_request(s.req)
        self.prompt_tokens_total += len(prompt_ids)

    def _load_remote_kv(self, req: Request) -> bool:
        """Disaggregated decode: a request whose prompt a prefill server computed waits outside the
        scheduler while a thread reads its KV from the tiers, so the running decodes' steps do not
        wait on Redis (vLLM's WAITING_FOR_REMOTE_KVS). Only without a host tier, which the engine
        thread alone may touch. True when the read was started."""
        chain = self.kv_tiers
        if chain is None or chain.host is not None or not (req.sampling_params.kv_transfer_params or {}).get(
                "do_remote_prefill"):
            return False
        keys, tokens = self.kv.tier_keys(req)
        if not keys:
            return False
        if self._kv_loader is None:
            from concurrent.futures import ThreadPoolExecutor
            self._kv_loader = ThreadPoolExecutor(1, thread_name_prefix="kvserve-kv-load")
        self._loading[req.request_id] = (req, keys, self._kv_loader.submit(chain.fetch, keys, tokens))
        return True

    def _admit_loaded(self) -> None:
        """Requests whose KV read ended go to the scheduler, the blocks read waiting for their lookup."""
        for rid, (req, keys, future) in list(self._loading.items()):
            if not future.done():
                continue
            del self._loading[rid]
            try:
                self.kv.preload(req, keys, tuple(future.result()))
            except Exception:  # the lookup reads the tiers itself (or computes the prompt)
                logger.exception("kv transfer: reading request %s's KV ahead failed", rid)
            self.scheduler.add_request(req)

    def _kv_compression_default(self, args: EngineArgs):
        """--kv-compression, parsed and checked against this model and context length."""
        value = args.kv_compression
        if value is None or value == "":
            return None
        try:
            c = parse_kv_compression(json.loads(value) if isinstance(value, str) else value, "--kv-compression")
            check_kv_compression(c, self.max_model_len, self.model_config.sliding_window, "--kv-compression")
        except json.JSONDecodeError as e:
            raise ConfigError(f"--kv-compression is not valid JSON ({e}); give an object such as "
                              '\'{"method": "streaming", "sink_tokens": 4, "window": 1024}\'') from None
        except KVCompressionError as e:
            raise ConfigError(str(e)) from None
        return c

    def _with_kv_compression(self, params: SamplingParams) -> SamplingParams:
        """The request's kv_compression, or the server default (--kv-compression) when it sets
        none; refused where this engine cannot serve it."""
        if params.kv_compression is None and self.kv_compression is not None:
            params = dataclasses.replace(params, kv_compression=self.kv_compression)
        try:
            check_kv_compression(params.kv_compression, self.max_model_len, self.model_config.sliding_window)
        except KVCompressionError as e:
            raise RequestError(str(e), "kv_compression") from None
        return params
    def _resolve_lora(self, lora_request: LoRARequest | None, sequences: int) -> str | None:
        """The request's adapter key (loading the adapter if needed, held in host memory for its
        sequences), or None for the base model."""
        if lora_request is None:
            return None
        if not isinstance(lora_request, LoRARequest):
            raise RequestError(f"lora_request must be a kvserve.LoRARequest, got {type(lora_request).__name__}",
                               "lora_request")
        if self.runner.lora is None:
            raise RequestError(f"lora_request {lora_request.lora_name!r}: LoRA is not enabled; create the engine "
                               f"with enable_lora=True (--enable-lora)", "lora_request")
        try:
            return self.runner.lora.resolve(lora_request, sequences)
        except LoRAError as e:
            raise RequestError(f"LoRA adapter {lora_request.lora_name!r}: {e}", "lora_request") from None

    def _tokenize_prompt(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if not isinstance(prompt, (str, list, tuple)):
            raise RequestError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}", "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty; send at least one token", "prompt")
            ids = self.tokenizer.encode(prompt)
            text = prompt
            if ids and max(ids) >= self.model_config.vocab_size:  # a --tokenizer larger than the model
                raise RequestError(f"the tokenizer gave token id {max(ids)}, outside this model's vocabulary of "
                                   f"{self.model_config.vocab_size}; use the model's own tokenizer", "prompt")
        else:
            # numpy integers (a token array's items) are token ids too
            ids = [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in prompt]
            text = None
            if not ids:
                raise RequestError("prompt is empty; send at least one token", "prompt")
            vocab = self.model_config.vocab_size
            bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt token ids must be integers in [0, {vocab}); got {bad[:5]}", "prompt")
        if not ids:
            raise RequestError("prompt tokenizes to zero tokens; send a non-empty prompt", "prompt")
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your "
                f"prompt has {len(ids)} tokens, which leaves no room for output; shorten the prompt "
                f"or raise max_model_len (--max-model-len)", "prompt")
        return text, ids

    def _resolve_max_tokens(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        """Output is capped at the context left after the prompt (finish reason "length"), as
        vLLM's engine does; the OpenAI server refuses an explicit overflow itself, with a 400."""
        room = self.max_model_len - prompt_len
        if params.max_tokens is None or params.max_tokens > room:
            return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))
        return params

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """End these requests now (unknown or finished ids are ignored); their blocks are freed.
        Returns each one's last output, finish_reason "abort", for logs and metrics."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        ended = []
        for rid in request_ids:
            group = self._groups.get(rid)
            if group is None:
                continue
            for s in group.seqs:
                if self._loading.pop(s.req.request_id, None) is not None:  # never reached the scheduler
                    s.req.status = RequestStatus.FINISHED_ABORTED
                    self.kv.forget(s.req)
                elif not s.req.is_finished:
                    self.scheduler.finish_request(s.req.request_id, RequestStatus.FINISHED_ABORTED)
            ended.append(self._make_output(group))  # every sequence finished: the group leaves
        return ended

    def take_kv_events(self) -> list:
        """The KV events since the last call, oldest first (empty when they are off)."""
        return self.kv_events.drain() if self.kv_events is not None else []

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def reset_prefix_cache(self) -> bool:
        return self.kv.reset_prefix_cache()

    # -- pinned prefixes (engine/pins.py); `cache_salt` is the caller's tenant's --------------------
    def pin_prefix(self, prompt_token_ids: list[int], cache_salt: str | None = None,
                   lora_request: LoRARequest | None = None) -> dict:
        """Start pinning a prefix; poll get_pin(id) until its status is "pinned"."""
        return self.pins.add(prompt_token_ids, cache_salt, lora_request)

    def get_pin(self, pin_id: str, cache_salt: str | None = None) -> dict | None:
        return self.pins.get(pin_id, cache_salt)

    def list_pins(self, cache_salt: str | None = None) -> list[dict]:
        return self.pins.list(cache_salt)

    def unpin(self, pin_id: str, cache_salt: str | None = None) -> dict | None:
        return self.pins.remove(pin_id, cache_salt)

    def kv_snapshot(self, cells: int = 1024, top: int = 8, cache_salt: str | None = None,
                    max_requests: int = 64) -> dict:
        """The dashboard's view of the KV pool and the scheduler's requests (kv/snapshot.py): plain
        data, computed only when asked. `cache_salt` is the viewer's; other tenants' prefixes and
        requests come back as counts and figures, never token ids."""
        from kvserve.kv.snapshot import kv_snapshot
        return kv_snapshot(self.kv, list(self.scheduler.running), list(self.scheduler.waiting), cells, top,
                           cache_salt, max_requests)

    def close(self) -> None:
        """Write the pool's cached blocks and the queued ones down to disk / Redis, then release
        the tiers (the disk tier's directory lock). The server calls it at shutdown; an engine
        never closed does it when collected or at interpreter exit."""
        if self.kv_tiers is not None:
            self._close_tiers()  # a finalizer: runs once
        if self._close_runner is not None:
            self._close_runner()

    # -- the step ---------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.last_step_progress = []
        if self._loading:
            if len(self._loading) == len(self._seq_of):  # nothing else to run: wait for a read, not spin
                from concurrent.futures import FIRST_COMPLETED, wait
                wait([f for _, _, f in self._loading.values()], timeout=0.01, return_when=FIRST_COMPLETED)
            self._admit_loaded()
        sched = self.scheduler.schedule()
        now = time.monotonic()
        for entry in sched.scheduled:
            if entry.request.first_scheduled_time is None:
                entry.request.first_scheduled_time = now
        if self.kv_offloader is not None and (sched.kv_offloads or sched.kv_restores):
            self.kv_offloader.apply(sched)  # before the runner's copies and forward write the pool
        if sched.is_empty and not sched.finished_req_ids:
            return []
        if sched.scheduled:
            self.num_steps += 1
            self.last_step_tokens = sum(e.num_new_tokens for e in sched.scheduled)
        result = self.runner.execute(sched)  # an empty step still drops finished requests' state
        # Outputs before the step: a speculated request can gain several tokens in one.
        before = {e.request.request_id: e.request.num_output_tokens for e in sched.scheduled
                  if e.spec_token_ids}
        touched = self.scheduler.update_from_output(sched, result)
        exports = [r for r in touched if r.is_finished and (r.sampling_params.kv_transfer_params or {}).get(
            "do_remote_decode")]
        if exports and self.kv_offloader is not None:
            self._export_kv(exports)
        if self.pins.records:
            for req in touched:
                if req.is_finished and self.pins.is_internal(req.request_id):
                    self.pins.finished(req)  # before anything else is allocated: see engine/pins.py
        if self.args.check_integrity:
            self.kv.check_integrity()
        now = time.monotonic()
        groups: dict[str, SequenceGroup] = {}
        for rid, chunk in result.prompt_logprobs.items():
            if rid in self._seq_of:
                self._add_prompt_logprobs(self._seq_of[rid], chunk)
        for req in touched:
            seq = self._seq_of[req.request_id]
            if req.first_token_time is None:
                req.first_token_time = now
            req.last_token_time = now
            if req.request_id in before:  # no logprobs or stop strings: speculation_allowed
                new_ids = req.output_token_ids[before[req.request_id]:]
                self.generation_tokens_total += len(new_ids)
                seq.new_token_ids.extend(new_ids)
                for j, t in enumerate(new_ids):  # a stop token's text is left out, as below
                    stop_token = j == len(new_ids) - 1 and req.status == RequestStatus.FINISHED_STOPPED
                    if not stop_token or req.sampling_params.include_stop_str_in_output:
                        seq.detok.add_token(t, stop_strings=False)
            else:
                self._add_sampled(req, seq, result.sampled[req.request_id])
            if req.is_finished:
                req.finished_time = now
            group = self._group_of[req.request_id]
            groups[group.request_id] = group  # n > 1: one output per request, not per sequence
        outputs = [self._make_output(g) for g in groups.values() if self._due(g)]
        if self.pins.records:  # a pin's prefill is the engine's own: no output, no request metrics
            groups = {k: g for k, g in groups.items() if not self.pins.is_internal(k)}
            outputs = [o for o in outputs if not self.pins.is_internal(o.request_id)]
        self.last_step_progress = [progress(g) for g in groups.values()]
        return outputs

    def _export_kv(self, reqs: list) -> None:
        """Disaggregated prefill: the finished prompts' full blocks are written to the lower tiers
        (Redis) before their final output leaves, so the decode server the router calls next
        finds them; they otherwise only go down on eviction. The step waits for the writes."""
        start = time.perf_counter()
        blocks = [b for r in reqs for b in self.kv.prompt_blocks(r)]
        self.kv_offloader.persist(blocks, timeout=KV_EXPORT_SECONDS)
        if not self.kv_tiers.flush(KV_EXPORT_SECONDS):
            logger.warning("kv transfer: the Redis writes of %d prompt blocks did not finish within %d s; "
                           "the decode server will recompute what it does not find", len(blocks), KV_EXPORT_SECONDS)
        self.kv_export_blocks += len(blocks)
        self.kv_export_seconds += time.perf_counter() - start

    def _due(self, group: SequenceGroup) -> bool:
        """Whether this step's output of the group is sent: a final-only request's when it ends; a
        streamed one's every --stream-interval tokens, its first token and its end at once."""
        if group.output_kind == RequestOutputKind.FINAL_ONLY:
            return all(s.req.is_finished for s in group.seqs)
        n = self.args.stream_interval
        return n == 1 or any(s.req.is_finished or len(s.new_token_ids) >= n
                             or len(s.new_token_ids) == s.req.num_output_tokens for s in group.seqs)

    def _add_sampled(self, req: Request, seq: Sequence, tok) -> None:
        """One sampled token: its logprobs, its text, and the stop strings it may complete."""
        self.generation_tokens_total += 1
        seq.new_token_ids.append(tok.token_id)
        if seq.logprobs is not None:
            entry = logprobs_entry(self.token_text, tok.token_id, tok.logprob, tok.rank, tok.top_logprobs)
            seq.logprobs.append(entry)
            seq.new_logprobs.append(entry)
            seq.cumulative_logprob += tok.logprob
        # As vLLM: a stop token (EOS, stop_token_ids) ends the output without its text unless
        # include_stop_str_in_output (it stays in token_ids); stop strings are looked for only
        # past min_tokens, and one found in the same step wins as the stop reason.
        p = req.sampling_params
        stopped_by_token = req.status == RequestStatus.FINISHED_STOPPED
        found_stop_string = False
        if not stopped_by_token or p.include_stop_str_in_output:
            found_stop_string = seq.detok.add_token(tok.token_id, stop_strings=req.num_output_tokens > p.min_tokens)
        if found_stop_string:
            req.stop_reason = seq.detok.stop_reason
            if req.is_finished:  # the same token also hit a length limit: the stop string wins
                req.status = RequestStatus.FINISHED_STOPPED
            else:
                self.scheduler.finish_request(req.request_id, RequestStatus.FINISHED_STOPPED)

    def _add_prompt_logprobs(self, seq: Sequence, chunk) -> None:
        """File a prefill chunk's prompt logprobs by position (a recomputed chunk overwrites)."""
        prompt = seq.req.prompt_token_ids
        for j, (lp, rank, top) in enumerate(zip(chunk.logprobs, chunk.ranks, chunk.top)):
            pos = chunk.start + j
            if seq.prompt_logprobs[pos] is None:
                seq.prompt_scored += 1
            seq.prompt_logprobs[pos] = logprobs_entry(self.token_text, prompt[pos], lp, rank, top)
        if seq.prompt_scored == len(prompt) - 1:
            seq.req.skip_prefix_cache = False  # all scored: a resume may read the cache again

    def _make_output(self, group: SequenceGroup) -> RequestOutput:
        out = build_output(group, self.send_deltas)
        if out.finished:
            self._groups.pop(group.request_id, None)
            for s in group.seqs:
                if s.req.lora_id is not None and self._seq_of.get(s.req.request_id) is s:
                    self.runner.lora.unpin(s.req.lora_id)
                self._seq_of.pop(s.req.request_id, None)
                self._group_of.pop(s.req.request_id, None)
        return out

    # -- observability ----------------------------------------------------------------------------
    def get_stats(self) -> EngineStats:
        return engine_stats(self)

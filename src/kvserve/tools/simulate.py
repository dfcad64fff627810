"""`kvserve simulate`: replay a trace through the real Scheduler and KVCacheManager, no weights loaded.

The model is replaced by CostModelRunner (deterministic tokens, roofline step time), so block
accounting — prefix hits, preemptions, evictions, blocks in use per step — is the engine's own,
and the clock is simulated: each step advances it by the cost model's estimate. A sweep runs the
same trace once per configuration (block size x KV memory x kv dtype x max-num-seqs x policy).
"""
from __future__ import annotations

import argparse
import heapq
import itertools
import json
import sys
from dataclasses import asdict, dataclass, field

from kvserve.config import (BLOCK_SIZES, KV_CACHE_DTYPES, SCHEDULING_POLICIES, ConfigError, SchedulerConfig,
                            check_writable, parse_size)
from kvserve.core.request import Request
from kvserve.core.sampling_params import SamplingParams
from kvserve.kv.events import KVEventSink
from kvserve.kv.hashing import extend_block_hashes, root_hash
from kvserve.kv.manager import KVCacheManager
from kvserve.routing import POLICIES, Replica, make_policy
from kvserve.sched.scheduler import Scheduler
from kvserve.tools.cost_model import CostModelRunner, StepCost
from kvserve.tools.plan import DTYPE_BYTES, fmt_bytes, kv_bytes_per_block, normalize_dtype, plan_kv
from kvserve.tools.presets import count_parameters, resolve_model
from kvserve.tools.workload import (DEFAULT_TOKEN_RANGE, LengthDist, Trace, WorkloadSpec, load_pins, synthetic_trace,
                                    trace_from_request_log)

# Dense bf16 peak and HBM bandwidth; "cpu" is CostModelRunner's own default (a 2-core laptop class).
HARDWARE = {"h100": (989e12, 3.35e12), "a100": (312e12, 2.0e12), "l4": (121e12, 0.3e12),
            "cpu": (StepCost.peak_flops, StepCost.mem_bandwidth)}


@dataclass(frozen=True)
class SimConfig:
    """One point of the sweep; field names are the engine's (EngineArgs) flags."""
    block_size: int = 16
    num_blocks: int = 0
    kv_cache_dtype: str = "auto"
    kv_cache_memory: int | None = None  # what num_blocks came from (None: given as --num-blocks)
    max_num_seqs: int = 256
    scheduling_policy: str = "fcfs"
    cache_aware_scheduling: bool = False
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    data_parallel_size: int = 1  # replicas, each with num_blocks of its own
    data_parallel_routing: str = "cache_aware"


@dataclass
class SimResult:
    config: SimConfig
    max_model_len: int
    num_requests: int = 0
    num_skipped: int = 0       # longer than max_model_len: the engine would refuse them
    prompt_tokens: int = 0
    output_tokens: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up on admission (new requests)
    prefix_cache_hits: int = 0
    resume_prefix_cache_queries: int = 0  # lookups of preempted requests resuming
    resume_prefix_cache_hits: int = 0
    num_preemptions: int = 0
    num_cached_block_evictions: int = 0
    peak_blocks_used: int = 0
    peak_kv_usage: float = 0.0
    mean_kv_usage: float = 0.0  # time-weighted over the simulated run
    num_steps: int = 0
    sim_time_s: float = 0.0
    request_throughput: float = 0.0
    output_throughput: float = 0.0  # output tokens / simulated second
    mean_ttft_s: float = 0.0
    p99_ttft_s: float = 0.0
    mean_e2e_s: float = 0.0
    error: str | None = None
    blocks_used_per_step: list[int] = field(default_factory=list, repr=False)
    # Per request id: (prompt tokens, of those served from the prefix cache): one tenant's hit rate
    request_cached_tokens: dict[str, tuple[int, int]] = field(default_factory=dict, repr=False)

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def to_dict(self, with_steps: bool = False) -> dict:
        d = asdict(self)
        d["prefix_hit_rate"] = self.prefix_hit_rate
        d.pop("request_cached_tokens")
        if not with_steps:
            d.pop("blocks_used_per_step")
        return d


class ReplayRunner(CostModelRunner):
    """CostModelRunner that emits recorded answers where the trace has them (exact multi-turn replay)."""

    def __init__(self, recorded: dict[str, tuple[int, list[int]]], **kw) -> None:
        super().__init__(**kw)
        self.recorded = recorded  # request id -> (prompt length, answer token ids)

    def token_for(self, request_id: str, position: int) -> int:
        rec = self.recorded.get(request_id)
        if rec is not None and 0 <= position - rec[0] < len(rec[1]):
            return rec[1][position - rec[0]]
        return super().token_for(request_id, position)


class _Replica:
    """One data-parallel replica: its own pool, scheduler, cost-model runner and clock."""

    def __init__(self, cfg: SimConfig, max_model_len: int, runner) -> None:
        self.events = KVEventSink()  # what the router learns, as from an engine core's KV events
        self.kv = KVCacheManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.kv_cache_dtype,
                                 events=self.events if cfg.data_parallel_size > 1 else None)
        self.sched = Scheduler(SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=max_model_len, enable_chunked_prefill=cfg.enable_chunked_prefill,
            scheduling_policy=cfg.scheduling_policy, cache_aware_scheduling=cfg.cache_aware_scheduling), self.kv)
        self.runner = runner
        self.clock = 0.0


def turn_request_id(conversation_id: str, turn: int) -> str:
    return f"{conversation_id}/t{turn}"


def simulate(trace: Trace, cfg: SimConfig, max_model_len: int, cost: StepCost | None = None,
             vocab_size: int = 49152, check_integrity: bool = False,
             pins: list[list[int]] = ()) -> SimResult:
    """Run the trace to completion under `cfg`; the clock is simulated seconds from the first arrival.
    `pins`: prefixes pinned on every replica before the first arrival (POST /v1/cache/pins), their
    prefill left out of the counts."""
    res = SimResult(config=cfg, max_model_len=max_model_len)
    if cfg.num_blocks * cfg.block_size < max_model_len:
        res.error = (f"the pool holds {cfg.num_blocks * cfg.block_size} tokens, less than max-model-len "
                     f"{max_model_len}: give it more KV memory or lower --max-model-len")
        return res
    pinned_blocks = sum(len(p) // cfg.block_size for p in pins)
    too_long = [i for i, p in enumerate(pins) if len(p) >= max_model_len]
    if too_long:
        res.error = (f"pin {too_long[0]} holds {len(pins[too_long[0]])} tokens, not less than max-model-len "
                     f"{max_model_len}: raise --max-model-len")
        return res
    if pinned_blocks + -(-max_model_len // cfg.block_size) > cfg.num_blocks:
        res.error = (f"the pins hold {pinned_blocks} of the pool's {cfg.num_blocks} blocks, leaving less than one "
                     f"max-model-len sequence unpinned (the engine refuses such a pin): give it more KV memory")
        return res
    recorded: dict[str, tuple[int, list[int]]] = {}
    replicas = [_Replica(cfg, max_model_len, ReplayRunner(recorded, vocab_size=vocab_size, cost=cost))
                for _ in range(cfg.data_parallel_size)]
    policy = make_policy(cfg.data_parallel_routing)
    views = [Replica(i) for i in range(len(replicas))]  # what the front end's router sees of each
    convs = {c.conversation_id: c for c in trace.conversations}
    seq = itertools.count()
    # (arrival, order, conversation id, turn, prompt ids): order keeps ties in trace order.
    pending = [(c.arrival_time, next(seq), c.conversation_id, 0, list(c.first_prompt)) for c in trace.conversations]
    heapq.heapify(pending)
    arrival, first_token, ttfts, e2es = {}, {}, [], []
    start = pending[0][0] if pending else 0.0
    for r in replicas:
        r.clock = start
    used_time = 0.0
    for r in replicas:
        _pin(r, pins, max_model_len)

    def admit(item) -> None:
        t, _, cid, k, prompt = item
        turn = convs[cid].turns[k]
        rid = turn_request_id(cid, k)
        if len(prompt) + turn.output_len > max_model_len:
            res.num_skipped += 1
            return
        answers = convs[cid].output_token_ids
        if answers is not None and k < len(answers):
            recorded[rid] = (len(prompt), answers[k])
        params = SamplingParams(max_tokens=turn.output_len, ignore_eos=True, temperature=0.0,
                                cache_retention=convs[cid].cache_retention)
        for view, r in zip(views, replicas):  # the router's view as of now: events and load
            view.index.apply(r.events.drain())
            view.num_running, view.num_waiting = len(r.sched.running), r.sched.num_waiting
        hashes = extend_block_hashes([], root_hash(cfg.kv_cache_dtype), prompt, cfg.block_size)
        r = replicas[policy.choose(hashes, views) if len(replicas) > 1 else 0]
        if not r.sched.has_unfinished_requests():
            r.clock = max(r.clock, t)  # an idle replica's clock waits for its next arrival
        # Arrival gets a sub-nanosecond tiebreak so equal trace times keep trace order, as
        # monotonic clock readings do in the engine.
        req = Request(rid, prompt, params, arrival_time=t + res.num_requests * 1e-12, priority=convs[cid].priority)
        r.sched.add_request(req)
        arrival[rid] = t
        res.num_requests += 1
        res.prompt_tokens += len(prompt)

    while True:
        busy = [r for r in replicas if r.sched.has_unfinished_requests()]
        if not pending and not busy:
            break
        # The next event: an arrival, or a step of the replica whose clock is furthest behind.
        r = min(busy, key=lambda x: x.clock) if busy else None
        if pending and (r is None or pending[0][0] <= r.clock):
            admit(heapq.heappop(pending))
            continue
        out = r.sched.schedule()
        if out.is_empty and not out.finished_req_ids:
            if not r.sched.running and not pending:
                res.error = (f"{r.sched.num_waiting} request(s) can never be scheduled "
                             f"(pool of {cfg.num_blocks} blocks)")
                break
            if not r.sched.running:
                r.clock = pending[0][0]
            continue
        before = r.runner.elapsed_s
        result = r.runner.execute(out)
        touched = r.sched.update_from_output(out, result)
        if check_integrity:
            r.kv.check_integrity()
        dt = r.runner.elapsed_s - before
        used = r.kv.pool.num_used_blocks
        used_time += used * dt
        r.clock += dt
        res.num_steps += 1
        res.blocks_used_per_step.append(used)
        res.peak_blocks_used = max(res.peak_blocks_used, used)
        for req in touched:
            rid = req.request_id
            res.output_tokens += 1
            if rid not in res.request_cached_tokens:
                res.request_cached_tokens[rid] = (req.num_prompt_tokens, max(req.num_cached_tokens, 0))
            if rid not in first_token:
                first_token[rid] = r.clock
                ttfts.append(r.clock - arrival[rid])
            if req.is_finished:
                e2es.append(r.clock - arrival[rid])
                cid, k = rid.rsplit("/t", 1)
                k = int(k) + 1
                if k < len(convs[cid].turns):
                    prompt = req.all_token_ids + convs[cid].turns[k].user_token_ids
                    heapq.heappush(pending, (r.clock, next(seq), cid, k, prompt))
    clock = max(r.clock for r in replicas)
    num_blocks = cfg.num_blocks * len(replicas)
    for r in replicas:
        s = r.kv.stats
        res.prefix_cache_queries += s.queries
        res.prefix_cache_hits += s.hits
        res.resume_prefix_cache_queries += s.resume_queries
        res.resume_prefix_cache_hits += s.resume_hits
        res.num_preemptions += r.sched.num_preemptions
        res.num_cached_block_evictions += r.kv.pool.num_evictions
    res.peak_kv_usage = res.peak_blocks_used / cfg.num_blocks
    res.sim_time_s = clock - start
    if res.sim_time_s > 0:
        res.mean_kv_usage = used_time / res.sim_time_s / num_blocks
        res.request_throughput = len(e2es) / res.sim_time_s
        res.output_throughput = res.output_tokens / res.sim_time_s
    if ttfts:
        ttfts.sort()
        res.mean_ttft_s = sum(ttfts) / len(ttfts)
        res.p99_ttft_s = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))]
    if e2es:
        res.mean_e2e_s = sum(e2es) / len(e2es)
    return res


def _pin(r: _Replica, pins: list[list[int]], max_model_len: int) -> None:
    """As the engine pins: prefill each prefix, pin its full blocks in the step that freed them."""
    for i, prefix in enumerate(pins):
        req = Request(f"pin/{i}", list(prefix), SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
        r.sched.add_request(req)
        while r.sched.has_unfinished_requests():
            out = r.sched.schedule()
            r.sched.update_from_output(out, r.runner.execute(out))
        r.kv.pin(req.request_id, req)
    r.kv.stats = type(r.kv.stats)()


# -- the sweep ------------------------------------------------------------------------------------
def _list(text: str, flag: str, conv):
    try:
        values = [conv(x.strip()) for x in str(text).split(",") if x.strip()]
    except (ValueError, ConfigError) as e:
        raise ConfigError(f"{flag} {text!r}: {e}") from None
    if not values:
        raise ConfigError(f"{flag} is empty; give one value or a comma-separated list")
    return values


def _choice(choices):
    def conv(x: str) -> str:
        if x not in choices:
            raise ValueError(f"{x!r} is not one of {', '.join(choices)}")
        return x
    return conv


def _on_off(x: str) -> bool:
    if x.lower() in ("on", "true", "1", "yes"):
        return True
    if x.lower() in ("off", "false", "0", "no"):
        return False
    raise ValueError(f"{x!r} is not on/off")


def _block_size(x: str) -> int:
    n = int(x)
    if n not in BLOCK_SIZES:
        raise ValueError(f"the engine takes block sizes {', '.join(map(str, BLOCK_SIZES))}, not {n}")
    return n


def _positive_int(x: str) -> int:
    n = int(x)
    if n < 1:
        raise ValueError(f"{n} must be >= 1")
    return n


@dataclass
class SweepReport:
    model: str
    trace: str
    num_requests: int
    max_model_len: int
    hardware: str
    notes: list[str]
    results: list[SimResult]


def build_configs(args, model_cfg, model_dtype: str) -> list[SimConfig]:
    sizes = _list(args.block_size, "--block-size", _block_size)
    dtypes = _list(args.kv_cache_dtype, "--kv-cache-dtype", _choice(KV_CACHE_DTYPES))
    seqs = _list(args.max_num_seqs, "--max-num-seqs", _positive_int)
    policies = _list(args.scheduling_policy, "--scheduling-policy", _choice(SCHEDULING_POLICIES))
    aware = _list(args.cache_aware_scheduling, "--cache-aware-scheduling", _on_off)
    dps = _list(args.data_parallel_size, "--data-parallel-size", _positive_int)
    routings = _list(args.data_parallel_routing, "--data-parallel-routing", _choice(sorted(POLICIES)))
    if args.num_blocks is not None:
        pools = [(None, n) for n in _list(args.num_blocks, "--num-blocks", _positive_int)]
    else:
        pools = [(m, None) for m in _list(args.kv_cache_memory, "--kv-cache-memory",
                                          lambda x: parse_size(x, "--kv-cache-memory"))]
    configs = []
    for bs, mem_blocks, dt, n, pol, ca, dp, routing in itertools.product(sizes, pools, dtypes, seqs, policies,
                                                                         aware, dps, routings):
        mem, blocks = mem_blocks
        if blocks is None:  # the engine's arithmetic, quantized caches' residual pool included
            blocks = plan_kv(model_cfg, mem, bs, dt, model_dtype, max_num_seqs=n).num_blocks
        if dp == 1 and routing != routings[0]:
            continue  # one replica: nothing to route
        configs.append(SimConfig(bs, blocks, dt, mem, n, pol, ca, args.max_num_batched_tokens,
                                 not args.no_prefix_caching, data_parallel_size=dp, data_parallel_routing=routing))
    return configs


def step_cost(model_cfg, model_dtype: str, bytes_per_token: float, hardware: str, overhead_ms: float) -> StepCost:
    params = count_parameters(model_cfg).total
    peak, bw = HARDWARE[hardware]
    return StepCost(flops_per_token=2 * params, weight_bytes=params * DTYPE_BYTES[model_dtype],
                    kv_bytes_per_token=bytes_per_token, peak_flops=peak, mem_bandwidth=bw,
                    step_overhead_s=overhead_ms / 1000)


def load_trace(args) -> Trace:
    lo, hi = (int(x) for x in args.token_range.split(":"))
    if args.trace:
        return trace_from_request_log(args.trace, shared_prefix_fraction=args.shared_prefix_fraction,
                                      prefix_len=args.prefix_len, seed=args.seed, token_range=(lo, hi))
    return synthetic_trace(WorkloadSpec(
        num_conversations=args.num_requests, prompt_len=LengthDist.parse(args.prompt_len, "--prompt-len"),
        output_len=LengthDist.parse(args.output_len, "--output-len"),
        shared_prefix_fraction=args.shared_prefix_fraction, prefix_len=args.prefix_len, num_turns=args.multi_turn,
        request_rate=args.request_rate, priority_levels=args.priority_levels, seed=args.seed, token_range=(lo, hi)))


def run_sweep(args, progress=None) -> SweepReport:
    """`progress(done, total, config)`: called after each configuration (the CLI prints it to stderr)."""
    spec = resolve_model(args.model or "SmolLM2-135M")
    cfg = spec.config
    dtype = normalize_dtype(spec.dtype if args.dtype == "auto" else args.dtype)
    trace = load_trace(args)
    need = trace.max_total_len()
    max_model_len = args.max_model_len or min(need, cfg.max_position_embeddings)
    notes = list(trace.notes)
    if need > max_model_len:
        notes.append(f"the longest request needs {need} tokens, more than max-model-len {max_model_len}: "
                     "longer requests are skipped, as the engine would refuse them")
    pins: list[list[int]] = []
    if args.pins:
        pins, pin_notes = load_pins(args.pins)
        notes += pin_notes
        if any(t >= cfg.vocab_size for p in pins for t in p):
            raise ConfigError(f"--pins {args.pins}: token ids past the vocabulary of {cfg.name} ({cfg.vocab_size}); "
                              f"give the pins.json of a server running this model")
    results = []
    configs = build_configs(args, cfg, dtype)
    for c in configs:
        bpt = kv_bytes_per_block(cfg, c.block_size, c.kv_cache_dtype, dtype) / c.block_size
        cost = step_cost(cfg, dtype, bpt, args.hardware, args.step_overhead_ms)
        results.append(simulate(trace, c, max_model_len, cost, cfg.vocab_size, pins=pins))
        if progress is not None:
            progress(len(results), len(configs), c)
    return SweepReport(cfg.name, trace.source, trace.num_requests, max_model_len, args.hardware, notes, results)


def format_report(r: SweepReport) -> str:
    lines = [f"kvserve simulate: {r.model}, {r.num_requests} requests, max-model-len {r.max_model_len}, "
             f"cost model: {r.hardware}", f"  trace: {r.trace}", "",
             f"  {'block':>5} {'KV memory':>11} {'blocks':>7} {'kv dtype':>8} {'seqs':>5} {'policy':>8} {'LPM':>3} |"
             f" {'hit rate':>8} {'peak KV':>7} {'mean KV':>7} {'preempt':>7} {'evict':>6} | {'tok/s':>9} {'req/s':>7}"
             f" {'TTFT ms':>8} {'p99 ms':>8}"]
    dp = any(x.config.data_parallel_size > 1 for x in r.results)
    if dp:
        lines[-1] += f" | {'dp':>2} {'routing':<12}"
    for x in r.results:
        c = x.config
        mem = fmt_bytes(c.kv_cache_memory) if c.kv_cache_memory is not None else "-"
        head = (f"  {c.block_size:>5} {mem:>11} {c.num_blocks:>7,} {c.kv_cache_dtype:>8} {c.max_num_seqs:>5} "
                f"{c.scheduling_policy:>8} {'on' if c.cache_aware_scheduling else 'off':>3} |")
        if x.error:
            lines.append(f"{head} error: {x.error}")
            continue
        lines.append(f"{head} {x.prefix_hit_rate:>8.1%} {x.peak_kv_usage:>7.1%} {x.mean_kv_usage:>7.1%} "
                     f"{x.num_preemptions:>7,} {x.num_cached_block_evictions:>6,} | {x.output_throughput:>9,.0f} "
                     f"{x.request_throughput:>7,.2f} {x.mean_ttft_s * 1e3:>8,.1f} {x.p99_ttft_s * 1e3:>8,.1f}"
                     + (f" | {c.data_parallel_size:>2} {c.data_parallel_routing:<12}" if dp else ""))
    lines += [""] + [f"NOTE: {n}" for n in r.notes]
    return "\n".join(lines).rstrip()


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="what-if: replay a workload through the real scheduler and KV manager",
                              description="Replay a request log or a synthetic workload through kvserve's scheduler "
                                          "and KV cache manager with a cost model instead of the model (no weights), "
                                          "once per configuration of the sweep. List values are comma-separated.")
    src = p.add_argument_group("workload")
    src.add_argument("--trace", metavar="LOGFILE", help="kvserve request log (JSONL, --request-log); default: synthetic")
    src.add_argument("--num-requests", type=int, default=200, help="synthetic: conversations (default %(default)s)")
    src.add_argument("--prompt-len", default="512", help="N, LO:HI or normal:MEAN,STD (default %(default)s)")
    src.add_argument("--output-len", default="128", help="N, LO:HI or normal:MEAN,STD (default %(default)s)")
    src.add_argument("--shared-prefix-fraction", type=float, default=0.0,
                     help="fraction of requests starting with one shared prefix (also for logs without token ids)")
    src.add_argument("--prefix-len", type=int, default=0, help="shared prefix length in tokens")
    src.add_argument("--multi-turn", type=int, default=1, metavar="K", help="turns per conversation")
    src.add_argument("--request-rate", type=float, default=None, help="Poisson arrivals per second (default: all at once)")
    src.add_argument("--priority-levels", type=int, default=1, help="random priorities 0..N-1 (for --scheduling-policy priority)")
    src.add_argument("--token-range", default=f"{DEFAULT_TOKEN_RANGE[0]}:{DEFAULT_TOKEN_RANGE[1]}", help=argparse.SUPPRESS)
    src.add_argument("--seed", type=int, default=0)
    src.add_argument("--pins", metavar="PINS_JSON", help="prefixes pinned on every replica before the first "
                     "request: a server's pins.json (in its --kv-disk-path) or a JSON list of token-id lists")
    m = p.add_argument_group("model and cost model")
    m.add_argument("--model", help="preset, config.json, model directory or .gguf (default SmolLM2-135M)")
    m.add_argument("--dtype", default="auto", help="model dtype for KV auto and weight bytes")
    m.add_argument("--max-model-len", type=int, default=None, help="default: the trace's longest request")
    m.add_argument("--hardware", default="h100", choices=sorted(HARDWARE), help="roofline peak FLOPs and bandwidth")
    m.add_argument("--step-overhead-ms", type=float, default=2.0, help="fixed cost per engine step")
    s = p.add_argument_group("sweep (comma-separated lists; every combination runs)")
    s.add_argument("--block-size", default="16")
    s.add_argument("--kv-cache-memory", default="4GiB", help="KV budget(s), e.g. 1GiB,512MiB")
    s.add_argument("--num-blocks", default=None, help="exact pool size(s) instead of --kv-cache-memory")
    s.add_argument("--kv-cache-dtype", default="auto", help=", ".join(KV_CACHE_DTYPES))
    s.add_argument("--max-num-seqs", default="256")
    s.add_argument("--scheduling-policy", default="fcfs", help="fcfs, priority")
    s.add_argument("--cache-aware-scheduling", default="off", help="off, on (SGLang-style longest prefix first)")
    s.add_argument("--max-num-batched-tokens", type=int, default=2048)
    s.add_argument("--no-prefix-caching", action="store_true")
    s.add_argument("--data-parallel-size", default="1", help="replicas, each with the KV budget above")
    s.add_argument("--data-parallel-routing", default="cache_aware", help=", ".join(sorted(POLICIES)))
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON ('-': print JSON instead of the table)")
    p.add_argument("--progress", action="store_true",
                   help="a line on stderr per configuration of the sweep (on by default at a terminal)")


def _progress(done: int, total: int, c: SimConfig) -> None:
    """One stderr line per configuration of a sweep: what ran and how far along the sweep is."""
    mem = fmt_bytes(c.kv_cache_memory) if c.kv_cache_memory is not None else f"{c.num_blocks} blocks"
    print(f"kvserve simulate: {done}/{total} done (block {c.block_size}, {mem}, {c.kv_cache_dtype}, "
          f"{c.max_num_seqs} seqs, {c.scheduling_policy})", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    try:
        if args.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1 (got {args.max_num_batched_tokens})")
        if not args.trace and args.num_requests < 1:
            raise ConfigError(f"--num-requests must be >= 1 (got {args.num_requests})")
        if args.step_overhead_ms < 0:
            raise ConfigError(f"--step-overhead-ms must be >= 0 (got {args.step_overhead_ms})")
        if args.max_model_len is not None and args.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1 (got {args.max_model_len})")
        check_writable(args.json, "--json")
        report = run_sweep(args, progress=_progress if sys.stderr.isatty() or args.progress else None)
    except ConfigError as e:
        print(f"kvserve simulate: error: {e}", file=sys.stderr)
        return 2
    doc = {**asdict(report), "results": [x.to_dict() for x in report.results]}
    if args.json == "-":
        print(json.dumps(doc, indent=2))
    else:
        print(format_report(report))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(doc, f, indent=2)
    return 1 if all(x.error for x in report.results) else 0

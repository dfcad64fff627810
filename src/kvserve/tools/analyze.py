"""`kvserve analyze LOGFILE`: request-length percentiles, a --max-model-len recommendation, prefix reuse.

Input: JSON Lines, one finished request per line. Accepted fields:
  prompt_tokens      int (a count) or list of token ids                       (required)
  output_tokens | completion_tokens   int or list of token ids               (optional)
  usage: {prompt_tokens, completion_tokens}   OpenAI-style, if the above are absent
  prompt_token_ids   list of token ids (kvserve's request log)               (optional)
  cached_tokens      prompt tokens the server served from its prefix cache    (optional)

kvserve's own request log (`kvserve serve --request-log FILE`) is that format; one record per
finished request, written by kvserve.core.request_log:
  time            float   unix seconds when the request finished
  request_id      str
  prompt_tokens   int     prompt length in tokens
  output_tokens   int     generated tokens
  cached_tokens   int     prompt tokens served from the prefix cache (0 with prefix caching off)
  cache_write_tokens int  prompt tokens the request wrote to the prefix cache (full blocks it added)
  cache_retention {"priority": int, "ttl_s": float | null}   its effective cache_retention
  prompt_token_ids list[int], optional (present when the server logs token ids; enables prefix analysis)
  ttft            float | null   seconds from arrival to first token (null if none was produced)
  e2e             float   seconds from arrival to finish
  finish_reason   "stop" | "length" | "abort" | null
  abort_reason    "client" | "shutdown" | "error", on aborted requests only
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from fractions import Fraction

from kvserve.config import ConfigError, check_block_size
from kvserve.tools.plan import KVPlan, add_model_arguments, fmt_bytes, memory_budget, normalize_dtype, plan_kv
from kvserve.tools.presets import resolve_model
from kvserve.tools.workload import request_log_lines


@dataclass
class LogRecord:
    prompt_len: int
    output_len: int | None
    prompt_token_ids: list[int] | None
    cached_tokens: int | None


def _count(value, name: str) -> tuple[int, list[int] | None]:
    if isinstance(value, list):
        return len(value), value
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value, None
    raise ValueError(f"{name} must be a non-negative int or a list of token ids (got {type(value).__name__})")


def parse_record(obj) -> LogRecord:
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    usage = obj.get("usage") if isinstance(obj.get("usage"), dict) else {}
    prompt = obj.get("prompt_tokens", usage.get("prompt_tokens"))
    if prompt is None:
        raise ValueError("no prompt_tokens field")
    prompt_len, ids = _count(prompt, "prompt_tokens")
    if isinstance(obj.get("prompt_token_ids"), list):
        ids = obj["prompt_token_ids"]
    output = next((obj[k] for k in ("output_tokens", "completion_tokens") if obj.get(k) is not None),
                  usage.get("completion_tokens"))
    output_len = None if output is None else _count(output, "output_tokens")[0]
    cached = obj.get("cached_tokens")
    return LogRecord(prompt_len, output_len, ids, cached if isinstance(cached, int) else None)


@dataclass
class RequestLog:
    records: list[LogRecord]
    skipped_lines: int = 0
    first_skip: str | None = None  # "line N: why", for the warning


def read_request_log(path: str) -> RequestLog:
    log = RequestLog(records=[])
    for lineno, line in request_log_lines(path, "LOGFILE"):
        try:
            log.records.append(parse_record(json.loads(line)))
        except (ValueError, json.JSONDecodeError) as e:  # a torn last line or a foreign record
            log.skipped_lines += 1
            log.first_skip = log.first_skip or f"line {lineno}: {e}"
    if not log.records:
        why = f" ({log.skipped_lines} lines skipped; first: {log.first_skip})" if log.skipped_lines else ""
        raise ConfigError(f"LOGFILE {path}: no usable request records{why}; each line must be a JSON object "
                          "with prompt_tokens (int or token-id list)")
    return log


@dataclass
class LengthStats:
    count: int
    mean: float
    p50: int
    p95: int
    p99: int
    max: int


def percentile(sorted_values: list[int], q: float) -> int:
    """Nearest-rank percentile: the smallest value with at least q% of the data at or below it."""
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def length_stats(values: list[int]) -> LengthStats:
    s = sorted(values)
    return LengthStats(len(s), sum(s) / len(s), percentile(s, 50), percentile(s, 95), percentile(s, 99), s[-1])


@dataclass
class PrefixReuse:
    requests: int          # requests with token ids
    prompt_tokens: int
    hit_tokens: int
    requests_with_hits: int

    @property
    def ratio(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def simulate_prefix_cache(prompts: list[list[int]], block_size: int) -> PrefixReuse:
    """Hits of a block-aligned, never-evicting prefix cache replayed in log order.

    A trie of full blocks keyed by (parent node, block tokens), like the chain hashes of vLLM's
    APC. As in the engines, the last prompt token is always recomputed, so a lookup covers at most
    len(prompt) - 1 tokens.
    """
    children: dict[tuple[int, tuple[int, ...]], int] = {}
    reuse = PrefixReuse(requests=len(prompts), prompt_tokens=0, hit_tokens=0, requests_with_hits=0)
    for ids in prompts:
        reuse.prompt_tokens += len(ids)
        node, hits, lookup_blocks = 0, 0, max(0, len(ids) - 1) // block_size
        for i in range(len(ids) // block_size):
            key = (node, tuple(ids[i * block_size:(i + 1) * block_size]))
            child = children.get(key)
            if child is None:
                child = children[key] = len(children) + 1  # every later block of this prompt is new too
            elif i < lookup_blocks:
                hits += block_size
            node = child
        reuse.hit_tokens += hits
        reuse.requests_with_hits += hits > 0
    return reuse


@dataclass
class ConcurrencyGain:
    model: str
    kv_cache_memory: int
    budget_source: str        # kv-cache-memory | gpu-memory | default
    kv_cache_dtype: str
    recommended: KVPlan       # at the recommended max-model-len, with the log's mean length
    baseline: KVPlan          # at --max-model-len, or the model's max_position_embeddings
    gain: float               # recommended / baseline max concurrency


@dataclass
class AnalyzeReport:
    logfile: str
    num_requests: int
    skipped_lines: int
    prompt: LengthStats
    output: LengthStats | None
    total: LengthStats
    block_size: int
    headroom: float
    recommended_max_model_len: int
    prefix_reuse: PrefixReuse | None
    shared_prefix_ratio: float | None
    observed_cached_ratio: float | None  # from cached_tokens, when the server logged it
    concurrency: ConcurrencyGain | None
    warnings: list[str] = field(default_factory=list)


def recommend_max_model_len(p99_total: int, block_size: int, headroom: float = 0.2) -> int:
    """P99 total x (1 + headroom), rounded up to a whole block (exact rational arithmetic)."""
    target = math.ceil(p99_total * (1 + Fraction(str(headroom))))
    return max(block_size, -(-target // block_size) * block_size)


def analyze(log: RequestLog, args: argparse.Namespace) -> AnalyzeReport:
    recs = log.records
    outputs = [r.output_len for r in recs if r.output_len is not None]
    totals = [r.prompt_len + (r.output_len or 0) for r in recs]
    total = length_stats(totals)
    rec_len = recommend_max_model_len(total.p99, args.block_size, args.headroom)
    warnings = [f"{log.skipped_lines} line(s) skipped (first: {log.first_skip})"] if log.skipped_lines else []
    if len(outputs) < len(recs):
        warnings.append(f"{len(recs) - len(outputs)} of {len(recs)} records have no output_tokens; their totals "
                        "count the prompt only, so the recommendation is a lower bound")
    with_ids = [r.prompt_token_ids for r in recs if r.prompt_token_ids is not None]
    reuse = simulate_prefix_cache(with_ids, args.block_size) if with_ids else None
    cached = [r for r in recs if r.cached_tokens is not None]
    observed = (sum(r.cached_tokens for r in cached) / max(1, sum(r.prompt_len for r in cached))) if cached else None
    report = AnalyzeReport(
        logfile=args.logfile, num_requests=len(recs), skipped_lines=log.skipped_lines,
        prompt=length_stats([r.prompt_len for r in recs]), output=length_stats(outputs) if outputs else None,
        total=total, block_size=args.block_size, headroom=args.headroom, recommended_max_model_len=rec_len,
        prefix_reuse=reuse, shared_prefix_ratio=reuse.ratio if reuse else None,
        observed_cached_ratio=observed, concurrency=None, warnings=warnings)
    if not args.no_plan:
        report.concurrency = _concurrency_gain(args, rec_len, round(total.mean), report)
    return report


def _concurrency_gain(args, rec_len: int, mean_len: int, report: AnalyzeReport) -> ConcurrencyGain:
    spec = resolve_model(args.model or "SmolLM2-135M")
    cfg, dtype = spec.config, normalize_dtype(spec.dtype if args.dtype == "auto" else args.dtype)
    budget = memory_budget(args, spec)
    base_len = args.max_model_len or cfg.max_position_embeddings
    if rec_len > cfg.max_position_embeddings:
        report.warnings.append(f"the recommended --max-model-len {rec_len} exceeds {cfg.name}'s "
                               f"max_position_embeddings ({cfg.max_position_embeddings}); requests that long "
                               "need a model with a longer context")
    kw = dict(tensor_parallel_size=args.tensor_parallel_size, mean_context_len=max(1, mean_len))
    rec = plan_kv(cfg, budget.kv_cache_memory, args.block_size, args.kv_cache_dtype, dtype, rec_len, **kw)
    base = plan_kv(cfg, budget.kv_cache_memory, args.block_size, args.kv_cache_dtype, dtype, base_len, **kw)
    if not rec.fits:
        report.warnings.append(f"the recommended --max-model-len {rec_len} does not fit in the KV budget; the "
                               f"largest length that fits is {rec.max_fitting_len}")
    if rec.max_concurrency_at_mean and rec.max_concurrency_at_mean > args.max_num_seqs:
        report.warnings.append(f"at the log's mean length the cache holds {rec.max_concurrency_at_mean:,.0f} requests, "
                               f"more than --max-num-seqs {args.max_num_seqs}: the scheduler, not KV, is the limit")
    return ConcurrencyGain(cfg.name, budget.kv_cache_memory, budget.source, args.kv_cache_dtype, rec, base,
                           rec.max_concurrency / base.max_concurrency if base.max_concurrency else math.inf)


def format_report(r: AnalyzeReport) -> str:
    lines = [f"kvserve analyze: {r.logfile}: {r.num_requests:,} requests"
             + (f" ({r.skipped_lines} line(s) skipped)" if r.skipped_lines else ""), "",
             f"  {'tokens':<8}{'mean':>10}{'p50':>9}{'p95':>9}{'p99':>9}{'max':>9}"]
    for name, s in (("prompt", r.prompt), ("output", r.output), ("total", r.total)):
        if s is not None:
            lines.append(f"  {name:<8}{s.mean:>10,.1f}{s.p50:>9,}{s.p95:>9,}{s.p99:>9,}{s.max:>9,}")
    lines += ["", f"Recommended --max-model-len {r.recommended_max_model_len:,}  "
              f"(P99 total {r.total.p99:,} + {r.headroom:.0%}, rounded up to block size {r.block_size})"]
    if r.prefix_reuse is not None:
        p = r.prefix_reuse
        lines.append(f"Shared-prefix ratio {p.ratio:.1%}: {p.hit_tokens:,} of {p.prompt_tokens:,} prompt tokens would "
                     f"hit a block-aligned prefix cache ({p.requests_with_hits:,} of {p.requests:,} requests hit)")
    else:
        lines.append("Shared-prefix ratio: n/a (the log has no token ids; log prompt_token_ids to measure it)")
    if r.observed_cached_ratio is not None:
        lines.append(f"Observed prefix-cache hits (cached_tokens in the log): {r.observed_cached_ratio:.1%} of prompt tokens")
    if r.concurrency is not None:
        c, rec, base = r.concurrency, r.concurrency.recommended, r.concurrency.baseline
        default = " (default; set --model and --gpu-memory or --kv-cache-memory)" if c.budget_source == "default" else ""
        lines += ["", f"Concurrency on {c.model}, {fmt_bytes(c.kv_cache_memory)} of KV per GPU{default}, "
                  f"kv-cache-dtype {c.kv_cache_dtype} ({rec.bytes_per_token:,.0f} bytes/token):",
                  f"  --max-model-len {base.max_model_len:>7,}: {base.max_concurrency:8,.1f} requests at full length",
                  f"  --max-model-len {rec.max_model_len:>7,}: {rec.max_concurrency:8,.1f} requests at full length "
                  f"({c.gain:.1f}x)",
                  f"  at the log's mean length {rec.mean_context_len:,}: {rec.max_concurrency_at_mean:,.1f} requests"]
    lines += [""] + [f"WARNING: {w}" for w in r.warnings]
    return "\n".join(lines).rstrip()


def report_dict(r: AnalyzeReport) -> dict:
    d = asdict(r)
    if r.prefix_reuse is not None:
        d["prefix_reuse"]["ratio"] = r.prefix_reuse.ratio
    return d


def add_parser(subparsers) -> None:
    p = subparsers.add_parser("analyze", help="request-length percentiles and a --max-model-len recommendation",
                              description="Analyze a JSONL request log (kvserve --request-log, or any log with "
                                          "prompt_tokens per line).")
    p.add_argument("logfile", metavar="LOGFILE", help="JSON Lines request log ('-' for stdin)")
    add_model_arguments(p)
    p.add_argument("--max-model-len", type=int, default=None,
                   help="current setting to compare against (default: the model's max_position_embeddings)")
    p.add_argument("--headroom", type=float, default=0.2, help="added to P99 total length (default 0.2 = 20%%)")
    p.add_argument("--no-plan", action="store_true", help="skip the concurrency estimate")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        check_block_size(args.block_size)
        if args.max_model_len is not None and args.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1 (got {args.max_model_len})")
        if args.headroom < 0:
            raise ConfigError(f"--headroom must be >= 0 (got {args.headroom})")
        report = analyze(read_request_log(args.logfile), args)
    except ConfigError as e:
        print(f"kvserve analyze: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report_dict(report), indent=2) if args.json else format_report(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_parser(parser.add_subparsers())
    return run(parser.parse_args(["analyze", *(sys.argv[1:] if argv is None else argv)]))


if __name__ == "__main__":
    raise SystemExit(main())

"""Synthetic workloads and request-log traces, shared by `kvserve bench serve` and `kvserve simulate`.

A workload is a list of conversations. Each conversation has one or more turns; turn k's prompt is
turn k-1's prompt + its answer + the turn's new user tokens (the multi-turn chat layout whose KV a
prefix cache can reuse). Prompts are token ids so that lengths are exact and the same trace means
the same thing to a server, the simulator and the real engine.
"""
from __future__ import annotations

import itertools
import json
import math
import random
import sys
from dataclasses import dataclass, field
from typing import Iterator

from kvserve.config import ConfigError
from kvserve.core.cache_retention import DEFAULT as DEFAULT_RETENTION
from kvserve.core.cache_retention import CacheRetentionError, parse_cache_retention

# Token ids drawn for synthetic prompts: above the special tokens of common vocabularies (SmolLM2's
# are < 17, Llama-3's sit at 128000+), below every supported vocab size.
DEFAULT_TOKEN_RANGE = (1000, 30000)


@dataclass(frozen=True)
class LengthDist:
    """Token-length distribution: fixed N, uniform LO:HI (inclusive), or normal MEAN,STD (clipped >= 1)."""
    kind: str  # fixed | uniform | normal
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str, flag: str) -> "LengthDist":
        s = str(text).strip()
        try:
            if s.startswith("normal:"):
                mean, std = (float(x) for x in s[len("normal:"):].split(","))
                if mean < 1 or std < 0:
                    raise ValueError
                return cls("normal", mean, std)
            if ":" in s:
                lo, hi = (int(x) for x in s.split(":"))
                if not 1 <= lo <= hi:
                    raise ValueError
                return cls("uniform", lo, hi)
            n = int(s)
            if n < 1:
                raise ValueError
            return cls("fixed", n)
        except ValueError:
            raise ConfigError(f"{flag} {text!r}: write N (fixed), LO:HI (uniform, 1 <= LO <= HI) or "
                              "normal:MEAN,STD (MEAN >= 1, STD >= 0)") from None

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))

    @property
    def max(self) -> int:
        """Upper bound used for sizing checks (normal: mean + 4 std)."""
        return int(self.a if self.kind == "fixed" else self.b if self.kind == "uniform" else self.a + 4 * self.b)

    def __str__(self) -> str:
        return {"fixed": f"{int(self.a)}", "uniform": f"{int(self.a)}:{int(self.b)}",
                "normal": f"normal:{self.a:g},{self.b:g}"}[self.kind]


@dataclass
class WorkloadSpec:
    num_conversations: int
    prompt_len: LengthDist          # new user tokens per turn (turn 0: the whole prompt after any shared prefix)
    output_len: LengthDist
    shared_prefix_fraction: float = 0.0  # conversations whose first prompt starts with the shared prefix
    prefix_len: int = 0
    num_turns: int = 1
    request_rate: float | None = None  # conversations per second (Poisson); None: all arrive at t=0
    priority_levels: int = 1           # priorities drawn uniformly from [0, priority_levels)
    seed: int = 0
    token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE

    def validate(self) -> None:
        if self.num_conversations < 1:
            raise ConfigError(f"need at least one request (got {self.num_conversations})")
        if not 0.0 <= self.shared_prefix_fraction <= 1.0:
            raise ConfigError(f"--shared-prefix-fraction must be in [0, 1] (got {self.shared_prefix_fraction})")
        if self.prefix_len < 0:
            raise ConfigError(f"--prefix-len must be >= 0 (got {self.prefix_len})")
        if self.shared_prefix_fraction > 0 and self.prefix_len == 0:
            raise ConfigError("--shared-prefix-fraction needs --prefix-len > 0 (the shared prefix's length in tokens)")
        if self.num_turns < 1:
            raise ConfigError(f"--multi-turn must be >= 1 (got {self.num_turns})")
        if self.request_rate is not None and not self.request_rate > 0:
            raise ConfigError(f"--request-rate must be > 0 requests/s (got {self.request_rate}); "
                              "leave it out for all requests at once")
        if self.priority_levels < 1:
            raise ConfigError(f"--priority-levels must be >= 1 (got {self.priority_levels})")
        lo, hi = self.token_range
        if not 0 <= lo < hi:
            raise ConfigError(f"token id range {lo}:{hi} is empty; need 0 <= LO < HI")


@dataclass
class Turn:
    user_token_ids: list[int]  # tokens this turn adds after the previous prompt and answer
    output_len: int


@dataclass
class Conversation:
    conversation_id: str
    arrival_time: float  # seconds from the start; later turns follow the previous answer at once
    turns: list[Turn]
    priority: int = 0
    # Its requests' cache_retention ({"priority": 0..100, "ttl_s": N}); None: the default
    cache_retention: dict | None = None
    # Recorded answers (from a log), one per turn; None: whatever the server/runner generates.
    output_token_ids: list[list[int]] | None = None

    @property
    def first_prompt(self) -> list[int]:
        return self.turns[0].user_token_ids


@dataclass
class Trace:
    conversations: list[Conversation]
    source: str                     # "synthetic: ..." or the log path
    notes: list[str] = field(default_factory=list)

    @property
    def num_requests(self) -> int:
        return sum(len(c.turns) for c in self.conversations)

    def max_total_len(self) -> int:
        """Longest context of any turn: all previous prompts + answers + this turn + its output."""
        longest = 0
        for c in self.conversations:
            total = 0
            for t in c.turns:
                total += len(t.user_token_ids) + t.output_len
                longest = max(longest, total)
        return longest


def _tokens(rng: random.Random, n: int, token_range: tuple[int, int]) -> list[int]:
    lo, hi = token_range
    return [rng.randrange(lo, hi) for _ in range(n)]


def is_shared(i: int, fraction: float) -> bool:
    """Conversation i starts with the shared prefix: spread evenly, so that every run of n
    conversations carries round(fraction * n) of them (+-1), not a binomial draw."""
    return math.floor((i + 1) * fraction + 1e-9) > math.floor(i * fraction + 1e-9)


def iter_conversations(spec: WorkloadSpec, rng: random.Random | None = None) -> Iterator[Conversation]:
    """An endless stream of conversations (bench --duration draws as many as it needs)."""
    spec.validate()
    rng = rng or random.Random(spec.seed)
    prefix = _tokens(rng, spec.prefix_len, spec.token_range)
    t = 0.0
    for i in itertools.count():
        turns = []
        for k in range(spec.num_turns):
            user = _tokens(rng, spec.prompt_len.sample(rng), spec.token_range)
            if k == 0 and is_shared(i, spec.shared_prefix_fraction):
                user = prefix + user
            turns.append(Turn(user, spec.output_len.sample(rng)))
        priority = rng.randrange(spec.priority_levels) if spec.priority_levels > 1 else 0
        yield Conversation(f"conv-{i}", t, turns, priority)
        if spec.request_rate is not None:
            t += rng.expovariate(spec.request_rate)


def describe(spec: WorkloadSpec) -> str:
    return (f"synthetic: {spec.num_turns} turn(s) per conversation, prompt {spec.prompt_len}, output "
            f"{spec.output_len}, shared prefix {spec.prefix_len} tokens on {spec.shared_prefix_fraction:.0%}, "
            f"{'all at t=0' if spec.request_rate is None else f'Poisson {spec.request_rate:g}/s'}, seed {spec.seed}")


def synthetic_trace(spec: WorkloadSpec) -> Trace:
    convs = list(itertools.islice(iter_conversations(spec), spec.num_conversations))
    return Trace(convs, f"{describe(spec)}, {spec.num_conversations} conversations")


def request_log_lines(path: str, what: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of the non-blank lines of a JSONL request log (`-`: stdin); `what`
    names it in errors (LOGFILE, --trace)."""
    try:
        f = sys.stdin if path == "-" else open(path, encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{what} {path}: cannot open it ({e.strerror})") from None
    with f:
        try:
            for lineno, line in enumerate(f, 1):
                if line.strip():
                    yield lineno, line
        except UnicodeDecodeError:
            raise ConfigError(f"{what} {path} is not UTF-8 text; give a JSONL request log "
                              "(kvserve serve --request-log writes one)") from None


def _logged_retention(value) -> dict | None:
    """A logged cache_retention; None (the default) when absent (a log from before the field) or
    the default. Raises CacheRetentionError for a malformed one."""
    retention = parse_cache_retention(value)
    return None if retention is None or retention == DEFAULT_RETENTION else retention.as_dict()


def trace_from_request_log(path: str, *, shared_prefix_fraction: float = 0.0, prefix_len: int = 0,
                           seed: int = 0, token_range: tuple[int, int] = DEFAULT_TOKEN_RANGE,
                           default_output_len: int = 128) -> Trace:
    """kvserve's request log (see kvserve.tools.analyze) -> a single-turn trace.

    Each request replays with its logged `cache_retention` (the effective one, a tenant's default
    applied). Arrival = finish `time` - `e2e` when both are logged (else all at t=0), in log order. Records
    with prompt_token_ids replay those exact tokens; the others get random tokens of the logged
    length, the first min(prefix_len, len - 1) of them taken from one shared prefix on a
    `shared_prefix_fraction` of the records (a model of prefix reuse the log did not record).
    """
    rng = random.Random(seed)
    prefix = _tokens(rng, prefix_len, token_range)
    rows, skipped = [], 0
    for _, line in request_log_lines(path, "--trace"):
        try:
            obj = json.loads(line)
            prompt = obj["prompt_tokens"]
            n = len(prompt) if isinstance(prompt, list) else int(prompt)
            if n < 1:
                raise ValueError
            rows.append(obj)
        except (ValueError, KeyError, TypeError, json.JSONDecodeError):
            skipped += 1
    if not rows:
        raise ConfigError(f"--trace {path}: no usable request records ({skipped} skipped); each line must be a "
                          "JSON object with prompt_tokens (kvserve serve --request-log writes them)")
    starts = [r["time"] - r["e2e"] if isinstance(r.get("time"), (int, float)) and isinstance(r.get("e2e"), (int, float))
              else None for r in rows]
    timed = None not in starts
    t0 = min(starts) if timed else 0.0
    convs, synthesized, bad_retention = [], 0, 0
    for i, r in enumerate(rows):
        ids = r.get("prompt_token_ids")
        if not isinstance(ids, list) and isinstance(r["prompt_tokens"], list):
            ids = r["prompt_tokens"]
        if not isinstance(ids, list):
            n = int(r["prompt_tokens"])
            share = prefix_len and rng.random() < shared_prefix_fraction
            head = prefix[:min(prefix_len, n - 1)] if share else []
            ids = head + _tokens(rng, n - len(head), token_range)
            synthesized += 1
        out = r.get("output_tokens", r.get("completion_tokens"))
        out_len = len(out) if isinstance(out, list) else int(out) if isinstance(out, int) and out > 0 else default_output_len
        arrival = (starts[i] - t0) if timed else 0.0
        try:
            retention = _logged_retention(r.get("cache_retention"))
        except CacheRetentionError:
            retention, bad_retention = None, bad_retention + 1
        convs.append(Conversation(str(r.get("request_id", f"req-{i}")) + f"@{i}", arrival, [Turn(list(ids), out_len)],
                                  cache_retention=retention))
    convs.sort(key=lambda c: c.arrival_time)  # stable: log order among equal arrivals
    notes = [f"{skipped} line(s) skipped"] if skipped else []
    if synthesized:
        notes.append(f"{synthesized} of {len(rows)} records have no prompt_token_ids: tokens synthesized from their "
                     f"lengths (shared prefix {prefix_len} tokens on ~{shared_prefix_fraction:.0%} of them)")
    if not timed:
        notes.append("the log has no time/e2e for every record: all requests arrive at t=0")
    if bad_retention:
        notes.append(f"{bad_retention} record(s) with a malformed cache_retention replayed with the default")
    return Trace(convs, path, notes)


def load_pins(path: str) -> tuple[list[list[int]], list[str]]:
    """The prefixes a server had pinned, from its `pins.json` (the --kv-disk-path directory records
    its pins there) or a JSON list of token-id lists; with notes on what the simulator does not
    model (a pin's tenant salt or adapter: it replays as a plain prefix)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
    except OSError as e:
        raise ConfigError(f"--pins {path}: cannot open it ({e.strerror})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"--pins {path} is not JSON ({e}); give a server's pins.json or a list of "
                          f"token-id lists") from None
    items = doc.get("pins") if isinstance(doc, dict) else doc
    if not isinstance(items, list):
        raise ConfigError(f"--pins {path}: expected a server's pins.json ({{\"pins\": [...]}}) or a list of "
                          f"token-id lists")
    pins, notes, scoped = [], [], 0
    for i, item in enumerate(items):
        ids = item.get("prompt_token_ids") if isinstance(item, dict) else item
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise ConfigError(f"--pins {path}: pin {i} has no prompt_token_ids (a non-empty list of token ids)")
        if isinstance(item, dict) and (item.get("cache_salt") or item.get("lora")):
            scoped += 1
        pins.append(ids)
    if scoped:
        notes.append(f"{scoped} of the {len(pins)} pins belong to a tenant (cache_salt) or an adapter; the "
                     f"simulator models neither, so they replay as plain prefixes every request can hit")
    return pins, notes

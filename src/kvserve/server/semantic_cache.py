"""The semantic response cache in front of chat completions: which requests may use it, the key
they are looked up under, the response a hit returns (streamed or not), its metrics and routes.

The embedder runs on its own thread, never in the engine's step loop or on the event loop."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from prometheus_client import Counter, Gauge, Histogram

from kvserve.semantic_cache import CacheKey, SemanticCache
from kvserve.semantic_cache.base import StoreUnavailable
from kvserve.server import protocol as P
from kvserve.server.protocol import APIError
from kvserve.server.sse import chat_chunk, sse_event

logger = logging.getLogger("kvserve.server")

HEADER = "x-kvserve-semantic-cache"
# Fields of SamplingParams that change nothing in the answer's text
_NOT_SAMPLING = {"output_kind", "kv_transfer_params"}


@dataclass
class SemanticCacheConfig:
    path: str | None  # SQLite file (its index beside it), a Redis URL (shared by servers); None: in memory
    threshold: float = 0.9
    ttl: float = 3600.0
    max_entries: int = 100_000
    max_bytes: int = 1 << 30


@dataclass
class Plan:
    """A request that consults the cache: its key, question, and what to store after a miss."""
    key: CacheKey
    tenant: str | None
    query: str
    threshold: float | None
    ttl: float | None
    embedding: object = None
    started: float = 0.0


@dataclass
class Headed:
    """A response body (dict, or async iterator of SSE events) with headers to send with it."""
    body: object
    headers: dict


def check_request(req: P.ChatCompletionRequest, enabled: bool) -> None:
    """400s naming the field for the per-request settings; also when the server has no cache."""
    asked = req.semantic_cache is True or req.semantic_cache_threshold is not None or req.semantic_cache_ttl is not None
    if not enabled and asked:
        field = "semantic_cache" if req.semantic_cache is True else (
            "semantic_cache_threshold" if req.semantic_cache_threshold is not None else "semantic_cache_ttl")
        raise APIError(f"{field}: this server has no semantic cache; start it with --semantic-cache, or drop "
                       f"{field}", param=field)
    t = req.semantic_cache_threshold
    if t is not None and not 0 < t <= 1:
        raise APIError(f"semantic_cache_threshold must be in (0, 1] (a cosine similarity), got {t}",
                       param="semantic_cache_threshold")
    if req.semantic_cache_ttl is not None and req.semantic_cache_ttl <= 0:
        raise APIError(f"semantic_cache_ttl must be a positive number of seconds, got {req.semantic_cache_ttl}",
                       param="semantic_cache_ttl")


@contextlib.contextmanager
def _unavailable_503():
    try:
        yield
    except StoreUnavailable as e:
        raise APIError(f"the semantic cache's store is unreachable ({e}); retry when it is back", status=503,
                       type="ServiceUnavailableError", code="semantic_cache_unavailable") from None


def _text(content) -> str | None:
    """A message's text, or None when it holds something other than text (not cacheable by meaning)."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for part in content:
        d = part if isinstance(part, dict) else part.model_dump()
        if d.get("type") != "text":
            return None
        parts.append(d.get("text") or "")
    return "\n".join(parts)


class SemanticFront:
    def __init__(self, config: SemanticCacheConfig, registry, embedder=None):
        if embedder is None:
            from kvserve.semantic_cache.embedder import MiniLMEmbedder
            embedder = MiniLMEmbedder()
        self.embedder = embedder
        self.cache = SemanticCache(config.path, embedder.dim, config.threshold, config.ttl, config.max_entries,
                                   config.max_bytes)
        # one thread: embeddings run one at a time beside the engine, never inside its step
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-embed")
        self.hits = Counter("kvserve:semantic_cache_hits", "Requests answered from the semantic cache.",
                            registry=registry)
        self.misses = Counter("kvserve:semantic_cache_misses", "Requests that looked in the semantic cache "
                              "and were generated.", registry=registry)
        self.bypasses = Counter("kvserve:semantic_cache_bypasses", "Requests that did not use the semantic "
                                "cache (sampling, opt-out, logprobs, n > 1, non-text content).", registry=registry)
        self.saved = Counter("kvserve:semantic_cache_time_saved_seconds", "Generation time the hits' cached "
                             "responses took when they were computed.", registry=registry)
        self.similarity = Histogram("kvserve:semantic_cache_similarity", "Cosine similarity of the nearest "
                                    "cached question, per lookup that found one.", registry=registry,
                                    buckets=(0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 0.925, 0.95, 0.975, 0.99, 1.0))
        self.entries = Gauge("kvserve:semantic_cache_entries", "Entries in the semantic cache.", registry=registry)
        self.bytes = Gauge("kvserve:semantic_cache_bytes", "Bytes of questions, responses and embeddings in "
                           "the semantic cache.", registry=registry)
        self.errors = Counter("kvserve:semantic_cache_errors", "Lookups and stores the semantic cache's store "
                              "failed (Redis down): the request was generated.", registry=registry)
        self._update_size()

    def _update_size(self) -> None:
        try:
            entries, nbytes = self.cache.totals()
        except StoreUnavailable:  # Redis down: the gauges keep their last figures
            return
        self.entries.set(entries)
        self.bytes.set(nbytes)

    def _failed(self, what: str, e: Exception) -> None:
        """A store that failed costs the request a generation (or a later hit), never an error."""
        self.errors.inc()
        if isinstance(e, StoreUnavailable):  # the store logs each outage once
            logger.debug("semantic cache: %s failed: %s", what, e)
        else:
            logger.exception("semantic cache: %s failed", what)

    def plan(self, req: P.ChatCompletionRequest, salt: str | None, tenant: str | None, model: str,
             params) -> Plan | None:
        """The lookup a request makes, or None (a bypass, counted)."""
        last = max((i for i, m in enumerate(req.messages) if m.role == "user"), default=None)
        query = None if last is None or last != len(req.messages) - 1 else _text(req.messages[last].content)
        sampling = params.temperature != 0 and req.semantic_cache is not True  # sampling only on opt-in
        if (req.semantic_cache is False or sampling or query is None or not query.strip() or params.n != 1
                or params.logprobs is not None or params.prompt_logprobs is not None or req.kv_transfer_params):
            self.bypasses.inc()
            return None
        history = [m.model_dump(exclude_none=True) for m in req.messages[:last]]
        settings = {k: v for k, v in dataclasses.asdict(params).items() if k not in _NOT_SAMPLING}
        settings["template"] = [req.add_generation_prompt, req.continue_final_message, req.chat_template_kwargs,
                                req.response_format.type if req.response_format else None]
        return Plan(CacheKey(model, salt, history, settings), tenant, query, req.semantic_cache_threshold,
                    req.semantic_cache_ttl, started=time.monotonic())

    async def lookup(self, plan: Plan):
        loop = asyncio.get_running_loop()
        plan.embedding = (await loop.run_in_executor(self._pool, self.embedder, [plan.query]))[0]
        try:
            hit = await loop.run_in_executor(self._pool, self.cache.lookup, plan.key, plan.embedding, plan.threshold)
        except Exception as e:
            self._failed("a lookup", e)
            hit = None
        if hit is None:
            self.misses.inc()
        else:
            self.hits.inc()
            self.saved.inc(hit.seconds)
            self.similarity.observe(hit.similarity)
        return hit

    def store(self, plan: Plan, content: str, finish_reason: str | None, stop_reason) -> None:
        """After a miss that finished: the answer, for the next question that means the same."""
        if finish_reason not in ("stop", "length"):
            return
        response = {"content": content, "finish_reason": finish_reason, "stop_reason": stop_reason}
        seconds = time.monotonic() - plan.started

        def insert():
            try:
                self.cache.insert(plan.key, plan.tenant, plan.query, plan.embedding, response, plan.ttl, seconds)
                self._update_size()
            except Exception as e:  # the answer was sent; a failed store costs a later hit, not this request
                self._failed("storing an entry", e)
        self._pool.submit(insert)

    def hit_response(self, req: P.ChatCompletionRequest, hit, model: str, role: str, prompt_tokens: int) -> Headed:
        headers = {HEADER: f"hit; similarity={hit.similarity:.3f}"}
        r = hit.response
        usage = P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=0, total_tokens=prompt_tokens,
                            semantic_cache={"hit": True, "similarity": round(hit.similarity, 4),
                                            "cached_question": hit.query})
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if not req.stream:
            choice = P.ChatChoice(index=0, message=P.AssistantMessage(role=role, content=r["content"]),
                                  finish_reason=r["finish_reason"], stop_reason=r["stop_reason"])
            return Headed(P.ChatCompletionResponse(id=rid, model=model, choices=[choice], usage=usage).model_dump(),
                          headers)
        return Headed(self._stream(req, r, rid, created, model, role, usage), headers)

    @staticmethod
    async def _stream(req, r, rid, created, model, role, usage):
        """The cached answer as a generated one streams: role, the text word by word, the finish."""
        def chunk(delta, finish=None):
            return sse_event(chat_chunk(P.ChatCompletionChunk(id=rid, created=created, model=model, choices=[
                P.ChatStreamChoice(index=0, delta=delta, finish_reason=finish,
                                   stop_reason=r["stop_reason"] if finish else None)])))
        yield chunk(P.DeltaMessage(role=role, content=""))
        words = r["content"].split(" ")
        for i, word in enumerate(words):
            yield chunk(P.DeltaMessage(content=word if i == len(words) - 1 else word + " "))
        yield chunk(P.DeltaMessage(), r["finish_reason"])
        if req.stream_options and req.stream_options.include_usage:
            yield sse_event(P.ChatCompletionChunk(id=rid, created=created, model=model, choices=[],
                                                  usage=usage).model_dump())
        yield "data: [DONE]\n\n"

    def size(self, tenant: str | None) -> dict:
        with _unavailable_503():
            size = self.cache.size(tenant)
        return {"object": "semantic_cache", **size, "threshold": self.cache.threshold, "ttl": self.cache.ttl}

    def clear(self, tenant: str | None) -> dict:
        with _unavailable_503():
            removed = self.cache.clear(tenant)
        self._update_size()
        return {"object": "semantic_cache", "deleted": removed}

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.cache.close()

"""Disaggregated prefill/decode in the server: vLLM's `kv_transfer_params` handshake as vllm-router's
--vllm-pd-disaggregation drives it.

The router sends the request to a prefill server first, with `max_tokens` 1 and
`kv_transfer_params: {"do_remote_decode": true, ...}`; that server computes the prompt, its engine
writes the prompt's full KV blocks to the shared Redis tier before the response leaves, and the
response's `kv_transfer_params` say where the KV is (`do_remote_prefill: true`, the producer's
engine fingerprint as `remote_engine_id`, and how many prompt tokens it wrote). The router passes
those, unchanged, in the same request to a decode server, whose prefix lookup reads the blocks
from Redis instead of computing them. A decode server that cannot use them (another model or KV
layout: the fingerprint differs; the entries are gone: producer down, evicted) computes the
prompt itself and counts it: the tokens are the same either way, only slower.
"""
from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from urllib.parse import urlparse

from prometheus_client import Counter

from kvserve.server.protocol import APIError

logger = logging.getLogger("kvserve.server")


@dataclass
class Plan:
    """What one request does in the handshake."""
    role: str  # "producer": prefill and leave the KV; "consumer": decode from it
    expected_tokens: int = 0  # consumer: the prompt tokens the producer says it wrote
    refused: bool = False  # consumer: the producer's KV is of another engine


class KVTransfer:
    def __init__(self, llm, registry) -> None:
        self.config = llm.args.kv_transfer
        self.fingerprint = llm.kv_fingerprint
        self.block_size = llm.args.block_size
        self.tp_size = llm.args.tensor_parallel_size
        url = urlparse(llm.args.kv_redis_url) if llm.args.kv_redis_url else None
        self.host, self.port = (url.hostname, url.port or 6379) if url is not None else (None, None)
        self.requests = Counter("kvserve:kv_transfer_requests", "Disaggregated prefill/decode requests by role and "
                                "outcome: sent (a prefill left its KV), loaded (a decode read all of it), recomputed "
                                "(a decode found less and computed the rest), refused (another engine's KV)",
                                ["role", "outcome"], registry=registry)
        self.tokens = Counter("kvserve:kv_transfer_tokens", "Prompt tokens whose KV a prefill server wrote (sent) "
                              "or a decode server read (loaded)", ["direction"], registry=registry)
        self.recomputed = Counter("kvserve:kv_transfer_recomputed_tokens", "Prompt tokens a decode server "
                                  "computed because the producer's KV was missing or refused", registry=registry)

    def plan(self, req, num_prompts: int) -> Plan | None:
        """Check a request's kv_transfer_params (400 naming what is wrong); None without them."""
        params = req.kv_transfer_params
        if not params:
            return None
        produce, consume = bool(params.get("do_remote_decode")), bool(params.get("do_remote_prefill"))
        if not produce and not consume:
            return None
        if self.config is None:
            raise APIError("kv_transfer_params need a server started with --kv-transfer-config (disaggregated "
                           "prefill/decode); send the request without them", param="kv_transfer_params")
        if produce and consume:
            raise APIError("kv_transfer_params: do_remote_decode and do_remote_prefill are both true; a request is "
                           "either prefilled here for a decode server or decoded here from a prefill server",
                           param="kv_transfer_params")
        if num_prompts != 1 or req.n != 1:
            raise APIError("kv_transfer_params take one prompt and n=1", param="kv_transfer_params")
        if produce:
            if not self.config.is_producer:
                raise APIError(f"this server's --kv-transfer-config kv_role is {self.config.kv_role}: it does not "
                               "prefill for a decode server (do_remote_decode); send it to a kv_producer or kv_both "
                               "server", param="kv_transfer_params")
            if req.stream:
                raise APIError("kv_transfer_params with do_remote_decode: send stream false (the KV's location "
                               "comes back in the response, as vllm-router expects)", param="stream")
            return Plan("producer")
        if not self.config.is_consumer:
            raise APIError(f"this server's --kv-transfer-config kv_role is {self.config.kv_role}: it does not decode "
                           "from a prefill server (do_remote_prefill); send it to a kv_consumer or kv_both server",
                           param="kv_transfer_params")
        expected = params.get("remote_num_tokens", 0)
        if not isinstance(expected, int) or isinstance(expected, bool) or expected < 0:
            raise APIError(f"kv_transfer_params.remote_num_tokens must be an integer >= 0 (got {expected!r})",
                           param="kv_transfer_params.remote_num_tokens")
        remote = params.get("remote_engine_id")
        if remote != self.fingerprint:
            # Under tensor parallelism an entry holds every rank's heads in rank order: only a
            # decode server with the producer's rank count can split it back.
            remote_tp = params.get("tp_size")
            tp = (f" (the prefill server runs --tensor-parallel-size {remote_tp}, this one {self.tp_size})"
                  if isinstance(remote_tp, int) and remote_tp != self.tp_size else "")
            logger.warning("kv transfer: the prefill server's KV (engine %r) is not this engine's (%s): another "
                           "model, dtype, block size or layout%s; computing the prompt here", remote,
                           self.fingerprint, tp)
            return Plan("consumer", expected, refused=True)
        return Plan("consumer", expected)

    @staticmethod
    def sampling(plan: Plan | None, params: list, req) -> list:
        """A producer's SamplingParams carry the handshake to the engine, which writes the KV."""
        if plan is None or plan.role != "producer":
            return params
        return [dataclasses.replace(p, kv_transfer_params=dict(req.kv_transfer_params)) for p in params]

    def finish(self, plan: Plan | None, finals: list) -> dict | None:
        """After the request: count it; a producer's response params (vLLM's keys, NixlConnector's
        shape) for the router to hand to the decode server."""
        if plan is None or not finals or finals[0] is None:
            return None
        out = finals[0]
        if plan.role == "producer":
            written = len(out.prompt_token_ids) // self.block_size * self.block_size
            self.requests.labels("producer", "sent").inc()
            self.tokens.labels("sent").inc(written)
            return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.fingerprint,
                    "remote_block_ids": list(range(written // self.block_size)), "remote_host": self.host,
                    "remote_port": self.port, "tp_size": self.tp_size, "remote_num_tokens": written}
        # The last prompt token is always computed (its logits sample the first output token), so
        # its block, when full, is computed too: only the full blocks before it can be read.
        want = min(plan.expected_tokens, (len(out.prompt_token_ids) - 1) // self.block_size * self.block_size)
        got = min(out.num_cached_tokens, want)
        outcome = "refused" if plan.refused else "loaded" if got >= want else "recomputed"
        self.requests.labels("consumer", outcome).inc()
        if not plan.refused:
            self.tokens.labels("loaded").inc(got)
        if want > got:
            self.recomputed.inc(want - got)
        return None

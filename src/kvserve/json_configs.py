"""The engine flags whose value is a JSON object (vLLM's --speculative-config, --kv-events-config,
--kv-transfer-config): their parsed forms and parsers, each error naming the flag and the key."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from kvserve.errors import ConfigError

SPECULATIVE_METHODS = ("ngram",)


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config, parsed (sched/spec_decode.py uses it)."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int
    prompt_lookup_max: int


def _json_object(value: dict | str | None, flag: str, example: str) -> dict | None:
    """A JSON-valued flag as a dict (None when unset); a ConfigError naming the flag otherwise."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{flag} is not valid JSON ({e}); give an object such as '{example}'") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{flag} must be a JSON object, got {value!r}")
    return value


def parse_speculative_config(value: dict | str | None) -> SpeculativeConfig | None:
    """vLLM's --speculative-config (a JSON object or a dict) -> SpeculativeConfig; None when unset.
    As vLLM: prompt_lookup_min / max default to each other, and to 5 when both are missing."""
    value = _json_object(value, "--speculative-config",
                         '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}')
    if value is None:
        return None
    known = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ConfigError(f"--speculative-config: {', '.join(unknown)} not supported (kvserve implements the "
                          f"ngram method's keys: {', '.join(sorted(known))})")
    method = value.get("method", "ngram")
    if method not in SPECULATIVE_METHODS:
        raise ConfigError(f"--speculative-config method {method!r} is not implemented; kvserve has "
                          f"{', '.join(SPECULATIVE_METHODS)} (prompt lookup), which needs no draft model")
    k = value.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ConfigError(f"--speculative-config needs num_speculative_tokens, an integer >= 1 (got {k!r})")
    lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
    lo, hi = (5, 5) if lo is None and hi is None else (hi if lo is None else lo, lo if hi is None else hi)
    for name, n in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ConfigError(f"--speculative-config {name} must be an integer >= 1 (got {n!r})")
    if lo > hi:
        raise ConfigError(f"--speculative-config prompt_lookup_min={lo} must be <= prompt_lookup_max={hi}")
    return SpeculativeConfig(method, k, lo, hi)


@dataclass(frozen=True)
class KVEventsConfig:
    """--kv-events-config, parsed: vLLM's KVEventsConfig keys and defaults."""
    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq" when events are enabled and no publisher is named
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def publishing(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


KV_EVENT_PUBLISHERS = ("null", "zmq")


def parse_kv_events_config(value: dict | str | None) -> KVEventsConfig | None:
    """vLLM's --kv-events-config (a JSON object or a dict) -> KVEventsConfig; None when unset."""
    value = _json_object(value, "--kv-events-config",
                         '{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}')
    if value is None:
        return None
    fields_ = {f.name: f for f in dataclasses.fields(KVEventsConfig)}
    unknown = sorted(set(value) - set(fields_))
    if unknown:
        raise ConfigError(f"--kv-events-config: unknown key {', '.join(unknown)}; the keys are "
                          f"{', '.join(fields_)} (vLLM's KVEventsConfig)")
    types = {"enable_kv_cache_events": bool, "publisher": str, "endpoint": str, "replay_endpoint": (str, type(None)),
             "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str}
    for key, v in value.items():
        ok = isinstance(v, types[key]) and not (types[key] is int and isinstance(v, bool))
        if not ok or (types[key] is int and v < 1):
            want = {bool: "true or false", str: "a string", int: "an integer >= 1"}.get(types[key], "a string or null")
            raise ConfigError(f"--kv-events-config {key} must be {want}, got {v!r}")
    enabled = value.get("enable_kv_cache_events", False)
    publisher = value.get("publisher") or ("zmq" if enabled else "null")
    if publisher not in KV_EVENT_PUBLISHERS:
        raise ConfigError(f"--kv-events-config publisher {publisher!r} is not one of {', '.join(KV_EVENT_PUBLISHERS)}")
    for key in ("endpoint", "replay_endpoint"):
        ep = value.get(key)
        if ep is not None and not ep.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(f"--kv-events-config {key} {ep!r} is not a ZMQ endpoint; use tcp://HOST:PORT "
                              f"(tcp://*:5557 binds every interface) or ipc://PATH")
    return KVEventsConfig(**{**value, "publisher": publisher})


@dataclass(frozen=True)
class KVTransferConfig:
    """--kv-transfer-config, parsed: vLLM's KVTransferConfig keys (the ones kvserve acts on)."""
    kv_connector: str
    kv_role: str  # kv_producer: prefills and leaves the KV below; kv_consumer: decodes from it; kv_both
    engine_id: str | None = None
    kv_connector_extra_config: dict = dataclasses.field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")


# kvserve moves KV through its shared Redis tier (--kv-redis-url); vLLM's connectors need their own
# transfer libraries and engines on the other side.
KV_CONNECTORS = ("RedisConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# vLLM's KVTransferConfig keys kvserve accepts and has nothing to do with (buffers, ranks and
# addresses of the connectors it does not have).
_KV_TRANSFER_INERT = ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port",
                      "kv_connector_module_path", "enable_permute_local_kv")


def parse_kv_transfer_config(value: dict | str | None) -> KVTransferConfig | None:
    """vLLM's --kv-transfer-config (a JSON object or a dict) -> KVTransferConfig; None when unset."""
    value = _json_object(value, "--kv-transfer-config", '{"kv_connector": "RedisConnector", "kv_role": "kv_both"}')
    if value is None:
        return None
    known = ("kv_connector", "kv_role", "engine_id", "kv_connector_extra_config", "kv_load_failure_policy",
             *_KV_TRANSFER_INERT)
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(f"--kv-transfer-config: unknown key {', '.join(unknown)}; the keys are "
                          f"{', '.join(known)} (vLLM's KVTransferConfig)")
    connector = value.get("kv_connector")
    if connector not in KV_CONNECTORS:
        raise ConfigError(f"--kv-transfer-config kv_connector {connector!r} is not available in kvserve, which "
                          f"moves KV through its shared Redis tier: use \"kv_connector\": \"RedisConnector\" "
                          f"with --kv-redis-url")
    role = value.get("kv_role")
    if role not in KV_ROLES:
        raise ConfigError(f"--kv-transfer-config kv_role must be one of {', '.join(KV_ROLES)} (got {role!r})")
    policy = value.get("kv_load_failure_policy", "recompute")
    if policy != "recompute":
        raise ConfigError(f"--kv-transfer-config kv_load_failure_policy {policy!r}: kvserve recomputes a prompt "
                          f"whose KV it cannot load (\"recompute\", vLLM's default); drop the key")
    engine_id = value.get("engine_id")
    if engine_id is not None and not isinstance(engine_id, str):
        raise ConfigError(f"--kv-transfer-config engine_id must be a string (got {engine_id!r})")
    extra = value.get("kv_connector_extra_config")
    extra = {} if extra is None else extra
    if not isinstance(extra, dict):
        raise ConfigError(f"--kv-transfer-config kv_connector_extra_config must be a JSON object (got {extra!r})")
    return KVTransferConfig(connector, role, engine_id, extra)

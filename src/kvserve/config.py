"""Engine settings: one dataclass whose fields are vLLM's engine-argument names.

The CLI maps `--flag-name` onto `flag_name` one to one (see kvserve.cli); the offline API takes
the same names as keyword arguments. Nothing else configures the engine.
"""
from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any

from kvserve.errors import ConfigError  # noqa: F401 (its users import it from here)
from kvserve.json_configs import (KV_EVENT_PUBLISHERS, KVEventsConfig, KVTransferConfig,  # noqa: F401
                                  SpeculativeConfig, parse_kv_events_config, parse_kv_transfer_config,
                                  parse_speculative_config)

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "int4")
SCHEDULING_POLICIES = ("fcfs", "priority")
PREEMPTION_MODES = ("recompute", "swap")
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's other spellings
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")

DEFAULT_CPU_KV_CACHE_MEMORY = 4 * 1024**3  # vLLM CPU backend's default KV space
DEFAULT_KV_DISK_SIZE = 10 * 1024**3  # disk KV tier cap when --kv-disk-path is given alone
QUANTIZATIONS = (None, "gguf", "none")

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3,
          "gb": 1000**3, "t": 1000**4, "tb": 1000**4, "ki": 1024, "kib": 1024, "mi": 1024**2,
          "mib": 1024**2, "gi": 1024**3, "gib": 1024**3, "ti": 1024**4, "tib": 1024**4}


from kvserve.vllm_compat import VLLM_NOOP, VLLM_NOOP_OFFLINE, VLLM_NOOP_VALUE, VLLM_REFUSED  # noqa: F401 (cli.py)

NO_RAY = ("--distributed-executor-backend ray needs the ray package, which is not installed: "
          "pip install 'kvserve[ray]' (on every node of the cluster), or use --distributed-executor-backend mp")


def accepted_values(name: str) -> tuple[str, ...]:
    """The values a VLLM_REFUSED argument is accepted with (as strings)."""
    allowed = VLLM_REFUSED[name][0]
    return (allowed,) if isinstance(allowed, str) else allowed or ()


def vllm_only_args(kwargs: dict) -> list[str]:
    """Check vLLM arguments that are not EngineArgs fields (`LLM(trust_remote_code=True)`): the
    no-ops are accepted, the unimplemented refused unless given their harmless value. Returns the
    names accepted, to be dropped; raises ConfigError for the rest."""
    accepted = []
    for name, value in kwargs.items():
        why = {**VLLM_NOOP, **VLLM_NOOP_VALUE, **VLLM_NOOP_OFFLINE}.get(name)
        if why is not None:
            logging.getLogger("kvserve").info("%s: accepted, nothing to do (%s)", name, why)
            accepted.append(name)
        elif name in VLLM_REFUSED:
            if value is not None and value is not False and str(value) not in accepted_values(name):
                raise ConfigError(f"{name}={value!r} is not supported: {VLLM_REFUSED[name][1]}")
            accepted.append(name)
    return accepted


_HUMAN_INT_RE = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(value: str) -> int:
    """vLLM's integer flags ('--max-model-len 32k'): k/m/g/t are powers of 1000 and may follow a
    decimal ('25.6k' = 25,600), K/M/G/T powers of 1024 after a whole number ('1K' = 1,024)."""
    text = value.strip()
    m = _HUMAN_INT_RE.fullmatch(text)
    if m is None:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"cannot parse {value!r}; use a whole number, or one with a suffix "
                              f"as vLLM takes them: 32k = 32,000, 32K = 32,768") from None
    number, suffix = m.groups()
    if suffix in _DECIMAL:
        return int(float(number) * _DECIMAL[suffix])
    if "." in number:
        raise ConfigError(f"{value!r} has a decimal with the binary suffix {suffix}; "
                          f"did you mean {number}{suffix.lower()}?")
    return int(number) * _BINARY[suffix]


def parse_size(value: str | int | float, flag: str = "size") -> int:
    """'4GiB', '512MB', '1e9' or a plain number of bytes -> bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(value)
    if m is None:
        try:
            return int(float(value))
        except ValueError:
            raise ConfigError(f"{flag}: cannot parse {value!r}; use bytes or a size like 4GiB, 512MiB, 2GB") from None
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128)  # what --block-size accepts


def check_block_size(block_size: int) -> int:
    if block_size not in BLOCK_SIZES:
        raise ConfigError(f"--block-size must be one of {', '.join(map(str, BLOCK_SIZES))} (got {block_size})")
    return block_size


def host_memory(field: str = "MemAvailable") -> int | None:
    """A /proc/meminfo field (MemAvailable, MemTotal) in bytes; None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_writable(path: str | None, flag: str) -> None:
    """Fail before a long run rather than after it when its output file cannot be written."""
    if not path or path == "-":
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ConfigError(f"{flag} {path} is a directory; give a file path")
    if not os.path.isdir(parent):
        raise ConfigError(f"{flag} {path}: the directory {parent} does not exist; create it or choose another path")
    if not os.access(parent, os.W_OK):
        raise ConfigError(f"{flag} {path}: cannot write in {parent}; choose another path")


def _arg(default: Any, help: str, group: str, choices: tuple | None = None) -> Any:
    """An EngineArgs field: its --help text, group and choices are what the CLI shows and what
    docs/serving.md is generated from, so they live here and nowhere else."""
    return field(default=default, metadata={"help": help, "group": group, "choices": choices})


@dataclass
class EngineArgs:
    """Every engine setting, under vLLM's engine-argument names; `--flag-name` <-> `flag_name`."""
    # Model
    model: str | None = _arg(None, "HF model directory, .gguf file or hub id (default: the embedded "
                                   "SmolLM2-135M-Instruct)", "Model")
    tokenizer: str | None = _arg(None, "tokenizer directory when it differs from the model's", "Model")
    served_model_name: str | None = _arg(None, "name(s) clients send as `model` (default: the model path)", "Model")
    dtype: str = _arg("auto", "compute dtype of weights and activations (auto: bfloat16 on CUDA and on CPUs "
                              "with AMX or AVX512-BF16, else float32)", "Model", DTYPES + tuple(DTYPE_ALIASES))
    quantization: str | None = _arg(
        None, "unset: weights as the checkpoint stores them (a GGUF file's Q4_1 / Q8_0 projections are kept "
              "and read as codes on AMX CPUs: the same bf16 values, fewer bytes); gguf: require that; "
              "none: dequantize every weight at load", "Model", ("gguf", "none"))
    device: str = _arg("auto", "where the model runs", "Model", DEVICES)
    seed: int = _arg(0, "engine-wide random seed (per-request `seed` overrides it)", "Model")
    max_model_len: int | None = _arg(None, "context length: prompt + output tokens per request; 32k = 32,000, "
                                           "32K = 32,768, auto = the model's (default: the model's)", "Model")
    generation_config: str = _arg(
        "auto", "auto: requests that leave temperature, top_p, top_k, min_p, repetition_penalty or max_tokens "
                "unset take the model's generation_config.json values, as vLLM; vllm: ignore them; a folder: "
                "take its generation_config.json's", "Model")
    override_generation_config: dict | None = _arg(
        None, "JSON object of generation_config.json keys merged over what --generation-config gives, "
              "e.g. '{\"temperature\": 0.5}' (vLLM's)", "Model")
    max_logprobs: int = _arg(20, "largest logprobs / top_logprobs a request may ask for (-1: no cap but the "
                                 "vocabulary, as vLLM)", "Model")
    # KV cache
    block_size: int = _arg(16, "tokens per KV block: 1, 2, 4, 8, 16, 32, 64 or 128", "KV cache")
    gpu_memory_utilization: float = _arg(0.9, "fraction of device memory for weights + KV cache (CUDA)", "KV cache")
    kv_cache_memory: int | None = _arg(None, "KV cache budget in bytes or 4GiB-style; the budget on CPU "
                                             "(default 4GiB)", "KV cache")
    kv_cache_dtype: str = _arg("auto", "KV element type: auto (model dtype), fp8 (= fp8_e4m3), fp8_e5m2, int8, "
                                       "int4 (quantized with scales)", "KV cache", KV_CACHE_DTYPES)
    enable_prefix_caching: bool = _arg(True, "reuse KV blocks of identical prompt prefixes across requests",
                                       "KV cache")
    num_gpu_blocks_override: int | None = _arg(None, "exact number of KV blocks (ignores the memory budget)",
                                               "KV cache")
    max_pinned_kv_bytes: int | None = _arg(None, "most KV cache bytes pinned prefixes (POST /v1/cache/pins) may "
                                                 "hold, bytes or 1GiB-style (default: half the KV cache)", "KV cache")
    # KV offload tiers
    swap_space: float = _arg(0.0, "GiB of host memory for the host KV tier (swapped-out and offloaded blocks)",
                             "KV offload tiers")
    cpu_offload_gb: float = _arg(0.0, "alias of --swap-space (the same host KV tier, in GiB); kvserve does not "
                                      "offload weights", "KV offload tiers")
    kv_disk_path: str | None = _arg(None, "directory of the disk KV tier (persists prefixes across restarts)",
                                    "KV offload tiers")
    kv_disk_size: str | int | None = _arg(None, "size cap of the disk tier, bytes or 20GiB-style (default 10GiB)",
                                          "KV offload tiers")
    kv_redis_url: str | None = _arg(None, "redis://host:port/db of a Redis KV tier shared by several servers",
                                    "KV offload tiers")
    kv_offload_min_priority: int = _arg(0, "blocks evicted from the device with a cache_retention priority below "
                                           "this (0..100), or past their ttl_s, are dropped, not written to the "
                                           "offload tiers (0: every block within its TTL is written)",
                                        "KV offload tiers")
    # Scheduler
    max_num_seqs: int = _arg(256, "most sequences in one batch", "Scheduler")
    max_num_batched_tokens: int | None = _arg(None, "token budget of one step (default 2048 with chunked prefill, "
                                                    "else max(max_model_len, 2048))", "Scheduler")
    enable_chunked_prefill: bool = _arg(True, "split long prompts across steps so decodes keep flowing", "Scheduler")
    scheduling_policy: str = _arg("fcfs", "fcfs, or priority (lower `priority` value runs first)", "Scheduler",
                                  SCHEDULING_POLICIES)
    preemption_mode: str | None = _arg(None, "what happens to a preempted request's KV: recompute, or swap to the "
                                             "host tier (default: swap when --swap-space/--cpu-offload-gb is set, "
                                             "else recompute)", "Scheduler", PREEMPTION_MODES)
    stream_interval: int = _arg(1, "tokens a streamed request gathers before they are sent (vLLM's; its first "
                                   "token and its end are sent at once): fewer, larger events, less server work "
                                   "per token", "Scheduler")
    cache_aware_scheduling: bool = _arg(False, "admit the waiting request with the longest cached prefix first "
                                               "(SGLang's longest-prefix-match)", "Scheduler")
    speculative_config: dict | str | None = _arg(
        None, "JSON object, vLLM's: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
              "\"prompt_lookup_max\": 3}' guesses a greedy request's next tokens from its own history and keeps "
              "those the model agrees with (ngram is the method implemented)", "Scheduler")
    kv_events_config: dict | str | None = _arg(
        None, "JSON object, vLLM's KVEventsConfig: '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
              "\"endpoint\": \"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv\"}' "
              "publishes every block the cache stores and drops, in every tier, for a KV-aware router", "KV cache")
    kv_transfer_config: dict | str | None = _arg(
        None, "JSON object, vLLM's KVTransferConfig: '{\"kv_connector\": \"RedisConnector\", \"kv_role\": "
              "\"kv_producer\"}' makes this server a prefill server of disaggregated prefill/decode "
              "(\"kv_consumer\": a decode server; \"kv_both\": either), driven by vllm-router's "
              "--vllm-pd-disaggregation with vLLM's kv_transfer_params; the KV moves through --kv-redis-url",
        "KV offload tiers")
    kv_compression: dict | str | None = _arg(
        None, "JSON object: the KV compression of requests that set no kv_compression of their own, e.g. "
              "'{\"method\": \"streaming\", \"sink_tokens\": 4, \"window\": 1024}' (attention sinks + recent "
              "window), '{\"method\": \"h2o\", \"heavy_tokens\": 512, \"window\": 512}' or snapkv (sink_tokens, "
              "heavy_tokens, window, observation_tokens); a request opts out "
              "with {\"method\": \"none\"} (docs/long-context.md)", "Scheduler")
    # Parallel
    data_parallel_size: int = _arg(1, "Number of data parallel groups: engine core processes behind this one API "
                                      "server, each with its own KV pool and its share of the cores", "Parallel")
    data_parallel_routing: str = _arg(
        "cache_aware", "kvserve: how the API server picks a data-parallel replica for a request: cache_aware "
                       "(the longest cached prefix, unless the load is out of balance), least_loaded (vLLM's "
                       "balancing) or round_robin", "Parallel", ("cache_aware", "least_loaded", "round_robin"))
    tensor_parallel_size: int = _arg(1, "Number of tensor parallel groups: ranks each holding 1/N of every "
                                        "projection and of the KV heads, one process per rank, each with its "
                                        "share of the cores (docs/tensor-parallel.md)", "Parallel")
    distributed_executor_backend: str = _arg(
        "mp", "Backend to use for distributed model workers, either \"ray\" or \"mp\" (multiprocessing); "
              "kvserve: mp starts the ranks as local processes (uni: the same at --tensor-parallel-size 1); ray "
              "places ranks 1..N-1 as actors on the running Ray cluster (RAY_ADDRESS, else the one `ray start` "
              "made here)",
        "Parallel", ("mp", "uni", "ray"))
    # Kernels
    attention_backend: str = _arg("auto", "attention kernels: torch (the CPU kernels, SDPA elsewhere) or "
                                          "triton (CUDA); auto: triton on CUDA when installed", "Kernels",
                                  ATTENTION_BACKENDS)
    disable_cascade_attn: bool = _arg(False, "read a prefix shared by many running requests once per request "
                                             "instead of once per group (cascade attention, CPU bf16 kernel; on "
                                             "by default)", "Kernels")
    enforce_eager: bool = _arg(False, "CUDA: run every step eagerly instead of replaying CUDA graphs for decode "
                                      "steps", "Kernels")
    max_cudagraph_capture_size: int = _arg(512, "CUDA: largest decode batch captured as a CUDA graph (larger "
                                                "batches run eagerly)", "Kernels")
    # LoRA
    enable_lora: bool = _arg(False, "If True, enable handling of LoRA adapters.", "LoRA")
    lora_modules: list[str] | None = _arg(
        None, "LoRA module configurations in either 'name=path' format or JSON format: "
              "'{\"name\": \"name\", \"path\": \"lora_path\", \"base_model_name\": \"id\"}' (several may follow "
              "the flag)", "LoRA")
    max_loras: int = _arg(1, "Max number of LoRAs in a single batch.", "LoRA")
    max_lora_rank: int = _arg(16, "Max LoRA rank.", "LoRA")
    max_cpu_loras: int | None = _arg(None, "Maximum number of LoRAs to store in CPU memory. Must be >= than "
                                           "`max_loras`.", "LoRA")
    lora_dtype: str = _arg("auto", "Data type for LoRA. If auto, will default to base model dtype.", "LoRA",
                           ("auto", "float32", "bfloat16", "float16"))
    # Logging and debugging
    check_integrity: bool = _arg(False, "verify block accounting after every step (slow; debugging)",
                                 "Logging and debugging")
    disable_log_stats: bool = _arg(False, "no periodic stats log line", "Logging and debugging")
    disable_dashboard: bool = _arg(False, "kvserve serve: no live KV dashboard at GET /dashboard (and no "
                                          "/dashboard/data); behind the API key when one is set",
                                   "Logging and debugging")

    @property
    def kv_events(self) -> KVEventsConfig | None:
        """The parsed --kv-events-config, or None."""
        return parse_kv_events_config(self.kv_events_config)

    @property
    def kv_transfer(self) -> KVTransferConfig | None:
        """The parsed --kv-transfer-config, or None."""
        return parse_kv_transfer_config(self.kv_transfer_config)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """The parsed --speculative-config, or None."""
        return parse_speculative_config(self.speculative_config)

    def validate(self) -> None:
        check_block_size(self.block_size)
        if self.quantization not in QUANTIZATIONS:
            raise ConfigError(f"--quantization must be one of {', '.join(q for q in QUANTIZATIONS if q)} or unset "
                              f"(got {self.quantization!r}); other weight formats are not implemented (use "
                              f"--kv-cache-dtype to quantize the KV cache)")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)} (got {self.kv_cache_dtype!r})")
        if self.kv_cache_dtype == "fp8":
            # vLLM's alias: one spelling, so block hashes and tier keys of the same format agree.
            self.kv_cache_dtype = "fp8_e4m3"
        if self.generation_config not in ("auto", "vllm") and not os.path.isfile(
                os.path.join(self.generation_config, "generation_config.json")):
            raise ConfigError(f"--generation-config must be 'auto' (the model's generation_config.json), 'vllm' "
                              f"(vLLM's defaults) or a folder holding a generation_config.json; "
                              f"{self.generation_config!r} has none")
        if self.override_generation_config is not None and not isinstance(self.override_generation_config, dict):
            raise ConfigError("--override-generation-config must be a JSON object of generation_config.json "
                              f"keys, e.g. '{{\"temperature\": 0.5}}'; got {self.override_generation_config!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ConfigError(f"--scheduling-policy must be one of {', '.join(SCHEDULING_POLICIES)} (got {self.scheduling_policy!r})")
        if self.preemption_mode is None:
            self.preemption_mode = "swap" if self.host_tier_gib > 0 else "recompute"
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ConfigError(f"--preemption-mode must be one of {', '.join(PREEMPTION_MODES)} (got {self.preemption_mode!r})")
        self.dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)} (got {self.dtype!r})")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ConfigError(f"--gpu-memory-utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.stream_interval < 1:
            raise ConfigError(f"--stream-interval must be >= 1 token (got {self.stream_interval})")
        if self.max_num_seqs < 1:
            raise ConfigError(f"--max-num-seqs must be >= 1 (got {self.max_num_seqs})")
        if self.max_cudagraph_capture_size < 1:
            raise ConfigError(f"--max-cudagraph-capture-size must be >= 1 (got {self.max_cudagraph_capture_size}); "
                              f"use --enforce-eager to capture no CUDA graphs")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ConfigError(f"--max-num-batched-tokens must be >= 1 (got {self.max_num_batched_tokens})")
        if isinstance(self.kv_cache_memory, str):
            self.kv_cache_memory = parse_size(self.kv_cache_memory, "--kv-cache-memory")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ConfigError(f"--kv-cache-memory must be > 0 bytes (got {self.kv_cache_memory})")
        if isinstance(self.max_pinned_kv_bytes, str):
            self.max_pinned_kv_bytes = parse_size(self.max_pinned_kv_bytes, "--max-pinned-kv-bytes")
        if self.max_pinned_kv_bytes is not None and self.max_pinned_kv_bytes < 0:
            raise ConfigError(f"--max-pinned-kv-bytes must be >= 0 bytes (got {self.max_pinned_kv_bytes}); 0 "
                              f"refuses every pin")
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 1:
            raise ConfigError(f"--num-gpu-blocks-override must be >= 1 KV block (got {self.num_gpu_blocks_override}); "
                              f"leave it unset to size the pool from --kv-cache-memory")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ConfigError(f"--max-model-len must be >= 1 (got {self.max_model_len})")
        if self.max_logprobs < -1:
            raise ConfigError(f"--max-logprobs must be >= 0, or -1 for no cap (got {self.max_logprobs})")
        if self.swap_space < 0:
            raise ConfigError(f"--swap-space must be >= 0 GiB (got {self.swap_space})")
        if not 0 <= self.kv_offload_min_priority <= 100:
            raise ConfigError(f"--kv-offload-min-priority must be a cache_retention priority in [0, 100] "
                              f"(got {self.kv_offload_min_priority})")
        if self.data_parallel_size < 1:
            raise ConfigError(f"--data-parallel-size must be >= 1 (got {self.data_parallel_size})")
        self._validate_tensor_parallel()
        self.speculative  # raises ConfigError on a malformed --speculative-config
        self.kv_events  # and on a malformed --kv-events-config
        if self.kv_transfer is not None and self.kv_redis_url is None:
            raise ConfigError("--kv-transfer-config RedisConnector moves KV through the shared Redis tier: add "
                              "--kv-redis-url redis://host:port/db, the same on the prefill and decode servers")
        self._validate_tiers()
        self._validate_lora()

    def _validate_tensor_parallel(self) -> None:
        tp = self.tensor_parallel_size
        if tp < 1:
            raise ConfigError(f"--tensor-parallel-size must be >= 1 (got {tp})")
        if self.distributed_executor_backend not in ("mp", "uni", "ray"):
            raise ConfigError(f"--distributed-executor-backend must be mp, uni or ray "
                              f"(got {self.distributed_executor_backend!r})")
        if tp == 1:
            return
        if self.distributed_executor_backend == "uni":
            raise ConfigError(f"--distributed-executor-backend uni runs one process, but --tensor-parallel-size {tp} "
                              f"needs one per rank; use --distributed-executor-backend mp")
        if self.distributed_executor_backend == "ray":
            import importlib.util
            if importlib.util.find_spec("ray") is None:
                raise ConfigError(NO_RAY)

    def _validate_lora(self) -> None:
        if self.lora_modules and not self.enable_lora:
            raise ConfigError("--lora-modules was given without --enable-lora; add --enable-lora")
        if self.max_loras < 1:
            raise ConfigError(f"--max-loras must be >= 1 (got {self.max_loras})")
        if self.max_lora_rank < 1:
            raise ConfigError(f"--max-lora-rank must be >= 1 (got {self.max_lora_rank})")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ConfigError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")
        self.lora_dtype = DTYPE_ALIASES.get(self.lora_dtype, self.lora_dtype)
        if self.lora_dtype not in DTYPES:
            raise ConfigError(f"--lora-dtype must be one of {', '.join(DTYPES)} (got {self.lora_dtype!r})")
        self.lora_module_paths  # raises ConfigError on a malformed --lora-modules entry

    @property
    def lora_module_paths(self) -> list[LoRAModulePath]:
        """--lora-modules parsed: 'name=path' or vLLM's JSON object form."""
        return [parse_lora_module(m) for m in self.lora_modules or []]

    def _validate_tiers(self) -> None:
        if self.cpu_offload_gb < 0:
            raise ConfigError(f"--cpu-offload-gb must be >= 0 GiB (got {self.cpu_offload_gb})")
        if self.swap_space and self.cpu_offload_gb and self.swap_space != self.cpu_offload_gb:
            raise ConfigError(f"--swap-space ({self.swap_space}) and --cpu-offload-gb ({self.cpu_offload_gb}) "
                              f"both size the one host KV tier; give only one of them")
        if self.kv_disk_size is not None and not self.kv_disk_path:
            raise ConfigError("--kv-disk-size was given without --kv-disk-path; add --kv-disk-path DIR "
                              "to enable the disk KV tier")
        if self.kv_disk_path is not None:
            if not str(self.kv_disk_path).strip():
                raise ConfigError("--kv-disk-path is empty; pass a directory for the disk KV tier")
            if self.resolved_kv_disk_size <= 0:
                raise ConfigError(f"--kv-disk-size must be a positive size such as 20GiB (got {self.kv_disk_size!r})")
        if self.kv_redis_url is not None and not re.match(r"^(redis|rediss|unix)://", self.kv_redis_url):
            raise ConfigError(f"--kv-redis-url {self.kv_redis_url!r} is not a Redis URL; use "
                              f"redis://host:port/db, rediss://... for TLS, or unix:///path/to/redis.sock")
        offload = self.kv_disk_path is not None or self.kv_redis_url is not None
        if offload and not self.enable_prefix_caching:
            raise ConfigError("--kv-disk-path / --kv-redis-url keep prefix-cache blocks, so they need prefix "
                              "caching; drop --no-enable-prefix-caching or the tier flags")
        total = host_memory("MemTotal")
        if total is not None and self.host_tier_gib * 2**30 > 0.7 * total:
            # vLLM's limit: the tier allocates lazily, so an oversize one would fail much later, mid-serve.
            flag = "--swap-space" if self.swap_space else "--cpu-offload-gb"
            raise ConfigError(f"{flag} {self.host_tier_gib:g} GiB is more than 70% of this machine's "
                              f"{total / 2**30:.1f} GiB of memory; lower {flag}")
        if self.preemption_mode == "swap" and self.host_tier_gib <= 0:
            raise ConfigError("--preemption-mode swap moves a preempted request's KV to host memory, but no host "
                              "tier is configured; set --swap-space (GiB), e.g. --swap-space 4")

    @property
    def host_tier_gib(self) -> float:
        """GiB of the host KV tier (0: none); --swap-space and --cpu-offload-gb name the same tier."""
        return self.swap_space or self.cpu_offload_gb

    @property
    def resolved_kv_disk_size(self) -> int:
        if self.kv_disk_size is None:
            return DEFAULT_KV_DISK_SIZE
        return parse_size(self.kv_disk_size, "--kv-disk-size")

    @property
    def has_kv_tiers(self) -> bool:
        return self.host_tier_gib > 0 or self.kv_disk_path is not None or self.kv_redis_url is not None

    def resolved_max_num_batched_tokens(self, max_model_len: int) -> int:
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ConfigError(
                    f"--max-num-batched-tokens ({self.max_num_batched_tokens}) is smaller than --max-model-len "
                    f"({max_model_len}) with chunked prefill off, so long prompts could never be scheduled; "
                    f"raise it, lower --max-model-len, or --enable-chunked-prefill")
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(max_model_len, 2048)

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


@dataclass(frozen=True)
class LoRAModulePath:
    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(entry: Any) -> LoRAModulePath:
    """One --lora-modules value: 'name=path', or '{"name": ..., "path": ..., "base_model_name": ...}'."""
    if isinstance(entry, dict):
        obj = entry
    elif isinstance(entry, str) and entry.strip().startswith("{"):
        try:
            obj = json.loads(entry)
        except ValueError as e:
            raise ConfigError(f"--lora-modules {entry!r} is not valid JSON ({e}); use name=path or "
                              f"'{{\"name\": ..., \"path\": ...}}'") from None
    elif isinstance(entry, str) and "=" in entry:
        name, _, path = entry.partition("=")
        obj = {"name": name.strip(), "path": path.strip()}
    else:
        raise ConfigError(f"--lora-modules {entry!r} is neither name=path nor a JSON object with name and path")
    if not isinstance(obj, dict) or not obj.get("name") or not obj.get("path"):
        raise ConfigError(f"--lora-modules {entry!r} needs a non-empty name and path")
    unknown = sorted(set(obj) - {"name", "path", "base_model_name"})
    if unknown:
        raise ConfigError(f"--lora-modules {entry!r}: unknown keys {unknown}; the keys are name, path and "
                          f"base_model_name")
    return LoRAModulePath(str(obj["name"]), str(obj["path"]), obj.get("base_model_name"))


@dataclass
class SchedulerConfig:
    """What the scheduler reads, under EngineArgs' names, with the values resolved (the budget and
    context length are numbers here, the speculative config parsed)."""
    max_num_batched_tokens: int
    max_model_len: int
    max_num_seqs: int = EngineArgs.max_num_seqs
    enable_chunked_prefill: bool = EngineArgs.enable_chunked_prefill
    scheduling_policy: str = EngineArgs.scheduling_policy
    cache_aware_scheduling: bool = EngineArgs.cache_aware_scheduling
    preemption_mode: str = "recompute"
    speculative_config: SpeculativeConfig | None = None
    cache_aware_window: int = 128  # how many waiting requests the cache-aware pass ranks (no flag)
    max_loras: int | None = None  # distinct adapters among running requests (None: no LoRA)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, max_model_len: int) -> SchedulerConfig:
        """`args` validated; `max_model_len` resolved against the model and the KV pool."""
        return cls(max_num_batched_tokens=args.resolved_max_num_batched_tokens(max_model_len),
                   max_model_len=max_model_len, max_num_seqs=args.max_num_seqs,
                   enable_chunked_prefill=args.enable_chunked_prefill, scheduling_policy=args.scheduling_policy,
                   cache_aware_scheduling=args.cache_aware_scheduling, preemption_mode=args.preemption_mode,
                   speculative_config=args.speculative, max_loras=args.max_loras if args.enable_lora else None)


@dataclass
class ModelConfig:
    """Architecture facts the engine needs, read from config.json or GGUF metadata."""
    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    sliding_window: int | None = None  # Mistral
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    name: str = "model"
    # Sampling defaults from generation_config.json, as SamplingParams fields (max_new_tokens ->
    # max_tokens); applied unless --generation-config vllm.
    sampling_defaults: dict = field(default_factory=dict)

    def kv_bytes_per_token(self, element_bytes: float) -> float:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * element_bytes

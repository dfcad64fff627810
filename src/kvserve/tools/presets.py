"""Model architectures for the operator tools: built-in presets, HF config.json and GGUF metadata.

The planner needs shapes, not weights, so everything here reads metadata only (a GGUF file is
memory-mapped by gguf.GGUFReader; tensor data is never touched). Preset numbers are copied from
the models' published config.json files.
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass, replace

from kvserve.config import ConfigError, ModelConfig

_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}

# name -> (config, dtype of the published weights)
PRESETS: dict[str, tuple[ModelConfig, str]] = {
    "Llama-3.1-8B": (ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE), bos_token_id=128000, eos_token_ids=[128001],
        name="Llama-3.1-8B"), "bfloat16"),
    "Llama-3.1-70B": (ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
        rope_scaling=dict(_LLAMA3_ROPE), bos_token_id=128000, eos_token_ids=[128001],
        name="Llama-3.1-70B"), "bfloat16"),
    # Llama 3 (not 3.1): same shapes as 3.1-70B with the original 8K context; the figure
    # everyone quotes (327,680 KV bytes per token in fp16) comes from this model.
    "Llama-3-70B": (ModelConfig(
        architecture="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
        bos_token_id=128000, eos_token_ids=[128001], name="Llama-3-70B"), "bfloat16"),
    "Mistral-7B": (ModelConfig(  # v0.3: 32K context, no sliding window
        architecture="mistral", vocab_size=32768, hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_theta=1000000.0,
        bos_token_id=1, eos_token_ids=[2], name="Mistral-7B"), "bfloat16"),
    "Qwen2.5-7B": (ModelConfig(
        architecture="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944,
        num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1000000.0,
        attention_bias=True, bos_token_id=151643, eos_token_ids=[151643], name="Qwen2.5-7B"), "bfloat16"),
    "SmolLM2-135M": (ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536,
        num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, head_dim=64,
        max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=[2], name="SmolLM2-135M"), "bfloat16"),
}

_HF_ARCHITECTURES = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2"}


@dataclass
class ModelSpec:
    """What the planner knows about a model before any weight is loaded."""
    config: ModelConfig
    dtype: str                        # dtype the weights were published in (float32 / bfloat16 / float16)
    source: str                       # preset name or the path read
    quantization: str | None = None   # detected from config.json's quantization_config
    file_weight_bytes: int | None = None  # GGUF: exact bytes of the tensors as stored in the file


@dataclass
class ParamCount:
    embedding: int
    lm_head: int        # 0 when tied to the embedding
    decoder_linear: int  # q/k/v/o and MLP projections of all layers (what weight quantization touches)
    other: int          # norms and biases

    @property
    def total(self) -> int:
        return self.embedding + self.lm_head + self.decoder_linear + self.other


def count_parameters(cfg: ModelConfig) -> ParamCount:
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    per_layer_linear = h * q + 2 * h * kv + q * h + 3 * h * cfg.intermediate_size
    per_layer_other = 2 * h + ((q + 2 * kv) if cfg.attention_bias else 0)
    return ParamCount(
        embedding=cfg.vocab_size * h,
        lm_head=0 if cfg.tie_word_embeddings else cfg.vocab_size * h,
        decoder_linear=cfg.num_hidden_layers * per_layer_linear,
        other=cfg.num_hidden_layers * per_layer_other + h)


def find_preset(name: str) -> str | None:
    """Case-insensitive preset lookup; tolerates an org prefix and an -Instruct suffix."""
    key = name.rsplit("/", 1)[-1].lower()
    for suffix in ("-instruct", "-it"):
        if key.endswith(suffix):
            key = key[: -len(suffix)]
    for preset in PRESETS:
        if preset.lower() == key:
            return preset
    return None


def resolve_model(model: str) -> ModelSpec:
    """A preset name, a config.json, a model directory holding one, or a .gguf file -> ModelSpec."""
    if os.path.isdir(model):
        path = os.path.join(model, "config.json")
        if not os.path.isfile(path):
            ggufs = sorted(f for f in os.listdir(model) if f.endswith(".gguf"))
            if len(ggufs) == 1:
                return model_spec_from_gguf(os.path.join(model, ggufs[0]))
            raise ConfigError(f"--model {model}: the directory has no config.json"
                              + (f" and {len(ggufs)} .gguf files; name one" if ggufs else "")
                              + "; pass a config.json, a .gguf file or a preset "
                              f"({', '.join(PRESETS)})")
        return model_spec_from_config_json(path)
    if os.path.isfile(model):
        if model.endswith(".gguf"):
            return model_spec_from_gguf(model)
        return model_spec_from_config_json(model)
    preset = find_preset(model)
    if preset is not None:
        cfg, dtype = PRESETS[preset]
        return ModelSpec(config=replace(cfg, eos_token_ids=list(cfg.eos_token_ids)), dtype=dtype, source=preset)
    raise ConfigError(f"--model {model!r} is neither an existing path (config.json, model directory, .gguf) "
                      f"nor a preset; presets: {', '.join(PRESETS)}")


def model_spec_from_config_json(path: str) -> ModelSpec:
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"--model {path}: cannot read it as a HuggingFace config.json ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"--model {path}: config.json must hold a JSON object")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "quantization_config": cfg.get("quantization_config")}
    name = os.path.basename(os.path.dirname(os.path.abspath(path))) or "model"
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    return ModelSpec(config=model_config_from_hf_dict(cfg, name), dtype=dtype, source=path,
                     quantization=_detect_quantization(cfg.get("quantization_config")))


def model_config_from_hf_dict(cfg: dict, name: str) -> ModelConfig:
    """Prefer the loader's reader (one source of truth with the engine); fall back to a light one.

    The light reader also covers decoders the engine cannot run (the arithmetic is the same for
    any GQA decoder), which is why a loader refusal falls through to it.
    """
    try:
        from kvserve.model.loader import model_config_from_hf
    except ImportError:
        model_config_from_hf = None
    if model_config_from_hf is not None:
        try:
            return model_config_from_hf(cfg, name)
        except (ValueError, KeyError, TypeError):
            pass
    return _light_model_config(cfg, name)


def _light_model_config(cfg: dict, name: str) -> ModelConfig:
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if k not in cfg]
    if missing:
        raise ConfigError(f"--model {name}: config.json lacks {', '.join(missing)}; "
                          "is it a decoder-only language model's config?")
    heads = int(cfg["num_attention_heads"])
    arch_names = cfg.get("architectures") or []
    architecture = next((_HF_ARCHITECTURES[a] for a in arch_names if a in _HF_ARCHITECTURES),
                        str(cfg.get("model_type", "llama")))
    eos = cfg.get("eos_token_id")
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(cfg.get("vocab_size", 32000)),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg.get("intermediate_size", 4 * int(cfg["hidden_size"]))),
        num_hidden_layers=int(cfg["num_hidden_layers"]),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5)),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rope_scaling=cfg.get("rope_scaling"),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", architecture == "qwen2")),
        sliding_window=cfg.get("sliding_window") if cfg.get("use_sliding_window", True) else None,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=list(eos) if isinstance(eos, list) else ([eos] if eos is not None else []),
        name=name)


def _detect_quantization(qcfg) -> str | None:
    if not isinstance(qcfg, dict):
        return None
    method = str(qcfg.get("quant_method", "")).lower()
    bits = qcfg.get("bits") or qcfg.get("w_bit")
    if "fp8" in method:
        return "fp8"
    if bits in (4, 8):
        return "int4" if bits == 4 else "int8"
    return None


def _gguf_value(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except AttributeError:  # gguf < 0.11 has no contents(): decode the scalar or string by hand
        part = field.parts[field.data[0]]
        try:
            return bytes(part).decode("utf-8") if part.dtype.kind == "u" and part.itemsize == 1 else part[0].item()
        except (ValueError, IndexError):
            return None


def model_spec_from_gguf(path: str) -> ModelSpec:
    st = os.stat(path)
    spec = _gguf_spec(os.path.abspath(path), st.st_size, st.st_mtime_ns)
    return replace(spec, config=replace(spec.config, eos_token_ids=list(spec.config.eos_token_ids)), source=path)


@functools.lru_cache(maxsize=8)
def _gguf_spec(path: str, size: int, mtime_ns: int) -> ModelSpec:
    """GGUFReader parses every metadata array (the vocabulary too): seconds on a large
    tokenizer, so a file is read once per (path, size, mtime)."""
    try:
        from gguf import GGUFReader
        reader = GGUFReader(path)
    except Exception as e:  # gguf raises ValueError / struct.error / OSError on bad files
        raise ConfigError(f"--model {path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    arch = _gguf_value(reader, "general.architecture")
    if not arch:
        raise ConfigError(f"--model {path}: GGUF metadata has no general.architecture")

    def get(key, default=None):
        value = _gguf_value(reader, f"{arch}.{key}")
        return default if value is None else value

    layers, hidden, heads = get("block_count"), get("embedding_length"), get("attention.head_count")
    if None in (layers, hidden, heads):
        raise ConfigError(f"--model {path}: GGUF metadata lacks {arch}.block_count / embedding_length / "
                          "attention.head_count; is it a decoder-only language model?")
    vocab = get("vocab_size")
    if vocab is None:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        vocab = len(tokens.data) if tokens is not None else 32000
    tensor_names = {t.name for t in reader.tensors}
    name = _gguf_value(reader, "general.name") or os.path.basename(path)
    cfg = ModelConfig(
        architecture=str(arch), vocab_size=int(vocab), hidden_size=int(hidden),
        intermediate_size=int(get("feed_forward_length", 4 * hidden)),
        num_hidden_layers=int(layers), num_attention_heads=int(heads),
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        sliding_window=get("attention.sliding_window"),
        bos_token_id=_gguf_value(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=[e] if (e := _gguf_value(reader, "tokenizer.ggml.eos_token_id")) is not None else [],
        name=str(name))
    return ModelSpec(config=cfg, dtype="bfloat16", source=path,
                     file_weight_bytes=sum(int(t.n_bytes) for t in reader.tensors))

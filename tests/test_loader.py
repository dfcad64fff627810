"""Loader: GGUF weights and config vs transformers' own GGUF loading; HF directories; errors."""
from __future__ import annotations

import contextlib
import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from tiny_models import (TINY_MODEL_KINDS, build_hf_model, llama_cpp_permute, make_tiny_gguf,  # noqa: E402
                         make_tiny_model, smollm2_gguf_path)

from kvserve.config import ModelConfig  # noqa: E402
from kvserve.model.gguf import hf_tensor_name, unpermute_rotary_rows  # noqa: E402
from kvserve.model.loader import (LoadedModel, ModelLoadError, expected_weight_names, load_model,  # noqa: E402
                                  model_config_from_hf, resolve_dtype)

HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def _no_init_weights():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: just pay for the init
        return contextlib.nullcontext()
    return no_init_weights()


@pytest.fixture(scope="module")
def smollm() -> LoadedModel:
    return load_model(None)


def hf_model_from_loaded(loaded: LoadedModel):
    """A transformers model holding exactly the weights kvserve loaded, configured from its ModelConfig."""
    c = loaded.config
    cfg_cls = getattr(transformers, HF_CLASSES[c.architecture].replace("ForCausalLM", "Config"))
    rope = {"rope_type": "default", "rope_theta": c.rope_theta, **(c.rope_scaling or {})}
    cfg = cfg_cls(vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
                  num_hidden_layers=c.num_hidden_layers, num_attention_heads=c.num_attention_heads,
                  num_key_value_heads=c.num_key_value_heads, head_dim=c.head_dim,
                  max_position_embeddings=c.max_position_embeddings, rms_norm_eps=c.rms_norm_eps,
                  rope_parameters=rope, tie_word_embeddings=c.tie_word_embeddings)
    with _no_init_weights():  # random init of 135M parameters that are overwritten anyway costs seconds
        model = getattr(transformers, HF_CLASSES[c.architecture])(cfg).eval()
    missing, unexpected = model.load_state_dict(loaded.weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    if c.tie_word_embeddings:
        model.tie_weights()
    return model


# ---------------------------------------------------------------- embedded GGUF (SmolLM2-135M)

def test_embedded_config(smollm):
    c = smollm.config
    assert (c.architecture, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        ("llama", 30, 9, 3, 64)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (576, 1536, 49152)
    assert c.rope_theta == 100000.0 and c.rope_scaling is None and c.rms_norm_eps == 1e-5
    assert c.tie_word_embeddings and "lm_head.weight" not in smollm.weights
    assert (c.bos_token_id, c.eos_token_ids) == (1, [2])
    assert smollm.tokenizer.eos_token_ids == [2]
    assert smollm.source == str(smollm2_gguf_path())
    assert set(smollm.weights) == set(expected_weight_names(c))
    assert all(w.dtype == torch.float32 for w in smollm.weights.values())


def test_embedded_model_knows_a_fact(smollm):
    # A wrong q/k permutation or name mapping still yields finite logits; only the real weights
    # put " Paris" on top here (one forward, so this stays cheap).
    model = hf_model_from_loaded(smollm)
    ids = torch.tensor([smollm.tokenizer.encode("The capital of France is")])
    with torch.no_grad():
        top = model(ids).logits[0, -1].topk(3).indices.tolist()
    assert smollm.tokenizer.decode(top[:1]) == " Paris", smollm.tokenizer.convert_ids_to_tokens(top)


@pytest.fixture(scope="module")
def hf_gguf_model():
    path = smollm2_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                            dtype=torch.float32).eval()


@pytest.mark.slow
def test_gguf_weights_equal_transformers_gguf_loading(smollm, hf_gguf_model):
    reference = hf_gguf_model.state_dict()
    reference.pop("lm_head.weight")  # tied: the same tensor as the embedding
    assert set(smollm.weights) == set(reference)
    for name, w in smollm.weights.items():
        assert torch.equal(w, reference[name]), name


@pytest.mark.slow
def test_gguf_logits_equal_transformers_gguf_model(smollm, hf_gguf_model):
    ours = hf_model_from_loaded(smollm)
    ids = torch.tensor([smollm.tokenizer.encode("def fib(n):\n    return n if n < 2 else fib(n-1) + fib(n-2)")])
    with torch.no_grad():
        a = ours(ids).logits
        b = hf_gguf_model(ids).logits
    torch.testing.assert_close(a, b, rtol=0, atol=1e-4)


def test_unpermute_inverts_llama_cpp_permutation():
    for n_head, head_dim in ((9, 64), (3, 64), (1, 8), (4, 16)):
        w = torch.randn(n_head * head_dim, 12)
        permuted = llama_cpp_permute(w, n_head)
        assert not torch.equal(permuted, w)
        assert torch.equal(unpermute_rotary_rows(permuted, n_head), w)
        b = torch.randn(n_head * head_dim)  # biases are permuted the same way
        assert torch.equal(unpermute_rotary_rows(llama_cpp_permute(b, n_head), n_head), b)


@pytest.mark.slow
@pytest.mark.parametrize("kind, quantize", [("llama_gqa", False), ("qwen2_bias", True)])
def test_tiny_gguf_round_trip(tmp_path, kind, quantize):
    # Written as llama.cpp's converter would (llama: q/k permuted; qwen2: not, with q/k/v bias;
    # untied output.weight), read back to the source weights: exactly for F32, within Q8_0's step.
    loaded = load_model(str(make_tiny_gguf(tmp_path, kind, quantize=quantize)))
    source = build_hf_model(kind)
    c, rc = loaded.config, source.config
    assert (c.architecture, c.attention_bias, c.tie_word_embeddings) == (kind.split("_")[0], kind == "qwen2_bias", False)
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps) == \
        (rc.num_hidden_layers, rc.num_attention_heads, rc.num_key_value_heads, 16, rc.rms_norm_eps)
    reference = source.state_dict()
    assert set(loaded.weights) == set(reference)
    for name, w in reference.items():
        if quantize and w.dim() == 2:  # Q8_0: 32-value blocks, scale = max|x| / 127
            torch.testing.assert_close(loaded.weights[name], w, rtol=0, atol=w.abs().max().item() / 127, msg=name)
        else:
            assert torch.equal(loaded.weights[name], w), name


def test_gguf_tensor_names():
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert hf_tensor_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    with pytest.raises(ValueError, match="unexpected GGUF tensor 'blk.0.ssm_in.weight'"):
        hf_tensor_name("blk.0.ssm_in.weight")


# ---------------------------------------------------------------- tiny HF directories

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("tiny")
    for kind in TINY_MODEL_KINDS:
        make_tiny_model(root, kind, sharded=kind == "llama_gqa")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("kind", TINY_MODEL_KINDS)
def test_tiny_checkpoint_loads_with_hf_config_and_weights(tiny_dir, kind):
    loaded = load_model(str(tiny_dir / kind))
    reference = build_hf_model(kind)  # same seed: the model that was saved
    rc, c = reference.config, loaded.config
    assert c.architecture == {"Llama": "llama", "Mistral": "mistral", "Qwen2": "qwen2"}[type(rc).__name__[:-6]]
    assert (c.hidden_size, c.intermediate_size, c.num_hidden_layers) == \
        (rc.hidden_size, rc.intermediate_size, rc.num_hidden_layers)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == \
        (rc.num_attention_heads, rc.num_key_value_heads, getattr(rc, "head_dim", None) or 16)
    assert c.rope_theta == rc.rope_parameters["rope_theta"] and c.rms_norm_eps == rc.rms_norm_eps
    assert c.tie_word_embeddings == rc.tie_word_embeddings
    assert c.attention_bias == (kind == "qwen2_bias")
    assert c.sliding_window == (rc.sliding_window if kind.startswith("mistral_swa") else None)
    if kind == "llama3_rope":
        assert c.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    else:
        assert c.rope_scaling is None
    assert (c.bos_token_id, c.eos_token_ids, loaded.tokenizer.eos_token_ids) == (1, [2], [2])
    expected = dict(reference.state_dict())
    if c.tie_word_embeddings:
        expected.pop("lm_head.weight")
    assert set(loaded.weights) == set(expected) == set(expected_weight_names(c))
    for name, w in expected.items():
        assert torch.equal(loaded.weights[name], w), name
    assert loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                                tokenize=False).endswith("assistant\n")


def test_sharded_checkpoint_reads_every_shard(tiny_dir):
    shards = sorted((tiny_dir / "llama_gqa").glob("*.safetensors"))
    assert len(shards) > 1
    loaded = load_model(str(tiny_dir / "llama_gqa"))
    assert set(loaded.weights) == set(expected_weight_names(loaded.config))


@pytest.mark.slow
def test_tiny_logits_through_hf_with_loaded_weights(tiny_dir):
    # llama3 rope scaling and the explicit head_dim must survive the config round trip
    for kind in ("llama3_rope", "llama_head_dim", "qwen2_bias"):
        loaded = load_model(str(tiny_dir / kind))
        ids = torch.tensor([loaded.tokenizer.encode("Tiny models, long enough prompt to pass 64 positions. " * 8)])
        assert ids.shape[1] > 64
        with torch.no_grad():
            a = hf_model_from_loaded(loaded)(ids).logits
            b = build_hf_model(kind)(ids).logits
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_dtype_is_applied(tiny_dir):
    loaded = load_model(str(tiny_dir / "qwen2_bias"), dtype=torch.bfloat16)
    reference = build_hf_model("qwen2_bias").state_dict()
    for name, w in loaded.weights.items():
        assert w.dtype == torch.bfloat16 and torch.equal(w, reference[name].to(torch.bfloat16)), name


def test_generation_config_eos_ids_are_merged(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir / "llama_tied", tmp_path / "m")
    gen = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [2, 0]}))
    loaded = load_model(str(d))
    assert loaded.config.eos_token_ids == [2, 0]
    assert loaded.tokenizer.eos_token_ids == [2, 0]
    assert loaded.config.sampling_defaults == {}  # none of vLLM's sampling keys in this file
    (d / "generation_config.json").write_text(json.dumps({**gen, "temperature": 0.6, "top_p": 0.9, "do_sample": True,
                                                          "max_new_tokens": 5, "num_beams": 1}))
    assert load_model(str(d)).config.sampling_defaults == {"temperature": 0.6, "top_p": 0.9, "max_tokens": 5}
    (d / "generation_config.json").write_text("{not json")  # as vLLM: warned about, the model still loads
    assert load_model(str(d)).config.sampling_defaults == {}


def test_tied_checkpoint_with_stored_lm_head_drops_it(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = shutil.copytree(tiny_dir / "llama_tied", tmp_path / "m")
    tensors = load_file(str(d / "model.safetensors"))
    save_file({**tensors, "lm_head.weight": tensors["model.embed_tokens.weight"].clone()}, str(d / "model.safetensors"))
    assert "lm_head.weight" not in load_model(str(d)).weights


# ---------------------------------------------------------------- config parsing

def _cfg(**overrides) -> dict:
    base = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 256}
    return {**base, **overrides}


def test_config_transformers4_keys():
    c = model_config_from_hf(_cfg(rope_theta=500000.0, num_key_value_heads=2, eos_token_id=[128001, 128009],
                                  rope_scaling={"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
                             "m")
    assert isinstance(c, ModelConfig)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 32.0
    assert c.eos_token_ids == [128001, 128009] and c.head_dim == 16 and c.num_key_value_heads == 2


def test_config_defaults_and_variants():
    c = model_config_from_hf(_cfg(eos_token_id=7), "m")
    assert (c.num_key_value_heads, c.head_dim, c.rope_theta, c.rope_scaling, c.eos_token_ids) == (4, 16, 10000.0, None, [7])
    q = model_config_from_hf(_cfg(architectures=["Qwen2ForCausalLM"], model_type="qwen2", sliding_window=4096,
                                  use_sliding_window=False), "q")
    assert q.attention_bias and q.sliding_window is None
    m = model_config_from_hf(_cfg(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=None), "m")
    assert m.architecture == "mistral" and m.sliding_window is None
    m = model_config_from_hf(_cfg(architectures=[], model_type="mistral", sliding_window=4096), "m")
    assert m.architecture == "mistral" and m.sliding_window == 4096
    lin = model_config_from_hf(_cfg(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}), "m")
    assert lin.rope_theta == 1e6 and lin.rope_scaling == {"rope_type": "linear", "factor": 2.0}


@pytest.mark.parametrize("cfg, message", [
    (_cfg(architectures=["Gemma2ForCausalLM"], model_type="gemma2"),
     "architecture Gemma2ForCausalLM is not supported; kvserve supports LlamaForCausalLM, MistralForCausalLM, "
     "Qwen2ForCausalLM"),
    (_cfg(architectures=None, model_type="gpt2"), "architecture model_type='gpt2' is not supported"),
    (_cfg(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}),
     "rope scaling type 'yarn' is not supported"),
    (_cfg(rope_scaling={"rope_type": "llama3", "factor": 8.0}), "llama3 rope scaling in config.json lacks"),
    ({k: v for k, v in _cfg().items() if k != "hidden_size"}, "lacks the required field 'hidden_size'"),
])
def test_config_errors(cfg, message):
    with pytest.raises(ModelLoadError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_config_from_hf(cfg, "m")


# ---------------------------------------------------------------- load errors

def _one_line(excinfo) -> str:
    msg = str(excinfo.value)
    assert "\n" not in msg
    return msg


def test_error_path_not_found(tmp_path):
    with pytest.raises(ModelLoadError) as e:
        load_model(str(tmp_path / "nope"))
    assert "not found" in _one_line(e)


def test_error_missing_files(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir / "llama_tied", tmp_path / "m")
    (d / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d))
    assert "has no tokenizer.json" in _one_line(e)
    shutil.copy(tiny_dir / "llama_tied" / "tokenizer.json", d)
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d))
    assert "has no *.safetensors weight files" in _one_line(e)
    (d / "config.json").unlink()
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d))
    assert "has no config.json" in _one_line(e)


def test_error_missing_shard_and_weight(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir / "llama_gqa", tmp_path / "m")
    shard = sorted(d.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d))
    assert f"missing safetensors shards listed in its index: {shard.name}" in _one_line(e)
    (d / "model.safetensors.index.json").unlink()  # now the remaining shards lack some tensors
    with pytest.raises(ModelLoadError) as e:
        load_model(str(d))
    assert "lacks weights" in _one_line(e)


def test_error_unsupported_architecture_directory(tiny_dir, tmp_path):
    d = shutil.copytree(tiny_dir / "llama_tied", tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "architectures": ["PhiForCausalLM"], "model_type": "phi"}))
    with pytest.raises(ModelLoadError, match="architecture PhiForCausalLM is not supported"):
        load_model(str(d))


@pytest.mark.slow
def test_error_corrupt_and_truncated_gguf(tmp_path):
    src = smollm2_gguf_path()
    truncated = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        truncated.write_bytes(f.read(src.stat().st_size // 2))
    with pytest.raises(ModelLoadError) as e:
        load_model(str(truncated))
    assert "corrupt or truncated GGUF" in _one_line(e)
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"PK\x03\x04" + b"\x00" * 64)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(garbage))
    assert "is not a GGUF file" in _one_line(e)
    header_only = tmp_path / "header.gguf"
    header_only.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ModelLoadError) as e:
        load_model(str(header_only))
    assert "corrupt or truncated GGUF" in _one_line(e)
    other = tmp_path / "weights.bin"
    other.write_bytes(b"\x00")
    with pytest.raises(ModelLoadError, match="not a .gguf checkpoint"):
        load_model(str(other))


# ---------------------------------------------------------------- dtype

def test_resolve_dtype():
    assert resolve_dtype("float32", "cuda") == torch.float32
    assert resolve_dtype("float16", "cpu") == torch.float16
    assert resolve_dtype("bfloat16", "cpu") == torch.bfloat16
    assert resolve_dtype("auto", "cuda") == torch.bfloat16
    with pytest.raises(ModelLoadError, match="--dtype must be one of"):
        resolve_dtype("fp64", "cpu")


@pytest.mark.parametrize("flags, bf16", [("fpu avx2 fma", False), ("fpu avx512f avx512bw", False),
                                         ("fpu avx512f avx512_bf16", True), ("fpu amx_bf16 amx_tile", True),
                                         ("fpu avx512_bf16_extra", False)])
def test_auto_dtype_on_cpu_follows_the_cpu_flags(flags, bf16, monkeypatch):
    from kvserve.model import loader
    cpuinfo = f"processor\t: 0\nvendor_id\t: X\nflags\t\t: {flags}\nbogomips\t: 1\n"
    assert loader.cpu_has_bf16(cpuinfo) is bf16
    monkeypatch.setattr(loader, "cpu_has_bf16", lambda: bf16)
    assert resolve_dtype("auto", "cpu") == (torch.bfloat16 if bf16 else torch.float32)




@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama_gqa", "llama3_rope", "mistral_swa", "qwen2_bias", "llama_tied"])
def test_hf_config_dict_inverts_model_config_from_hf(tmp_path, kind):
    from kvserve.model.loader import hf_config_dict, load_hf_directory, model_config_from_hf
    cfg = load_hf_directory(make_tiny_model(tmp_path, kind)).config
    assert model_config_from_hf(hf_config_dict(cfg), name=cfg.name) == cfg

"""Mistakes a user can make at start-up or per request: each is refused with a message naming
what to change (found by auditing the CLI and offline API as a vLLM user would use them)."""
from __future__ import annotations

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.config import ConfigError, EngineArgs, host_memory
from kvserve.core.sampling_params import SamplingParamsError
from kvserve.model.tokenizer import TokenizerError, chat_text_messages


def test_cli_reports_load_errors_in_one_line(capsys, tmp_path):
    assert main(["generate", "hi", "--model", str(tmp_path / "nonexistent")]) == 2
    err = capsys.readouterr().err
    assert "error: model path" in err and "not found" in err and "Traceback" not in err
    (tmp_path / "empty").mkdir()
    assert main(["generate", "hi", "--model", str(tmp_path / "empty")]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_max_model_len_past_the_model_needs_the_override(tiny, monkeypatch):
    with pytest.raises(ConfigError, match=r"--max-model-len 2048 is larger than the model's context size "
                                          r"\(max_position_embeddings 1024\).*KVSERVE_ALLOW_LONG_MAX_MODEL_LEN"):
        LLM(tiny, dtype="float32", max_model_len=2048, kv_cache_memory="16MiB")
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's switch works too
    assert LLM(tiny, dtype="float32", max_model_len=2048, kv_cache_memory="16MiB").engine.max_model_len == 2048


@pytest.mark.needs("linux")
def test_budgets_beyond_the_machine_are_refused():
    total = host_memory("MemTotal")
    with pytest.raises(ConfigError, match="more than 70% of this machine's"):
        EngineArgs(swap_space=total / 2**30).validate()


@pytest.mark.needs("linux")
def test_kv_cache_larger_than_memory_is_refused(tiny):
    with pytest.raises(ConfigError, match="memory available; lower --kv-cache-memory"):
        LLM(tiny, dtype="float32", kv_cache_memory="64TiB")


@pytest.mark.parametrize("kwargs, message", [
    (dict(top_k=-2), "top_k must be -1 or 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature="a"), "temperature must be a finite number"),
    (dict(max_tokens=2.5), "max_tokens must be an integer"),
    (dict(stop=5), "stop must be a string or a list"),
    (dict(seed=True), "seed must be an integer"),
])
def test_sampling_params_of_the_wrong_kind(kwargs, message):
    with pytest.raises(SamplingParamsError, match=message):
        SamplingParams(**kwargs).validate()


def test_sampling_params_vllm_spellings_still_work():
    for kwargs in (dict(top_k=-1), dict(stop="x"), dict(stop=None), dict(stop=("a", "b"))):
        SamplingParams(**kwargs).validate()
    assert SamplingParams(top_k=-1).top_k == 0 and SamplingParams(stop="x").stop == ["x"]


def test_chat_messages_are_normalised_or_refused():
    out = chat_text_messages([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                              {"role": "assistant", "content": None, "tool_calls": []}])
    assert out == [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": "", "tool_calls": []}]
    for messages, message in (([{"role": "user", "content": 5}], r"messages\[0\].content must be a string"),
                              ([{"role": "bot", "content": "x"}], r"messages\[0\].role must be one of"),
                              ([{"role": "user", "content": [{"type": "image_url"}]}], "'image_url' is not supported"),
                              ([], "non-empty list"), (["hi"], r"messages\[0\] must be a dict")):
        with pytest.raises(TokenizerError, match=message):
            chat_text_messages(messages)


def _serve(argv: list[str]):
    """`kvserve serve ARGV` parsed as the CLI does: the namespace and the EngineArgs it makes."""
    from kvserve.cli import build_parser, engine_args_from
    ns = build_parser().parse_args(["serve", *argv])
    return ns, engine_args_from(ns)


@pytest.mark.parametrize("argv, field, value", [
    (["-tp", "1"], None, None),  # accepted at its one supported value: nothing to set
    (["--generation-config", "vllm"], "generation_config", "vllm"),
    (["--generation-config", "auto"], "generation_config", "auto"),
    (["--tokenizer-mode", "auto"], None, None),
    (["--distributed-executor-backend", "mp"], None, None),
    (["--load-format", "auto"], None, None), (["--load-format", "safetensors"], None, None),
    (["--load-format", "gguf"], None, None),
    (["--dtype", "half"], "dtype", "float16"), (["--dtype", "float"], "dtype", "float32"),
])
def test_vllm_engine_flags_take_effect_or_are_harmless(argv, field, value):
    """A vLLM flag kvserve implements sets its EngineArgs field; one accepted at its only harmless
    value sets nothing (the EngineArgs equal the defaults')."""
    _, args = _serve(argv)
    if field is None:
        assert args == _serve([])[1]
    else:
        assert getattr(args, field) == value


@pytest.mark.parametrize("argv", [["--max-seq-len-to-capture", "8192"], ["--disable-frontend-multiprocessing"]])
def test_vllm_noop_flags_say_they_do_nothing(argv, caplog):
    with caplog.at_level("INFO", logger="kvserve"):
        _, args = _serve(argv)
    assert args == _serve([])[1]
    assert f"{argv[0]}: accepted, nothing to do" in caplog.text


@pytest.mark.parametrize("argv, attr, value", [(["--root-path", "/x"], "root_path", "/x"),
                                               (["--allowed-origins", '["http://a"]'], "allowed_origins", ["http://a"]),
                                               (["--response-role", "bot"], "response_role", "bot")])
def test_vllm_server_flags_reach_the_server_settings(argv, attr, value):
    ns, _ = _serve(argv)
    assert getattr(ns, attr) == value and getattr(_serve([])[0], attr) != value


@pytest.mark.parametrize("argv, message", [(["-pp", "2"], "pipeline parallelism"),
                                           (["--tokenizer-mode", "slow"], "fast tokenizer"),
                                           (["--distributed-executor-backend", "threads"], "invalid choice"),
                                           (["--allowed-origins", "*"], "JSON list")])
def test_vllm_serve_flags_refused_with_the_reason(argv, message, capsys):
    from kvserve.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", *argv])
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("alias, dtype", [("half", "float16"), ("float", "float32")])
def test_vllm_dtype_spellings_map_to_one_name(alias, dtype):
    args = EngineArgs(dtype=alias)
    args.validate()
    assert args.dtype == dtype


def test_max_logprobs_minus_one_means_the_vocabulary(tiny):
    """vLLM's -1 is "no cap": every request may ask up to the vocabulary, not none of them."""
    with pytest.raises(ConfigError, match="-1 for no cap"):
        EngineArgs(model=str(tiny), max_logprobs=-2).validate()
    llm = LLM(str(tiny), max_logprobs=-1, dtype="float32", kv_cache_memory="16MiB")
    vocab = llm.engine.model_config.vocab_size
    assert llm.engine.max_logprobs == vocab
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=vocab), use_tqdm=False)[0]
    assert len(out.outputs[0].logprobs[0]) == vocab
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=1, logprobs=vocab + 1), use_tqdm=False)


def test_override_generation_config_must_be_a_json_object():
    from kvserve.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--override-generation-config", "temperature=0.5"])
    ns = build_parser().parse_args(["serve", "--override-generation-config", '{"temperature": 0.5}'])
    assert ns.override_generation_config == {"temperature": 0.5}
    with pytest.raises(ConfigError, match="JSON object of generation_config.json keys"):
        EngineArgs(override_generation_config=[("temperature", 0.5)]).validate()


def test_generation_config_folder_without_the_file_is_refused(tmp_path):
    from kvserve.config import ConfigError, EngineArgs
    with pytest.raises(ConfigError, match="a folder holding a generation_config.json; '.*' has none"):
        EngineArgs(generation_config=str(tmp_path)).validate()


@pytest.mark.slow
def test_a_quantized_cache_that_holds_less_than_auto_says_so_at_startup(caplog):
    """The residual pool of a quantized cache is taken off --kv-cache-memory first (one open block per
    --max-num-seqs, plus one); where that leaves fewer tokens than a full-precision cache, startup
    warns. The figures follow from the model's shapes by docs/kv-cache.md's formulas."""
    memory, block = 100 * 2**20, 16
    with caplog.at_level("INFO", logger="kvserve.runner.build"):
        llm = LLM(None, kv_cache_dtype="int8", kv_cache_memory=memory, max_model_len=512)
    c = llm.engine.model_config
    L, H, D = c.num_hidden_layers, c.num_key_value_heads, c.head_dim
    e = torch.empty((), dtype=llm.engine.runner.dtype).element_size()
    int8_block = L * block * (2 * H * D + 4 * H * D // min(32, block) + 4 * H * D // min(32, D))
    entry = L * block * (2 * H * D * e + 1)  # one open block at the model dtype, plus its mask
    entries = 256 + 1
    blocks = (memory - entries * entry) // int8_block
    if blocks < entries:  # the pool gets at most one entry per block: size them together
        blocks = memory // (int8_block + entry)
    auto_tokens = memory // (L * block * 2 * H * D * e) * block
    assert blocks * block < auto_tokens  # the case this test is about
    text = caplog.text
    assert f"takes {min(entries, blocks) * entry / 2**20:.1f} MiB" in text
    assert (f"holds {blocks * block} tokens in this budget, fewer than auto's {auto_tokens}" in text
            and "lower --max-num-seqs" in text)

"""Mistakes a user can make at start-up or per request: each is refused with a message naming
what to change (found by auditing the CLI and offline API as a vLLM user would use them)."""
from __future__ import annotations

import pytest
from tiny_models import make_tiny_model

from kvserve import LLM, SamplingParams
from kvserve.cli import main
from kvserve.config import ConfigError, EngineArgs, host_memory
from kvserve.core.sampling_params import SamplingParamsError
from kvserve.model.tokenizer import TokenizerError, chat_text_messages


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny"), kind="llama_gqa"))  # max_position_embeddings 1024


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


def test_budgets_beyond_the_machine_are_refused():
    total = host_memory("MemTotal")
    if total is None:
        pytest.skip("no /proc/meminfo")
    with pytest.raises(ConfigError, match="more than 70% of this machine's"):
        EngineArgs(swap_space=total / 2**30).validate()


def test_kv_cache_larger_than_memory_is_refused(tiny):
    if host_memory() is None:
        pytest.skip("no /proc/meminfo")
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


@pytest.mark.parametrize("argv", [["-tp", "1"], ["--generation-config", "vllm"], ["--generation-config", "auto"],
                                  ["--tokenizer-mode", "auto"],
                                  ["--distributed-executor-backend", "mp"], ["--max-seq-len-to-capture", "8192"],
                                  ["--disable-frontend-multiprocessing"], ["--root-path", "/x"],
                                  ["--allowed-origins", '["http://a"]'], ["--response-role", "bot"],
                                  ["--load-format", "auto"], ["--load-format", "safetensors"],
                                  ["--load-format", "gguf"], ["--dtype", "half"], ["--dtype", "float"]])
def test_vllm_serve_flags_are_accepted(argv):
    from kvserve.cli import build_parser
    build_parser().parse_args(["serve", *argv])


@pytest.mark.parametrize("argv, message", [(["-tp", "2"], "tensor parallelism"),
                                           (["--tokenizer-mode", "slow"], "fast tokenizer"),
                                           (["--distributed-executor-backend", "ray"], "no Ray backend"),
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


def test_a_quantized_cache_that_holds_less_than_auto_says_so_at_startup(caplog):
    """The residual pool of a quantized cache is taken off --kv-cache-memory first (one open block per
    --max-num-seqs); where that leaves fewer tokens than a full-precision cache, startup warns."""
    with caplog.at_level("INFO", logger="kvserve.runner.build"):
        LLM(None, kv_cache_dtype="int8", kv_cache_memory=100 * 2**20, max_model_len=512)
    text = caplog.text
    assert "residual pool" in text and "takes 62.7 MiB" in text  # 178 entries: one per block
    assert "holds 2848 tokens in this budget, fewer than auto's 4544" in text and "lower --max-num-seqs" in text

"""Server parts that need no model: CLI flags, API keys and salts, request models, metrics export."""
from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import generate_latest
from pydantic import ValidationError
from server_util import parse_metrics

from kvserve.cli import build_parser, engine_args_from
from kvserve.config import ConfigError, EngineArgs
from kvserve.engine.async_engine import StepEvent
from kvserve.engine.outputs import CompletionOutput, EngineStats, RequestMetrics, RequestOutput, RequestProgress
from kvserve.server.auth import Authenticator, effective_cache_salt, load_api_keys
from kvserve.server.metrics import ServerMetrics, build_1_2_5_buckets
from kvserve.server.protocol import ChatCompletionRequest, CompletionRequest

# ----- CLI -----

def parse(*argv):
    return build_parser().parse_args(list(argv))


def test_every_engine_field_has_a_flag_with_vllm_spelling():
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    for name in EngineArgs.field_names():
        assert "--" + name.replace("_", "-") in help_text, name


def test_engine_flags_map_one_to_one():
    ns = parse("serve", "some/model", "--kv-cache-memory", "4GiB", "--no-enable-prefix-caching",
               "--max-num-seqs", "8", "--block-size", "32", "--kv-cache-dtype", "int8",
               "--no-enable-chunked-prefill", "--max-num-batched-tokens", "4096", "--served-model-name", "a", "b",
               "--scheduling-policy", "priority", "--seed", "7", "--disable-log-stats")
    args = engine_args_from(ns)
    assert args.model == "some/model"
    assert args.kv_cache_memory == 4 * 1024**3
    assert args.enable_prefix_caching is False and args.enable_chunked_prefill is False
    assert (args.max_num_seqs, args.block_size, args.kv_cache_dtype) == (8, 32, "int8")
    assert (args.max_num_batched_tokens, args.scheduling_policy, args.seed) == (4096, "priority", 7)
    assert args.served_model_name == "a" and ns.served_model_name == ["a", "b"]
    assert args.disable_log_stats is True
    defaults = engine_args_from(parse("serve"))
    assert dataclasses.asdict(defaults) == dataclasses.asdict(_validated(EngineArgs()))


def test_server_defaults():
    ns = parse("serve")
    assert (ns.host, ns.port, ns.api_key) == ("127.0.0.1", 8000, [])


@pytest.mark.parametrize("argv, needle", [
    (["--pipeline-parallel-size", "2"], "pipeline parallelism is not implemented"),
    (["--quantization", "awq"], "invalid choice: 'awq'"),
    (["--max-loras", "many"], "invalid int value: 'many'"),
    (["--speculative-config", "[4]"], "a JSON object"),
    (["--kv-cache-memory", "lots"], "cannot parse 'lots'"),
    (["--kv-cache-dtype", "fp4"], "invalid choice"),
])
def test_unimplemented_or_bad_flags_are_refused(argv, needle, capsys):
    with pytest.raises(SystemExit) as e:
        parse("serve", *argv)
    assert e.value.code == 2
    assert needle in capsys.readouterr().err


def test_kv_transfer_config_errors_name_the_key_at_start_up():
    with pytest.raises(ConfigError, match="kv_connector None is not available"):
        engine_args_from(parse("serve", "--kv-transfer-config", "{}"))


def test_tensor_parallel_size_one_is_accepted():
    ns = parse("serve", "--tensor-parallel-size", "1", "--trust-remote-code")
    assert engine_args_from(ns) == _validated(EngineArgs())


@pytest.mark.parametrize("value, expected", [
    ("2048", 2048), ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("1m", 1_000_000), ("1M", 1024**2),
])
def test_integer_flags_take_vllms_suffixes(value, expected):
    args = engine_args_from(parse("serve", "--max-model-len", value, "--max-num-batched-tokens", value))
    assert args.max_model_len == expected and args.max_num_batched_tokens == expected


def test_max_model_len_auto_means_the_models_own():
    assert engine_args_from(parse("serve", "--max-model-len", "auto")).max_model_len is None
    assert engine_args_from(parse("serve", "--max-model-len", "-1")).max_model_len is None


@pytest.mark.parametrize("argv, needle", [
    (["--max-model-len", "1.5K"], "did you mean 1.5k"),
    (["--max-model-len", "lots"], "32k = 32,000, 32K = 32,768"),
    (["--kv-cache-memory-bytes", "4GiB"], "cannot parse '4GiB'"),
])
def test_bad_suffixed_integers_are_refused_with_the_convention(argv, needle, capsys):
    with pytest.raises(SystemExit):
        parse("serve", *argv)
    assert needle in capsys.readouterr().err


def test_kv_cache_memory_bytes_is_vllms_name_for_the_budget():
    assert engine_args_from(parse("serve", "--kv-cache-memory-bytes", "2G")).kv_cache_memory == 2 * 1024**3
    assert engine_args_from(parse("serve", "--kv-cache-memory-bytes", "2g")).kv_cache_memory == 2 * 10**9
    assert engine_args_from(parse("serve", "--kv-cache-memory-bytes", "123456")).kv_cache_memory == 123456


def test_num_gpu_blocks_override_zero_is_refused_before_loading():
    with pytest.raises(ConfigError, match="--num-gpu-blocks-override must be >= 1"):
        engine_args_from(parse("serve", "--num-gpu-blocks-override", "0"))


def test_api_keys_after_one_flag_or_repeated(tmp_path):
    from kvserve.cli import check_api_keys
    ns = parse("serve", "--api-key", "a", "b", "--api-key", "c")
    assert ns.api_key == ["a", "b", "c"]
    check_api_keys(ns)
    # `--api-key KEY MODEL` would read the model as a second key and serve the default model
    with pytest.raises(ConfigError, match="give the model before the keys"):
        check_api_keys(parse("serve", "--api-key", "k", str(tmp_path)))
    check_api_keys(parse("serve", str(tmp_path), "--api-key", "k"))


def test_harmless_vllm_launch_flags_are_accepted():
    ns = parse("serve", "-O3", "--download-dir", "/models", "-cc", '{"level": 3}', "--compilation-config", "{}",
               "--optimization-level", "2", "--disable-fastapi-docs", "--trust-remote-code")
    assert engine_args_from(ns) == _validated(EngineArgs())
    assert ns.disable_fastapi_docs is True


def _validated(args: EngineArgs) -> EngineArgs:
    args.validate()  # resolves defaults that depend on other flags (preemption mode)
    return args


def test_invalid_engine_values_are_config_errors():
    with pytest.raises(ConfigError, match="--block-size"):
        engine_args_from(parse("serve", "--block-size", "3"))


def test_tool_subcommands_are_wired_when_present():
    sub = build_parser()._subparsers._group_actions[0].choices
    for name in ("serve", "generate", "chat"):
        assert name in sub
    import importlib.util
    for module, command in (("plan", "plan"), ("analyze", "analyze"), ("stats", "stats")):
        if importlib.util.find_spec(f"kvserve.tools.{module}") is not None:
            assert command in sub
            assert sub[command].get_default("_run") is not None


# ----- auth -----

def test_api_keys_file_formats(tmp_path):
    j = tmp_path / "keys.json"
    j.write_text(json.dumps({"ka": "alice", "kb": "bob"}))
    lst = tmp_path / "keys_list.json"
    lst.write_text(json.dumps([{"key": "kc", "tenant": "carol"}, {"key": "kd"}]))
    txt = tmp_path / "keys.txt"
    txt.write_text("# comment\nke erin\n\nkf\n")
    assert {(k.key, k.tenant) for k in load_api_keys(["shared"], str(j))} == \
        {("shared", None), ("ka", "alice"), ("kb", "bob")}
    assert {(k.key, k.tenant) for k in load_api_keys([], str(lst))} == {("kc", "carol"), ("kd", "kd")}
    assert {(k.key, k.tenant) for k in load_api_keys([], str(txt))} == {("ke", "erin"), ("kf", "kf")}


@pytest.mark.parametrize("content, needle", [
    ("{not json", "invalid JSON"), ("a b c\n", "expected `KEY [TENANT]`"), ("", "no keys found"),
    ('[{"tenant": "x"}]', "string \"key\""),
])
def test_bad_api_keys_files(tmp_path, content, needle):
    f = tmp_path / "k"
    f.write_text(content)
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[").replace("]", r"\]")):
        load_api_keys([], str(f))


def test_missing_keys_file_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_api_keys([], str(tmp_path / "absent"))


def test_authenticate():
    auth = Authenticator(load_api_keys(["k1", "k2"], None))
    assert auth.enabled
    assert auth.authenticate("Bearer k2").key == "k2"
    assert auth.authenticate("bearer k1").key == "k1"
    for bad in (None, "", "Bearer", "Bearer k3", "Basic k1", "k1"):
        assert auth.authenticate(bad) is None
    assert not Authenticator([]).enabled


def test_cache_salt_combines_tenant_and_client_salt():
    assert effective_cache_salt(None, None) is None
    assert effective_cache_salt(None, "x") == "x"
    a, b = effective_cache_salt("alice", None), effective_cache_salt("bob", None)
    assert a != b
    # A client salt splits a tenant's cache further but never lands in another tenant's.
    assert effective_cache_salt("alice", "x") not in (a, b, effective_cache_salt("bob", "x"), "x")
    assert effective_cache_salt("alice", "x") == effective_cache_salt("alice", "x")
    # No ambiguity from concatenation.
    assert effective_cache_salt("ab", "c") != effective_cache_salt("a", "bc")


# ----- request models -----

@pytest.mark.parametrize("body", [
    {"prompt": "x", "max_tokens": "5"}, {"prompt": "x", "stream": "yes"}, {"prompt": 5},
    {"prompt": "x", "n": 0}, {"prompt": "x", "temperature": -1}, {"prompt": [1, "a"]}, {},
])
def test_completion_request_is_strict(body):
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate(body)


def test_completion_request_accepts_openai_and_vllm_fields():
    r = CompletionRequest.model_validate({
        "prompt": [[1, 2], [3]], "temperature": 0, "top_k": 5, "min_p": 0.1, "ignore_eos": True,
        "min_tokens": 2, "priority": 3, "cache_salt": "s", "stream_options": {"include_usage": True},
        "repetition_penalty": 1.1, "unknown_new_openai_field": 1})
    assert r.prompt == [[1, 2], [3]] and r.temperature == 0.0 and r.top_k == 5


def test_unset_request_fields_take_the_generation_config_defaults():
    from types import SimpleNamespace

    from kvserve.server.serving import OpenAIServing, ServingConfig
    llm = SimpleNamespace(tokenizer=None, max_model_len=100, token_text=str,
                          sampling_defaults={"temperature": 0.6, "top_p": 0.9, "max_tokens": 8})
    serving = OpenAIServing(llm, ServingConfig(served_model_names=["m"]))
    unset = serving._sampling_params(CompletionRequest.model_validate({"prompt": "x"}), 50, None)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.6, 0.9, 0, 8)
    given = serving._sampling_params(CompletionRequest.model_validate(
        {"prompt": "x", "temperature": 0, "top_p": 1.0, "max_tokens": 30}), 30, None)
    assert (given.temperature, given.top_p, given.max_tokens) == (0.0, 1.0, 8)  # max_new_tokens caps, as vLLM
    llm.sampling_defaults = {}
    assert serving._sampling_params(CompletionRequest.model_validate({"prompt": "x"}), 50, None).temperature == 1.0


def test_chat_request_needs_messages():
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({"messages": []})
    r = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]})
    assert r.messages[0].content[0].text == "hi"


# ----- metrics -----

def stats(**kw) -> EngineStats:
    base = dict(num_running=2, num_waiting=1, num_blocks_total=100, num_blocks_free=60, num_blocks_used=30,
                num_blocks_cached=10, kv_usage=0.3, cached_usage=0.1, token_occupancy=0.8,
                prefix_cache_queries=200, prefix_cache_hits=50, num_preemptions=1,
                prompt_tokens_total=200, generation_tokens_total=20, tier_hits={"device": 50})
    base.update(kw)
    return EngineStats(**base)


def finished_output(rid: str, t0: float) -> RequestOutput:
    m = RequestMetrics(arrival_time=t0, first_scheduled_time=t0 + 0.5, first_token_time=t0 + 1.0,
                       last_token_time=t0 + 3.0, finished_time=t0 + 3.0, num_cached_tokens=16)
    outs = [CompletionOutput(index=0, text="abc", token_ids=[1, 2, 3, 4, 5], finish_reason="length")]
    return RequestOutput(rid, None, list(range(40)), outs, True, 16, m)


def test_metrics_export_vllm_names_with_model_label():
    m = ServerMetrics("my-model", 1024)
    m(StepEvent(stats(), [], [], 0.0))
    m(StepEvent(stats(prefix_cache_queries=300, prefix_cache_hits=150, num_preemptions=3,
                      tier_hits={"device": 150}), [finished_output("r1", 10.0)], ["r2"], 13.0))
    text = generate_latest(m.registry).decode()
    samples = parse_metrics(text)
    label = '{engine="0",model_name="my-model"}'
    assert samples["vllm:gpu_cache_usage_perc" + label] == 0.3
    assert samples["vllm:kv_cache_usage_perc" + label] == 0.3
    assert samples["vllm:num_requests_running" + label] == 2
    assert samples["vllm:prefix_cache_queries_total" + label] == 300  # counters follow the cumulative stats
    assert samples["vllm:prefix_cache_hits_total" + label] == 150
    assert samples["vllm:gpu_prefix_cache_hit_rate" + label] == 0.5
    assert samples["vllm:num_preemptions_total" + label] == 3
    assert samples["kvserve:kv_blocks_cached" + label] == 10
    assert samples["kvserve:kv_cached_usage_perc" + label] == 0.1
    assert samples["kvserve:kv_token_occupancy_perc" + label] == 0.8
    assert samples['vllm:request_success_total{engine="0",finished_reason="length",model_name="my-model"}'] == 1
    assert samples['vllm:request_success_total{engine="0",finished_reason="abort",model_name="my-model"}'] == 1
    assert samples["vllm:time_to_first_token_seconds_sum" + label] == pytest.approx(1.0)
    assert samples["vllm:request_queue_time_seconds_sum" + label] == pytest.approx(0.5)
    assert samples["vllm:e2e_request_latency_seconds_sum" + label] == pytest.approx(3.0)
    assert samples["vllm:request_time_per_output_token_seconds_sum" + label] == pytest.approx(0.5)
    assert samples["vllm:request_prompt_tokens_sum" + label] == 40
    assert samples["vllm:request_generation_tokens_sum" + label] == 5
    for line in text.splitlines():
        # every engine series is labelled; the process / runtime collectors' are not (as on vLLM)
        if line and not line.startswith(("#", "process_", "python_")):
            assert 'model_name="my-model"' in line, line
    assert "process_resident_memory_bytes" in text and "python_info" in text


def test_inter_token_latency_from_streamed_outputs():
    m = ServerMetrics("m", 64)
    met = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=0.2, last_token_time=0.2)
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "a", [7])], False, 0, met)
    m(StepEvent(stats(), [out], [], 0.2))
    met2 = dataclasses.replace(met, last_token_time=0.5)
    out2 = dataclasses.replace(out, outputs=[CompletionOutput(0, "ab", [7, 8])], metrics=met2)
    m(StepEvent(stats(), [out2], [], 0.5))
    s = parse_metrics(generate_latest(m.registry).decode())
    assert s['vllm:inter_token_latency_seconds_count{engine="0",model_name="m"}'] == 1
    assert s['vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"}'] == pytest.approx(0.3)
    assert s['vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"}'] == pytest.approx(0.2)


def test_token_buckets():
    assert build_1_2_5_buckets(100) == [1, 2, 5, 10, 20, 50, 100]


def test_inter_token_latency_of_a_request_whose_output_waits_for_the_end():
    """A non-streamed request (FINAL_ONLY) has no output until it finishes; the engine's
    per-step RequestProgress still gives TTFT and every inter-token gap, counted once."""
    m = ServerMetrics("m", 64)
    m(StepEvent(stats(), [], [], 0.2, progress=[RequestProgress("r", 1, 0.0, 0.2, 0.2)]))
    m(StepEvent(stats(), [], [], 0.5, progress=[RequestProgress("r", 2, 0.0, 0.2, 0.5)]))
    met = RequestMetrics(arrival_time=0.0, first_scheduled_time=0.0, first_token_time=0.2,
                         last_token_time=0.9, finished_time=0.9)
    out = RequestOutput("r", None, [1, 2], [CompletionOutput(0, "abc", [7, 8, 9], finish_reason="length")],
                        True, 0, met)
    m(StepEvent(stats(), [out], [], 0.9, progress=[RequestProgress("r", 3, 0.0, 0.2, 0.9)]))
    s = parse_metrics(generate_latest(m.registry).decode())
    assert s['vllm:inter_token_latency_seconds_count{engine="0",model_name="m"}'] == 2
    assert s['vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"}'] == pytest.approx(0.7)
    assert s['vllm:time_to_first_token_seconds_count{engine="0",model_name="m"}'] == 1
    assert s['vllm:request_generation_tokens_sum{engine="0",model_name="m"}'] == 3
    assert s['vllm:request_success_total{engine="0",finished_reason="length",model_name="m"}'] == 1


def test_the_request_log_records_aborted_requests_with_why(tmp_path):
    """--request-log writes a line for every request that ended: finished ones, and aborted ones
    with finish_reason "abort" and the abort_reason the engine gave (the client, the drain, a step)."""
    from kvserve.core.request_log import REQUEST_LOG_KEYS
    from kvserve.engine.async_engine import StepEvent
    from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from kvserve.server.metrics import RequestLogWriter

    def output(rid: str, reason: str, n: int) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=1.0, first_scheduled_time=1.1, first_token_time=1.2,
                                 last_token_time=1.5, finished_time=1.6, num_cached_tokens=0, max_tokens=10)
        done = CompletionOutput(index=0, text="x" * n, token_ids=list(range(n)), cumulative_logprob=None,
                                logprobs=None, finish_reason=reason)
        return RequestOutput(rid, None, [1, 2, 3], [done], True, 0, metrics)

    path = tmp_path / "requests.jsonl"
    writer = RequestLogWriter(str(path))
    writer(StepEvent(stats=None, outputs=[output("done", "length", 10)], aborted=["gone"], now=0.0,
                     ended=[(output("gone", "abort", 4), "client"), (output("late", "abort", 7), "shutdown")]))
    writer.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["request_id"], r["finish_reason"], r.get("abort_reason"), r["output_tokens"]) for r in lines] == [
        ("done", "length", None, 10), ("gone", "abort", "client", 4), ("late", "abort", "shutdown", 7)]
    assert all(set(r) <= set(REQUEST_LOG_KEYS) for r in lines)


def test_outputs_a_slow_reader_has_not_read_merge_into_one():
    """A stream's unread outputs come out as one: cumulative fields from the last, deltas joined,
    so a client that reads slowly costs one SSE event per read, not one per engine step."""
    import asyncio

    from kvserve.engine.async_engine import RequestStream
    from kvserve.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def step(tokens: list[int], new: list[int], finished: bool = False) -> RequestOutput:
        metrics = RequestMetrics(arrival_time=0.0, first_scheduled_time=None, first_token_time=None,
                                 last_token_time=None, finished_time=None, num_cached_tokens=0, max_tokens=9)
        o = CompletionOutput(index=0, text="".join(map(str, tokens)), token_ids=tokens,
                             finish_reason="length" if finished else None,
                             delta_text="".join(map(str, new)), delta_token_ids=new)
        return RequestOutput("r", None, [1], [o], finished, 0, metrics)

    class Engine:
        aborted: list[str] = []

        def abort(self, request_id):
            self.aborted.append(request_id)

    async def main():
        stream = RequestStream(Engine(), "r", asyncio.get_running_loop())
        for item in (step([1], [1]), step([1, 2], [2]), step([1, 2, 3], [3])):
            stream._sink.queue.put_nowait(item)
        got = []
        async for out in stream:
            got.append(out)
            if len(got) == 1:
                stream._sink.queue.put_nowait(step([1, 2, 3, 4], [4], finished=True))
        return got

    first, last = asyncio.run(main())
    assert first.outputs[0].token_ids == [1, 2, 3] and first.outputs[0].delta_token_ids == [1, 2, 3]
    assert first.outputs[0].delta_text == "123" and not first.finished
    assert last.finished and last.outputs[0].delta_token_ids == [4]


@settings(max_examples=300, deadline=None)
@given(text=st.text(), request_id=st.text(min_size=1), model=st.text(min_size=1), index=st.integers(0, 200),
       created=st.integers(0, 2**40), finish=st.sampled_from([None, "stop", "length", "abort"]),
       stop=st.one_of(st.none(), st.integers(0, 2**31), st.text()))
def test_stream_chunk_templates_write_what_the_models_write(text, request_id, model, index, created, finish, stop):
    """The streamed events' fast path: the same bytes as the pydantic chunks, any text (quotes,
    controls, non-ASCII, emoji), chat and completions."""
    from kvserve.server import protocol as P
    from kvserve.server.sse import ChunkTemplate, chat_chunk, sse_event
    completion = P.CompletionChunk(id=request_id, created=created, model=model, choices=[
        P.CompletionStreamChoice(index=index, text=text, finish_reason=finish, stop_reason=stop)])
    assert ChunkTemplate(request_id, created, model, chat=False).event(index, text, finish, stop) == \
        sse_event(completion.model_dump())
    chat = P.ChatCompletionChunk(id=request_id, created=created, model=model, choices=[P.ChatStreamChoice(
        index=index, delta=P.DeltaMessage(content=text), finish_reason=finish, stop_reason=stop)])
    assert ChunkTemplate(request_id, created, model, chat=True).event(index, text, finish, stop) == \
        sse_event(chat_chunk(chat))

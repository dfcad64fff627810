"""vLLM engine arguments kvserve refuses or accepts as no-ops, with why: what `--help`, the
CLI's errors and `LLM(**kwargs)` say about them (config.py checks them, cli.py turns them into flags)."""

# vLLM arguments kvserve does not implement: name -> (accepted value(s) or None, why); the CLI's flags
# and `LLM(**kwargs)` both take them. A flag whose field is
# added to EngineArgs later is generated from it instead, so an entry here can never shadow a real one.
VLLM_REFUSED = {
    "pipeline_parallel_size": ("1", "pipeline parallelism is not implemented"),
    "enable_expert_parallel": (None, "mixture-of-experts models are not supported"),
    "load_format": (("auto", "safetensors", "gguf"), "only safetensors directories and GGUF files are loaded, "
                                                     "told apart by the path"),
    "chat_template": (None, "custom chat templates are not implemented; the model's own template is used"),
    "tool_call_parser": (None, "tool calling is not implemented"),
    "enable_auto_tool_choice": (None, "tool calling is not implemented"),
    "reasoning_parser": (None, "reasoning parsers are not implemented"),
    "guided_decoding_backend": (None, "structured output is not implemented"),
    "revision": (None, "hub revisions are not supported; pass a local model directory"),
    "tokenizer_mode": ("auto", "the model's fast tokenizer (tokenizer.json or GGUF metadata) is always used"),
}
# Flags that change nothing here: name -> why (switches), and the same for flags that take a value.
VLLM_NOOP = {"trust_remote_code": "kvserve never runs model code; llama, mistral and qwen2 are built in",
             "disable_log_requests": "requests are not logged unless --enable-log-requests is given",
             "disable_frontend_multiprocessing": "the API server is the front end already; whether the engine core "
                                                 "has a process of its own is VLLM_ENABLE_V1_MULTIPROCESSING's, "
                                                 "as in vLLM V1"}
VLLM_NOOP_VALUE = {"max_seq_len_to_capture": "kvserve's decode graphs cover every context length "
                                             "(the attention kernel reads lengths from device memory)",
                   "download_dir": "models are local paths; nothing is downloaded",
                   "compilation_config": "kvserve does not run torch.compile; its CPU kernels are compiled "
                                         "ahead, its CUDA decode steps are CUDA graphs (--enforce-eager)",
                   "optimization_level": "kvserve does not run torch.compile (see --compilation-config)"}
# Offline `LLM(...)` arguments of vLLM's with nothing to do here (value ignored).
VLLM_NOOP_OFFLINE = {"disable_custom_all_reduce": "tensor parallelism's all-reduce is torch.distributed's "
                                                  "(gloo on CPU, NCCL on CUDA); there is no custom one"}


"""`kvserve serve|generate|chat|plan|analyze|stats|bench|simulate`.

Engine flags are generated from the EngineArgs dataclass (`--max-num-seqs` <-> max_num_seqs), so the
CLI, the offline API and vLLM's flag names cannot drift apart. vLLM flags kvserve does not implement
are refused with the reason, never silently ignored.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib
import logging
import os
import sys
import typing

from kvserve import envs
from kvserve.config import (VLLM_NOOP, VLLM_NOOP_VALUE, VLLM_REFUSED, ConfigError, EngineArgs, accepted_values,
                            human_readable_int, parse_size)

logger = logging.getLogger("kvserve")

_ALIASES = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"], "data_parallel_size": ["-dp"],
            "compilation_config": ["-cc"], "optimization_level": ["-O"]}


class _Refuse(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        if str(values) not in accepted_values(self.dest):
            parser.error(f"{option_string}{'' if values is None else ' ' + str(values)} is not supported: "
                         f"{VLLM_REFUSED[self.dest][1]}")


class _Noop(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        logger.info("%s: accepted, nothing to do (%s)", option_string, {**VLLM_NOOP, **VLLM_NOOP_VALUE}[self.dest])


def _json_flag(value: str, fits, what: str):
    """A flag given as JSON (vLLM's CORS lists, --override-generation-config), checked for its shape."""
    import json
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        parsed = None
    if not fits(parsed):
        raise argparse.ArgumentTypeError(f"{value!r} is not {what}")
    return parsed


def _json_list(value: str) -> list[str]:
    return _json_flag(value, lambda x: isinstance(x, list) and all(isinstance(i, str) for i in x),
                      "a JSON list of strings, e.g. '[\"http://localhost:3000\"]'")


def _json_object(value: str) -> dict:
    return _json_flag(value, lambda x: isinstance(x, dict), "a JSON object, e.g. '{\"temperature\": 0.5}'")


def _checked(parse, ok, what: str):
    """An argparse type: `parse` the value, then `ok` must hold; else an error saying it is not `what`."""
    def check(value: str):
        try:
            x = parse(value)
        except ValueError:
            x = None
        if x is None or not ok(x):
            raise argparse.ArgumentTypeError(f"{value!r} is not {what}")
        return x
    return check


_INF = float("inf")
_non_negative = _checked(float, lambda x: 0 <= x < _INF, "a number of seconds >= 0")
_positive_int = _checked(int, lambda n: n >= 1, "a whole number >= 1")
_unit_interval = _checked(float, lambda x: 0 < x <= 1, "a similarity in (0, 1]")
_positive_float = _checked(float, lambda x: 0 < x < _INF, "a number > 0")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _size(value: str) -> int:
    try:
        return parse_size(value, "size")
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _vllm_int(auto: bool = False):
    """vLLM's integer flags with its k/K suffixes ('32k', '1K'); `auto`: '-1' and 'auto' mean the
    default (None), as vLLM's --max-model-len takes them."""
    def parse(value: str):
        if auto and value.strip().lower() in ("auto", "-1"):
            return None
        try:
            return human_readable_int(value)  # argparse's message names the flag
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def add_engine_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> None:
    """One flag per EngineArgs field, with the help text, group and choices its metadata gives."""
    hints = typing.get_type_hints(EngineArgs)
    defaults = EngineArgs()
    groups: dict[str, argparse._ArgumentGroup] = {}
    for f in dataclasses.fields(EngineArgs):
        title = f.metadata["group"]
        if title not in groups:
            groups[title] = parser.add_argument_group(f"{title} (engine)")
        group = groups[title]
        default = getattr(defaults, f.name)
        kind = hints[f.name]
        base = next((t for t in typing.get_args(kind) if t is not type(None)), kind)
        kwargs: dict = {"dest": f.name, "default": default, "help": f.metadata["help"]}
        if f.name == "model" and model_positional:
            parser.add_argument("model_pos", nargs="?", metavar="MODEL", help=f.metadata["help"])
        if base is bool:  # --enable-x/--no-enable-x as vLLM; plain switches for off-by-default flags
            on_off = f.name.startswith("enable_") or default
            kwargs["action"] = argparse.BooleanOptionalAction if on_off else "store_true"
        elif f.name in ("kv_cache_memory", "max_pinned_kv_bytes"):
            kwargs["type"] = _size
        elif f.name in ("max_model_len", "max_num_batched_tokens"):
            kwargs["type"] = _vllm_int(auto=f.name == "max_model_len")
        elif f.name in ("override_generation_config", "speculative_config", "kv_compression"):
            kwargs["type"] = _json_object
        elif f.name in ("kv_events_config", "kv_transfer_config"):
            kwargs["type"] = str  # parsed by EngineArgs.validate, whose errors name the key
        elif f.name in ("served_model_name", "lora_modules"):
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = base
        if f.metadata["choices"]:
            kwargs["choices"] = f.metadata["choices"]
        if default is not None and base is not bool:
            kwargs["help"] += " (default: %(default)s)"
        group.add_argument(_flag(f.name), *_ALIASES.get(f.name, []), **kwargs)
        if f.name == "kv_cache_memory":  # vLLM's name, with vLLM's suffixes (4G = 4 GiB, 4g = 4e9 bytes)
            group.add_argument("--kv-cache-memory-bytes", dest=f.name, default=argparse.SUPPRESS,
                               type=_vllm_int(), metavar="BYTES",
                               help="vLLM's name for --kv-cache-memory: bytes, or with vLLM's suffixes "
                                    "(4G = 4 GiB, 4g = 4,000,000,000)")
    refused = parser.add_argument_group("vLLM flags kvserve refuses (an error names the reason)")
    for name, (_, why) in VLLM_REFUSED.items():
        if name not in hints:
            only = " or ".join(accepted_values(name))
            refused.add_argument(_flag(name), *_ALIASES.get(name, []), dest=name, nargs="?", action=_Refuse,
                                 default=argparse.SUPPRESS, metavar="X",
                                 help=why + (f" (only {only} is accepted)" if only else ""))
    noop = parser.add_argument_group("vLLM flags accepted with nothing to do")
    for name, why in VLLM_NOOP.items():
        if name not in hints:
            noop.add_argument(_flag(name), dest=name, nargs=0, action=_Noop, default=argparse.SUPPRESS, help=why)
    for name, why in VLLM_NOOP_VALUE.items():
        noop.add_argument(_flag(name), *_ALIASES.get(name, []), dest=name, action=_Noop, default=argparse.SUPPRESS,
                          metavar="X", help=why)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    values = {f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineArgs)}
    if getattr(ns, "model_pos", None):
        if values["model"] and values["model"] != ns.model_pos:
            raise ConfigError(f"model given twice: positional {ns.model_pos!r} and --model {values['model']!r}")
        values["model"] = ns.model_pos
    names = values["served_model_name"]
    values["served_model_name"] = names[0] if names else None
    args = EngineArgs(**values)
    args.validate()
    return args


def _add_serve(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible server",
                       description="Start the OpenAI-compatible HTTP server (vLLM's `vllm serve` flags).")
    add_engine_args(p, model_positional=True)
    s = p.add_argument_group("Server")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s; 0.0.0.0 exposes it)")
    s.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    s.add_argument("--api-key", action="extend", nargs="+", default=[], help="require `Authorization: Bearer KEY` on /v1 "
                   "routes; several keys after one flag (vLLM's) or repeated (all share one tenant); default: "
                   "$VLLM_API_KEY if set, as vLLM")
    s.add_argument("--api-keys-file", help="JSON {key: tenant} or lines `KEY TENANT`; each tenant gets its own "
                   "prefix cache (salted block hashes)")
    s.add_argument("--enable-log-requests", action="store_true", help="log each request's prompt and params")
    s.add_argument("--max-log-len", type=int, default=None, help="characters of a prompt shown in request logs")
    s.add_argument("--request-log", metavar="PATH", help="append one JSON line per request that ended, aborts "
                   "included with why "
                   "(input for `kvserve analyze`)")
    s.add_argument("--max-request-body-bytes", type=_size, default=32 * 1024**2,
                   help="larger request bodies get 413 (default: 32MiB)")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="(default: %(default)s: one access-log line per HTTP request, as vLLM)")
    s.add_argument("--disable-uvicorn-access-log", action="store_true", help="no access-log lines")
    s.add_argument("--disable-fastapi-docs", action="store_true",
                   help="no /docs, /redoc or /openapi.json (vLLM's)")
    s.add_argument("--root-path", default="", help="FastAPI root_path when behind a path-based proxy")
    s.add_argument("--response-role", default="assistant", help="role of the generated chat message "
                   "(default: %(default)s)")
    s.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS origins, a JSON list "
                   "(default: %(default)s, as vLLM)")
    s.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods, a JSON list")
    s.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers, a JSON list")
    s.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    s.add_argument("--max-queued-requests", type=_positive_int, default=None, metavar="N",
                   help="refuse a request with 503 and Retry-After while N requests wait to be scheduled "
                        "(SGLang's flag; default: no limit, as vLLM)")
    s.add_argument("--shutdown-timeout", type=_non_negative, default=0.0, metavar="SECONDS",
                   help="on SIGTERM / SIGINT, let requests in flight finish for up to SECONDS, then end the "
                        "rest with an error (vLLM's; default 0: end them at once). New requests are refused")
    s.add_argument("--semantic-cache", nargs="?", const="", default=None, metavar="PATH|URL",
                   help="answer a chat question that means the same as a cached one (same model, tenant, earlier "
                        "turns and sampling settings) from the cache, without the model; greedy requests only "
                        "unless a request opts in. PATH: the SQLite store (default: in memory); "
                        "redis://host:port/db: a Redis store that every server pointed at it shares")
    s.add_argument("--semantic-cache-threshold", type=_unit_interval, default=0.9, metavar="SIMILARITY",
                   help="cosine similarity of the last user message a hit needs, in (0, 1] (default: %(default)s)")
    s.add_argument("--semantic-cache-ttl", type=_positive_float, default=3600.0, metavar="SECONDS",
                   help="how long an entry is served (default: %(default)s)")
    s.add_argument("--semantic-cache-max-entries", type=_positive_int, default=100_000, metavar="N",
                   help="entries kept, least recently used evicted first (default: %(default)s)")
    s.add_argument("--semantic-cache-max-bytes", type=_size, default=1 << 30, metavar="SIZE",
                   help="bytes of questions, answers and embeddings kept, least recently used evicted first "
                        "(default: 1GiB)")
    p.set_defaults(_run=run_serve)


def check_api_keys(ns: argparse.Namespace) -> None:
    """--api-key takes several keys (vLLM's), so `--api-key KEY MODEL` reads MODEL as a key and
    would serve the default model: refuse a key that names an existing path when no model is given."""
    if ns.model or getattr(ns, "model_pos", None):
        return
    for key in ns.api_key:
        if os.path.exists(key):
            raise ConfigError(f"--api-key took {key!r}, which is a path: give the model before the keys "
                              f"(`kvserve serve MODEL --api-key KEY`) or as --model, since --api-key takes "
                              f"every value after it, as vLLM's")


def run_serve(ns: argparse.Namespace) -> int:
    import uvicorn
    from prometheus_client import disable_created_metrics

    from kvserve.engine.async_engine import AsyncLLM
    from kvserve.server.app import build_app
    from kvserve.server.auth import Authenticator, load_api_keys
    from kvserve.server.metrics import RequestLogWriter, ServerMetrics, StatLogger
    from kvserve.server.serving import CorsConfig, ServingConfig

    check_api_keys(ns)
    args = engine_args_from(ns)
    # vLLM reads VLLM_API_KEY when --api-key is not given; a launch script relying on it must not run open.
    env_key = envs.VLLM_API_KEY
    auth = Authenticator(load_api_keys(ns.api_key or ([env_key] if env_key else []), ns.api_keys_file))
    names = ns.served_model_name or [args.model or "SmolLM2-135M-Instruct"]
    if ns.semantic_cache:  # a mistyped URL fails before the model loads
        from kvserve.semantic_cache.base import check_location
        check_location(ns.semantic_cache)
    llm = AsyncLLM.from_engine_args(args)
    disable_created_metrics()  # no *_created series: monitoring greps see one line per metric
    metrics = ServerMetrics(names[0], llm.max_model_len, args, initial_stats=llm.stats_by_rank)
    llm.step_listeners.append(metrics)
    if not args.disable_log_stats:
        # vLLM's VLLM_LOG_STATS_INTERVAL, under our prefix.
        llm.step_listeners.append(StatLogger(envs.KVSERVE_LOG_STATS_INTERVAL))
    if ns.request_log:
        llm.step_listeners.append(RequestLogWriter(ns.request_log))
    dashboard = None
    if not args.disable_dashboard:
        from kvserve.server.dashboard import DashboardSeries
        dashboard = DashboardSeries()
        llm.step_listeners.append(dashboard)
    cors = CorsConfig(ns.allowed_origins, ns.allowed_methods, ns.allowed_headers, ns.allow_credentials)
    config = ServingConfig(served_model_names=names, max_logprobs=llm.max_logprobs,
                           enable_log_requests=ns.enable_log_requests, max_log_len=ns.max_log_len,
                           response_role=ns.response_role, cors=cors, scheduling_policy=args.scheduling_policy,
                           disable_docs=ns.disable_fastapi_docs, max_queued_requests=ns.max_queued_requests,
                           lora_modules=args.lora_module_paths)
    semantic = None
    if ns.semantic_cache is not None:
        from kvserve.server.semantic_cache import SemanticCacheConfig
        semantic = SemanticCacheConfig(ns.semantic_cache or None, ns.semantic_cache_threshold, ns.semantic_cache_ttl,
                                       ns.semantic_cache_max_entries, ns.semantic_cache_max_bytes)
    app = build_app(llm, config, metrics, auth, ns.max_request_body_bytes, dashboard, semantic)
    s = llm.latest_stats
    logger.info("serving %s as %s on http://%s:%d (max_model_len=%d, %d KV blocks of %d tokens, auth %s)",
                args.model or "embedded SmolLM2-135M-Instruct", ", ".join(names), ns.host, ns.port,
                llm.max_model_len, s.num_blocks_total, args.block_size, "on" if auth.enabled else "off")
    # uvicorn's own grace covers the drain plus the time to send the requests it ended their errors.
    server_config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                                   timeout_graceful_shutdown=ns.shutdown_timeout + 5, root_path=ns.root_path,
                                   access_log=not ns.disable_uvicorn_access_log)
    # Everything built so far (tokenizer, app, routes, schemas) lives as long as the server: out of
    # the collector's sight, a streamed token's garbage no longer makes it walk that heap
    # (bench/NOTES.md, "The API server's heap frozen after start-up"), as vLLM's server does.
    gc.collect()
    gc.freeze()
    _run_draining(server_config, lambda: llm.begin_shutdown(ns.shutdown_timeout))
    return 0


def _run_draining(server_config, on_exit) -> None:
    """uvicorn's server, telling the engine at the first SIGTERM / SIGINT (vLLM's --shutdown-timeout):
    uvicorn stops accepting connections and waits for the open ones; the engine refuses new
    requests, lets those in flight run for the drain time, then ends the rest with an error
    response, so no client sees a cut connection or a cancelled handler."""
    import asyncio

    import uvicorn

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            if not self.should_exit:
                # A signal handler may run between any two bytecodes of the loop's thread (inside a
                # lock a logger or Thread.start needs): the work runs as a loop callback instead.
                try:
                    asyncio.get_running_loop().call_soon_threadsafe(on_exit)
                except RuntimeError:  # no loop yet: a signal during start-up
                    on_exit()
            super().handle_exit(sig, frame)

    DrainingServer(server_config).run()


def _add_generate(sub) -> None:
    for name, help_ in (("generate", "complete one prompt, streaming to stdout"),
                        ("chat", "interactive chat; later turns reuse the conversation's KV prefix")):
        p = sub.add_parser(name, help=help_, description=help_)
        if name == "generate":
            p.add_argument("prompt", help="the prompt text")
            p.add_argument("--chat", dest="use_chat", action="store_true",
                           help="wrap the prompt as one user message in the model's chat template")
        else:
            p.add_argument("--system", help="system message for the conversation")
        g = p.add_argument_group("Sampling")
        g.add_argument("--max-tokens", type=int, default=256 if name == "chat" else 64)
        g.add_argument("--temperature", type=float, default=0.7 if name == "chat" else 0.0)
        g.add_argument("--top-p", type=float, default=1.0)
        g.add_argument("--top-k", type=int, default=0)
        g.add_argument("--min-p", type=float, default=0.0)
        g.add_argument("--stop", action="append", default=[])
        g.add_argument("--ignore-eos", action="store_true")
        add_engine_args(p)
        p.set_defaults(_run=_run_chat if name == "chat" else _run_generate)


def _stream(engine, request_id: str, prompt, params, out=sys.stdout):
    from kvserve.engine.outputs import RequestError

    try:
        engine.add_request(request_id, prompt, params)
    except RequestError as e:
        raise ConfigError(str(e)) from None
    final = None
    try:
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.request_id == request_id:
                    out.write(o.outputs[0].delta_text)
                    out.flush()
                    final = o
    except KeyboardInterrupt:
        engine.abort_request([request_id])
        out.write("\n[interrupted]")
    out.write("\n")
    return final


def _engine_and_params(ns):
    from kvserve.core.sampling_params import SamplingParams
    from kvserve.engine.engine import LLMEngine

    engine = LLMEngine.from_engine_args(engine_args_from(ns))
    params = SamplingParams(max_tokens=ns.max_tokens, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k,
                            min_p=ns.min_p, stop=ns.stop, ignore_eos=ns.ignore_eos, seed=ns.seed)
    return engine, params


def _report(final) -> None:
    if final is not None:
        n_out = len(final.outputs[0].token_ids)
        t = final.metrics
        dur = (t.last_token_time or t.arrival_time) - t.arrival_time
        print(f"[{len(final.prompt_token_ids)} prompt tokens ({final.num_cached_tokens} cached), {n_out} generated"
              f"{f', {n_out / dur:.1f} tok/s' if dur > 0 else ''}]", file=sys.stderr)


def _run_generate(ns) -> int:
    engine, params = _engine_and_params(ns)
    prompt = ns.prompt
    if ns.use_chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                      add_generation_prompt=True)
    _report(_stream(engine, "generate-0", prompt, params))
    return 0


def _run_chat(ns) -> int:
    engine, params = _engine_and_params(ns)
    messages = [{"role": "system", "content": ns.system}] if ns.system else []
    print("kvserve chat: type a message; /reset clears the conversation, /exit or Ctrl-D quits.", file=sys.stderr)
    for turn in range(1_000_000):
        try:
            line = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if ns.system else []
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        try:
            final = _stream(engine, f"chat-{turn}", ids, params)
        except ConfigError as e:  # the conversation outgrew the context
            print(f"error: {e}; /reset to start over", file=sys.stderr)
            messages.pop()
            continue
        messages.append({"role": "assistant", "content": final.outputs[0].text if final else ""})
        _report(final)
    return 0


_TOOLS = ("plan", "analyze", "stats", "bench_serve", "simulate")


def _add_tools(sub) -> None:
    """Each tool module exposes add_parser(subparsers) and run(args) -> int; absent ones are skipped."""
    for module_name in _TOOLS:
        try:
            module = importlib.import_module(f"kvserve.tools.{module_name}")
        except ModuleNotFoundError as e:
            if e.name == f"kvserve.tools.{module_name}":
                continue  # not written yet
            logger.warning("kvserve %s is unavailable: %s", module_name, e)
            continue
        except Exception as e:  # a broken tool must not take `kvserve serve` down with it
            logger.warning("kvserve %s is unavailable: %s: %s", module_name, type(e).__name__, e)
            continue
        before = set(sub.choices)
        try:
            module.add_parser(sub)
        except Exception as e:
            logger.warning("kvserve %s is unavailable: %s: %s", module_name, type(e).__name__, e)
            continue
        for name in set(sub.choices) - before:
            sub.choices[name].set_defaults(_run=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve", description="LLM inference engine and OpenAI-compatible "
                                     "server built around KV-cache management.")
    from kvserve.version import __version__
    parser.add_argument("--version", action="version", version=f"kvserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(sub)
    _add_generate(sub)
    _add_tools(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    parser = build_parser()
    ns = parser.parse_args(argv)
    if not getattr(ns, "_run", None):
        parser.print_help()
        return 2
    try:
        return ns._run(ns) or 0
    except _user_errors() as e:
        print(f"kvserve {ns.command}: error: {e}", file=sys.stderr)
        return 2


def _user_errors() -> tuple[type[BaseException], ...]:
    """Errors caused by the user's settings or files: one line, no traceback. Looked up lazily,
    so `kvserve plan` and friends do not import torch; a module that raised is loaded by then."""
    kinds: list[type[BaseException]] = [ConfigError]
    for module, name in (("kvserve.model.loader", "ModelLoadError"), ("kvserve.model.tokenizer", "TokenizerError"),
                         ("kvserve.engine.outputs", "RequestError"), ("kvserve.cache.quantizers", "QuantError"),
                         ("kvserve.core.sampling_params", "SamplingParamsError"),
                         ("kvserve.ops.cpu_kernels", "KernelBuildError")):
        if module in sys.modules:
            kinds.append(getattr(sys.modules[module], name))
    return tuple(kinds)


if __name__ == "__main__":
    sys.exit(main())

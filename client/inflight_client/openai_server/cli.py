"""inflight-openai: the OpenAI-compatible server in front of a Triton `llm` model.

  inflight-openai --triton-url localhost:8000 --model-dir model_repository/llm/1/inflight-tiny
  inflight-openai --triton-url triton:8000 --tokenizer /ckpt/Llama-3-8B-Instruct \\
      --served-model-name llama-3-8b --chat-template chat.jinja --port 9000 --lora-modules sql-bot
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

from inflight.context_length import checkpoint_max_len
from inflight.serving.parent import when_parent_exits

from .app import Settings, create_app
from .auth import API_KEY_ENV
from .lora_updates import ENV, allowed_by_environment
from .process import PARENT_ENV
from .reasoning import PARSERS as REASONING_PARSERS
from .tool_parsers import PARSERS


def parse_args(argv: list[str] | None = None) -> tuple[Settings, argparse.Namespace]:
    parser = argparse.ArgumentParser(prog="inflight-openai", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--triton-url", default="localhost:8000", help="Triton's HTTP address (host:port)")
    parser.add_argument("--triton-model", default="llm", help="the Triton model with the vLLM backend's tensors")
    parser.add_argument("--triton-metrics-url",
                        help="Triton's metrics endpoint, which /metrics reads (default: http://<--triton-url's "
                             "host>:8002/metrics, Triton's default port)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--model-dir", help="the checkpoint directory Triton serves (its tokenizer; its name "
                                            "is the model id)")
    source.add_argument("--tokenizer", help="a directory with the model's tokenizer files")
    parser.add_argument("--served-model-name", help="the model id clients use (default: the directory's name)")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME",
                        help="the LoRA adapters `llm` serves (its multi_lora.json names), each listed as a model id")
    parser.add_argument("--allow-runtime-lora-updating", action="store_true",
                        help=f"serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter (also on where "
                             f"{ENV}=true, vLLM's switch); `llm` reads the adapters where its engine has "
                             "allow_runtime_lora_updating (`make serve` passes this flag then)")
    parser.add_argument("--chat-template", help="a Jinja chat template file, instead of the tokenizer's own")
    parser.add_argument("--trust-request-chat-template", action="store_true",
                        help="render the chat_template a request may send (vLLM's flag; a template is code that "
                             "runs on this server, in transformers' Jinja sandbox), instead of refusing it")
    parser.add_argument("--default-max-tokens", type=int,
                        help="max_tokens when a request gives none (default: as vLLM's server and OpenAI's API, 16 "
                             "for a completion, and a chat runs to the end of the context, or to the checkpoint's "
                             "max_new_tokens, see --generation-config)")
    parser.add_argument("--generation-config", choices=("auto", "vllm"), default="auto",
                        help="vLLM's: auto (the default) takes the sampling defaults of the checkpoint's "
                             "generation_config.json (temperature, top_p, top_k, min_p, the penalties; max_new_tokens "
                             "as a chat's default max_tokens) for requests that leave them out; vllm ignores them")
    parser.add_argument("--disable-any-whitespace", action="store_true",
                        help="constrained JSON (response_format, tool calls, guided_json) without free whitespace: "
                             "compact JSON, no space after ':' or ',', as vLLM's structured-outputs option "
                             "of that name gives it; a small model may otherwise spend max_tokens on whitespace the "
                             "schema allows")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="serve tool_choice \"auto\" (OpenAI's default when a request gives tools, as LangChain's "
                             "and LlamaIndex's tool bindings send it): the model decides whether to call, and its "
                             "calls are read from its text in the format of --tool-call-parser (vLLM's flags)")
    parser.add_argument("--tool-call-parser", choices=PARSERS,
                        help="the model's tool-call format, for --enable-auto-tool-choice: hermes (<tool_call> tags: "
                             "Hermes 2 Pro, Qwen 2.5 and 3), llama3_json (a JSON object per call: Llama 3.1-3.3), "
                             "pythonic (a Python list of calls: ToolACE, Llama 3.2 with a pythonic chat template), "
                             "llama4_pythonic (Llama 4) or mistral (calls after a [TOOL_CALLS] token, in the form "
                             "the tokenizer's version has: Mistral 7B v0.3, Nemo, Small, Ministral, Magistral, "
                             "Devstral)")
    parser.add_argument("--reasoning-parser", choices=REASONING_PARSERS,
                        help="split a chat reply into `reasoning` and `content` (vLLM's flag): deepseek_r1 (<think> "
                             "... </think>: DeepSeek-R1 and its Llama and Qwen distills, QwQ), qwen3 (the same "
                             "markers, Qwen3's thinking mode) or mistral (Magistral's [THINK] ... [/THINK]). Give "
                             "`llm` the same "
                             "engine setting, so that a constraint waits for the end of the reasoning (`make serve` "
                             "passes this flag where `llm` has it)")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="vLLM's flag: usage gains prompt_tokens_details.cached_tokens, the prompt tokens `llm` "
                             "found in its prefix cache (the Responses API's usage always has them)")
    parser.add_argument("--hf-overrides", type=_json_object, metavar="JSON",
                        help="vLLM's flag: config.json values over the checkpoint's, the same as `llm`'s engine "
                             "setting hf_overrides (a reranker converted into a classifier: its architectures and "
                             "classifier_from_token; `make serve` passes `llm`'s)")
    parser.add_argument("--max-model-len", type=int,
                        help="the context length `llm` runs with (default: the checkpoint's, from config.json; "
                             "needed with a --tokenizer directory without one)")
    parser.add_argument("--max-triton-requests", type=int, default=1024,
                        help="the most outputs this server has in flight to Triton at once (a request per "
                             "prompt, of n outputs each); more wait here, by priority then in turn. At most "
                             "`llm`'s max_num_seqs + max_queue_size (what `make serve` passes), one request's many "
                             "prompts never fill the engine's queue by themselves")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on every route but /health, /ping, /version and "
                             f"/metrics (repeatable: any of the keys; default: ${API_KEY_ENV} if set, else no key)")
    parser.add_argument("--no-request-priority", dest="request_priority", action="store_false",
                        help="refuse a request's 'priority' other than normal (400), as vLLM's server does without "
                             "priority scheduling: clients that are not trusted cannot preempt each other")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--log-level", default="info")
    args = parser.parse_args(argv)
    directory = args.model_dir or args.tokenizer
    if not os.path.isdir(directory):
        parser.error(f"{directory!r} is not a directory")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        parser.error(f"--chat-template {args.chat_template!r} is not a file")
    name = args.served_model_name or os.path.basename(os.path.normpath(directory))
    if name in args.lora_modules:
        parser.error(f"--lora-modules: {name!r} is also the served model name")
    if args.max_triton_requests < 1:
        parser.error(f"--max-triton-requests must be at least 1, got {args.max_triton_requests}")
    if args.default_max_tokens is not None and args.default_max_tokens < 1:
        parser.error(f"--default-max-tokens must be at least 1, got {args.default_max_tokens}")
    if any(not key.strip() for key in args.api_key):
        parser.error("--api-key: a key must not be empty")
    for module in args.lora_modules:
        if "=" in module or module.lstrip().startswith("{"):
            parser.error(f"--lora-modules: {module!r} is vLLM's name=path form; give the names alone: `llm` "
                         "loads the adapters, from the paths in its multi_lora.json")
    if args.enable_auto_tool_choice and args.tool_call_parser is None:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (the model's tool-call format: "
                     f"{', '.join(PARSERS)})")
    max_model_len = args.max_model_len or checkpoint_max_len(directory)
    if max_model_len is None:
        parser.error(f"the context length is unknown: {directory!r} has no config.json transformers can read; give "
                     "--max-model-len, the max_model_len `llm` runs with (it bounds prompts and max_tokens)")
    if max_model_len < 2:
        parser.error(f"--max-model-len must be at least 2 (a prompt token and an output token), got {max_model_len}")
    triton_host = args.triton_url.rpartition(":")[0] or args.triton_url
    settings = Settings(args.triton_url, directory, name, max_model_len, args.triton_model, args.chat_template,
                        args.default_max_tokens, tuple(args.lora_modules), args.disable_any_whitespace,
                        args.trust_request_chat_template, args.max_triton_requests, args.generation_config,
                        tuple(args.api_key) or tuple(filter(None, [os.environ.get(API_KEY_ENV)])),
                        args.request_priority, args.tool_call_parser if args.enable_auto_tool_choice else None,
                        args.reasoning_parser, args.enable_prompt_tokens_details,
                        args.triton_metrics_url or f"http://{triton_host}:8002/metrics", args.hf_overrides,
                        args.allow_runtime_lora_updating or allowed_by_environment(os.environ))
    return settings, args


def _json_object(text: str) -> dict:
    """argparse's type for a JSON object (argparse names the flag in its error)."""
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object of config.json keys and values")
    return value


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    settings, args = parse_args(argv)
    _exit_with_parent()
    _raise_open_files_limit(settings.max_triton_requests)
    # uvloop and httptools (uvicorn's "standard" choices) take less CPU per streamed chunk than
    # asyncio's loop and h11, CPU that on a small host is taken from the engine
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                loop="uvloop", http="httptools")


def _exit_with_parent() -> None:
    """Started by inflight's launcher (or a test's OpenAIServerProcess): stop, as on SIGTERM, once
    that process is gone. Killed with SIGKILL, it could stop nobody, and this server kept serving
    its port (the next `make serve` found it taken)."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return

    def stop() -> None:
        print(f"inflight-openai: the process that started this server (pid {parent}) is gone; stopping",
              file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)

    when_parent_exits(int(parent), stop, "inflight-openai-parent-watch")


def _raise_open_files_limit(max_triton_requests: int) -> None:
    """A connection to Triton per request in flight and one per client: 1024 open files (a common
    soft limit) is too few for busy servers. Raise the soft limit to the hard one, as vLLM's server
    does, and say so when that is still short."""
    import resource
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = hard if hard == resource.RLIM_INFINITY else min(hard, 65536)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError):   # macOS refuses some values its getrlimit reports
            pass
    if soft != resource.RLIM_INFINITY and soft < 2 * max_triton_requests + 64:
        print(f"inflight-openai: only {soft} open files are allowed (ulimit -n); with --max-triton-requests "
              f"{max_triton_requests} and as many clients, connections may fail with 'Too many open files'",
              file=sys.stderr)


if __name__ == "__main__":
    main()

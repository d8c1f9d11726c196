"""The FastAPI application: routes, request bodies parsed into schemas.py's models, and every
failure answered in the OpenAI error shape (errors.py) — a bug is a 500 with a one-line message,
its traceback only in this server's log."""
from __future__ import annotations

import asyncio
import contextlib
import gc
import importlib.metadata
import json
import logging
import types
import typing
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response

from inflight.config import PRIORITIES, parse_priority
from inflight.serving.protocol import LONE_SURROGATE, lone_surrogate_field

from .auth import RequireAPIKey
from .body_limit import LimitBody
from .chat_completions import create_chat_completion
from .chat_template import ChatTemplate
from .classify import create_classify, read_classifier
from .completions import create_completion
from .context import LARGE_BODY_BYTES, Context
from .embeddings import create_embedding
from .errors import APIError
from .generation_config import sampling_defaults
from .lora_updates import load_lora_adapter, unload_lora_adapter
from .metrics import VllmMetrics
from .models import ServedModels
from .reasoning import markers
from .responses import create_response
from .schemas import (ChatCompletionRequest, ClassificationRequest, CompletionRequest, DetokenizeRequest,
                      EmbeddingRequest, LoadLoRAAdapterRequest, RerankRequest, ResponsesRequest, ScoreRequest,
                      TokenizeRequest, UnloadLoRAAdapterRequest)
from .score import create_rerank, create_score
from .tokenization import detokenize, tokenize
from .tool_parsers import check_tokenizer
from .triton import TritonLLM

log = logging.getLogger("inflight.openai")


@dataclass(slots=True)
class Settings:
    triton_url: str
    tokenizer_dir: str
    served_model_name: str
    max_model_len: int                      # the context length `llm` runs with
    triton_model: str = "llm"
    chat_template: str | None = None
    default_max_tokens: int | None = None     # None: 16 for completions, the context for chats
    lora_names: tuple[str, ...] = ()        # the LoRA adapters `llm` serves, each a model id
    disable_any_whitespace: bool = False
    trust_request_chat_template: bool = False
    max_triton_requests: int = 1024         # outputs in flight to Triton at once; more wait here (OutputSlots)
    generation_config: str = "auto"         # vLLM's: "auto" reads the checkpoint's sampling defaults, "vllm" ignores them
    api_keys: tuple[str, ...] = ()          # any of them opens every route but the probes (auth.py); none: open
    request_priority: bool = True           # False: a request's priority other than normal is a 400 (vLLM's FCFS)
    tool_call_parser: str | None = None     # set: tool_choice "auto" reads calls in this format (tool_parsers.py)
    reasoning_parser: str | None = None     # set: chat replies split into reasoning and content (reasoning.py)
    prompt_tokens_details: bool = False     # usage's prompt_tokens_details.cached_tokens (vLLM's flag)
    triton_metrics_url: str = "http://localhost:8002/metrics"   # read for /metrics (metrics.py)
    hf_overrides: dict | None = None        # vLLM's: config.json values over the file's, as `llm` has them
    allow_runtime_lora_updating: bool = False   # vLLM's /v1/load_lora_adapter and unload (lora_updates.py)


def _members(annotation) -> list:
    """The types a value of this annotation may be: Optional and unions flattened, Annotated unwrapped."""
    if typing.get_origin(annotation) is typing.Annotated:
        return _members(typing.get_args(annotation)[0])
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [kind for arg in typing.get_args(annotation) for kind in _members(arg)]
    return [annotation]


def _field(kinds: list, name: str):
    """The field `name` (or its alias) of a model among `kinds`; None if none has it."""
    for kind in kinds:
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            for field_name, field in kind.model_fields.items():
                if name in (field_name, field.alias):
                    return field
    return None


def _where(schema: type[BaseModel], loc: tuple, unknown: bool) -> str:
    """An error's location as the request wrote it: the field names down to the value, with list
    positions (`tools[0].function.parameters`), found by walking the schema's fields; not pydantic's
    union member and validator tags (prompt.list[int], tool_choice.function-after[...]) nor dict
    keys, which say nothing to a user. An unknown key is named last."""
    where, kinds = "", [schema]
    for i, part in enumerate(loc):
        if isinstance(part, int):
            where += f"[{part}]"
            kinds = [item for kind in kinds if typing.get_origin(kind) in (list, tuple)
                     for item in _members(typing.get_args(kind)[0])]
        elif (field := _field(kinds, part)) is not None or (unknown and i == len(loc) - 1):
            where += f".{part}" if where else str(part)
            kinds = _members(field.annotation) if field is not None else []
    return where


def _validation_error(error: ValidationError, schema: type[BaseModel]) -> APIError:
    errors = error.errors()
    # an unknown key, or a boolean for a number, is the likeliest mistake, even where a union's
    # other members also complain
    first = next((e for e in errors if e["type"] in ("extra_forbidden", "bool_not_number")), errors[0])
    name = str(first["loc"][0]) if first["loc"] else None
    unknown = first["type"] == "extra_forbidden"
    where = _where(schema, first["loc"], unknown)
    # a union's members each say what they take of the same value: all of them, not the first
    said = [first["msg"]]
    if first["type"] != "bool_not_number":
        said += [e["msg"][:1].lower() + e["msg"][1:] for e in errors if e["msg"] != first["msg"]
                 and e.get("input") is first.get("input") and _where(schema, e["loc"], False) == where]
    message = "unknown parameter" if unknown else "; or ".join(dict.fromkeys(said))
    return APIError(400, f"'{where}': {message}" if where else message, name)


async def _body(request: Request, schema: type[BaseModel]):
    body = await request.body()
    try:
        # UTF-8 only (RFC 8259), as the checks below assume: json.loads would also take UTF-16/32
        raw = json.loads(body.decode("utf-8-sig", "surrogatepass"))
    except ValueError as exc:       # also an integer longer than Python converts (4,300 digits)
        raise APIError(400, f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(raw, dict):
        raise APIError(400, "the request body must be a JSON object")
    # a surrogate as JSON's escape, or as its raw UTF-8-like bytes (ED A0..BF xx), which json accepts
    if (b"\\ud" in body or b"\\uD" in body or b"\xed" in body) and (field := lone_surrogate_field(raw)):
        raise APIError(400, f"'{field}' {LONE_SURROGATE}", field)
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise _validation_error(exc, schema) from None


async def _large(request: Request) -> bool:
    return len(await request.body()) > LARGE_BODY_BYTES     # read once: Starlette keeps it


def _request_id(request: Request, body) -> str:
    """vLLM's: the X-Request-Id header, else the body's request_id, else a new one (a response's
    id is this after its kind's prefix)."""
    return request.headers.get("x-request-id") or body.request_id or uuid.uuid4().hex


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, handler):
    """Run a handler (for a stream, up to its first response; otherwise to the end) but cancel
    it, and with it the Triton requests, if the client goes away first (Triton cancels each at
    its next response: one still waiting in the engine's queue, at its first token)."""
    work = asyncio.ensure_future(handler)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        work.cancel()
        raise
    finally:
        watch.cancel()
    if work not in done:
        log.info("inflight-openai: the client left before the response; cancelling its request")
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)     # its streams are cancelled on the way out
        return Response(status_code=499)      # nobody is listening
    return work.result()


def create_app(settings: Settings) -> FastAPI:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(settings.tokenizer_dir)
    reasoning = None if settings.reasoning_parser is None else markers(settings.reasoning_parser, tokenizer)
    check_tokenizer(settings.tool_call_parser, tokenizer)
    ctx = Context(TritonLLM(settings.triton_url, settings.triton_model, settings.max_triton_requests), tokenizer,
                  ChatTemplate(tokenizer, settings.chat_template, settings.trust_request_chat_template),
                  ServedModels(settings.served_model_name, settings.max_model_len, settings.lora_names),
                  settings.default_max_tokens, settings.disable_any_whitespace, settings.tool_call_parser,
                  sampling_defaults(settings.tokenizer_dir, settings.generation_config),
                  reasoning=reasoning, prompt_tokens_details=settings.prompt_tokens_details,
                  classifier=read_classifier(settings.tokenizer_dir, settings.hf_overrides))
    metrics = VllmMetrics(settings.triton_metrics_url, settings.triton_model, settings.served_model_name)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await ctx.triton.start()
        await metrics.start()
        # what start-up built (transformers, the tokenizer, the app's models) lives as long as the
        # server: frozen, the garbage collector's full passes stop walking it over and over (they
        # were a tenth of this server's CPU when streaming to 64 clients)
        gc.collect()
        gc.freeze()
        yield
        await ctx.triton.close()
        await metrics.close()
        ctx.large_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="inflight OpenAI-compatible server", lifespan=lifespan)
    app.add_middleware(LimitBody)
    if settings.api_keys:           # added last: it runs first, so an unkeyed body is never read
        app.add_middleware(RequireAPIKey, keys=settings.api_keys)

    @app.exception_handler(APIError)
    async def api_error(_request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(HTTPException)
    async def http_error(_request, exc: HTTPException):      # unknown path, wrong method
        return JSONResponse(APIError(exc.status_code, str(exc.detail)).body(), status_code=exc.status_code)

    @app.exception_handler(ClientDisconnect)
    async def client_left(_request, _exc):      # while it sent its body: nobody to answer, nothing wrong here
        return Response(status_code=499)

    @app.exception_handler(Exception)
    async def unexpected(_request, exc: Exception):
        log.exception("inflight-openai: unexpected error")
        return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}").body(), status_code=500)

    # /ping (GET or POST) as vLLM's server answers it, for load balancers that probe that path
    @app.api_route("/ping", methods=["GET", "POST"])
    @app.get("/health")
    async def health():
        if not await ctx.triton.ready():
            raise APIError(503, f"Triton at {ctx.triton.url} or its model '{ctx.triton.model}' is not ready")
        return JSONResponse({})

    @app.get("/version")
    async def version():
        return JSONResponse({"version": importlib.metadata.version("inflight")})

    @app.get("/metrics")
    async def metrics_page():
        return Response(await metrics.page(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return JSONResponse(ctx.models.listing())

    @app.get("/v1/models/{model:path}")          # a path: served model names may hold a '/'
    async def model_card(model: str):
        return JSONResponse(ctx.models.card(model))

    def priority_allowed(body) -> None:
        if not settings.request_priority and body.priority is not None \
                and parse_priority(body.priority) != PRIORITIES["normal"]:
            raise APIError(400, f"'priority' {body.priority!r}: this server runs every request at normal priority "
                           "(--no-request-priority; vLLM's server refuses it without priority scheduling)", "priority")

    async def generate(request: Request, schema, create):
        """A generation route: the body read as its schema, then create(body, ctx, request id, large)."""
        body = await _body(request, schema)
        priority_allowed(body)
        return await _unless_disconnected(request, create(body, ctx, _request_id(request, body), await _large(request)))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest, create_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatCompletionRequest, create_chat_completion)

    @app.post("/v1/responses")
    async def responses(request: Request):
        return await generate(request, ResponsesRequest, create_response)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await generate(request, EmbeddingRequest, create_embedding)

    @app.post("/classify")
    async def classify(request: Request):
        return await generate(request, ClassificationRequest, create_classify)

    @app.post("/score")
    @app.post("/v1/score")           # vLLM's paths: it moved /v1/score to /score, and keeps both
    async def score(request: Request):
        return await generate(request, ScoreRequest, create_score)

    @app.post("/rerank")
    @app.post("/v1/rerank")          # Jina's path
    @app.post("/v2/rerank")          # Cohere's
    async def rerank(request: Request):
        return await generate(request, RerankRequest, create_rerank)

    if settings.allow_runtime_lora_updating:        # else no such routes: a 404, as from vLLM's server
        @app.post("/v1/load_lora_adapter")
        async def load_lora_route(request: Request):
            return await load_lora_adapter(await _body(request, LoadLoRAAdapterRequest), ctx)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_route(request: Request):
            return await unload_lora_adapter(await _body(request, UnloadLoRAAdapterRequest), ctx)

    @app.post("/tokenize")
    async def tokenize_route(request: Request):
        return await ctx.offload(await _large(request), tokenize, await _body(request, TokenizeRequest), ctx)

    @app.post("/detokenize")          # likewise for a long list of ids
    async def detokenize_route(request: Request):
        return await ctx.offload(await _large(request), detokenize, await _body(request, DetokenizeRequest), ctx)

    return app

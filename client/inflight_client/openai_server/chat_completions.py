"""POST /v1/chat/completions: the messages (and tools) rendered with the chat template into
prompt token ids, one `llm` request with `n` outputs. A stream sends each choice's role first,
then content deltas (or tool-call deltas, tools.py), then its finish_reason (and usage last, with
stream_options.include_usage). vLLM's `echo`: a final message of the reply's role (an assistant's,
continued with continue_final_message) starts each choice's content. vLLM's `return_token_ids`:
the prompt's ids in the response (a stream: in each role chunk), each choice's generated ids in its
choice (a stream: per delta). The Responses API (responses.py) is a view over a chat request:
run_chat is what both routes run."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.responses import JSONResponse

from . import beam_search, generation
from .context import Context
from .errors import APIError
from .chat_template import message_text
from .logprobs import chat_logprobs, sampled_ids
from .reasoning import reader
from .sampling import chat_sampling
from .schemas import ChatCompletionRequest
from .sse import event, sse_response
from .structured import Constraint, blame, request_constraints, single
from .tool_parsers import ENVELOPED, PARSERS, AutoToolText, call_envelope, call_id_of, special_tokens_kept
from .tools import ToolCallText, called_function, tool_constraint, tool_message, tool_schemas
from .triton import LLMResponse, Prompt


@dataclass(slots=True)
class ChatRun:
    """A chat request sent to `llm`: its whole reply, or (streamed) its chunks as they come, and the
    sampling it runs with. `as_sent` names an error's fields as the request did: run_chat's own
    errors already are, a stream's come as `llm` names them."""
    reply: dict | None
    chunks: AsyncIterator[dict] | None
    sampling: dict
    as_sent: Callable[[APIError], APIError]


async def create_chat_completion(body: ChatCompletionRequest, ctx: Context, request_id: str, large: bool):
    run = await run_chat(body, ctx, request_id, large, ctx.prompt_tokens_details)
    if run.chunks is not None:
        return sse_response(_events(run.chunks), run.as_sent)
    return JSONResponse(run.reply)


async def _events(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield event(chunk)
    finally:
        await chunks.aclose()


async def run_chat(body: ChatCompletionRequest, ctx: Context, request_id: str, large: bool,
                   cached_tokens: bool) -> ChatRun:
    """cached_tokens: the usage has prompt_tokens_details.cached_tokens."""
    adapter = ctx.models.check(body.model)
    generate = beam_search.generator(body, ctx) if body.use_beam_search else ctx.triton.generate
    if body.tool_choice == "auto" and ctx.tool_call_parser is None:
        # vLLM answers the same without --enable-auto-tool-choice and a --tool-call-parser
        raise APIError(400, "'tool_choice' \"auto\" (the default when 'tools' are given) needs a tool-call "
                       "parser to find calls in free text: start this server with --enable-auto-tool-choice and "
                       f"--tool-call-parser ({', '.join(PARSERS)}: the model's format), or give 'tool_choice' "
                       "\"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}} (the output "
                       "is then constrained to a call), or \"none\"", "tool_choice")
    constraint = single(_constraints(body, ctx), ctx.disable_any_whitespace)
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
    prompt, prompt_ids = await ctx.offload(large, _prompt, body, tools, ctx)
    sampling = ctx.fit(chat_sampling(body, ctx.chat_max_tokens, constraint, adapter, ctx.sampling_defaults),
                       prompt_ids, "messages")
    if (_calls_tools(body) and special_tokens_kept(ctx.tool_call_parser)) or _reads_special_markers(ctx):
        sampling["skip_special_tokens"] = False         # the parsers read the model's tags (as vLLM's)
    if _thinking_off(body, ctx):
        sampling["reasoning_ended"] = True              # a constraint from the first token, as vLLM's server asks
    text = None if body.truncate_prompt_tokens is not None else ctx.text_input(prompt, bool(body.add_special_tokens))
    calls = [generate(Prompt(prompt_ids, text, "truncate_prompt_tokens"), sampling)]
    head = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "created": int(time.time()),
            "model": body.model or ctx.models.name}
    top_n = body.top_logprobs or 0
    prompt_text = prompt if body.return_prompt_text else None      # vLLM's: the rendered template
    def as_sent(error: APIError) -> APIError:
        return blame(_as_sent(error, body), constraint)
    try:
        if body.stream:
            responses = await generation.stream(calls)
            return ChatRun(None, _chunks({**head, "object": "chat.completion.chunk"}, body, responses, top_n,
                                         prompt_ids, _echo(body), prompt_text, ctx, cached_tokens), sampling, as_sent)
        outputs, usage = await generation.gather(calls, body.n)
    except APIError as exc:
        raise as_sent(exc) from None
    choices = []
    echo = _echo(body)
    hidden = _hides_reasoning(body, ctx)
    thinkers = _reasoning_readers(body, ctx, prompt_ids, len(outputs))
    for index, out in enumerate(outputs):
        text, reasoning = "".join(out.text), None
        if thinkers is not None:        # reasoning "" where it ended at once (as vLLM's)
            reasoning, text = thinkers[index].split(text)
        message = {"role": _role(body), "content": text}
        reason = out.finish_reason
        if _calls_tools(body):
            message, reason = tool_message(_tool_reader(body, ctx), text, reason)
        if echo:
            message["content"] = echo + (message["content"] or "")
        message["refusal"] = None       # a field of every message in OpenAI's schema (and vLLM's replies)
        if ctx.reasoning is not None:   # vLLM's field, and no content is null there
            message["reasoning"] = None if hidden else reasoning
            message["content"] = message["content"] or None
        choice = {"index": index, "message": message,
                  "logprobs": chat_logprobs(body.shown(out.logprobs), top_n) if body.logprobs and not hidden else None,
                  "finish_reason": reason, "stop_reason": out.stop_reason}
        if body.return_token_ids:
            choice["token_ids"] = None if hidden else sampled_ids(out.logprobs)
        choices.append(choice)
    reply = {**head, "choices": choices, "usage": usage.body(ctx.reasoning is not None, cached_tokens)}
    if body.prompt_logprobs is not None:         # vLLM's: once, for the one prompt of every choice
        reply["prompt_logprobs"] = outputs[0].prompt_logprobs
    if body.return_token_ids:
        reply["prompt_token_ids"] = prompt_ids
    if prompt_text is not None:
        reply["prompt_text"] = prompt_text
    return ChatRun(reply, None, sampling, as_sent)


def _constraints(body: ChatCompletionRequest, ctx: Context) -> list[Constraint]:
    """The request's output constraints. A forced tool call (named or "required") replaces the
    request's own (`response_format`, `structured_outputs`, `guided_*`), which shape content, and a
    forced call has none (vLLM drops them too): in the model's own format where the parser has a
    structural tag (call_envelope), else in tools.py's JSON forms. "auto" may put the call envelope
    on the reply, joined with the request's own constraint where it has one."""
    found = request_constraints(body)
    if _calls_tools(body) and body.tool_choice != "auto":
        tag = call_envelope(ctx.tool_call_parser, body)
        return [tool_constraint(body) if tag is None else _tagged(tag, "tool_choice", tool_schemas(body))]
    # (not with min_tokens, which `llm` refuses beside a grammar: banning EOS could leave it no token)
    if body.tool_choice == "auto" and body.tools and ctx.tool_call_parser is not None and not body.min_tokens \
            and len(found) < 2:
        own = found[0] if found else None
        tag = call_envelope(ctx.tool_call_parser, body, own.structured_outputs if own else None)
        if tag is not None:         # an error in the joined tag may be either's: it names both
            return [_tagged(tag, own.source, f"{own.source}' or 'tools", own.structured_outputs) if own
                    else _tagged(tag, "tools")]
    return found


def _tagged(tag: dict, source: str, written_at: str | None = None, options: dict | None = None) -> Constraint:
    """The tag as `llm`'s constraint (JSON text, as vLLM's), with the options of the constraint it
    joins (disable_any_whitespace, backend)."""
    kept = {k: v for k, v in (options or {}).items() if k in ("disable_any_whitespace", "backend")}
    return Constraint({**kept, "structural_tag": json.dumps(tag)}, source, written_at or source)


def _as_sent(error: APIError, body: ChatCompletionRequest) -> APIError:
    """The names the request used: `llm` names the limit 'max_tokens' (a request that gave
    max_completion_tokens reads its own name), and a chat's prompt came from 'messages'."""
    renamed = {"prompt": "messages"}
    if body.max_completion_tokens is not None:
        renamed["max_tokens"] = "max_completion_tokens"
    if error.param in renamed:
        error.message = error.message.replace(f"'{error.param}'", f"'{renamed[error.param]}'")
        error.param = renamed[error.param]
    return error


def _prompt(body: ChatCompletionRequest, tools: list[dict] | None, ctx: Context) -> tuple[str, list[int]]:
    """The rendered template and its token ids. Unless the prompt is to be cut, text that cannot
    fit is refused before the template renders it (which holds every message's text) and again
    before the tokenizer reads what the template made of it."""
    if body.truncate_prompt_tokens is None:
        ctx.check_size("".join(message_text(m, i) for i, m in enumerate(body.messages)), "messages")
    prompt = ctx.chat.render(body.messages, tools, body)
    if body.truncate_prompt_tokens is None:
        ctx.check_size(prompt, "messages")
        return prompt, ctx.tokenize(prompt, body.add_special_tokens)
    ids = ctx.tokenize(prompt, body.add_special_tokens)
    return prompt, ctx.truncate(ids, body.truncate_prompt_tokens, body.truncation_side)


def _role(body: ChatCompletionRequest) -> str:
    """The reply's role: vLLM's, the last message's where no generation prompt opens a new turn."""
    return "assistant" if body.add_generation_prompt else body.messages[-1].role


def _echo(body: ChatCompletionRequest) -> str:
    last = body.messages[-1]
    return message_text(last, len(body.messages) - 1) if body.echo and last.role == _role(body) else ""


def _calls_tools(body: ChatCompletionRequest) -> bool:
    return body.tools is not None and body.tool_choice != "none"


def _hides_reasoning(body: ChatCompletionRequest, ctx: Context) -> bool:
    """include_reasoning false with a reasoning parser: no reasoning in the reply, nor its tokens in
    logprobs or token_ids, where it would leak (vLLM's suppress_metadata)."""
    return ctx.reasoning is not None and not body.include_reasoning


def _thinking_off(body: ChatCompletionRequest, ctx: Context) -> bool:
    """qwen3 with chat_template_kwargs' enable_thinking false: vLLM's parser then reads no reasoning
    (all content), whatever the template made of the flag."""
    return ctx.reasoning is not None and ctx.reasoning.parser == "qwen3" and \
        (body.chat_template_kwargs or {}).get("enable_thinking", True) is False


def _reads_special_markers(ctx: Context) -> bool:
    """Whether the reasoning parser reads markers that are special tokens (mistral's, where the
    tokenizer has them; without them vLLM's parser reads no reasoning and the text stays as usual)."""
    return ctx.reasoning is not None and ctx.reasoning.markers.content_first and ctx.reasoning.start_id is not None


def _reasoning_readers(body: ChatCompletionRequest, ctx: Context, prompt_ids: list[int], n: int) -> list | None:
    """Each choice's reasoning reader (--reasoning-parser; reasoning.reader); None without a parser
    or with qwen3's thinking off."""
    if ctx.reasoning is None or _thinking_off(body, ctx):
        return None
    return [reader(ctx.reasoning, prompt_ids) for _ in range(n)]


def _tool_reader(body: ChatCompletionRequest, ctx: Context) -> ToolCallText | AutoToolText:
    """What reads a choice's text as tool calls: the model's own format for "auto", and for a forced
    call where the parser has a tag for it (call_envelope)."""
    if body.tool_choice == "auto" or ctx.tool_call_parser in ENVELOPED:
        return AutoToolText(ctx.tool_call_parser, parallel=body.parallel_tool_calls is not False,
                            named=called_function(body) is not None, tokenizer=ctx.tokenizer)
    return ToolCallText(called_function(body), call_id_of(ctx.tool_call_parser))


async def _chunks(head: dict, body: ChatCompletionRequest, responses, top_n: int, prompt_ids: list[int], echo: str,
                  prompt_text: str | None, ctx: Context, cached_tokens: bool):
    include_usage, continuous = body.stream_usage()
    hidden = _hides_reasoning(body, ctx)
    shows_ids = body.return_token_ids and not hidden
    readers = [_tool_reader(body, ctx) for _ in range(body.n)] if _calls_tools(body) else None
    thinkers = _reasoning_readers(body, ctx, prompt_ids, body.n)
    usage = generation.Usage()
    counts = [0] * body.n                   # each choice's tokens so far
    reasoned: list[int] | None = None       # and of those its reasoning tokens (llm's count, where it gives one)
    ended = set()                           # choices whose finish_reason went out (`llm` repeats it)

    def chunk(response: LLMResponse, index: int, delta: dict, logprobs=None, reason=None,
              positions: list | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        if reason is not None:                  # vLLM's stop_reason, in the chunk that ends the choice
            choice["stop_reason"] = response.stop_reasons[index]
        out = {**head, "choices": [choice]}
        if "role" in delta:
            if body.return_token_ids:
                out["prompt_token_ids"] = prompt_ids
            if prompt_text is not None:
                out["prompt_text"] = prompt_text
        elif shows_ids:
            choice["token_ids"] = sampled_ids(positions)
        if continuous:
            out["usage"] = generation.usage_body(response.num_input_tokens, counts[index],
                                                 None if reasoned is None else reasoned[index])
        return out

    first = True
    try:
        async for _, response in responses:
            if first:
                if response.num_reasoning_tokens is not None and ctx.reasoning is not None:
                    reasoned = [0] * body.n
                for index in range(body.n):
                    yield chunk(response, index, {"role": _role(body),
                                                  "content": readers[index].empty_content if readers else ""})
                for index in range(body.n if echo else 0):
                    yield chunk(response, index, {"content": echo}, positions=[])
            usage.add(response, first)
            first = False
            for index, text in enumerate(response.texts):
                if index in ended:
                    continue
                counts[index] += response.num_output_tokens[index]
                if reasoned is not None:
                    reasoned[index] += response.num_reasoning_tokens[index]
                reason, positions = response.finish_reasons[index], response.logprobs[index]
                if reason is not None:
                    ended.add(index)
                if not (response.num_output_tokens[index] or text or reason or positions):
                    continue        # nothing new for this output in this step
                logprobs = None
                if body.logprobs and positions is not None and not hidden:
                    logprobs = chat_logprobs(body.shown(positions), top_n)
                if readers is None and thinkers is None:
                    yield chunk(response, index, {"content": text}, logprobs, reason, positions)
                    continue
                delta = {}
                if thinkers is not None:
                    reasoning, text = thinkers[index].feed(text)
                    if reason is not None:
                        more, rest = thinkers[index].close()
                        reasoning, text = reasoning + more, text + rest
                    if reasoning and not hidden:
                        delta["reasoning"] = reasoning
                content, calls = readers[index].feed(text) if readers is not None else (text, [])
                if reason is not None and readers is not None:
                    rest, more = readers[index].close()
                    content, calls = content + (rest or ""), calls + more
                    reason = readers[index].finish_reason(reason)
                if content:
                    delta["content"] = content
                if calls:
                    delta["tool_calls"] = calls
                if delta or reason is not None or logprobs is not None or shows_ids:
                    yield chunk(response, index, delta, logprobs, reason, positions)
    finally:
        await responses.aclose()
    if include_usage:
        yield {**head, "choices": [], "usage": usage.body(ctx.reasoning is not None, cached_tokens)}

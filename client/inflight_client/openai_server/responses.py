"""POST /v1/responses: OpenAI's Responses API as a view over a chat completion. The request becomes
a ChatCompletionRequest (`instructions` a system message; the input items chat messages, where an
earlier reply's reasoning, message and function_call items make one assistant turn and each
function_call_output a tool message; flat function tools, `text.format`, `reasoning.effort`,
`max_output_tokens` and `truncation` in their chat names), which run_chat runs as any chat: the
same template, sampling, constraints, tool and reasoning readers and usage. Its reply, or its
stream's deltas, becomes the output items: a reasoning item (--reasoning-parser), a message with its
output_text, a function_call item per call. A stream is the Responses events, each with its
sequence_number, as server-sent events named by their type. Nothing is stored (vLLM 0.32's default):
previous_response_id and background are refused (schemas.py)."""
from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import AsyncIterator

from starlette.responses import JSONResponse

from inflight.config import SamplingParams

from .chat_completions import ChatRun, run_chat
from .context import Context
from .errors import APIError
from .schemas import (ChatCompletionRequest, FunctionCallItem, FunctionCallOutputItem, FunctionChoice, MessageItem,
                      ReasoningItem, ResponsesRequest)
from .sse import event_stream, with_errors

LOGPROBS = "message.output_text.logprobs"
# fields the chat request takes under the same name
SHARED = ("model", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
          "frequency_penalty", "seed", "stop", "stop_token_ids", "ignore_eos", "logit_bias", "skip_special_tokens",
          "include_stop_str_in_output", "structured_outputs", "chat_template_kwargs", "include_reasoning",
          "parallel_tool_calls", "priority", "cache_salt", "request_id", "session_id", "metadata", "user",
          "service_tier", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention", "safety_identifier",
          "stream")
# a chat error's field names -> this request's (a name before any it begins)
RENAMED = (("response_format.json_schema.schema", "text.format.schema"), ("response_format", "text.format"),
           ("max_completion_tokens", "max_output_tokens"), ("max_tokens", "max_output_tokens"), ("messages", "input"),
           ("reasoning_effort", "reasoning.effort"), ("truncate_prompt_tokens", "truncation"))
_CHAT_TOOL = re.compile(r"'tools\[(\d+)\]\.function\.")
_CHAT_CHOICE = '{"type": "function", "function": {"name": ...}}'
ENGINE_DEFAULTS = SamplingParams()          # what `llm` samples with where the request and checkpoint say nothing


async def create_response(body: ResponsesRequest, ctx: Context, request_id: str, large: bool):
    try:
        chat = chat_request(body)
        run = await run_chat(chat, ctx, request_id, large, cached_tokens=True)
    except APIError as exc:
        raise as_sent(exc) from None
    head = _head(body, run.sampling, request_id, body.model or ctx.models.name)
    if run.chunks is not None:
        return event_stream(_stream(head, run))
    choice = run.reply["choices"][0]
    items = Items()
    message, logprobs = choice["message"], (choice["logprobs"] or {}).get("content")
    if chat.tool_choice == "required":      # its content is the text cut after its calls (tools.py), as streamed
        items.feed({**message, "content": None}, logprobs)
        items.feed({"content": message["content"]})
    else:
        items.feed(message, logprobs)
    items.finish(choice["finish_reason"])
    return JSONResponse(_done(head, items.items, choice["finish_reason"], run.reply["usage"]))


def as_sent(error: APIError) -> APIError:
    """A chat error in this request's names."""
    message = _CHAT_TOOL.sub(r"'tools[\1].", error.message).replace(_CHAT_CHOICE, '{"type": "function", "name": ...}')
    for chat, own in RENAMED:
        message = message.replace(f"'{chat}", f"'{own}")
    error.message = message
    if error.param is not None:
        error.param = dict(RENAMED).get(error.param, error.param).split(".")[0]
    return error


# the request as a chat

def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    chat = body.model_dump(include=set(SHARED), exclude_unset=True)
    chat["messages"] = _messages(body)
    if body.tools:
        chat["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                         for tool in body.tools]
    choice = body.tool_choice
    if choice is not None and (body.tools or choice not in ("auto", "none")):     # without tools, no choice (vLLM's)
        named = isinstance(choice, FunctionChoice)
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}} if named else choice
    if body.max_output_tokens is not None:
        chat["max_completion_tokens"] = body.max_output_tokens
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        chat["response_format"] = {"type": "json_schema", "json_schema": fmt.model_dump(
            include={"name", "description", "schema_", "strict"}, by_alias=True, exclude_none=True)}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    if LOGPROBS in (body.include or ()):
        chat.update(logprobs=True, top_logprobs=body.top_logprobs)
    if body.truncation == "auto":
        chat["truncate_prompt_tokens"] = -1         # the start of the prompt cut to leave a token's room (vLLM's)
    if body.stream:
        chat["stream_options"] = {"include_usage": True}
    last = body.input[-1]
    if isinstance(last, MessageItem) and last.role == "assistant" and last.status in ("in_progress", "incomplete"):
        chat["continue_final_message"] = True       # vLLM's: an unfinished reply is continued
    return ChatCompletionRequest.model_validate(chat)


def _messages(body: ResponsesRequest) -> list[dict]:
    """The chat messages: an earlier reply's items (its reasoning, its message, its calls) join one
    assistant turn, as vLLM joins them."""
    messages = [] if body.instructions is None else [{"role": "system", "content": body.instructions}]
    for i, item in enumerate(body.input):
        turn = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
        if isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": _parts(item.output), "tool_call_id": item.call_id})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": _arguments(item, i)}}
            if turn is None:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            else:
                turn.setdefault("tool_calls", []).append(call)
        elif isinstance(item, ReasoningItem):
            reasoning = _reasoning(item, i)
            if turn is None or "reasoning" in turn:
                messages.append({"role": "assistant", "content": None, "reasoning": reasoning})
            else:
                turn["reasoning"] = reasoning
        elif item.role == "assistant" and turn is not None and turn["content"] is None:
            turn["content"] = _parts(item.content)
        else:
            messages.append({"role": item.role, "content": _parts(item.content)})
    return messages


def _parts(parts: list) -> list[dict]:
    """Text parts as a chat message's content (whose text the template gets joined, message_text)."""
    return [part.model_dump(exclude_none=True) for part in parts]


def _arguments(item: FunctionCallItem, index: int):
    """A call's arguments as the template takes them (an object), read here to name the item."""
    try:
        return json.loads(item.arguments) if item.arguments else {}
    except ValueError as exc:
        raise APIError(400, f"'input[{index}].arguments' is not valid JSON: {exc}", "input") from None
    except RecursionError:
        raise APIError(400, f"'input[{index}].arguments' is nested too deeply", "input") from None


def _reasoning(item: ReasoningItem, index: int) -> str:
    """A reasoning item's text: its content, else its summary (vLLM's)."""
    if item.encrypted_content is not None:
        raise APIError(400, f"'input[{index}].encrypted_content': this server makes no encrypted reasoning and reads "
                       "none; send the reasoning item's 'content'", "input")
    return "\n".join(part.text for part in item.content or item.summary)


# the reply as output items

def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Items:
    """One reply's output items, built from its chat deltas as they come (a whole reply is one
    delta): an item opens at the first delta of its kind and is done when another begins or the
    reply ends. `feed` and `finish` return the stream events they make."""

    def __init__(self):
        self.items: list[dict] = []       # every item opened, in output order (the open one last)
        self.kind: str | None = None      # the open item's type
        self.text = ""                    # its text (a call's arguments) so far
        self.logprobs: list[dict] = []    # a message's so far
        self.held: list[dict] = []        # of tokens whose text is not content yet (or never: reasoning, an end)
        self.call: dict | None = None     # a call's first delta, its item not open yet (_open_call)

    def feed(self, delta: dict, logprobs: list[dict] | None = None) -> list[dict]:
        """A chat delta (or a whole message) with the logprobs of its tokens, which go with the
        message's text (in a stream, with its next delta), as a whole reply's all go with it."""
        self.held += logprobs or []
        events = []
        if delta.get("reasoning"):
            events += self._write("reasoning", delta["reasoning"])
        if delta.get("content"):
            events += self._write("message", delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:            # a call's first delta: its item opens with its arguments
                events += self._open_call()
                self.call = call
            if call["function"].get("arguments"):
                events += self._open_call() + self._write("function_call", call["function"]["arguments"])
        return events

    def finish(self, reason: str | None) -> list[dict]:
        """The last item done: incomplete where the reply ran out of tokens. A reply of nothing is
        an empty message."""
        events = self._open_call()
        events += [] if self.items else self._open("message")
        if self.kind == "message":
            self.logprobs += self.held
        return events + self._close("incomplete" if reason == "length" else "completed")

    def _open_call(self) -> list[dict]:
        """The call named last opens: at its first arguments, as a named call's name streams
        before the reasoning it follows, or at the next call or the end."""
        call, self.call = self.call, None
        return [] if call is None else self._close("completed") + self._open("function_call", call)

    def _write(self, kind: str, text: str) -> list[dict]:
        events = [] if self.kind == kind else self._close("completed") + self._open(kind)
        self.text += text
        at, item_id = len(self.items) - 1, self.items[-1]["id"]
        if kind == "function_call":
            return events + [{"type": "response.function_call_arguments.delta", "item_id": item_id,
                              "output_index": at, "delta": text}]
        if kind == "reasoning":
            return events + [{"type": "response.reasoning_text.delta", "item_id": item_id, "output_index": at,
                              "content_index": 0, "delta": text}]
        logprobs, self.held = self.held, []
        self.logprobs += logprobs
        return events + [{"type": "response.output_text.delta", "item_id": item_id, "output_index": at,
                          "content_index": 0, "delta": text, "logprobs": logprobs}]

    def _open(self, kind: str, call: dict | None = None) -> list[dict]:
        self.kind, self.text, self.logprobs = kind, "", []
        if kind == "function_call":
            item = {"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": call["function"]["name"],
                    "arguments": "", "status": "in_progress"}
            part = None
        elif kind == "reasoning":
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"id": _id("msg"), "type": "message", "role": "assistant", "content": [], "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.items.append(item)
        at = len(self.items) - 1
        events = [{"type": "response.output_item.added", "output_index": at, "item": dict(item)}]
        if part is not None:
            events.append({"type": "response.content_part.added", "item_id": item["id"], "output_index": at,
                           "content_index": 0, "part": part})
        return events

    def _close(self, status: str) -> list[dict]:
        if self.kind is None:
            return []
        item, at, text = self.items[-1], len(self.items) - 1, self.text
        where = {"item_id": item["id"], "output_index": at}
        if self.kind == "function_call":
            item.update(arguments=text, status=status)
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": text}]
        else:
            if self.kind == "reasoning":
                part = {"type": "reasoning_text", "text": text}
                done = {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": text}
            else:
                part = {"type": "output_text", "text": text, "annotations": [], "logprobs": self.logprobs}
                done = {"type": "response.output_text.done", **where, "content_index": 0, "text": text,
                        "logprobs": self.logprobs}
            item.update(content=[part], status=status)
            events = [done, {"type": "response.content_part.done", **where, "content_index": 0, "part": part}]
        self.kind = None
        return events + [{"type": "response.output_item.done", "output_index": at, "item": item}]


# the response object and its stream

def _head(body: ResponsesRequest, sampling: dict, request_id: str, model: str) -> dict:
    """The response before its output: the request's fields echoed (the sampling as it runs), as
    OpenAI's and vLLM's responses have them."""
    choice = ("auto" if body.tool_choice is None else _dumped(body.tool_choice)) if body.tools else "none"
    return {"id": f"resp_{request_id}", "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "error": None, "incomplete_details": None, "instructions": body.instructions, "metadata": body.metadata,
            "model": model, "output": [], "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": sampling.get("temperature", ENGINE_DEFAULTS.temperature),
            "top_p": sampling.get("top_p", ENGINE_DEFAULTS.top_p),
            "tool_choice": choice,
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
            "max_output_tokens": sampling["max_tokens"], "max_tool_calls": body.max_tool_calls,
            "previous_response_id": None, "background": False, "prompt": None, "reasoning": _dumped(body.reasoning),
            "service_tier": body.service_tier or "auto", "text": _dumped(body.text) or {"format": {"type": "text"}},
            "top_logprobs": body.top_logprobs, "truncation": body.truncation or "disabled", "usage": None,
            "user": body.user}


def _dumped(value):
    return value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value


def _done(head: dict, items: list[dict], reason: str | None, usage: dict) -> dict:
    incomplete = reason == "length"
    details = usage.get("completion_tokens_details") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0     # none from a vLLM backend
    return {**head, "status": "incomplete" if incomplete else "completed", "completed_at": int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "output": items,
            "usage": {"input_tokens": usage["prompt_tokens"],
                      "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
                      "output_tokens": usage["completion_tokens"],
                      "output_tokens_details": {"reasoning_tokens": details.get("reasoning_tokens", 0)},
                      "total_tokens": usage["total_tokens"]}}


class Numbered:
    """The stream's events as server-sent events named by their type, each with its sequence_number
    (the error event that may end it too)."""

    def __init__(self):
        self.number = 0

    def __call__(self, event: dict) -> bytes:
        event["sequence_number"] = self.number
        self.number += 1
        return f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n".encode()

    def error(self, error: APIError) -> bytes:
        return self({"type": "error", **{key: error.body()["error"][key] for key in ("code", "message", "param")}})


def _stream(head: dict, run: ChatRun) -> AsyncIterator[bytes]:
    """The stream's events; a failure after the first ends it with an error event in sequence (as
    chat's streams end, without [DONE])."""
    numbered = Numbered()
    return with_errors(_events(head, run, numbered), lambda exc: as_sent(run.as_sent(exc)), numbered.error, done=None)


async def _events(head: dict, run: ChatRun, sent: Numbered) -> AsyncIterator[bytes]:
    """Created and in_progress, each item's events as the chat's deltas come, then completed (as
    vLLM 0.32, also for a response cut short: its status says so)."""
    items, reason, usage = Items(), None, None
    try:
        yield sent({"type": "response.created", "response": head})
        yield sent({"type": "response.in_progress", "response": head})
        async for chunk in run.chunks:
            if not chunk["choices"]:            # the usage, last
                usage = chunk["usage"]
                continue
            choice = chunk["choices"][0]
            for event in items.feed(choice["delta"], (choice["logprobs"] or {}).get("content")):
                yield sent(event)
            reason = choice["finish_reason"] or reason
        for event in items.finish(reason):
            yield sent(event)
        yield sent({"type": "response.completed", "response": _done(head, items.items, reason, usage)})
    finally:
        await run.chunks.aclose()

"""Forced tool calls for chat completions, as vLLM does them (`tool_choice` "auto" is
tool_parsers.py's): a named `tool_choice` constrains the output to that function's `parameters`
schema (the text is its arguments); "required" constrains it to a JSON array of {"name",
"parameters"} calls, one of the tools each. The text then becomes `tool_calls`, whole or as
stream deltas (OpenAI's shape: the first delta of a call has its id, type and name, later ones add
to `function.arguments`). With a tool-call parser whose format vLLM 0.32 has a structural tag for,
the call is written in that format instead (tool_parsers.call_envelope).
"""
from __future__ import annotations

import json
import math
import re
import secrets
import string
import uuid

from .errors import APIError
from .schemas import ChatCompletionRequest, NamedToolChoice
from .structured import Constraint

EMPTY_OBJECT = {"type": "object", "properties": {}}
_BETWEEN_CALLS = re.compile(r"[\s,\[]*")          # what separates the array's elements


class _Literal:
    """A JSON number Python cannot hold, kept as the model wrote it: 1e999 as a float would be
    written back as Infinity, which is not JSON, and int() refuses more than 4300 digits."""
    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text


def _float(text: str) -> float | _Literal:
    value = float(text)
    return value if math.isfinite(value) else _Literal(text)


def _int(text: str) -> int | _Literal:
    try:
        return int(text)
    except ValueError:
        return _Literal(text)


_DECODER = json.JSONDecoder(parse_float=_float, parse_int=_int)
_MARK = uuid.uuid4().hex                        # around a _Literal's text in json.dumps' output
_MARKED = re.compile(f'"{_MARK}([^"]*){_MARK}"')


def decode_json(text: str, start: int = 0) -> tuple[object, int]:
    """The JSON value at text[start:] and where it ends (numbers kept as the model wrote them
    where Python's cannot hold them); JSONDecodeError where none is complete there."""
    return _DECODER.raw_decode(text, start)


def _parameters(tool) -> dict:
    return tool.function.parameters or EMPTY_OBJECT


def _required_schema(tools, parallel: bool) -> dict:
    """An array of at least one {"name": <a tool's name>, "parameters": <its schema>} (exactly one
    without `parallel`), with the tools' "$defs" lifted to the top so that their "#/$defs/..."
    references still resolve."""
    defs, calls = {}, []
    for tool in tools:
        parameters = dict(_parameters(tool))
        shared = parameters.pop("$defs", {})
        if not isinstance(shared, dict):
            raise APIError(400, f"'tools': the $defs of {tool.function.name!r} must be an object", "tools")
        for name, schema in shared.items():
            if defs.setdefault(name, schema) != schema:      # one would stand for both (vLLM refuses it too)
                raise APIError(400, f"'tools': the definition {name!r} ($defs) differs between tools; "
                               "give the tools' shared definitions one schema or distinct names", "tools")
        calls.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": parameters},
                      "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return {**schema, "$defs": defs} if defs else schema


def tool_constraint(body: ChatCompletionRequest) -> Constraint | None:
    """The constraint a named or "required" tool_choice puts on the output ("none": none)."""
    if isinstance(body.tool_choice, NamedToolChoice):
        tool = next(t for t in body.tools if t.function.name == body.tool_choice.function.name)
        return Constraint({"json": _parameters(tool)}, "tool_choice", tool_schemas(body))
    if body.tool_choice == "required":
        return Constraint({"json": _required_schema(body.tools, body.parallel_tool_calls is not False)},
                          "tool_choice", tool_schemas(body))
    return None


def tool_schemas(body: ChatCompletionRequest) -> str:
    """Where a forced call's schemas are written, for `llm`'s errors: the named tool's parameters,
    or all the tools for "required"."""
    if isinstance(body.tool_choice, NamedToolChoice):
        i = next(i for i, t in enumerate(body.tools) if t.function.name == body.tool_choice.function.name)
        return f"tools[{i}].function.parameters"
    return "tools"


def called_function(body: ChatCompletionRequest) -> str | None:
    """The named tool_choice's function (None for "required")."""
    return body.tool_choice.function.name if isinstance(body.tool_choice, NamedToolChoice) else None


def openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def mistral_call_id() -> str:
    """Mistral's form of a call id, 9 letters and digits: its chat templates (and mistral-common)
    refuse any other in the history a client sends back, so vLLM makes these for its mistral parser."""
    return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


def new_call(index: int, name: str, arguments: str, call_id=openai_call_id) -> dict:
    return {"index": index, "id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def arguments_json(parameters) -> str:
    """A call's parameters as its arguments' JSON text (as vLLM writes them), in ASCII escapes where
    they hold a lone surrogate (a model's "\\ud800"), which has no UTF-8 form for the reply, and
    with a number too large for a float as the model wrote it."""
    text = json.dumps(parameters, ensure_ascii=False, default=_marked)
    if any("\ud800" <= c <= "\udfff" for c in text):
        text = json.dumps(parameters, default=_marked)
    return _MARKED.sub(r"\1", text)


def _marked(value: _Literal) -> str:
    return f"{_MARK}{value.text}{_MARK}"


class ToolCallText:
    """One choice's output text read as a forced call, as it arrives: `feed` returns the content
    (none) and the `tool_calls` delta entries the new text completes, `close` what is left at the
    end (AutoToolText's shape)."""

    empty_content = None              # a forced call's reply has no content (OpenAI's null; vLLM 0.32 writes "")

    def __init__(self, function: str | None, call_id=openai_call_id):
        self.function = function          # named tool_choice; None: "required"'s array
        self.call_id = call_id            # what makes each call's id (the model's form: tool_parsers.call_id_of)
        self.text = ""
        self.position = 0                 # "required": where the next call starts
        self.num_calls = 0
        self.closed = False               # "required": the array's "]" was read

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content, calls): a forced call's text is all calls."""
        self.text += text
        return "", self._named(text) if self.function is not None else self._required()

    def _named(self, text: str) -> list[dict]:
        if self.num_calls == 0:
            self.num_calls = 1
            return [new_call(0, self.function, text, self.call_id)]
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def _required(self) -> list[dict]:
        """Each array element once it is complete: {"name", "parameters"} -> a call whose
        arguments are the parameters' JSON (as vLLM writes them)."""
        deltas = []
        while not self.closed:
            start = _BETWEEN_CALLS.match(self.text, self.position).end()
            if self.text.startswith("]", start):
                self.closed = True
                break
            try:
                call, end = decode_json(self.text, start)
            except (json.JSONDecodeError, RecursionError):     # not complete yet (or never: too deep)
                break
            deltas.append(new_call(self.num_calls, call["name"], arguments_json(call["parameters"]), self.call_id))
            self.num_calls += 1
            self.position = end
        return deltas

    def finish_reason(self, reason: str) -> str:
        """'tool_calls' when a "required" array ended as its grammar did; a named call keeps
        'stop', as OpenAI and vLLM report a call the request forced."""
        return "tool_calls" if self.function is None and reason == "stop" and self.closed else reason

    def close(self) -> tuple[str | None, list[dict]]:
        """At the end: the text of a "required" array cut short (by max_tokens, a stop string or
        a stop token) after its last complete call, which is content, not a call."""
        if self.function is not None or self.closed:
            return None, []
        return self.text[self.position:] or None, []


def tool_message(reader, text: str, reason: str) -> tuple[dict, str]:
    """A whole output as the assistant message and its finish_reason, read by a ToolCallText or an
    AutoToolText (tool_parsers.py): the same calls and content a stream of it gives."""
    content, calls = reader.feed(text)
    rest, more = reader.close()
    calls += more
    for call in calls:
        del call["index"]
    text = content + (rest or "")
    message = {"role": "assistant", "content": text or (None if calls else reader.empty_content)}
    if calls:
        message["tool_calls"] = calls
    return message, reader.finish_reason(reason)

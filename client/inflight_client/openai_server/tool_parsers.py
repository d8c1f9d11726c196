"""`tool_choice` "auto": tool calls found in free text, in the model's own tool-call format, with
vLLM's `--enable-auto-tool-choice --tool-call-parser NAME` (the formats below). The model
decides whether to call; the text it writes is read as it arrives: content streams as content,
and each call goes out whole once its JSON is complete (the arguments are not split into pieces).
Content is the text before the first call (a reply that has calls, vLLM's parsers read the same
way); whitespace alone before a call is none. Where vLLM 0.32 constrains the calls as the model
writes them (a strict tool, or parallel_tool_calls false; and a "required" or named tool_choice,
then read here too), `call_envelope` is its structural tag.

- `hermes` (Hermes 2 Pro, Qwen 2.5 and 3): each call `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`. A block before the first call that is not a JSON call stays in the content as
  written.
- `llama3_json` (Llama 3.1 to 3.3): a reply that starts with a JSON object (after whitespace or
  `<|python_tag|>`) is calls, `{"name": ..., "parameters": {...}}` (or "arguments"), separated by
  ';' (or anything else: text between calls is skipped); a reply that starts with anything else, or
  whose first object is not a call, is content. A later object that is not a call ends the calls.
- `pythonic` (ToolACE; Llama 3.2 with a chat template that asks for it) and `llama4_pythonic`
  (Llama 4, which may wrap the list in `<|python_start|>` ... `<|python_end|>`): a reply that is a
  Python list of calls, `[get_weather(city="Oslo"), add(a=1, b=2)]`, each argument a keyword with
  a literal value (JSON's null/true/false too; tuples and sets become lists), is calls; any other
  reply is content, whole, as vLLM's reads a whole reply. So a reply that starts as a list of calls
  (`[name(`) is held until it ends; any other streams as it comes.
- `mistral` (Mistral's instruct models: 7B v0.3, Nemo, Small, Ministral, Magistral, Devstral): each
  `[TOOL_CALLS]` opens calls, which run to the next one (or the end). Its form follows the tokenizer,
  as vLLM's choice does: without an `[ARGS]` token (before Mistral's tokenizer v11) a JSON list of
  {"name", "arguments"} (or one such object); with one, `name[ARGS]{...}` (or `name{...}`), a call
  each. What does not read as a call is skipped; a reply in which no call reads is content, whole.
"""
from __future__ import annotations

import ast
import json
import math
import re

from inflight.structured import older_tag_format

from .tools import arguments_json, called_function, decode_json, mistral_call_id, new_call, openai_call_id

PARSERS = ("hermes", "llama3_json", "pythonic", "llama4_pythonic", "mistral")
ENVELOPED = ("hermes", "llama3_json")       # the formats vLLM 0.32 has a structural tag for
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"      # llama4_pythonic: around its list
TOOL_CALLS, ARGS = "[TOOL_CALLS]", "[ARGS]"     # mistral: before calls; v11+ between a call's name and arguments
_PYTHONIC_HEAD = re.compile(r"\[\s*[A-Za-z_]\w*\(")      # how a pythonic list of calls starts
_PYTHONIC_START = re.compile(r"(?:\[\s*(?:[A-Za-z_]\w*)?)?")  # what could still become that
_JSON_NAMES = {"null": None, "true": True, "false": False}


def call_envelope(parser: str, body, own: dict | None = None) -> dict | None:
    """The structural tag vLLM 0.32 puts on a reply with tools for the formats it has one for
    (hermes, llama3_json; its default VLLM_ENFORCE_STRICT_TOOL_CALLING), so that the model writes
    its calls in its own format:
    - "required": one call or more, and nothing else; a named tool_choice: that function's call.
    - "auto": only where a tool is `strict`, or parallel_tool_calls is false; calls are optional
      and text around them free. With a constraint of the request's own (`own`, its
      structured_outputs; needs a strict tool) the reply is either calls, as for "required", or
      what that constraint allows.
    A call names a given tool; a strict tool's arguments follow its `parameters` (another's are any
    JSON); with parallel_tool_calls false the reply holds at most one call. None: no tag (the
    JSON forms of tools.py, or the request's own constraint alone)."""
    if parser not in ENVELOPED:
        return None
    parallel, named = body.parallel_tool_calls is not False, called_function(body)
    tools = [tool for tool in body.tools if named in (None, tool.function.name)]
    strict = [tool.function.strict is True for tool in tools]
    choice = "forced" if named else body.tool_choice
    other = None if own is None else _format_of(own)
    if choice == "auto":
        if own is not None and (other is None or not any(strict)):
            return None                 # the request's own constraint alone
        if own is None and parallel and not any(strict):
            return None
        choice = "auto" if own is None else "required"
    calls = [(tool.function.name, tool.function.parameters if s and tool.function.parameters is not None else True)
             for tool, s in zip(tools, strict)]
    fmt = _hermes_envelope(calls, choice) if parser == "hermes" else _llama3_envelope(calls, choice)
    if not parallel and fmt["type"] != "tag":
        fmt["stop_after_first"] = True
    if other is not None:
        fmt = {"type": "or", "elements": [fmt, other]}
    return {"type": "structural_tag", "format": fmt}


def _hermes_envelope(calls: list[tuple[str, dict | bool]], choice: str) -> dict:
    """vLLM's own tag for hermes: each tool's call, its JSON on lines of its own or not."""
    tags = [{"type": "tag", "begin": f'{HERMES_OPEN}{newline}{{"name": "{_in_json(name)}", "arguments": ',
             "content": {"type": "json_schema", "json_schema": schema}, "end": f"}}{newline}{HERMES_CLOSE}"}
            for name, schema in calls for newline in ("\n", "")]
    if choice == "auto":
        return {"type": "triggered_tags", "triggers": [HERMES_OPEN], "tags": tags}
    return {"type": "tags_with_separator", "tags": tags, "separator": "", "at_least_one": True,
            "stop_after_first": choice == "forced"}


def _llama3_envelope(calls: list[tuple[str, dict | bool]], choice: str) -> dict:
    """xgrammar's template for Llama 3's JSON calls, which vLLM takes (get_model_structural_tag
    "llama"), written out here: the OpenAI server carries neither xgrammar nor the torch it needs
    (tests/test_tool_parsers.py holds the two equal)."""
    tags = [{"type": "tag", "begin": f'{{"name": "{_in_json(name)}", "parameters": ',
             "content": {"type": "json_schema", "json_schema": schema}, "end": "}"} for name, schema in calls]
    if choice == "forced":
        return tags[0]
    return {"type": "triggered_tags", "triggers": ['{"name": '], "tags": tags, "excludes": ["<think>", "</think>"],
            "at_least_one": choice == "required"}


def _in_json(name: str) -> str:
    """A tool's name as a JSON string holds it, so that the call the tag makes the model write reads
    back as that name (vLLM's tags put it in raw: a name with '"' or '\\' came back as text)."""
    return json.dumps(name, ensure_ascii=False)[1:-1]


def _format_of(constraint: dict) -> dict | None:
    """The structural-tag format that allows what a request's structured_outputs allows (vLLM's
    structured_outputs_to_format); None where its shape is not one (`llm` then gives the error), and
    for a Lark grammar, which a tag cannot hold."""
    kind = next((k for k in ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
                 if constraint.get(k) is not None), None)
    value = constraint.get(kind)
    if kind in ("json", "structural_tag") and isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    if kind == "json" and isinstance(value, dict):
        return {"type": "json_schema", "json_schema": value}
    if kind == "json_object" and value is True:
        return {"type": "json_schema", "json_schema": {"type": "object"}}
    if kind == "regex" and isinstance(value, str):
        return {"type": "regex", "pattern": value}
    if kind == "grammar" and isinstance(value, str) and "::=" in value:     # EBNF (vLLM turns Lark into it)
        return {"type": "grammar", "grammar": value}
    if kind == "choice" and isinstance(value, list) and all(isinstance(c, str) for c in value):
        return {"type": "or", "elements": [{"type": "const_string", "value": c} for c in value]}
    if kind == "structural_tag" and isinstance(value, dict) and isinstance(value.get("format"), dict):
        return value["format"]
    if kind == "structural_tag" and isinstance(value, dict) and isinstance(value.get("structures"), list) \
            and all(isinstance(s, dict) for s in value["structures"]):
        return older_tag_format(value)
    return None


def special_tokens_kept(parser: str) -> bool:
    """Whether the parser reads special tokens (skip_special_tokens false): Hermes 2 Pro's
    <tool_call> tags and Mistral's [TOOL_CALLS] are special tokens, so vLLM keeps them in the text
    for these parsers."""
    return parser in ("hermes", "mistral")


def call_id_of(parser: str | None):
    """What makes the ids of the calls read for this parser: Mistral's form for mistral (the model's
    chat template refuses another when the client sends the calls back), else OpenAI's."""
    return mistral_call_id if parser == "mistral" else openai_call_id


def check_tokenizer(parser: str | None, tokenizer) -> None:
    """SystemExit naming the flag where the parser cannot read this tokenizer's output (vLLM refuses
    to start too): mistral's needs Mistral's [TOOL_CALLS] token."""
    if parser == "mistral" and not _has_token(tokenizer, TOOL_CALLS):
        raise SystemExit(f"inflight-openai: --tool-call-parser mistral: the tokenizer has no {TOOL_CALLS!r} token "
                         "(Mistral's tool-call marker)")


def _has_token(tokenizer, token: str) -> bool:
    """Whether the token is in the tokenizer's vocabulary (where vLLM looks), without building it."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id is not None and tokenizer.convert_ids_to_tokens(token_id) == token


def _call(value, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in arguments_keys if k in value), None)
    return None if key is None else (value["name"], arguments_json(value[key]))


def _decoded(text: str, start: int = 0) -> tuple[object, int] | None:
    """The JSON value at text[start:] and its end; None where none is complete there (or it is
    nested too deeply for Python's decoder, which a model can write)."""
    try:
        return decode_json(text, start)
    except (json.JSONDecodeError, RecursionError):
        return None


def _mistral_call(value) -> tuple[str, str] | None:
    """(name, arguments JSON) of an element of Mistral's JSON list of calls; None if it is not one. As
    vLLM's: arguments that are a string are taken as written, and none are {}."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments")
    if arguments is None:
        return value["name"], "{}"
    return value["name"], arguments if isinstance(arguments, str) else arguments_json(arguments)


def _mistral_list(text: str, complete: bool) -> list[tuple[str, str]] | None:
    """The calls of a pre-v11 [TOOL_CALLS]'s text, a JSON list of calls or one call (elements that
    are not calls skipped, text after it too, as vLLM's); [] where none reads; None while more text
    could still make them."""
    start = len(text) - len(text.lstrip())
    if start < len(text) and text[start] not in "[{":
        return []
    decoded = _decoded(text, start) if start < len(text) else None
    if decoded is None:
        return [] if complete else None
    calls = decoded[0] if isinstance(decoded[0], list) else [decoded[0]]
    return [call for call in map(_mistral_call, calls) if call is not None]


def _mistral_named(text: str, complete: bool) -> list[tuple[str, str]] | None:
    """The call of a v11+ [TOOL_CALLS]'s text, `name[ARGS]{...}` or `name{...}`: its arguments the
    JSON object as the model wrote it (vLLM's), text after it skipped; [] where it is not a call;
    None while more text could still make it one."""
    args, brace = text.find(ARGS), text.find("{")
    split = args if args >= 0 and (brace < 0 or args < brace) else brace
    if split < 0:
        return [] if complete else None
    name, start = text[:split].strip(), split + len(ARGS) if split == args else split
    start += len(text[start:]) - len(text[start:].lstrip())
    if not name or (start < len(text) and text[start] != "{"):
        return []
    decoded = _decoded(text, start) if start < len(text) else None
    if decoded is None:
        return [] if complete else None
    return [(name, text[start:decoded[1]])]


def _whole_call(text: str, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """The call a block's text is, JSON and nothing else around it but whitespace; None if not one."""
    text = text.strip()
    decoded = _decoded(text)
    return _call(decoded[0], arguments_keys) if decoded is not None and decoded[1] == len(text) else None


def held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of text could start `tag` (held back until they cannot):
    also reasoning.py's, for its markers."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


def _literal(node: ast.expr):
    """A Python literal's value as JSON holds it; ValueError for anything else (a name, a call, an
    expression, bytes, a number JSON cannot write)."""
    if isinstance(node, ast.Constant) and type(node.value) in (str, int, bool, type(None)):
        return node.value
    if isinstance(node, ast.Constant) and type(node.value) is float and math.isfinite(node.value):
        return node.value
    if isinstance(node, ast.Dict) and all(isinstance(k, ast.Constant) for k in node.keys):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.JoinedStr) and all(isinstance(part, ast.Constant) for part in node.values):
        return "".join(part.value for part in node.values)      # an f-string without placeholders
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if type(value) in (int, float):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError("not a literal")


def _python_calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call of a pythonic reply, `[name(key=literal, ...), ...]`; None
    if it is not one. As vLLM's, the reply is read as a Python module whose first statement is the list
    (so text after it that is Python too is ignored), and its pattern refuses positional arguments
    and dotted names."""
    try:
        module = ast.parse(text)
        calls = module.body[0].value if module.body and isinstance(module.body[0], ast.Expr) else None
        if not isinstance(calls, ast.List) or not calls.elts:
            return None
        found = []
        for call in calls.elts:
            if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args \
                    or any(k.arg is None for k in call.keywords):
                return None
            found.append((call.func.id, arguments_json({k.arg: _literal(k.value) for k in call.keywords})))
        return found
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class AutoToolText:
    """One choice's output text read for tool calls as it arrives: `feed` returns the content and
    the `tool_calls` delta entries the new text completes, `close` those of what is left at the end."""

    empty_content = ""                # a reply without a call, and without text (as vLLM's)

    def __init__(self, parser: str, parallel: bool = True, named: bool = False, tokenizer=None):
        assert parser in PARSERS
        self.parser = parser
        self.parallel = parallel      # False (parallel_tool_calls false): calls after the first are dropped
        self.named = named            # the call a named tool_choice forced (under call_envelope's tag)
        self.call_id = call_id_of(parser)
        # mistral: the form of its calls, from the model's tokenizer as vLLM tells it: name[ARGS]{...}
        # where it has an [ARGS] token (v11+), else a JSON list
        self.args_token = parser == "mistral" and _has_token(tokenizer, ARGS)
        self.calls_at = None          # mistral: where the call text being read starts; None: no [TOOL_CALLS] yet
        self.call_read = False        # mistral: that text was read (then calls_at: where the next marker may start)
        self.text = ""
        self.position = 0             # what has been read: sent as content, or taken as calls
        self.num_calls = 0
        self.in_call = False          # hermes: inside <tool_call> ... </tool_call>
        self.calling = None           # llama3_json, pythonic: None until the reply's first characters tell
        self.done = False             # llama3_json: its calls ended; what follows is not content

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        if self.parser == "hermes":
            return self._hermes()
        if self.parser == "mistral":
            return self._mistral()
        return self._llama3_json() if self.parser == "llama3_json" else self._pythonic()

    def close(self) -> tuple[str | None, list[dict]]:
        """At the end: the content not yet sent (held text, a call never completed) and an
        unfinished hermes block that still parses as a whole call (vLLM reads those too)."""
        if self.parser in ("pythonic", "llama4_pythonic"):
            return self._close_pythonic()
        rest, self.position = self.text[self.position:], len(self.text)
        calls = []
        if self.parser == "hermes" and self.in_call:
            call = _whole_call(rest, ("arguments", "parameters"))
            if call is not None:
                calls, rest = self._take(call), ""
            else:
                rest = HERMES_OPEN + rest
        if self.parser == "mistral" and self.calls_at is not None:
            calls = self._mistral_calls(final=True)
        if self.num_calls:
            return None, calls         # after a call, text is not content
        if self.calling:
            rest = self.text            # calls that never completed: the whole reply is content
        return rest or None, calls

    def finish_reason(self, reason: str) -> str:
        """'tool_calls' when the reply held a call and ended as the model chose (vLLM's streams;
        a reply cut by max_tokens keeps "length"); a named tool_choice's call keeps 'stop', as
        OpenAI and vLLM report a call the request forced."""
        return "tool_calls" if self.num_calls and reason == "stop" and not self.named else reason

    def _take(self, name_and_arguments: tuple[str, str]) -> list[dict]:
        call = new_call(self.num_calls, *name_and_arguments, self.call_id)
        self.num_calls += 1
        return [call] if self.parallel or self.num_calls == 1 else []

    def _hermes(self) -> tuple[str, list[dict]]:
        content, calls = [], []
        while True:
            if not self.in_call:
                start = self.text.find(HERMES_OPEN, self.position)
                if start < 0:
                    # all but what could be the start of a tag (or, before anything was sent,
                    # whitespace that a call may follow) is read: content before the first call,
                    # and after one nothing
                    end = len(self.text) - held_prefix(self.text[self.position:], HERMES_OPEN)
                    if not self.num_calls:
                        if self.position == 0 and not self.text[:end].strip():
                            break
                        content.append(self.text[self.position:end])
                    self.position = end
                    break
                if not self.num_calls and (self.position or self.text[:start].strip()):
                    content.append(self.text[self.position:start])
                self.position, self.in_call = start + len(HERMES_OPEN), True
            end = self.text.find(HERMES_CLOSE, self.position)
            if end < 0:
                break
            block = self.text[self.position:end]
            call = _whole_call(block, ("arguments", "parameters"))
            if call is not None:
                calls += self._take(call)
            elif not self.num_calls:
                content.append(f"{HERMES_OPEN}{block}{HERMES_CLOSE}")
            self.position, self.in_call = end + len(HERMES_CLOSE), False
        return "".join(content), calls

    def _mistral(self) -> tuple[str, list[dict]]:
        content = ""
        if self.calls_at is None:
            start = self.text.find(TOOL_CALLS, self.position)
            end = start if start >= 0 else len(self.text) - held_prefix(self.text[self.position:], TOOL_CALLS)
            if self.position or self.text[:end].strip():      # whitespace alone before a call is none
                content, self.position = self.text[self.position:end], end
            if start < 0:
                return content, []
            self.calls_at = start + len(TOOL_CALLS)
        return content, self._mistral_calls(final=False)

    def _mistral_calls(self, final: bool) -> list[dict]:
        """The calls of each [TOOL_CALLS]'s text once it is complete: it runs to the next marker (or
        the end), so that a call cut short or malformed ends there and the next one still reads."""
        calls = []
        while True:
            end = self.text.find(TOOL_CALLS, self.calls_at)
            if not self.call_read:
                text = self.text[self.calls_at:end if end >= 0 else len(self.text)]
                read = (_mistral_named if self.args_token else _mistral_list)(text, final or end >= 0)
                if read is None:
                    break                  # not complete yet
                calls += [call for name_and_arguments in read for call in self._take(name_and_arguments)]
                self.call_read = True
            if end < 0:
                if self.call_read:         # only the next marker matters now: look for it in what is new
                    self.calls_at = max(self.calls_at, len(self.text) - len(TOOL_CALLS) + 1)
                break
            self.calls_at, self.call_read = end + len(TOOL_CALLS), False
        return calls

    def _llama3_json(self) -> tuple[str, list[dict]]:
        if self.done:
            self.position = len(self.text)
            return "", []
        if self.calling is None:
            body = self.text.lstrip()
            if body.startswith(PYTHON_TAG):
                body = body[len(PYTHON_TAG):].lstrip()
            elif PYTHON_TAG.startswith(body):
                return "", []              # nothing yet, or what could be the start of the tag
            if not body:
                return "", []
            self.calling = body.startswith("{")
            if self.calling:
                self.position = len(self.text) - len(body)
        if not self.calling:
            content, self.position = self.text[self.position:], len(self.text)
            return content, []
        calls = []
        while True:
            # the first call opens the reply; after it, anything up to the next object is skipped (';'
            # as Llama writes, ',' or text: vLLM's whole-reply reading takes every call wherever it is)
            start = self.text.find("{", self.position) if self.num_calls else self.position
            decoded = _decoded(self.text, start) if 0 <= start < len(self.text) else None
            if decoded is None:
                break                      # not complete yet (close() gives what never completes)
            call = _call(decoded[0], ("parameters", "arguments"))
            if call is not None:
                calls += self._take(call)
                self.position = decoded[1]
            elif self.num_calls:           # text after the calls is not content
                self.position, self.done = len(self.text), True
                break
            else:                          # its first object is not a call: the reply is content
                self.calling, self.position = False, 0
                return self._llama3_json()[0], calls
        return "", calls

    def _tagged(self) -> bool:
        """A llama4_pythonic reply that opens with <|python_start|>: vLLM drops the tag and every
        <|python_end|> after it."""
        return self.parser == "llama4_pythonic" and self.text.startswith(PYTHON_START)

    def _pythonic_body(self) -> str:
        return self.text[len(PYTHON_START):] if self._tagged() else self.text

    def _pythonic(self) -> tuple[str, list[dict]]:
        if self.calling is None:
            body = self._pythonic_body()
            if (self.parser == "llama4_pythonic" and PYTHON_START.startswith(body)) or _PYTHONIC_START.fullmatch(body):
                return "", []              # what could still be the tag, or open a list of calls
            self.calling = _PYTHONIC_HEAD.match(body) is not None
            self.position = len(self.text) - len(body)
        if self.calling:
            return "", []                  # read whole at the end: calls only if all of it is calls
        return self._pythonic_content(final=False), []

    def _pythonic_content(self, final: bool) -> str:
        """The content not yet sent (a tagged reply's <|python_end|> dropped, and held while one
        could be starting)."""
        tagged, end = self._tagged(), len(self.text)
        if tagged and not final:
            end -= held_prefix(self.text[self.position:], PYTHON_END)
        content, self.position = self.text[self.position:end], end
        return content.replace(PYTHON_END, "") if tagged else content

    def _close_pythonic(self) -> tuple[str | None, list[dict]]:
        if self.calling is False:
            return self._pythonic_content(final=True) or None, []
        body = self._pythonic_body()
        if self._tagged():
            body = body.replace(PYTHON_END, "")
        found = _python_calls(body) if self.calling else None
        if found is None:
            return body or None, []
        return None, [call for name_and_arguments in found for call in self._take(name_and_arguments)]

"""`tool_choice` "auto": tool calls found in free text, in the model's own tool-call format, with
vLLM's `--enable-auto-tool-choice --tool-call-parser NAME` (the two formats below). The model
decides whether to call; the text it writes is read as it arrives: content streams as content,
and each call goes out whole once its JSON is complete (the arguments are not split into pieces).

- `hermes` (Hermes 2 Pro, Qwen 2.5 and 3): each call `<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>`. Content is the text before the first call; text between or after calls is not
  (vLLM keeps only that part too). A block that is not a JSON call stays in the content as written.
- `llama3_json` (Llama 3.1 to 3.3): an output that starts with a JSON object (after whitespace or
  `<|python_tag|>`) is calls, `{"name": ..., "parameters": {...}}` (or "arguments"), separated by
  ';'; an output that starts with anything else is content. A call that does not parse ends the
  calls: the text from there on is content.
"""
from __future__ import annotations

import json
import re

from .tools import arguments_json, decode_json, new_call

PARSERS = ("hermes", "llama3_json")
HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
_BETWEEN_CALLS = re.compile(r"[\s;]*")      # llama3_json: what separates calls


def special_tokens_kept(parser: str) -> bool:
    """Whether the parser reads special tokens (skip_special_tokens false): Hermes 2 Pro's
    <tool_call> tags are special tokens, so vLLM keeps them in the text for this parser."""
    return parser == "hermes"


def _call(value, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """(name, arguments JSON) of a decoded call object; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in arguments_keys if k in value), None)
    return None if key is None else (value["name"], arguments_json(value[key]))


def _whole_call(text: str, arguments_keys: tuple[str, ...]) -> tuple[str, str] | None:
    """The call a block's text is, JSON and nothing else around it but whitespace; None if not one."""
    text = text.strip()
    try:
        value, end = decode_json(text)
    except json.JSONDecodeError:
        return None
    return _call(value, arguments_keys) if end == len(text) else None


def _held_tag_prefix(text: str, tag: str) -> int:
    """How many characters at the end of text could start `tag` (held back until they cannot)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class AutoToolText:
    """One choice's output text read for tool calls as it arrives: `feed` returns the content and
    the `tool_calls` delta entries the new text completes, `close` those of what is left at the end."""

    def __init__(self, parser: str, parallel: bool = True):
        assert parser in PARSERS
        self.parser = parser
        self.parallel = parallel      # False (parallel_tool_calls false): calls after the first are dropped
        self.text = ""
        self.position = 0             # what has been read: sent as content, or taken as calls
        self.num_calls = 0
        self.in_call = False          # hermes: inside <tool_call> ... </tool_call>
        self.calling = None           # llama3_json: None until the output's first characters tell
        self.failed = False           # llama3_json: a call did not parse; the rest is content

    def feed(self, text: str) -> tuple[str, list[dict]]:
        self.text += text
        return self._hermes() if self.parser == "hermes" else self._llama3_json()

    def close(self) -> tuple[str | None, list[dict]]:
        """At the end: the content not yet sent (a held start of a tag, a call never completed) and
        an unfinished hermes block that still parses as a whole call (vLLM reads those too)."""
        rest, self.position = self.text[self.position:], len(self.text)
        if self.parser == "hermes" and self.in_call:
            call = _whole_call(rest, ("arguments", "parameters"))
            if call is not None:
                return None, self._take(call)
            return f"<tool_call>{rest}", []
        if self.parser == "hermes" and self.num_calls:
            return None, []            # text after a call is not content
        return rest or None, []

    def finish_reason(self, reason: str) -> str:
        """'tool_calls' when the output held a call (vLLM's for "auto")."""
        return "tool_calls" if self.num_calls else reason

    def _take(self, name_and_arguments: tuple[str, str]) -> list[dict]:
        call = new_call(self.num_calls, *name_and_arguments)
        self.num_calls += 1
        return [call] if self.parallel or self.num_calls == 1 else []

    def _hermes(self) -> tuple[str, list[dict]]:
        content, calls = [], []
        while True:
            if not self.in_call:
                start = self.text.find(HERMES_OPEN, self.position)
                if start < 0:
                    # all but what could be the start of a tag is read: content before the first
                    # call, and after one nothing (text outside the tags is not content then)
                    end = len(self.text) - _held_tag_prefix(self.text[self.position:], HERMES_OPEN)
                    if not self.num_calls:
                        content.append(self.text[self.position:end])
                    self.position = end
                    break
                if not self.num_calls:
                    content.append(self.text[self.position:start])
                self.position, self.in_call = start + len(HERMES_OPEN), True
            end = self.text.find(HERMES_CLOSE, self.position)
            if end < 0:
                break
            block = self.text[self.position:end]
            call = _whole_call(block, ("arguments", "parameters"))
            if call is None:
                content.append(f"{HERMES_OPEN}{block}{HERMES_CLOSE}")
            else:
                calls += self._take(call)
            self.position, self.in_call = end + len(HERMES_CLOSE), False
        return "".join(content), calls

    def _llama3_json(self) -> tuple[str, list[dict]]:
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
        if not self.calling or self.failed:
            content, self.position = self.text[self.position:], len(self.text)
            return content, []
        calls = []
        while True:
            start = _BETWEEN_CALLS.match(self.text, self.position).end()
            if start == len(self.text):
                break
            try:
                value, end = decode_json(self.text, start)
            except json.JSONDecodeError:
                break                          # not complete yet (close() gives what never completes)
            call = _call(value, ("parameters", "arguments"))
            if call is None:
                self.failed = True
                content, self.position = self.text[start:], len(self.text)
                return content, calls
            calls += self._take(call)
            self.position = end
        return "", calls

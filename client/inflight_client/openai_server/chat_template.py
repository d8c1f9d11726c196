"""Chat messages -> the prompt's text, with the checkpoint's own chat template
(tokenizer_config.json, rendered by transformers' apply_chat_template), a --chat-template file, or
(where the server trusts them) the request's own.

The callers tokenize it without adding special tokens unless asked, as vLLM does: chat templates
write their own BOS (a second one would change the model's output)."""
from __future__ import annotations

import inspect
import json

from .errors import APIError
from .schemas import ChatMessage, TemplateFields


# content part types that are text, and the key holding it (vLLM's too: the Responses API's
# input_text / output_text, and the refusal an assistant turn in OpenAI's own history may carry)
TEXT_PARTS = {"text": "text", "input_text": "text", "output_text": "text", "refusal": "refusal"}


def message_text(message: ChatMessage, index: int) -> str:
    """String content, or the text of list content's parts (a bare string is one) joined by
    newlines (vLLM's way)."""
    content = message.content
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for position, part in enumerate(content):
        if isinstance(part, str):
            texts.append(part)
            continue
        kind = part.get("type")
        key = TEXT_PARTS.get(kind) if isinstance(kind, str) else None
        if key is None:
            raise APIError(400, f"'messages[{index}].content': only text parts are supported, got "
                           f"{kind!r}", "messages")
        if not isinstance(part.get(key), str):
            raise APIError(400, f"'messages[{index}].content[{position}].{key}' must be a string", "messages")
        texts.append(part[key])
    return "\n".join(texts)


def template_message(message: ChatMessage, index: int) -> dict:
    """A message as transformers' chat templates take it: text content, and an assistant's
    `tool_calls` with their `arguments` as objects (OpenAI sends a JSON string; templates render
    `arguments | tojson` or iterate its items). An empty `tool_calls` is left out, as vLLM does. An
    assistant's `reasoning` (a reply's, sent back) is also its `reasoning_content`, the name Qwen3's
    and other templates render an earlier reply's reasoning from (vLLM passes both)."""
    item = {**message.model_dump(exclude_none=True), "content": message_text(message, index)}
    if message.role == "assistant" and isinstance(item.get("reasoning"), str):
        item.setdefault("reasoning_content", item["reasoning"])
    calls = item.get("tool_calls")
    if message.role != "assistant" or not isinstance(calls, list):
        return item
    if not calls:
        del item["tool_calls"]
        return item
    item["tool_calls"] = [_parsed_arguments(call, index, j) for j, call in enumerate(calls)]
    return item


def _parsed_arguments(call, index: int, position: int):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str | None):
        return call
    field = f"messages[{index}].tool_calls[{position}].function.arguments"
    try:
        arguments = json.loads(function["arguments"]) if function.get("arguments") else {}
    except ValueError as exc:       # also an integer longer than Python converts (4,300 digits)
        raise APIError(400, f"'{field}' is not valid JSON: {exc}", "messages") from None
    except RecursionError:
        raise APIError(400, f"'{field}' is nested too deeply", "messages") from None
    return {**call, "function": {**function, "arguments": arguments}}


class ChatTemplate:
    def __init__(self, tokenizer, template_path: str | None = None, trust_request_templates: bool = False):
        self.tokenizer = tokenizer
        # apply_chat_template's own parameters, which chat_template_kwargs may not set
        self.reserved = {name for name, p in inspect.signature(tokenizer.apply_chat_template).parameters.items()
                         if p.kind is not p.VAR_KEYWORD}
        self.template = None
        if template_path is not None:
            with open(template_path, encoding="utf-8") as f:
                self.template = f.read()
        # a request's own template renders on this server: only where its operator allows it (vLLM's rule)
        self.trust_request_templates = trust_request_templates

    def _template(self, fields: TemplateFields) -> str | None:
        if fields.chat_template is None:
            return self.template
        if not self.trust_request_templates:
            raise APIError(400, "'chat_template': this server does not render templates sent with requests; its "
                           "operator can allow it with --trust-request-chat-template", "chat_template")
        return fields.chat_template

    def render(self, messages: list[ChatMessage], tools: list[dict] | None, fields: TemplateFields) -> str:
        """The prompt's text. `tools` (OpenAI's {"type": "function", "function": {...}} entries)
        and `documents` go to the template as transformers passes them, `chat_template_kwargs` as
        more variables; templates that do not use them ignore them."""
        template = self._template(fields)
        if template is None and not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "the model has no chat template (tokenizer_config.json 'chat_template'); "
                           "start the server with --chat-template FILE", "messages")
        variables = fields.template_variables()
        taken = sorted(self.reserved & set(fields.chat_template_kwargs or {}))
        if taken:
            raise APIError(400, f"'chat_template_kwargs' may not set {taken[0]!r}, a parameter of the template's "
                           "rendering (the request has a field for the ones that matter)", "chat_template_kwargs")
        conversation = [template_message(message, i) for i, message in enumerate(messages)]
        if not _knows_developer(template or getattr(self.tokenizer, "chat_template", None)):
            # OpenAI's newer name for the system role, as vLLM maps it
            conversation = [{**m, "role": "system"} if m["role"] == "developer" else m for m in conversation]
        try:
            return self.tokenizer.apply_chat_template(
                conversation, chat_template=template, tools=tools, documents=fields.documents, tokenize=False,
                add_generation_prompt=fields.add_generation_prompt,
                continue_final_message=fields.continue_final_message, **variables)
        except Exception as exc:      # the template's own checks (raise_exception(...)) or a syntax error
            raise APIError(400, f"'messages': the chat template failed: {exc}", "messages") from None

    def render_pair(self, query: str, document: str, variables: dict) -> str:
        """A cross-encoder's prompt from the server's template (vLLM's score template: the
        roles "query" and "document"), the request's chat_template_kwargs as variables."""
        taken = sorted(self.reserved & set(variables))
        if taken:
            raise APIError(400, f"'chat_template_kwargs' may not set {taken[0]!r}, a parameter of the template's "
                           "rendering", "chat_template_kwargs")
        try:
            return self.tokenizer.apply_chat_template([{"role": "query", "content": query},
                                                       {"role": "document", "content": document}],
                                                      chat_template=self.template, tokenize=False, **variables)
        except Exception as exc:      # the template's own checks or a syntax error
            raise APIError(400, f"the score template (--chat-template) failed: {exc}", "queries") from None


def _knows_developer(template) -> bool:
    return isinstance(template, str) and ("'developer'" in template or '"developer"' in template)

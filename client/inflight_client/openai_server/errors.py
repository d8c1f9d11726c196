"""Errors in the OpenAI API's JSON shape ({"error": {"message", "type", "param", "code"}}) with
the HTTP status a client can act on: 400 a bad parameter (named), 404 an unknown model, 429 the
engine's queue is full, 503 Triton or the model is not ready, 500 a bug on the server's side with
the request. Never a traceback."""
from __future__ import annotations

import re

TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
         405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 500: "internal_error",
         503: "service_unavailable"}

# how `llm` errors that are the server's state, not the request's fault, begin (see serving/loop.py)
UNAVAILABLE = ("the engine failed", "the server failed", "the server is shutting down", "the model is being unloaded",
               "timed out in queue")
# how `llm` errors that are a bug on its side with this request begin: a client may retry, not mend it
INTERNAL = ("the request could not be read", "the grammar could not be compiled")
# Triton's own for a model it does not serve now, anywhere in its message
TRITON_UNAVAILABLE = ("Request for unknown model", "is not ready", "is not found")


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": TYPES.get(self.status, "error"), "param": self.param,
                          "code": self.code or self.status}}


# `llm` input names -> the OpenAI parameter they came from
PARAMS = {"text_input": "prompt", "input_ids": "prompt", "embedding_request.input": "input"}


def _named_field(message: str) -> str | None:
    match = re.search(r"'([A-Za-z_]+)'", message)
    return match.group(1) if match else None


def from_triton(message: str) -> APIError:
    """An error response from Triton for one request. The `llm` model's request errors name the
    field, so anything that is not the server's state is the request's fault."""
    if message.startswith("queue full"):
        return APIError(429, message, code="queue_full")
    if message.startswith(UNAVAILABLE):
        return APIError(503, message)
    if message.startswith(INTERNAL):
        return APIError(500, message)
    # not an `llm` error naming its field first, whose quoted library text may say anything:
    # xgrammar's for a grammar without a root rule ends 'The root rule with name "root" is not found'
    if not message.startswith("'") and any(marker in message for marker in TRITON_UNAVAILABLE):
        return APIError(503, message)
    for name, param in PARAMS.items():     # the parameter the client sent, in the message too
        message = message.replace(f"'{name}'", f"'{param}'")
    return APIError(400, message, param=_named_field(message))


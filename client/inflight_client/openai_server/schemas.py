"""The OpenAI request bodies this server accepts (pydantic), with vLLM's extra sampling fields
(`top_k`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`repetition_penalty`, `cache_salt`) and inflight's `priority`. Unknown fields are refused by name;
fields OpenAI defines but this server cannot honour are refused with a message saying so.
Value ranges the engine checks (top_p, max_tokens vs the context, ...) are left to `llm`, whose
messages name the field, so each rule lives in one place.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from .errors import APIError

MAX_LOGPROBS = 20       # the engine's limit (inflight.config.MAX_LOGPROBS)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions."""
    model_config = ConfigDict(extra="forbid")

    model: str
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    ignore_eos: bool | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None                      # accepted, unused
    priority: Literal["high", "normal", "low"] | None = None
    cache_salt: str | None = None

    @model_validator(mode="after")
    def _check_shared(self):
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "'stream_options' can only be used when 'stream' is true", "stream_options")
        if self.logit_bias:
            raise APIError(400, "'logit_bias' is not supported", "logit_bias")
        return self


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _check_completion(self):
        if self.prompt == "" or self.prompt == [] or any(p == "" or p == [] for p in self.prompts()):
            raise APIError(400, "'prompt' must not be empty", "prompt")
        if self.suffix is not None:
            raise APIError(400, "'suffix' is not supported", "suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "'best_of' is not supported (only 1)", "best_of")
        if self.echo and self.logprobs is not None:
            raise APIError(400, "'echo' with 'logprobs' is not supported (prompt log-probabilities are not "
                           "computed)", "echo")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompt forms the OpenAI spec allows, as a list of prompts."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [prompt]
        return list(prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")     # name, tool_call_id, ...: handed to the template
    role: str
    content: str | list[dict] | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    max_tokens: int | None = None                # deprecated by OpenAI, still sent by many clients
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    response_format: ResponseFormat | None = None
    tools: list[dict] | None = None
    tool_choice: str | dict | None = None
    parallel_tool_calls: bool | None = None      # accepted, unused (no tools)
    metadata: dict | None = None                 # accepted, unused
    store: bool | None = None                    # accepted, unused

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "'top_logprobs' needs 'logprobs': true", "top_logprobs")
        # issue 15 (structured outputs) turns these into `structured_outputs` (see sampling.py)
        if self.response_format is not None and self.response_format.type != "text":
            raise APIError(400, f"'response_format' of type {self.response_format.type!r} is not supported",
                           "response_format")
        if self.tools:
            raise APIError(400, "'tools' are not supported", "tools")
        if self.tool_choice not in (None, "none"):
            raise APIError(400, "'tool_choice' is not supported (only 'none')", "tool_choice")
        return self

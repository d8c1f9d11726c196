"""OpenAI request -> the `llm` model's `sampling_parameters` JSON (vLLM's SamplingParams names).

One function per request kind: a LoRA adapter becomes `"lora_name"` (and `"lora_path"`) from the
served model id the request named (models.py), and the request's output constraint
(`response_format`, `guided_*`, `tool_choice`; structured.py) becomes `"structured_outputs"`.
"""
from __future__ import annotations

import json

from .errors import APIError
from .schemas import ChatCompletionRequest, CompletionRequest, SamplingFields
from .structured import Constraint

# request fields passed through under the same name when given
PASSED = ("temperature", "top_p", "top_k", "min_p", "min_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
          "include_stop_str_in_output", "frequency_penalty", "presence_penalty", "repetition_penalty",
          "logit_bias", "priority", "cache_salt", "bad_words", "allowed_token_ids", "skip_special_tokens",
          "spaces_between_special_tokens", "stream_interval")


def _common(body: SamplingFields, max_tokens: int, constraint: Constraint | None, adapter: dict | None,
            defaults: dict | None) -> dict:
    params = {"max_tokens": max_tokens, **(adapter or {})}
    if constraint is not None:      # as JSON text: the vLLM backend json.loads this key (`llm` takes either)
        try:
            params["structured_outputs"] = json.dumps(constraint.structured_outputs)
        except RecursionError:      # the body parsed, but its schema wrapped in the constraint is too deep
            raise APIError(400, f"'{constraint.source}' is nested too deeply", constraint.source) from None
    for name in PASSED:
        value = getattr(body, name)
        if value is None and defaults:      # the checkpoint's generation_config.json (generation_config.py)
            value = defaults.get(name)
        if value is not None:
            params[name] = value
    if body.n != 1:
        params["n"] = body.n
    if body.prompt_logprobs is not None:
        params["prompt_logprobs"] = body.prompt_logprobs
    if body.thinking_token_budget != -1:    # `llm` needs its engine's reasoning_parser for it, as vLLM
        params["thinking_token_budget"] = body.thinking_token_budget
    if body.return_token_ids:       # each token's map names the sampled token first; a request's own N wins
        params["logprobs"] = 0
    return params


def completion_sampling(body: CompletionRequest, default_max_tokens: int, constraint: Constraint | None,
                        adapter: dict | None = None, defaults: dict | None = None) -> dict:
    """`defaults`: the sampling defaults of the checkpoint (generation_config.py), for the fields
    the request leaves out (its max_tokens goes with a chat's only)."""
    max_tokens = default_max_tokens if body.max_tokens is None else body.max_tokens or 1    # 0: echo only
    params = _common(body, max_tokens, constraint, adapter, defaults)
    if body.logprobs is not None:
        params["logprobs"] = body.logprobs
    if body.echo and body.logprobs is not None and body.prompt_logprobs is None:
        # the echoed prompt's tokens get theirs; a request's own prompt_logprobs scores them as it
        # asks, vLLM's rule (the echoed positions then keep at most logprobs + 1 entries each)
        params["prompt_logprobs"] = body.logprobs
    return params


def chat_sampling(body: ChatCompletionRequest, default_max_tokens: int, constraint: Constraint | None,
                  adapter: dict | None = None, defaults: dict | None = None) -> dict:
    max_tokens = next((m for m in (body.max_completion_tokens, body.max_tokens) if m is not None), default_max_tokens)
    params = _common(body, max_tokens, constraint, adapter, defaults)
    if body.logprobs:
        params["logprobs"] = body.top_logprobs or 0
    return params

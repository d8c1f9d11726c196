"""Request parsing for the `llm` model, following the Triton vLLM backend's tensor conventions.

Sampling knobs arrive as a `sampling_parameters` JSON object and/or as request parameters (the
HTTP generate endpoint turns unknown JSON keys into parameters); a knob given both ways takes the
tensor's value, as the vLLM backend reads the tensor alone when it is present (its own test client
sends every knob both ways). Clients such as genai-perf send
numbers as strings ({"max_tokens": "128"}), so numeric strings are accepted; anything else that
does not fit raises RequestError with a message naming the field. A JSON null means "not given".
Triton's OpenAI frontend always sends `n`, `frequency_penalty` and `presence_penalty` (1, 0, 0).

An embedding request (an `llm` whose engine has runner "pooling") is the vLLM backend's
`embedding_request` input, the JSON Triton's OpenAI frontend sends for /v1/embeddings:
{"input": text or token ids, "pooling_params": {"dimensions": [n]}}.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from typing import NoReturn

import numpy as np

from ..config import MAX_BAD_WORDS, PRIORITIES, SamplingParams, is_int, parse_priority
from ..pooling import ONE_TOKEN, TASKS, PoolingParams
from ..structured import json_value, parse_spec


class RequestError(ValueError):
    """A malformed request: the message names the offending input or parameter."""


BOOL_INPUTS = ("stream", "exclude_input_in_output", "return_finish_reason", "return_num_input_tokens",
               "return_num_output_tokens", "return_logprobs", "return_token_ids", "return_cumulative_logprob",
               "return_prompt_logprobs", "return_stop_reason", "queue_heartbeat", "return_num_reasoning_tokens",
               "return_num_cached_tokens")
MAX_N = 128         # outputs per request (the OpenAI API's limit)

# sampling knob -> the kind of value it takes
KNOBS = {
    "max_tokens": "int", "min_tokens": "int", "temperature": "float", "top_p": "float", "top_k": "int",
    "seed": "int", "stop": "strings", "stop_token_ids": "ints", "ignore_eos": "bool", "logprobs": "count",
    "prompt_logprobs": "count",
    "bad_words": "strings", "bad_words_ids": "int_lists",
    # vLLM's constraint object (or its JSON text); guided_decoding is its older name
    "structured_outputs": "constraint", "guided_decoding": "constraint",
    "lora_name": "str", "lora_path": "str",
    "repetition_penalty": "float", "frequency_penalty": "float", "presence_penalty": "float",
    "min_p": "float", "logit_bias": "bias", "allowed_token_ids": "ints",
    "skip_special_tokens": "bool", "spaces_between_special_tokens": "bool", "thinking_token_budget": "int",
    "reasoning_ended": "bool",
}
# per-request settings that may also come through the same channels
SETTINGS = {"priority": "priority", "cache_salt": "str", "n": "int", "include_stop_str_in_output": "bool",
            "stream_interval": "int"}
PRIORITY_NAMES = {value: name for name, value in PRIORITIES.items()}
# request parameters Triton or its clients set on their own; never sampling knobs
IGNORED_PARAMETERS = {"triton_enable_empty_final_response", "sequence_id", "sequence_start", "sequence_end",
                      "priority_level", "timeout", "headers", "binary_data_output"}


def ignored_parameter(name: str) -> bool:
    """A request parameter no model of this repository reads: Triton's and its clients' own, and
    the headers Triton forwards as parameters (--grpc-header-forward-pattern: x-request-id,
    x-trace-id), whose names have a '-' as no knob's does. Refused as unknown, they failed every
    request of a server that forwards headers."""
    return name in IGNORED_PARAMETERS or "-" in name


@dataclass(slots=True)
class GenerateRequest:
    prompt_text: str | None
    prompt_ids: list[int] | None
    params: SamplingParams
    priority: str = "normal"
    cache_salt: str | None = None
    stream: bool = False
    exclude_input_in_output: bool = False     # resolved: the vLLM default is true when streaming
    return_finish_reason: bool = False
    return_num_input_tokens: bool = False
    return_num_output_tokens: bool = False
    return_logprobs: bool = False
    return_token_ids: bool = False
    return_cumulative_logprob: bool = False
    return_prompt_logprobs: bool = False
    return_stop_reason: bool = False          # inflight's: vLLM's stop_reason (its OpenAI server's field)
    bad_words: tuple[str, ...] = ()
    n: int = 1                                # outputs, each its own engine request (seed + i)
    include_stop_str_in_output: bool = False
    stream_interval: int = 1                  # vLLM's: tokens per streamed response (the model's setting, if larger)
    queue_heartbeat: bool = False             # inflight's: an empty response after each second without one (a stream)
    return_num_reasoning_tokens: bool = False  # inflight's: num_reasoning_tokens (an engine with a reasoning_parser)
    return_num_cached_tokens: bool = False    # inflight's: num_cached_tokens, the prompt's prefix-cache hit
    pooling: PoolingParams | None = None      # an embedding request's (embedding_request): no generation


def one_value(name: str, array: np.ndarray):
    """The one element of a one-element input (any shape)."""
    if array.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(array.shape)}")
    return array.reshape(-1)[0]


def _bool_input(name: str, array: np.ndarray) -> bool:
    if array.dtype != np.bool_:
        raise RequestError(f"input '{name}' must be BOOL, got {array.dtype}")
    return bool(one_value(name, array))


def string_input(name: str, array: np.ndarray) -> str:
    return string_value(name, one_value(name, array), array.dtype)


def string_value(name: str, value, dtype=None) -> str:
    """One element of a BYTES input, decoded strictly: a string with bytes replaced would be
    another string (another stop word, another tenant's cache_salt)."""
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise RequestError(f"input '{name}' is not valid UTF-8") from None
    if isinstance(value, str):
        return value
    raise RequestError(f"input '{name}' must be a string (BYTES), got {dtype or type(value).__name__}")


def _coerce(name: str, kind: str, value):
    """One knob's value, from JSON (numbers possibly as strings)."""
    return _COERCERS[kind](name, value)


def _fail(name: str, value, expected: str) -> NoReturn:
    raise RequestError(f"'{name}' must be {expected}, got {value!r}")


def _int(name: str, value) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        if abs(value) >= 2**53:     # past this a float holds no exact integer: Triton's HTTP generate reads
            _fail(name, value, "an integer sent exactly (a top-level integer past int64 reaches the model "
                  "as a rounded double over HTTP generate: send it in 'sampling_parameters')")
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    _fail(name, value, "an integer")


def _float(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        _fail(name, value, "a number")
    try:
        number = float(value.strip() if isinstance(value, str) else value)
    except ValueError:
        _fail(name, value, "a number")
    except OverflowError:           # an integer past float's range
        number = math.inf
    if not math.isfinite(number):
        _fail(name, value, "a finite number")
    return number


def _bool(name: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    _fail(name, value, "a boolean")


def _str(name: str, value) -> str:
    if not isinstance(value, str):
        _fail(name, value, "a string")
    return value


def _priority(name: str, value) -> str:
    """Its class's name, which the engine reads as given."""
    try:
        return PRIORITY_NAMES[parse_priority(value)]
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def _strings(name: str, value) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(value)
    _fail(name, value, "a string or a list of strings")


def _ints(name: str, value) -> tuple[int, ...]:
    if not isinstance(value, list):
        _fail(name, value, "a list of integers")
    return tuple(_int(name, v) for v in value)


def _bias(name: str, value) -> tuple[tuple[int, float], ...]:
    """{token id (a JSON key, so a string): bias}"""
    if not isinstance(value, dict):
        _fail(name, value, "an object mapping token ids to numbers")
    return tuple((_int(f"{name}' key '{key}", key), _float(name, bias)) for key, bias in value.items())


def _constraint(name: str, value):
    try:
        return parse_spec(value, name)
    except ValueError as exc:
        raise RequestError(str(exc)) from None


def _int_lists(name: str, value) -> tuple[tuple[int, ...], ...]:
    if not (isinstance(value, list) and all(isinstance(v, list) for v in value)):
        _fail(name, value, "a list of lists of integers")
    return tuple(tuple(_int(name, t) for t in v) for v in value)


def check_count(name: str, values, limit: int) -> None:
    if len(values) > limit:
        raise RequestError(f"'{name}' holds {len(values)} entries, more than {limit}")


def _count(name: str, value) -> int:
    """A number of log-probabilities; true is 1, as vLLM's SamplingParams reads it."""
    return 1 if value is True else _int(name, value)


_COERCERS = {"int": _int, "float": _float, "bool": _bool, "str": _str, "priority": _priority, "strings": _strings,
             "ints": _ints, "bias": _bias, "constraint": _constraint, "int_lists": _int_lists, "count": _count}


MIN_BYTES_PER_TOKEN = 32     # the bound below never allows a token fewer bytes


def bytes_per_token(tokenizer) -> int:
    """The most bytes one token can stand for, at least MIN_BYTES_PER_TOKEN: the vocabulary's
    longest entry in UTF-8 (an over-estimate: 'Ġ', '▁' or '<0x0A>' stand for one byte), so text
    over max_model_len x this surely has more tokens than the context holds."""
    return max(MIN_BYTES_PER_TOKEN, *(len(token.encode("utf-8")) for token in tokenizer.get_vocab()))


def check_text_size(text: str, max_model_len: int, per_token: int, field: str = "text_input") -> None:
    """Bound the tokenizer's work before it starts: no prompt this long can fit anyway."""
    limit = max_model_len * per_token
    size = len(text.encode("utf-8"))
    if size > limit:
        raise RequestError(f"'{field}' is {size} bytes, more than the context of {max_model_len} tokens can hold "
                           f"(the limit is {limit}: {per_token} bytes a token at most)")


LONE_SURROGATE = "holds a lone UTF-16 surrogate (an escape in \\ud800-\\udfff without its pair), which is not text"


def lone_surrogate_field(values: dict) -> str | None:
    """The first key that holds a lone UTF-16 surrogate, or whose value does: JSON may escape half
    of a pair alone ("\\ud800"), which Python keeps as a string no tokenizer or grammar can encode.
    Such a key comes back escaped, printable in the error."""
    for key, value in values.items():
        escaped = key.encode("utf-8", "backslashreplace").decode("utf-8")
        if escaped != key:
            return escaped
        try:
            json.dumps(value, ensure_ascii=False).encode("utf-8")
        except RecursionError:
            continue                  # too deep to check here; refused as such where it is read
        except UnicodeEncodeError:
            return key
    return None


def _knobs(sampling_parameters: str | None, parameters: dict) -> dict:
    merged: dict = {}
    if sampling_parameters is not None:
        try:
            values = json_value(sampling_parameters, "sampling_parameters") if sampling_parameters.strip() else {}
        except ValueError as exc:
            raise RequestError(str(exc)) from None
        if not isinstance(values, dict):
            raise RequestError(f"'sampling_parameters' must be a JSON object, got {type(values).__name__}")
        if "\\ud" in sampling_parameters.lower() and (field := lone_surrogate_field(values)):   # JSON's escape
            raise RequestError(f"'{field}' {LONE_SURROGATE}")
        merged.update(values)
    for key, value in parameters.items():
        if ignored_parameter(key):
            continue
        if merged.get(key) is None:         # null in the JSON is "not given": the parameter's value stands
            merged[key] = value
    merged = {key: value for key, value in merged.items() if value is not None}
    unknown = sorted(set(merged) - set(KNOBS) - set(SETTINGS))
    if unknown:
        raise RequestError(f"unknown sampling parameter(s) {unknown}; known: {sorted(KNOBS) + sorted(SETTINGS)}")
    return {key: _coerce(key, (KNOBS | SETTINGS)[key], value) for key, value in merged.items()}


def parse_request(inputs: dict[str, np.ndarray], parameters: dict) -> GenerateRequest:
    """inputs: name -> numpy array of the tensors present; parameters: the request's parameters."""
    if "embedding_request" in inputs:
        return _embedding_request(inputs, parameters)
    text = inputs.get("text_input")
    ids = inputs.get("input_ids")
    if text is not None and ids is not None:
        raise RequestError("give either 'text_input' or 'input_ids', not both")
    if text is None and ids is None:
        raise RequestError("one of 'text_input' or 'input_ids' is required")
    prompt_text = prompt_ids = None
    if text is not None:
        prompt_text = string_input("text_input", text)     # "" is the BOS alone, as in vLLM
    else:
        if ids.dtype.kind not in "iu":
            raise RequestError(f"input 'input_ids' must be INT32, got {ids.dtype}")
        prompt_ids = [int(t) for t in ids.reshape(-1)]
        if not prompt_ids:
            raise RequestError("input 'input_ids' is empty")
    flags = {name: _bool_input(name, inputs[name]) for name in BOOL_INPUTS if name in inputs}
    sampling = inputs.get("sampling_parameters")
    knobs = _knobs(None if sampling is None else string_input("sampling_parameters", sampling), parameters)
    priority = knobs.pop("priority", None)
    if "priority" in inputs:            # the tensor wins, as for every knob given both ways
        priority = _coerce("priority", "priority", string_input("priority", inputs["priority"]))
    cache_salt = knobs.pop("cache_salt", None)
    if "cache_salt" in inputs:
        cache_salt = string_input("cache_salt", inputs["cache_salt"])
    if "guided_decoding" in knobs:
        if "structured_outputs" in knobs:
            raise RequestError("give 'structured_outputs' or its older name 'guided_decoding', not both")
        knobs["structured_outputs"] = knobs.pop("guided_decoding")
    bad_words = knobs.pop("bad_words", ())
    if any(not word for word in bad_words):
        raise RequestError("'bad_words' must hold non-empty strings")
    for name, words in (("bad_words", bad_words), ("bad_words_ids", knobs.get("bad_words_ids") or ())):
        check_count(name, words, MAX_BAD_WORDS)     # each list as sent (a word becomes up to two id sequences)
    n = knobs.pop("n", 1)
    if not 1 <= n <= MAX_N:
        raise RequestError(f"'n' must be an integer in [1, {MAX_N}], got {n}")
    include_stop = knobs.pop("include_stop_str_in_output", False)
    stream_interval = knobs.pop("stream_interval", 1)
    if stream_interval < 1:
        raise RequestError(f"'stream_interval' must be at least 1, got {stream_interval}")
    try:
        params = SamplingParams(**knobs)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    _resolve_exclude_input(flags)
    _check_heartbeat(flags)
    if n > 1 and flags.get("return_token_ids"):
        raise RequestError("'return_token_ids' needs 'n' = 1")
    return GenerateRequest(prompt_text, prompt_ids, params, priority or "normal", cache_salt,
                           bad_words=bad_words, n=n, include_stop_str_in_output=include_stop,
                           stream_interval=stream_interval, **flags)


def _embedding_request(inputs: dict[str, np.ndarray], parameters: dict) -> GenerateRequest:
    """The vLLM backend's embedding_request: its input (text, or token ids) and pooling_params, and
    inflight's lora_name (the adapter to compute it with); of the other inputs, the token counts,
    the request's priority and cache_salt, and queue_heartbeat (how Triton sees a client that left
    while its request waits) are read (the others are generation's, and are refused rather than
    ignored)."""
    name = "embedding_request"
    read = {name, "return_num_input_tokens", "return_num_output_tokens", "stream", "priority", "cache_salt",
            "queue_heartbeat"}
    others = sorted(set(inputs) - read | {key for key in parameters if not ignored_parameter(key)})
    if others:
        raise RequestError(f"'{name}' is a request of its own: give it without {others}")
    try:
        request = json_value(string_input(name, inputs[name]), name)
    except ValueError as exc:
        raise RequestError(str(exc)) from None
    if not isinstance(request, dict) or "input" not in request:
        raise RequestError(f"'{name}' must be a JSON object with an 'input'")
    known = ["input", "lora_name", "lora_path", "pooling_params"]
    unknown = sorted(set(request) - set(known))
    if unknown:
        raise RequestError(f"'{name}': unknown key(s) {unknown}; known: {known}")
    prompt = request["input"]
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        text, ids = None, [int(t) for t in prompt]
    elif isinstance(prompt, str):
        text, ids = prompt, None
    else:
        raise RequestError(f"'{name}.input' must be a string or a non-empty list of token ids (one prompt)")
    flags = {key: _bool_input(key, inputs[key]) for key in ("return_num_input_tokens", "return_num_output_tokens",
                                                              "stream", "queue_heartbeat") if key in inputs}
    _check_heartbeat(flags)
    priority = _coerce("priority", "priority", string_input("priority", inputs["priority"])) \
        if "priority" in inputs else "normal"
    cache_salt = string_input("cache_salt", inputs["cache_salt"]) if "cache_salt" in inputs else None
    adapter = {key: request[key] for key in ("lora_name", "lora_path") if request.get(key) is not None}
    for key, value in adapter.items():        # inflight's: the adapter the vector is computed with
        if not isinstance(value, str):
            raise RequestError(f"'{name}.{key}' must be a string, got {value!r}")
    try:
        params = replace(ONE_TOKEN, **adapter)
    except ValueError as exc:
        raise RequestError(f"'{name}': {exc}") from None
    return GenerateRequest(text, ids, params, priority, cache_salt,
                           pooling=_pooling_params(request.get("pooling_params")), **flags)


def _check_heartbeat(flags: dict) -> None:
    if flags.get("queue_heartbeat") and not flags.get("stream"):
        raise RequestError("'queue_heartbeat' needs 'stream' = true: a request that is not streamed gets one response")


def _pooling_params(value) -> PoolingParams:
    """vLLM's PoolingParams: dimensions (Triton's OpenAI frontend sends [n]), use_activation (false:
    an embedding not normalized, a classifier's raw logits) and task ("embed", the default, or a
    classifier's "classify")."""
    name = "embedding_request.pooling_params"
    value = {} if value is None else value
    if not isinstance(value, dict):
        raise RequestError(f"'{name}' must be an object")
    known = ["dimensions", "task", "use_activation"]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise RequestError(f"'{name}': unknown key(s) {unknown}; known: {known}")
    dims = value.get("dimensions")
    if isinstance(dims, list) and len(dims) == 1:
        dims = dims[0]
    if dims is not None and not is_int(dims):
        raise RequestError(f"'{name}.dimensions' must be an integer (or a list of one), got {value['dimensions']!r}")
    use_activation = value.get("use_activation")
    if use_activation is not None and not isinstance(use_activation, bool):
        raise RequestError(f"'{name}.use_activation' must be a boolean, got {use_activation!r}")
    task = value.get("task", "embed")
    if task not in TASKS:
        raise RequestError(f"'{name}.task' must be one of {list(TASKS)}, got {task!r}")
    return PoolingParams(dims, use_activation, task)


def _resolve_exclude_input(flags: dict) -> None:
    """The vLLM backend's rule: the prompt is repeated in a non-streaming response unless
    excluded, never in a stream, and asking for it in a stream is an error. The ensemble (which
    sets return_token_ids) keeps TensorRT-LLM's rule: a stream ignores the flag."""
    stream = flags.get("stream", False)
    given = flags.get("exclude_input_in_output")
    if stream and given is False and not flags.get("return_token_ids"):
        # the vLLM backend's words, which its own CI and its clients match
        raise RequestError("When streaming, `exclude_input_in_output` = False is not allowed.")
    flags["exclude_input_in_output"] = stream if given is None else given or stream

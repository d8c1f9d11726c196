"""Request parsing for the llm model: the vLLM-backend conventions, numbers sent as strings, and
every malformed request rejected with a message that names the field — never an exception of
another kind (fuzzed with hypothesis)."""
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight.serving.protocol import RequestError, parse_request


def text(value="hello"):
    return np.array([value.encode() if isinstance(value, str) else value], dtype=object)


def flag(value=True):
    return np.array([value])


def test_text_request_with_sampling_parameters_as_genai_perf_sends_them():
    req = parse_request({"text_input": text(), "stream": flag(True), "exclude_input_in_output": flag(True),
                         "sampling_parameters": text(json.dumps({"max_tokens": "128", "temperature": "0.5",
                                                                  "ignore_eos": "true", "top_k": 5}))}, {})
    assert req.prompt_text == "hello" and req.stream and req.exclude_input_in_output
    assert (req.params.max_tokens, req.params.temperature, req.params.ignore_eos, req.params.top_k) == (128, 0.5, True, 5)


def test_knobs_as_request_parameters_and_input_ids():
    req = parse_request({"input_ids": np.array([1, 2, 3], dtype=np.int32)},
                        {"max_tokens": 7, "priority": "high", "cache_salt": "tenant-a", "seed": 3,
                         "triton_enable_empty_final_response": True})
    assert req.prompt_ids == [1, 2, 3] and req.params.max_tokens == 7 and req.params.seed == 3
    assert req.priority == "high" and req.cache_salt == "tenant-a"


def test_headers_triton_forwards_as_parameters_are_ignored_and_typos_still_refused():
    """--grpc-header-forward-pattern makes each matching header a request parameter (x-request-id):
    names with a '-', as no knob has, are not knobs; an unknown one-word name is still refused."""
    req = parse_request({"text_input": text()}, {"x-request-id": "abc", "x-b3-traceid": "1", "max_tokens": 3})
    assert req.params.max_tokens == 3
    with pytest.raises(RequestError, match=r"unknown sampling parameter\(s\) \['temprature'\]"):
        parse_request({"text_input": text()}, {"temprature": 0.5})


def test_a_knob_in_the_tensor_and_as_a_parameter_takes_the_tensors_value():
    req = parse_request({"text_input": text(), "sampling_parameters": text('{"max_tokens": 3}')},
                        {"max_tokens": 4, "seed": 5})
    assert (req.params.max_tokens, req.params.seed) == (3, 5)


def test_a_null_knob_in_the_tensor_leaves_the_parameters_value():
    """null is "not given" (vLLM's SamplingParams default), so a request parameter of that knob stands."""
    req = parse_request({"text_input": text(), "sampling_parameters": text('{"max_tokens": null}')}, {"max_tokens": 5})
    assert req.params.max_tokens == 5


def test_stop_and_bad_words():
    req = parse_request({"text_input": text()}, {"stop": "\n\n", "bad_words": ["foo", "bar"], "stop_token_ids": [5]})
    assert req.params.stop == ("\n\n",) and req.bad_words == ("foo", "bar") and req.params.stop_token_ids == (5,)


def test_word_lists_are_bounded():
    """A request's bad words and stop strings are handled on threads every request shares (100,000
    bad words held Triton's request thread 4.4 s): at most 10,000 and 1,000, each refused by name."""
    for knobs, message in (({"bad_words": [f"w{i}" for i in range(10_001)]}, "'bad_words' holds 10001 entries"),
                           ({"bad_words_ids": [[1]] * 10_001}, "'bad_words_ids' holds 10001 entries"),
                           ({"stop": [f"s{i}" for i in range(1_001)]}, "'stop' holds 1001 strings, more than 1000")):
        with pytest.raises((RequestError, ValueError), match=message):
            parse_request({"text_input": text()}, knobs)
    both = parse_request({"text_input": text()}, {"bad_words": ["w"] * 10_000, "bad_words_ids": [[1]] * 10_000})
    assert len(both.bad_words) == len(both.params.bad_words_ids) == 10_000, "each list up to the bound"


BAD = [
    ({}, {}, "'text_input' or 'input_ids'"),
    ({"text_input": text(), "input_ids": np.array([1], dtype=np.int32)}, {}, "not both"),
    ({"text_input": text(b"\xff\xfe")}, {}, "'text_input' is not valid UTF-8"),
    ({"text_input": np.array([b"a", b"b"], dtype=object)}, {}, "'text_input' must hold exactly one"),
    ({"input_ids": np.array([], dtype=np.int32)}, {}, "'input_ids' is empty"),
    ({"input_ids": np.array([1.5], dtype=np.float32)}, {}, "'input_ids' must be INT32"),
    ({"text_input": text(), "stream": np.array([1], dtype=np.int32)}, {}, "'stream' must be BOOL"),
    ({"text_input": text(), "sampling_parameters": text("{not json")}, {}, "'sampling_parameters' is not valid JSON"),
    ({"text_input": text(), "sampling_parameters": text("[1, 2]")}, {}, "'sampling_parameters' must be a JSON object"),
    ({"text_input": text()}, {"max_tokens": 0}, "'max_tokens'"),
    ({"text_input": text()}, {"max_tokens": "many"}, "'max_tokens' must be an integer"),
    ({"text_input": text()}, {"max_tokens": 2.5}, "'max_tokens' must be an integer"),
    ({"text_input": text()}, {"temperature": -0.1}, "'temperature'"),
    ({"text_input": text()}, {"temperature": "NaN"}, "'temperature' must be a finite number"),
    ({"text_input": text()}, {"temperature": 10**400}, "'temperature' must be a finite number"),   # past float's range
    ({"text_input": text()}, {"logit_bias": {"5": -10**400}}, "'logit_bias' must be a finite number"),
    ({"text_input": text()}, {"top_p": 0}, "'top_p'"),
    ({"text_input": text()}, {"top_p": 1.01}, "'top_p'"),
    ({"text_input": text()}, {"top_k": -2}, "'top_k'"),
    ({"text_input": text()}, {"min_tokens": 9, "max_tokens": 2}, "'min_tokens'"),
    ({"text_input": text()}, {"ignore_eos": "maybe"}, "'ignore_eos' must be a boolean"),
    ({"text_input": text()}, {"seed": 2**64}, "'seed' must be an integer in [-2**63, 2**64)"),
    # a top-level integer past int64 reaches the model over HTTP generate as a double, rounded
    ({"text_input": text()}, {"seed": float(2**63)}, "'seed' must be an integer sent exactly"),
    ({"text_input": text()}, {"stop": 5}, "'stop' must be a string or a list"),
    ({"text_input": text()}, {"temprature": 0.5}, "unknown sampling parameter(s) ['temprature']"),
    ({"text_input": text()}, {"priority": "urgent"}, "'priority' must be 'high', 'normal', 'low' or an integer"),
    ({"text_input": text()}, {"priority": 1.5}, "'priority' must be 'high', 'normal', 'low' or an integer"),
    # the token ids tensor holds one output's ids: an n > 1 request would get the first output's alone
    ({"text_input": text(), "return_token_ids": flag()}, {"n": 2}, "'return_token_ids' needs 'n' = 1"),
    ({"text_input": text(), "return_token_ids": flag()}, {"n": "3"}, "'return_token_ids' needs 'n' = 1"),
    ({"text_input": text(), "sampling_parameters": text("[" * 100000 + "]" * 100000)}, {},
     "'sampling_parameters' is nested too deeply"),
    ({"text_input": text(), "sampling_parameters": text('{"max_tokens": ' + "1" * 5000 + "}")}, {},
     "'sampling_parameters' is not valid JSON: Exceeds the limit"),
    ({"text_input": text()}, {"structured_outputs": {"json": {"type": "string", "format": []}}},
     "'structured_outputs.json' uses the format []"),
    ({"text_input": text()}, {"structured_outputs": {"json": '{"maxLength": ' + "9" * 5000 + "}"}},
     "'structured_outputs.json' is not valid JSON: Exceeds the limit"),
]


@pytest.mark.parametrize("given, expected", [("high", "high"), ("LOW", "low"), (0, "normal"), ("0", "normal"),
                                             (-1, "high"), ("-20", "high"), (1, "low"), (7, "low")])
def test_priority_takes_the_classes_or_vllms_integers(given, expected):
    """vLLM's integer priority (lower runs sooner, 0 its default) onto the three classes."""
    as_input = parse_request({"text_input": text(), "priority": text(str(given))}, {})
    as_knob = parse_request({"text_input": text(), "sampling_parameters": text(json.dumps({"priority": given}))}, {})
    assert as_input.priority == as_knob.priority == expected


def test_priority_and_cache_salt_given_both_ways_take_the_tensors_value():
    """The rule for every knob (the vLLM backend's own test client sends them both ways)."""
    knobs = text(json.dumps({"priority": "low", "cache_salt": "knob"}))
    req = parse_request({"text_input": text(), "priority": text("high"), "cache_salt": text("tensor"),
                         "sampling_parameters": knobs}, {})
    assert (req.priority, req.cache_salt) == ("high", "tensor")


@pytest.mark.parametrize("inputs, parameters, message", BAD)
def test_malformed_requests_name_the_field(inputs, parameters, message):
    with pytest.raises(RequestError) as info:
        parse_request(inputs, parameters)
    assert message in str(info.value)


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.integers(2**1024, 2**1100) | st.floats(allow_nan=True)
                           | st.text(max_size=8),
                           lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3),
                           max_leaves=6)
knob_names = st.sampled_from(["max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                              "stop_token_ids", "ignore_eos", "logprobs", "bad_words", "bad_words_ids", "priority",
                              "cache_salt", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_p",
                              "logit_bias", "allowed_token_ids", "skip_special_tokens",
                              "spaces_between_special_tokens", "unknown_knob"])
tensors = st.one_of(
    st.builds(lambda s: np.array([s], dtype=object), st.binary(max_size=12)),
    st.builds(lambda xs: np.array(xs, dtype=np.int32), st.lists(st.integers(-5, 2**31 - 1), max_size=4)),
    st.builds(lambda xs: np.array(xs, dtype=np.bool_), st.lists(st.booleans(), max_size=2)),
    st.builds(lambda xs: np.array(xs, dtype=np.float32), st.lists(st.floats(width=32), max_size=2)),
)
input_names = st.sampled_from(["text_input", "input_ids", "stream", "sampling_parameters", "exclude_input_in_output",
                               "return_logprobs", "priority", "cache_salt"])


@settings(max_examples=500, deadline=None)
@given(inputs=st.dictionaries(input_names, tensors, max_size=4),
       parameters=st.dictionaries(knob_names, json_values, max_size=4),
       sampling=st.one_of(st.none(), st.dictionaries(knob_names, json_values, max_size=4).map(json.dumps), st.text(max_size=10)))
def test_fuzzed_requests_parse_or_fail_with_a_request_error(inputs, parameters, sampling):
    if sampling is not None:
        inputs["sampling_parameters"] = np.array([sampling.encode()], dtype=object)
    try:
        req = parse_request(inputs, parameters)
    except RequestError as exc:
        assert str(exc), "an error must say what is wrong"
        return
    assert (req.prompt_text is None) != (req.prompt_ids is None)
    assert req.params.max_tokens >= 1


def test_vllms_readings_of_seed_minus_one_tiny_temperatures_and_logprobs_true():
    """As vLLM 0.32's SamplingParams: a seed of -1 is no seed (the same text every time, before),
    a temperature above 0 and under 0.01 samples at 0.01 (it was greedy under 1e-5), and
    `"logprobs": true` asks for 1 (it was refused)."""
    from inflight import SamplingParams
    assert SamplingParams(seed=-1).seed is None and SamplingParams(seed=-2).seed == -2
    assert SamplingParams(temperature=1e-6).temperature == 0.01 and SamplingParams(temperature=0).temperature == 0
    knobs = text(json.dumps({"logprobs": True, "prompt_logprobs": True, "seed": -1, "temperature": 0.001}))
    params = parse_request({"text_input": text(), "sampling_parameters": knobs}, {}).params
    assert (params.logprobs, params.prompt_logprobs, params.seed, params.temperature) == (1, 1, None, 0.01)

"""Structured outputs through a real tritonserver: `structured_outputs` and its older name
`guided_decoding` in sampling_parameters (an object or its JSON text, as the vLLM backend takes
them) over HTTP and gRPC streaming, the ensemble's TensorRT-LLM guided_decoding inputs, and a
clear error for every bad constraint."""
import json
import re

import jsonschema
import pytest

from inflight.detokenizer import decode
from inflight_client.streams import grpc_inputs, http_generate, http_stream

from .helpers import run_streams, wait_for_metric
from .test_structured import SCHEMAS

pytestmark = pytest.mark.server


def sampling(seed, constraint, key="structured_outputs", **extra):
    return {"max_tokens": 256, "temperature": 1.0, "seed": seed, key: constraint, **extra}


def compact(schema):
    return {"json": schema, "disable_any_whitespace": True}


def test_http_stream_deltas_concatenate_to_valid_json(server):
    for i, schema in enumerate(SCHEMAS[:4]):
        out = http_stream(server.http_url, "llm", {
            "text_input": "The assert statement", "stream": True, "return_finish_reason": True,
            "sampling_parameters": json.dumps(sampling(i, compact(schema)))})
        assert out.error is None and out.finish_reason == "stop" and len(out.chunks) > 3
        jsonschema.validate(json.loads(out.text), schema)
    whole = http_generate(server.http_url, "llm", {"text_input": "Boolean operations", "exclude_input_in_output": True,
                                                   "sampling_parameters": json.dumps(sampling(7, compact(SCHEMAS[2])))})
    jsonschema.validate(json.loads(whole["text_output"]), SCHEMAS[2])


def test_grpc_streams_with_the_constraint_as_json_text(server, tokenizer):
    """The vLLM backend's form: the structured_outputs value is itself a JSON string."""
    requests = [{"model": "llm", "inputs": grpc_inputs(
        "A class definition", True, sampling(20 + i, json.dumps(compact(SCHEMAS[i]))),
        return_finish_reason=True, return_token_ids=True)} for i in range(len(SCHEMAS))]
    for out, schema in zip(run_streams(server, requests), SCHEMAS):
        assert out.error is None and out.finish_reason == "stop"
        assert out.text == decode(tokenizer, out.token_ids)
        jsonschema.validate(json.loads(out.text), schema)
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0


def test_guided_decoding_is_an_alias(server):
    regex = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    new = http_generate(server.http_url, "llm", {"text_input": "Today is", "exclude_input_in_output": True,
                                                 "sampling_parameters": json.dumps(sampling(3, {"regex": regex}))})
    old = http_generate(server.http_url, "llm", {
        "text_input": "Today is", "exclude_input_in_output": True,
        "sampling_parameters": json.dumps(sampling(3, {"regex": regex, "backend": "xgrammar"}, key="guided_decoding"))})
    assert re.fullmatch(regex, new["text_output"]) and old["text_output"] == new["text_output"]
    # as a request parameter (Triton passes strings only), in JSON text
    param = http_generate(server.http_url, "llm", {"text_input": "Today is", "exclude_input_in_output": True,
                                                   "max_tokens": 64, "temperature": 1.0, "seed": 3,
                                                   "guided_decoding": json.dumps({"choice": ["up", "down"]})})
    assert param["text_output"] in ("up", "down")


def test_ensemble_takes_tensorrt_llm_guided_decoding_inputs(server):
    def ensemble(guide_type, guide=None):
        payload = {"text_input": "The value is", "max_tokens": 128, "temperature": 1.0, "seed": 5,
                   "exclude_input_in_output": True, "guided_decoding_guide_type": guide_type}
        if guide is not None:
            payload["guided_decoding_guide"] = guide
        return http_generate(server.http_url, "ensemble", payload)

    # json_schema compiles with xgrammar's default (any whitespace, as vLLM's default): a top-level
    # enum leaves the model no whitespace to wander into
    schema = {"enum": ["red", "green", "blue"]}
    jsonschema.validate(json.loads(ensemble("json_schema", json.dumps(schema))["text_output"]), schema)
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{3}", ensemble("regex", "[A-Z]{3}-[0-9]{3}")["text_output"])
    assert ensemble("ebnf_grammar", 'root ::= "on" | "off"')["text_output"] in ("on", "off")
    reply = ensemble("json")      # an object or an array, as TensorRT-LLM's built-in JSON grammar
    assert "error" not in reply and reply["text_output"].lstrip()[:1] in ("{", "["), reply
    streamed = http_stream(server.http_url, "ensemble", {
        "text_input": "The value is", "max_tokens": 128, "temperature": 1.0, "seed": 5, "stream": True,
        "guided_decoding_guide_type": "regex", "guided_decoding_guide": "[A-Z]{3}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{3}-[0-9]{3}", streamed.text)


def llm_error(constraint, key="structured_outputs", **extra):
    return ("llm", {"text_input": "hi", "sampling_parameters": json.dumps({"max_tokens": 8, key: constraint, **extra})})


def ensemble_error(**inputs):
    return ("ensemble", {"text_input": "hi", "max_tokens": 8, **inputs})


ERRORS = [
    (llm_error({"json": {"type": "foo"}}), "'structured_outputs.json' is not a valid JSON schema: Unsupported type \"foo\""),
    (llm_error({"regex": "(ab"}), "'structured_outputs.regex' is not a valid regex: Regex parsing error"),
    (llm_error({"grammar": "root ::= foo"}), "'structured_outputs.grammar' is not a valid grammar: EBNF parser error"),
    (llm_error({"choice": []}), "'structured_outputs.choice' is empty"),
    (llm_error({"json": {}, "regex": "a"}), "'structured_outputs' must give exactly one of json, regex, choice, grammar, json_object, structural_tag; got json, regex"),
    (llm_error({}), "got none"),
    (llm_error({"regex": "a", "backend": "outlines"}, key="guided_decoding"), "'guided_decoding.backend' must be 'xgrammar' or 'auto'"),
    (llm_error("{not json", key="guided_decoding"), "'guided_decoding' is not valid JSON"),
    (llm_error({"json": "{bad"}), "'structured_outputs.json' is not valid JSON"),
    (llm_error({"regex": "a"}, guided_decoding={"regex": "b"}), "give 'structured_outputs' or its older name 'guided_decoding', not both"),
    (llm_error({"regex": "a"}, min_tokens=2), "'min_tokens' cannot be combined with 'structured_outputs'"),
    (llm_error({"structural_tag": "{}"}), "'structured_outputs.structural_tag' is not a valid structural tag"),
    (ensemble_error(guided_decoding_guide_type="xml", guided_decoding_guide="x"),
     "'guided_decoding_guide_type' must be one of ['ebnf_grammar', 'json', 'json_schema', 'regex'], got 'xml'"),
    (ensemble_error(guided_decoding_guide_type="regex"), "guide type 'regex' needs 'guided_decoding_guide'"),
    (ensemble_error(guided_decoding_guide="[0-9]+"), "'guided_decoding_guide' needs 'guided_decoding_guide_type'"),
    (ensemble_error(guided_decoding_guide_type="json_schema", guided_decoding_guide="{nope"),
     "'guided_decoding_guide' is not valid JSON"),
    (ensemble_error(guided_decoding_guide_type="regex", guided_decoding_guide="[0-"),
     "'structured_outputs.regex' is not a valid regex"),
]


@pytest.mark.parametrize("request_, message", ERRORS, ids=[m[:50] for _, m in ERRORS])
def test_bad_constraints_get_an_error_naming_the_field(server, request_, message):
    model, payload = request_
    reply = http_generate(server.http_url, model, payload)
    assert message in reply.get("error", ""), reply
    assert "Traceback" not in reply["error"] and "At:" not in reply["error"] and "/project/" not in reply["error"]
    ok = http_generate(server.http_url, "llm", {"text_input": "The", "max_tokens": 2})
    assert "error" not in ok


def test_grpc_stream_gets_the_compile_error(server):
    out = run_streams(server, [{"model": "llm", "inputs": grpc_inputs(
        "hi", True, {"max_tokens": 8, "structured_outputs": {"json": {"type": "array", "minItems": 3, "maxItems": 1}}})}])[0]
    assert "'structured_outputs.json' is not a valid JSON schema: minItems is greater than maxItems" in out.error

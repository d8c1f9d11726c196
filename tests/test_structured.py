"""Structured outputs in the engine: constrained sampling with the shipped model at temperature 1.0
gives text that parses and validates (JSON schemas with jsonschema, regex, choice, EBNF and Lark
grammars), unconstrained neighbours are untouched, preemption keeps a matcher's state, a new
schema compiles without stalling running requests, and every bad constraint is refused with a
message that names the field."""
import json
import math
import re
import time

import jsonschema
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from inflight import EngineConfig, LLMEngine, SamplingParams
from inflight import structured
from inflight.detokenizer import decode
from inflight.serving.loop import EngineLoop
from inflight.serving.protocol import GenerateRequest
from inflight.structured import parse_spec

from .conftest import DEFAULT_MODEL
from .helpers import RecordingSink

PROMPTS = ["The assert statement", "A class definition", "Boolean operations", "def", "The import system",
           "JSON:", "Exceptions can be raised", "The with statement"]

# nested objects, arrays with min/max items, enums, numbers with bounds, required/optional keys,
# string patterns; strings are bounded so that a sampled string cannot run past max_tokens
SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city"]}},
     "required": ["name", "address"]},
    {"type": "object", "properties": {"scores": {"type": "array", "minItems": 2, "maxItems": 4,
                                                 "items": {"type": "integer", "minimum": 0, "maximum": 100}}},
     "required": ["scores"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "size": {"type": "string", "enum": ["S", "M", "L", "XL"]}},
     "required": ["color", "size"]},
    {"type": "object", "properties": {"temperature": {"type": "number", "minimum": -50, "maximum": 60},
                                      "humidity": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 100}},
     "required": ["temperature", "humidity"]},
    {"type": "object", "properties": {"date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
                                      "code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
     "required": ["date", "code"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 10},
                                      "retries": {"type": "integer", "minimum": 0, "maximum": 5}},
     "required": ["ok"]},
    {"type": "object", "properties": {"items": {"type": "array", "maxItems": 3, "items": {
        "type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 999},
                                         "label": {"type": "string", "maxLength": 8}},
        "required": ["id", "label"]}}},
     "required": ["items"]},
    {"type": "array", "items": {"enum": ["yes", "no", "maybe"]}, "minItems": 1, "maxItems": 5},
    {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object", "properties": {
        "c": {"type": "integer", "minimum": 10, "maximum": 20}}, "required": ["c"]}}, "required": ["b"]}},
     "required": ["a"]},
    {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                          {"type": "string", "maxLength": 5}]}},
     "required": ["value"]},
    {"type": "object", "properties": {"kind": {"const": "event"},
                                      "title": {"type": "string", "minLength": 3, "maxLength": 12},
                                      "priority": {"type": "integer", "minimum": 1, "maximum": 3}},
     "required": ["kind", "title", "priority"]},
    {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999},
                                                  "role": {"enum": ["admin", "editor", "viewer"]}},
                 "required": ["id", "role"]},
        "values": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}, "minItems": 1, "maxItems": 4}},
     "required": ["user", "values"]},
]


def prompt_ids(tokenizer, i):
    return tokenizer(PROMPTS[i % len(PROMPTS)])["input_ids"]


def json_params(i, schema, **extra):
    # compact JSON: with any whitespace allowed, a small model sampled at temperature 1 wanders into
    # whitespace for hundreds of tokens (allowed by the schema, but it never stops)
    return SamplingParams(max_tokens=256, temperature=1.0, seed=i, **extra,
                          structured_outputs={"json": schema, "disable_any_whitespace": True})


def text_of(tokenizer, out):
    return decode(tokenizer, out.token_ids)


def test_200_sampled_requests_over_12_schemas_all_stop_and_validate(reference_engine, tokenizer):
    engine = reference_engine
    compiled_before = engine.structured.num_compiled
    params = [json_params(i, SCHEMAS[i % len(SCHEMAS)]) for i in range(200)]
    outs = engine.generate([prompt_ids(tokenizer, i) for i in range(200)], params)
    assert [o.finish_reason for o in outs] == ["stop"] * 200, "max_tokens must be large enough that all stop"
    for i, out in enumerate(outs):
        assert out.token_ids[-1] in engine.eos_token_ids         # the grammar ended, then EOS
        text = text_of(tokenizer, out)
        jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
        # without free whitespace the JSON is compact, as vLLM's: no space after ',' or ':'
        assert not re.search(r"\s", re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)), text
    assert len({text_of(tokenizer, o) for o in outs}) > 150, "temperature 1.0 should vary the outputs"
    assert engine.structured.num_compiled - compiled_before <= len(SCHEMAS), "each schema compiles once"
    assert engine.kv.num_used_blocks == 0 and engine.num_constrained == 0 and not engine.requests


def test_regex_choice_json_object_ebnf_and_lark(reference_engine, tokenizer):
    cases = [
        ({"regex": r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]"},
         lambda t: re.fullmatch(r"[0-9]{4}-(0[1-9]|1[0-2])-[0-3][0-9]", t)),
        ({"regex": r"(yes|no), because [a-z ]{1,20}\."}, lambda t: re.fullmatch(r"(yes|no), because [a-z ]{1,20}\.", t)),
        ({"choice": ["positive", "negative", "neutral", "it's \"mixed\""]},
         lambda t: t in ("positive", "negative", "neutral", "it's \"mixed\"")),
        # any object: nothing bounds its strings or numbers, so some samples run to max_tokens
        ({"json_object": True, "disable_any_whitespace": True}, lambda t: isinstance(json.loads(t), dict)),
        ({"grammar": 'root ::= term | term op term | term op term op term\nop ::= "+" | "-" | "*"\n'
                     'term ::= [0-9] | [1-9] [0-9]'},
         lambda t: re.fullmatch(r"([0-9]|[1-9][0-9])([-+*]([0-9]|[1-9][0-9])){0,2}", t)),
        ({"grammar": 'start: NAME "=" NUMBER\nNAME: /[a-z]{1,6}/\nNUMBER: /[0-9]{1,3}/'},      # Lark, as vLLM takes
         lambda t: re.fullmatch(r"[a-z]{1,6}=[0-9]{1,3}", t)),
    ]
    params = [SamplingParams(max_tokens=128, temperature=1.0, seed=10 * c + i, structured_outputs=spec)
              for c, (spec, _) in enumerate(cases) for i in range(8)]
    outs = reference_engine.generate([prompt_ids(tokenizer, i) for i in range(len(params))], params)
    for j, out in enumerate(outs):
        spec, check = cases[j // 8]
        text = text_of(tokenizer, out)
        if "json_object" in spec and out.finish_reason == "length":
            continue
        assert out.finish_reason == "stop" and check(text), (spec, text)
    assert sum(o.finish_reason == "stop" for o in outs[24:32]) >= 4
    choices = {text_of(tokenizer, o) for o in outs[16:24]}
    assert len(choices) > 1, "sampling still applies within the allowed set"


CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Oslo", "Lima"]}}, "required": ["city"],
        "additionalProperties": False}
# the call's JSON as a regex: a JSON schema there allows any whitespace, where a small model wanders
CALL_TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<call>"], "at_least_one": True, "stop_after_first": True,
    "tags": [{"type": "tag", "begin": "<call>", "content": {"type": "regex", "pattern": '\\{"city":"(Oslo|Lima)"\\}'},
              "end": "</call>"}]}}


def test_structural_tags_in_xgrammars_format_and_the_older_one(reference_engine, tokenizer):
    """vLLM's structured_outputs.structural_tag: xgrammar's format (here one call that must come)
    constrains what the tag holds; the older form leaves the text free until a trigger."""
    params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i,
                             structured_outputs={"structural_tag": json.dumps(CALL_TAG), "backend": "xgrammar"})
              for i in range(8)]
    for out in reference_engine.generate([prompt_ids(tokenizer, i) for i in range(8)], params):
        call = re.fullmatch(r"<call>(.*)</call>", text_of(tokenizer, out), re.S)
        assert out.finish_reason == "stop" and call, text_of(tokenizer, out)
        jsonschema.validate(json.loads(call.group(1)), CITY)
    older = {"type": "structural_tag", "structures": [{"begin": "<call>", "schema": CITY, "end": "</call>"}],
             "triggers": ["<call>"]}
    free = reference_engine.generate([prompt_ids(tokenizer, 0)], SamplingParams(max_tokens=20, temperature=0))[0]
    tagged = reference_engine.generate([prompt_ids(tokenizer, 0)], SamplingParams(
        max_tokens=20, temperature=0, structured_outputs={"structural_tag": older}))[0]
    assert "<call>" not in text_of(tokenizer, free) and tagged.token_ids == free.token_ids, "no trigger: text is free"


def test_disable_any_whitespace_bounds_the_whitespace_of_a_tags_json(reference_engine, tokenizer):
    """xgrammar has no compact form for the JSON inside a structural tag: with disable_any_whitespace
    each whitespace run there is one character at most, so the tiny model, which otherwise spends
    max_tokens on it, ends its call (both forms of a tag)."""
    call = {"type": "tag", "begin": "<call>", "content": {"type": "json_schema", "json_schema": CITY}, "end": "</call>"}
    tag = {"type": "structural_tag", "format": {**CALL_TAG["format"], "tags": [call]}}
    older = {"type": "structural_tag", "structures": [{"begin": "<call>", "schema": CITY, "end": "</call>"}],
             "triggers": ["<call>"]}
    prompts = [prompt_ids(tokenizer, i) for i in range(8)]
    wandering = reference_engine.generate(prompts[:4], [SamplingParams(
        max_tokens=60, temperature=1.0, seed=i, structured_outputs={"structural_tag": tag}) for i in range(4)])
    assert any(re.search(r"\s{2}", text_of(tokenizer, out)) for out in wandering), "the tiny model wanders"
    for structural_tag in (tag, older):
        params = [SamplingParams(max_tokens=200, temperature=1.0, seed=i, structured_outputs={
            "structural_tag": structural_tag, "disable_any_whitespace": True}) for i in range(8)]
        for out in reference_engine.generate(prompts, params):
            text = text_of(tokenizer, out)
            assert not re.search(r"\s{2}", text[text.find("<call>"):]), text
            if structural_tag is tag:
                assert out.finish_reason == "stop", text
                jsonschema.validate(json.loads(re.fullmatch(r"<call>(.*)</call>", text, re.S).group(1)), CITY)


def test_unconstrained_requests_are_unchanged_by_constrained_neighbours(reference_engine, tokenizer):
    engine = reference_engine
    plain = [SamplingParams(max_tokens=24, temperature=t, seed=100 + i, ignore_eos=True, top_k=k)
             for i, (t, k) in enumerate([(1.0, -1), (0.0, -1), (0.8, 20), (1.3, -1)] * 2)]
    plain_prompts = [prompt_ids(tokenizer, i) for i in range(len(plain))]
    alone = engine.generate(plain_prompts, plain)
    constrained = [json_params(300 + i, SCHEMAS[i]) for i in range(12)]
    constrained_alone = engine.generate([prompt_ids(tokenizer, i + 3) for i in range(12)], constrained)
    mixed = engine.generate(plain_prompts + [prompt_ids(tokenizer, i + 3) for i in range(12)], plain + constrained)
    assert [o.token_ids for o in mixed[:len(plain)]] == [o.token_ids for o in alone]
    assert [o.token_ids for o in mixed[len(plain):]] == [o.token_ids for o in constrained_alone]
    assert engine.structured.mask_steps > 0


def test_steps_without_constrained_rows_do_no_mask_work(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=64))
    engine.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=8, ignore_eos=True))
    assert engine.structured.mask_steps == 0 and engine.structured._bitmask is None
    assert engine.structured._compiler is None, "no grammar compiler is built for unconstrained requests"


def test_preempted_constrained_requests_resume_the_same_structure(reference_engine, tokenizer):
    """A pool of 10 blocks for 16 requests forces recompute preemptions mid-structure; the outputs
    are token for token those of the roomy engine, and all validate."""
    small = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(dtype="float64", num_kv_blocks=10, max_num_seqs=16, max_model_len=160,
                                                                  max_num_batched_tokens=256, cpu_threads=1))
    schema = SCHEMAS[6]                                          # an array of up to 3 objects: long outputs
    prompts = [prompt_ids(tokenizer, i) for i in range(16)]
    params = [SamplingParams(max_tokens=10 * 16 - len(p), temperature=1.0, seed=500 + i,
                             structured_outputs={"json": schema, "disable_any_whitespace": True})
              for i, p in enumerate(prompts)]
    outs = small.generate(prompts, params)
    assert sum(o.num_preemptions for o in outs) >= 5 and small.stats()["preemptions"] >= 5
    roomy = reference_engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(text_of(tokenizer, out)), schema)
    assert small.kv.num_used_blocks == 0 and small.num_constrained == 0


def large_schema(n):
    return {"type": "object", "properties": {f"field{j}": {"type": "array", "items": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": j}, "y": {"type": "string", "pattern": "[a-z]{2,9}@[a-z]{3}"},
        "z": {"enum": [f"v{k}" for k in range(20)]}}}} for j in range(n)}}


def test_compiling_a_new_schema_stalls_neither_running_requests_nor_later_ones(tokenizer):
    """The serving loop compiles in a pool of its own: while a large new schema compiles, a stream
    that is already running keeps receiving tokens, and a request sent after it (Triton's execute
    thread, where the compile used to run, hands requests over one at a time) is answered in full,
    also one whose grammar was compiled before."""
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(max_num_seqs=8, num_kv_blocks=256, cpu_threads=1))
    engine.structured.compile(parse_spec({"json_object": True}))        # the tokenizer's vocabulary, up front
    loop = EngineLoop(engine, tokenizer).start()
    try:
        running = RecordingSink()
        loop.submit(GenerateRequest(None, prompt_ids(tokenizer, 0), SamplingParams(max_tokens=800, ignore_eos=True),
                                    stream=True), running)
        while len(running.sends) < 5:
            time.sleep(0.01)
        constrained, later = RecordingSink(), RecordingSink()
        schema = large_schema(300)
        started = time.monotonic()
        loop.submit(GenerateRequest(None, prompt_ids(tokenizer, 1), SamplingParams(
            max_tokens=64, temperature=1.0, seed=1, structured_outputs={"json": schema, "disable_any_whitespace": True}),
            exclude_input_in_output=True), constrained)
        loop.submit(GenerateRequest(None, prompt_ids(tokenizer, 2), SamplingParams(max_tokens=4, ignore_eos=True),
                                    stream=True), later)
        known = RecordingSink()         # a grammar compiled before: it does not queue behind the new one
        loop.submit(GenerateRequest(None, prompt_ids(tokenizer, 3), SamplingParams(
            max_tokens=4, structured_outputs={"json_object": True}), stream=True), known)
        while engine.structured.num_compiled < 2:
            time.sleep(0.005)
        compiled = time.monotonic()
        compile_s = compiled - started
        times = [s[0] for s in running.sends if started <= s[0] <= compiled]
        gaps = [b - a for a, b in zip([started] + times, times + [compiled])]
        assert compile_s > 0.3, f"the schema compiled in {compile_s:.2f} s: too fast to show anything"
        assert len(times) >= 5 and max(gaps) < compile_s / 2, (compile_s, gaps)
        for sink in (later, known):
            assert sink.finished.is_set() and sink.sends[-1][0] < compiled and sink.sends[-1][3] is None
        assert constrained.finished.wait(60) and constrained.sends[-1][3] is None
        text = constrained.text
        if text.endswith("}"):                # finished by its grammar (else max_tokens)
            jsonschema.validate(json.loads(text), schema)
    finally:
        loop.shutdown()
    assert engine.kv.num_used_blocks == 0


def test_the_wait_for_a_seat_starts_after_the_grammar_compiled(tokenizer):
    """max_queue_wait_s is the wait for a seat: a schema that takes longer to compile than the
    limit does not time its request out on an idle server (it did, and a retry, now cached, passed)."""
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(max_num_seqs=8, num_kv_blocks=256, cpu_threads=1,
                                                                   max_queue_wait_s=0.3))
    engine.structured.compile(parse_spec({"json_object": True}))        # the tokenizer's vocabulary, up front
    loop = EngineLoop(engine, tokenizer).start()
    try:
        sink = RecordingSink()
        started = time.monotonic()
        loop.submit(GenerateRequest(None, prompt_ids(tokenizer, 1), SamplingParams(
            max_tokens=4, structured_outputs={"json": large_schema(300), "disable_any_whitespace": True}),
            stream=True), sink)
        assert sink.finished.wait(60) and sink.sends[-1][3] is None, sink.sends[-1]
        assert sink.sends[0][0] - started > 0.3, "the schema compiled within the limit: nothing shown"
    finally:
        loop.shutdown()


def new_schema_request(tokenizer, seed: int, fields: int) -> GenerateRequest:
    return GenerateRequest(None, prompt_ids(tokenizer, seed), SamplingParams(
        max_tokens=4, structured_outputs={"json": large_schema(fields), "disable_any_whitespace": True}), stream=True)


def test_a_request_whose_client_left_while_its_grammar_waited_is_answered_and_never_compiled(tokenizer):
    """A request waiting for the compile thread behind another new schema is known to the response
    thread, which sees its client leave (a cancel, or a failed queue heartbeat) and answers it; its
    grammar is then never compiled, so the new grammars behind it do not wait for it."""
    # cpu_threads=1: one compile thread, as an instance given one core has
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(max_num_seqs=8, num_kv_blocks=256, cpu_threads=1))
    engine.structured.compile(parse_spec({"json_object": True}))        # the tokenizer's vocabulary, up front
    loop = EngineLoop(engine, tokenizer, cancel_poll_s=0.05).start()
    try:
        first, left = RecordingSink(), RecordingSink()
        loop.submit(new_schema_request(tokenizer, 1, 300), first)
        loop.submit(new_schema_request(tokenizer, 2, 301), left)
        left.left = True
        assert left.finished.wait(60) and first.finished.wait(60) and first.sends[-1][3] is None
        loop.shutdown()
        assert engine.structured.cached(new_schema_request(tokenizer, 2, 301).params.structured_outputs) is None
        assert engine.structured.cached(new_schema_request(tokenizer, 1, 300).params.structured_outputs) is not None
    finally:
        loop.shutdown()
    assert engine.kv.num_used_blocks == 0


def test_requests_waiting_for_their_grammar_count_against_max_queue_size(tokenizer):
    """The compile pool's queue is bounded like the engine's: past max_queue_size requests waiting
    for their grammar, a new schema is refused at once as 'queue full'; a seat comes back when its
    grammar is compiled."""
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(max_num_seqs=8, num_kv_blocks=256, cpu_threads=1,
                                                                   max_queue_size=2))
    engine.structured.compile(parse_spec({"json_object": True}))
    loop = EngineLoop(engine, tokenizer).start()
    try:
        sinks = [RecordingSink() for _ in range(4)]
        for i, sink in enumerate(sinks[:3]):
            loop.submit(new_schema_request(tokenizer, i, 300 + i), sink)
        assert sinks[2].finished.wait(5) and sinks[2].sends[-1][3].startswith("queue full: 2 requests are already "
                                                                              "waiting for their grammar")
        assert sinks[0].finished.wait(60) and sinks[1].finished.wait(60)
        loop.submit(new_schema_request(tokenizer, 3, 303), sinks[3])
        assert sinks[3].finished.wait(60)
        assert [sink.sends[-1][3] for sink in (sinks[0], sinks[1], sinks[3])] == [None] * 3
    finally:
        loop.shutdown()


def test_a_full_grammar_queue_gives_a_lower_priority_request_up_for_a_higher_one(tokenizer):
    """As the engine's full queue does: with every seat of max_queue_size held by requests waiting
    for their grammar, a higher-priority request takes the place of the newest of the lowest class
    whose compile has not begun (which ends with the error, its grammar never compiled); with none
    below it, the newcomer is refused as before."""
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(max_num_seqs=8, num_kv_blocks=256, cpu_threads=1,
                                                                   max_queue_size=2))
    engine.structured.compile(parse_spec({"json_object": True}))
    loop = EngineLoop(engine, tokenizer).start()
    requests = {name: new_schema_request(tokenizer, i, 300 + i) for i, name in enumerate(("normal", "low", "high",
                                                                                            "late-low"))}
    try:
        sinks = {name: RecordingSink() for name in requests}
        for name, request in requests.items():
            request.priority = name.removeprefix("late-")
            loop.submit(request, sinks[name])
        assert all(sink.finished.wait(60) for sink in sinks.values())
        errors = {name: sink.sends[-1][3] for name, sink in sinks.items()}
        assert errors == {"normal": None, "high": None,
                          "low": "queue full: a request of a higher priority took this one's place in the queue "
                                 "(max_queue_size 2)",
                          "late-low": "queue full: 2 requests are already waiting for their grammar to compile "
                                      "(max_queue_size)"}, errors
    finally:
        loop.shutdown()
    assert engine.structured.cached(requests["low"].params.structured_outputs) is None, "never compiled"
    assert engine.kv.num_used_blocks == 0


def test_a_request_whose_client_left_gives_its_grammar_seat_back_at_once(tokenizer):
    """Answered when its client leaves, a request still waiting for its compile frees its seat then
    (not when its turn in the pool comes): a live request is neither displaced nor refused for it."""
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(max_num_seqs=8, num_kv_blocks=256, cpu_threads=1,
                                                                   max_queue_size=3))
    engine.structured.compile(parse_spec({"json_object": True}))
    loop = EngineLoop(engine, tokenizer, cancel_poll_s=0.05).start()
    sinks = {}

    def submit(name: str, priority: str, fields: int) -> None:
        request = new_schema_request(tokenizer, len(sinks) + 11, fields)
        request.priority = priority
        sinks[name] = RecordingSink()
        loop.submit(request, sinks[name])
    try:
        submit("compiling", "normal", 600)           # holds the one compile thread for seconds
        time.sleep(0.1)
        submit("left", "low", 301)
        sinks["left"].left = True
        submit("low", "low", 302)
        assert sinks["left"].finished.wait(5) and not sinks["compiling"].finished.is_set()
        submit("high", "high", 303)
        submit("another-low", "low", 304)
        assert all(sink.finished.wait(120) for sink in sinks.values())
        errors = {name: sink.sends[-1][3] for name, sink in sinks.items() if name != "left"}
        assert errors == {"compiling": None, "low": None, "high": None,
                          "another-low": "queue full: 3 requests are already waiting for their grammar to compile "
                                         "(max_queue_size)"}, errors
    finally:
        loop.shutdown()


def test_a_refused_constraint_sent_again_is_refused_at_once_under_its_own_field(tokenizer):
    """xgrammar takes as long to refuse a deep schema as to compile one (~2.7 s at 300 levels
    here): a constraint refused once is kept as refused, so sent again, by any field, it is
    answered at once, without a compile thread or a seat of max_queue_size."""
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(max_num_seqs=8, num_kv_blocks=256, cpu_threads=1,
                                                                   max_queue_size=1))
    bad = {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}
    with pytest.raises(ValueError, match=r"^'guided_decoding.json' is not a valid JSON schema: "):
        engine.structured.compile(parse_spec({"json": bad}, "guided_decoding"))
    compiled = engine.structured.num_compiled
    loop = EngineLoop(engine, tokenizer).start()
    try:
        busy, again = RecordingSink(), RecordingSink()
        loop.submit(new_schema_request(tokenizer, 1, 300), busy)        # the one seat, compiling for seconds
        loop.submit(GenerateRequest(None, prompt_ids(tokenizer, 2), SamplingParams(
            max_tokens=4, structured_outputs={"json": bad})), again)
        assert again.finished.wait(1) and not busy.finished.is_set()
        assert again.sends[-1][3].startswith("'structured_outputs.json' is not a valid JSON schema: ")
        assert busy.finished.wait(60) and busy.sends[-1][3] is None
    finally:
        loop.shutdown()
    assert engine.structured.num_compiled == compiled + 1                # the new schema's compile only


def test_at_a_stop_a_grammar_not_begun_is_refused_without_compiling(tokenizer, monkeypatch, tmp_path):
    """Triton waits for every request before it unloads the model: at a stop (the launcher's flag
    file) a request still waiting for the compile thread is refused then, not compiled first."""
    flag = tmp_path / "stopping"
    monkeypatch.setenv("INFLIGHT_SHUTDOWN_FLAG", str(flag))
    engine = LLMEngine.from_pretrained(DEFAULT_MODEL, EngineConfig(max_num_seqs=8, num_kv_blocks=256, cpu_threads=1))
    engine.structured.compile(parse_spec({"json_object": True}))
    loop = EngineLoop(engine, tokenizer).start()
    try:
        first, waiting = RecordingSink(), RecordingSink()
        loop.submit(new_schema_request(tokenizer, 1, 300), first)
        loop.submit(new_schema_request(tokenizer, 2, 301), waiting)
        flag.write_text("")
        for sink in (first, waiting):
            assert sink.finished.wait(60) and sink.sends[-1][3] == "the server is shutting down"
        assert engine.structured.cached(new_schema_request(tokenizer, 2, 301).params.structured_outputs) is None
    finally:
        loop.shutdown()


def test_grammar_cache_is_lru_by_canonical_text(monkeypatch, tokenizer):
    cache = structured.StructuredOutputs(tokenizer, 4096, (2,), 8)
    monkeypatch.setattr(structured, "CACHE_SIZE", 2)
    first = cache.compile(parse_spec({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}}))
    # the same schema as JSON text with other spacing: the same canonical text, compiled once
    assert cache.compile(parse_spec('{"json": "{ \\"type\\": \\"object\\", \\"properties\\": {\\"a\\": {\\"type\\": \\"integer\\"}}}"}')) is first
    assert cache.num_compiled == 1
    cache.compile(parse_spec({"regex": "[a-z]+"}))
    assert cache.compile(parse_spec({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}})) is first
    cache.compile(parse_spec({"choice": ["x", "y"]}))     # evicts the least recently used: the regex, not the
    assert cache.num_compiled == 3                        # schema, which is older but was used since
    assert cache.compile(parse_spec({"json": {"type": "object", "properties": {"a": {"type": "integer"}}}})) is first
    assert cache.num_compiled == 3
    cache.compile(parse_spec({"regex": "[a-z]+"}))
    assert cache.num_compiled == 4


def test_grammar_cache_is_bounded_in_bytes_too(monkeypatch, tokenizer):
    """A grammar of many choices holds megabytes: the cache keeps at most CACHE_BYTES of them
    (least recently used out first), not 256 whatever their size."""
    cache = structured.StructuredOutputs(tokenizer, 4096, (2,), 8)
    big = [cache.compile(parse_spec({"choice": [f"{name}-{i}" for i in range(2000)]})) for name in ("a", "b")]
    assert all(grammar.memory_size_bytes > 100_000 for grammar in big)
    monkeypatch.setattr(structured, "CACHE_BYTES", big[0].memory_size_bytes + big[1].memory_size_bytes // 2)
    third = cache.compile(parse_spec({"choice": [f"c-{i}" for i in range(2000)]}))
    assert cache.cache_bytes <= structured.CACHE_BYTES and cache.cache_bytes == sum(
        g.memory_size_bytes for g in cache._cache.values())
    assert cache.cached(parse_spec({"choice": [f"c-{i}" for i in range(2000)]})) is third, "the newest stays"
    assert cache.cached(parse_spec({"choice": [f"a-{i}" for i in range(2000)]})) is None, "the oldest went"


def test_a_schema_asked_for_while_it_compiles_is_compiled_once_and_the_cache_stays_free(monkeypatch, tokenizer):
    """Three threads asking for one new schema at once share its compile (a burst of the same
    response_format compiled it once per compile thread); building the compiler (the tokenizer's
    vocabulary) does not hold up cache lookups of other threads."""
    import threading
    cache = structured.StructuredOutputs(tokenizer, 4096, (2,), 8)
    build = cache._build_compiler

    def slow_build(name):
        time.sleep(1.0)
        return build(name)
    monkeypatch.setattr(cache, "_build_compiler", slow_build)
    spec = parse_spec({"json": large_schema(100)})
    results = []
    threads = [threading.Thread(target=lambda: results.append(cache.compile(spec))) for _ in range(3)]
    for thread in threads:
        thread.start()
    time.sleep(0.2)
    started = time.monotonic()
    assert cache.cached(parse_spec({"regex": "[a-z]+"})) is None and time.monotonic() - started < 0.5
    for thread in threads:
        thread.join(60)
    assert len(results) == 3 and results[0] is results[1] is results[2] and cache.num_compiled == 1
    with pytest.raises(ValueError, match="is not a valid regex"):    # an error is each asker's
        cache.compile(parse_spec({"regex": "a("}))
    assert cache._compiling == {}


def test_a_compile_error_names_the_field_of_each_request_that_asked(monkeypatch, tokenizer):
    """Two requests, one sending guided_decoding and one structured_outputs, ask for the same bad
    schema at once: each error names its own request's field, not the first's."""
    import threading
    cache = structured.StructuredOutputs(tokenizer, 4096, (2,), 8)
    compile_grammar = cache._compile
    monkeypatch.setattr(cache, "_compile", lambda compiler, spec: time.sleep(0.5) or compile_grammar(compiler, spec))
    bad = {"type": "array", "items": {"type": "integer"}, "minItems": 3, "maxItems": 1}
    errors = {}

    def ask(name):
        try:
            cache.compile(parse_spec({"json": bad}, name))
        except ValueError as exc:
            errors[name] = str(exc)
    threads = [threading.Thread(target=ask, args=(name,)) for name in ("guided_decoding", "structured_outputs")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert {name: message.split(" ")[0] for name, message in errors.items()} == {
        "guided_decoding": "'guided_decoding.json'", "structured_outputs": "'structured_outputs.json'"}
    assert cache.num_compiled == 1


def test_refused_constraints_are_kept_apart_and_never_evict_a_compiled_grammar(monkeypatch, tokenizer):
    cache = structured.StructuredOutputs(tokenizer, 4096, (2,), 8)
    monkeypatch.setattr(structured, "CACHE_SIZE", 2)
    monkeypatch.setattr(structured, "REFUSALS_SIZE", 2)
    good = cache.compile(parse_spec({"regex": "[a-z]+"}))
    for bad in ("a(", "b(", "c("):
        with pytest.raises(ValueError, match=r"^'structured_outputs.regex' is not a valid regex"):
            cache.compile(parse_spec({"regex": bad}))
    assert cache.cached(parse_spec({"regex": "[a-z]+"})) is good and cache.num_compiled == 4
    with pytest.raises(ValueError, match=r"^'guided_decoding.regex' is not a valid regex"):
        cache.cached(parse_spec({"regex": "c("}, "guided_decoding"))
    assert cache.cached(parse_spec({"regex": "a("})) is None           # the oldest refusal, evicted


SHAPE_ERRORS = [
    ({"json": {"type": "object"}, "regex": "a+"}, "'structured_outputs' must give exactly one of json, regex, choice, grammar, json_object, structural_tag; got json, regex"),
    ({}, "'structured_outputs' must give exactly one of json, regex, choice, grammar, json_object, structural_tag; got none"),
    ({"choice": []}, "'structured_outputs.choice' is empty"),
    ({"choice": ["a", 3]}, "'structured_outputs.choice' must be a list of strings"),
    ({"json": "{not json"}, "'structured_outputs.json' is not valid JSON"),
    ({"json": [1, 2]}, "'structured_outputs.json' must be a JSON schema object"),
    ({"regex": ""}, "'structured_outputs.regex' must be a non-empty string"),
    ({"grammar": 5}, "'structured_outputs.grammar' must be a non-empty string"),
    ({"json_object": False}, "'structured_outputs.json_object' must be true"),
    ({"regex": "a", "backend": "outlines"}, "'structured_outputs.backend' must be 'xgrammar' or 'auto'"),
    ({"regex": "a", "disable_any_whitespace": "yes"}, "'structured_outputs.disable_any_whitespace' must be a boolean"),
    ({"structural_tag": "[1]"}, "'structured_outputs.structural_tag' must be an object, got list"),
    ({"structural_tag": {"structures": [{"begin": "<a>", "end": "</a>"}], "triggers": ["<a>"]}},
     "'structured_outputs.structural_tag.structures' must be a list of objects with 'begin' and 'end' strings and a "
     "'schema' object"),
    ({"structural_tag": {"structures": [], "triggers": "<a>"}},
     "'structured_outputs.structural_tag.triggers' must be a list of non-empty strings"),
    ({"structural_tag": {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": {
        "type": "array", "items": json.loads("[" * 90 + "]" * 90)}}}},
     "'structured_outputs.structural_tag' is nested too deeply: objects and arrays may nest at most 80 levels"),
    ({"json": {"type": "array", "items": json.loads("[" * 70 + "]" * 70)}},
     "'structured_outputs.json' is nested too deeply: objects and arrays may nest at most 64 levels (vLLM's limit)"),
    ({"json": {}, "whitespace_pattern": " *"}, "'structured_outputs.whitespace_pattern' is not supported by xgrammar"),
    ({"jsn": {}}, "'structured_outputs' has unknown key(s) ['jsn']"),
    # what xgrammar would compile away (it accepts output that breaks these), refused as vLLM refuses them
    ({"json": {"type": "string", "pattern": "[a-z]+", "maxLength": 3}},
     "'structured_outputs.json' combines 'pattern' with 'maxLength' at the top level, which xgrammar would not"),
    ({"json": {"type": "object", "properties": {"mail": {"type": "string", "format": "idn-email"}}}},
     "'structured_outputs.json' uses the format 'idn-email' at /properties/mail"),
    ({"json": {"type": "string", "format": "regex"}}, "uses the format 'regex' at the top level"),
    ({"json": {"type": "string", "format": "ipvanyaddress"}}, "uses the format 'ipvanyaddress'"),   # pydantic's
    ({"json": {"type": "object", "properties": {"a": {"anyOf": []}}}}, "gives an empty 'anyOf' at /properties/a"),
    ({"json": {"type": []}}, "gives an empty 'type' at the top level"),
    ({"json": {"oneOf": []}}, "gives an empty 'oneOf' at the top level"),
    ({"json": {"type": "integer", "oneOf": [{"type": "integer"}, {"$ref": "#/$defs/X"}], "$defs": {"X": {}}}},
     "gives 'type' \"integer\" next to values or branches outside it at the top level (its 'oneOf' branch 1, "
     "which names no type within it)"),
    ({"json": {"$defs": {"x": {"not": {"type": "string"}}}}}, "uses 'not' at /$defs/x"),
    ({"json": {"anyOf": [{"type": "integer"}, {"if": {"type": "string"}, "then": {"maxLength": 1}}]}},
     "uses 'if' at /anyOf/1"),
    ({"json": {"type": "array", "items": {"type": "string", "format": "date", "minLength": 10}}},
     "combines 'format' with 'minLength' at /items"),
    ({"json": {"anyOf": [{"type": "integer"}, {"required": ["a"]}]}}, "uses 'required' without a 'type' at /anyOf/1"),
    ({"json": {"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]}},
     "gives 'properties' next to 'anyOf' at the top level"),
    ({"json": {"allOf": [{"type": "integer"}, {"type": "integer", "minimum": 5}]}}, "uses 'allOf' of 2 schemas"),
    ({"json": {"type": "object", "required": ["a"]}},
     "requires 'a' at the top level, which its 'properties' do not define"),
    ({"json": {"$defs": {"X": {"type": "integer"}}, "$ref": "#/$defs/X", "minimum": 5}},
     "gives 'minimum' next to '$ref' at the top level"),
    ("[1]", "'structured_outputs' must be an object with one of the keys"),
    ("{oops", "'structured_outputs' is not valid JSON"),
]


# each schema refused as compiled away, with an output that breaks it and xgrammar (the pinned
# version) would let through: the measurement behind the refusal
COMPILED_AWAY = [
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}, {"required": ["b"]}]}, "8.5"),
    ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3"),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}, '{"a": 1}'),
    ({"type": "object", "required": ["a"]}, "{}"),
    ({"type": "object", "required": ["a"], "additionalProperties": {"type": "integer"}}, "{}"),
    ({"minimum": 5}, "3"),
    ({"maxLength": 2}, '"abcd"'),
    ({"$defs": {"X": {"type": "integer"}}, "$ref": "#/$defs/X", "maximum": 5}, "9"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "[1, 1]"),    # a pydantic set[int]
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 5}}, "[]"),
    ({"type": "array", "items": {"type": "integer"}, "contains": {"const": 1}, "maxContains": 1}, "[1, 1]"),
    ({"type": "number", "multipleOf": 0.25}, "5.1"),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentRequired": {"a": ["b"]}}, '{"a": 1}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
      "dependentSchemas": {"a": {"required": ["b"]}}}, '{"a": 1}'),
    ({"type": "object", "propertyNames": {"pattern": "^a+$"}, "properties": {"b": {"type": "integer"}}}, '{"b": 1}'),
    ({"type": "object", "propertyNames": {"pattern": "^a+$"}, "patternProperties": {"^b": {"type": "integer"}}},
     '{"b": 1}'),
    ({"anyOf": [{"type": "integer"}, {"type": "string"}], "minimum": 10}, "2"),
    ({"enum": [1, 2, 30], "minimum": 10}, "2"),
    ({"const": 2, "minimum": 10}, "2"),
    ({"type": "string", "format": "date", "pattern": "^1999-"}, '"2000-01-01"'),
    ({"type": "string", "format": "email", "pattern": "@corp\\.com$"}, '"a@b.org"'),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",   # draft-07's dependentRequired
      "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "dependencies": {"a": ["b"]}}, '{"a": 1}'),
    ({"type": "string", "enum": ["a", 1]}, "1"),
    ({"type": "integer", "const": "x"}, '"x"'),
    ({"type": "integer", "anyOf": [{"type": "integer", "minimum": 5}, {"type": "string", "maxLength": 3}]}, '"ab"'),
    ({"$defs": {"N": {"type": "integer"}}, "type": "string", "anyOf": [{"$ref": "#/$defs/N"}]}, "3"),
    ({"$defs": {"N": {"type": "integer"}}, "type": "string", "$ref": "#/$defs/N"}, "3"),
]


@pytest.mark.parametrize("schema, breaking", COMPILED_AWAY, ids=[json.dumps(s)[:50] for s, _ in COMPILED_AWAY])
def test_what_xgrammar_compiles_away_is_refused(schema, breaking):
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(breaking), schema)
    assert _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False), breaking)
    with pytest.raises(ValueError, match="which xgrammar would not enforce"):
        SamplingParams(structured_outputs={"json": schema})


@pytest.mark.parametrize("schema, broken", [
    ({"type": "string", "pattern": '^a"b$'}, '"a"b"'),
    ({"type": "string", "pattern": "^a\\x22$"}, '"a""'),
    ({"type": "string", "pattern": '^[\\"]+$'}, '"""'),
    ({"type": "string", "pattern": "^a\\u005cb$"}, '"a\\b"'),       # JSON's backspace escape: not a backslash
    ({"type": "object", "properties": {"note": {"type": "string", "pattern": "^a\\nb$"}}}, '{"note":"a\nb"}'),
    ({"type": "object", "patternProperties": {'^k"$': {"type": "integer"}}}, '{"k"":1}'),
    ({"type": "string", "pattern": "^[\\b]$"}, '"\b"'),                  # a backspace in a class
    ({"type": "string", "pattern": "^[\\n-\\r]$"}, '"\n"'),              # a class of nothing else
])
def test_a_pattern_matching_a_character_json_escapes_is_refused(schema, broken):
    """xgrammar 0.2.9 writes a quote, backslash or control character a pattern matches literally
    into the JSON string as it is: output json.loads refuses, or reads as another string."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from inflight.structured import json_schema_grammar
    assert _is_grammar_accept_string(xgr.Grammar.from_ebnf(json_schema_grammar(json.dumps(schema), False)), broken)
    try:
        value = json.loads(broken)
    except ValueError:
        pass
    else:                                   # valid JSON, but not the string the pattern matched
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(value, schema)
    with pytest.raises(ValueError, match="literally, a character JSON escapes"):
        SamplingParams(structured_outputs={"json": schema})


@pytest.mark.parametrize("pattern", ['^[^"\\\\]*$', "^[^\\n]+$", "^\\S+@\\S+\\.\\S+$", "^\\d{3}-\\d{4}$",
                                     "^https?://[a-z.]+/$", "^\\w+$", "^[!-~]+$", "^[\\x00-\\x7F]*$",
                                     "^[\\w\\s.,!?'\"-]+$", '^[a-z"]$', "^\\b\\w+\\b$"])
def test_patterns_without_a_literal_json_escape_are_served(pattern):
    SamplingParams(structured_outputs={"json": {"type": "string", "pattern": pattern}})     # not refused


@pytest.mark.parametrize("string", [{"type": "string"}, {"type": "string", "maxLength": 8},
                                    {"type": "string", "minLength": 1}, {"type": "string", "pattern": "^.+$"}])
def test_constrained_json_strings_hold_no_raw_control_character(string):
    """xgrammar 0.2.9 let U+0000-U+001F into length-bounded strings: a tool call's arguments came
    back as JSON that json.loads refuses (a random model picked one in 240 calls)."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from inflight.structured import json_schema_grammar
    schema = {"type": "object", "properties": {"tz": string}, "required": ["tz"]}
    grammar = xgr.Grammar.from_ebnf(json_schema_grammar(json.dumps(schema), any_whitespace=False))
    assert _is_grammar_accept_string(grammar, '{"tz":"UTC+1"}')
    for code in range(0x20):
        assert not _is_grammar_accept_string(grammar, '{"tz":"a%sb"}' % chr(code)), hex(code)


@pytest.mark.parametrize("schema, valid", [
    ({"type": "object", "properties": {"Straße": {"enum": ["décembre", "café1"]}}, "required": ["Straße"]},
     ['{"Straße":"décembre"}', '{"Straße":"café1"}']),
    ({"type": "string", "pattern": "^[é1]{3}$"}, ['"é1é"', '"111"']),
    ({"type": "object", "properties": {"naïve\\xe9": {"const": "\\xe91"}}, "required": ["naïve\\xe9"]},
     ['{"naïve\\\\xe9":"\\\\xe91"}']),          # a backslash and "xe9" in the text: no escape
])
def test_schema_text_outside_ascii_is_enforced_as_written(schema, valid, reference_engine, tokenizer):
    """xgrammar prints U+0080-U+00FF as \\xHH and reads a hex digit after it into the escape:
    "café1" was enforced as "caf" + U+0E91, so a constrained output could never be right."""
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string

    from inflight.structured import json_schema_grammar
    grammar = xgr.Grammar.from_ebnf(json_schema_grammar(json.dumps(schema), any_whitespace=False))
    for text in valid:
        jsonschema.validate(json.loads(text), schema)
        assert _is_grammar_accept_string(grammar, text), text
    out = reference_engine.generate([prompt_ids(tokenizer, 0)], SamplingParams(
        max_tokens=32, temperature=0, structured_outputs={"json": schema, "disable_any_whitespace": True}))[0]
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(text_of(tokenizer, out)), schema)


def test_the_schemas_pydantic_and_openai_examples_write_are_served():
    """What the added checks must not refuse: pydantic 2's shapes ($defs, a $ref with a
    description, Optional as anyOf with null, enums, defaults), pydantic 1's one-schema allOf
    around a $ref, pydantic 2.7-2.9's discriminated union (a one-value enum next to the tag's const),
    OpenAPI's nullable and x- keys, and OpenAI's function-calling example."""
    from enum import Enum
    from pathlib import Path
    from typing import Annotated, Literal

    from pydantic import AnyUrl, BaseModel, Field, SecretStr, StringConstraints

    class Size(str, Enum):
        small = "S"
        large = "L"

    class Address(BaseModel):
        city: str = Field(max_length=20)
        zip: str | None = Field(None, pattern=r"^[0-9]{5}$")

    class Order(BaseModel):
        size: Size = Size.small
        address: Address = Field(description="where to ship")
        items: list[int] = Field(min_length=1)
        note: str | None = None

    pydantic_1 = {"title": "Order", "type": "object", "definitions": {"Size": {"enum": ["S", "L"], "type": "string"}},
                  "properties": {"size": {"description": "d", "default": "S", "allOf": [{"$ref": "#/definitions/Size"}]}},
                  "required": ["size"]}
    weather = {"type": "object", "properties": {"location": {"type": "string"},
                                                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["location"], "additionalProperties": False}
    class Cat(BaseModel):
        pet_type: Literal["cat"]
        lives: int

    class Dog(BaseModel):
        pet_type: Literal["dog"]

    class Owner(BaseModel):
        pet: Cat | Dog = Field(discriminator="pet_type")

    pydantic_2_9 = Owner.model_json_schema()
    for name in ("Cat", "Dog"):      # what 2.7-2.9 write for a Literal: const and a one-value enum
        tag = pydantic_2_9["$defs"][name]["properties"]["pet_type"]
        tag["enum"] = [tag["const"]]
    openapi = {"type": "object", "properties": {"kind": {"type": "string", "enum": ["a", "b"], "nullable": True,
                                                         "x-order": 1}}}
    class Account(BaseModel):        # formats xgrammar leaves as any string, which validators do too
        home: AnyUrl                 # format uri with minLength 1: a uri is never empty
        password: SecretStr
        key_file: Path
        blob: bytes
        tags: list[str] = Field(json_schema_extra={"uniqueItems": False})
        size: Size

    one_of_the_calls = {"type": "object", "anyOf": [{"properties": {"name": {"const": "f"}}, "required": ["name"]}]}
    typed_refs = {"$defs": {"A": {"type": "object", "properties": {"kind": {"type": ["string", "null"], "anyOf": [
                                  {"$ref": "#/$defs/Kind"}, {"type": "null"}]}}},
                            "B": {"allOf": [{"$ref": "#/$defs/A"}]}, "Kind": {"type": "string", "enum": ["x"]}},
                  "type": "object", "anyOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}]}
    class Notes(BaseModel):          # notes beside a $ref and an enum, constrained dict keys
        size: Size = Field(json_schema_extra={"example": "S"})
        status: Literal["open", "closed"] = Field(json_schema_extra={"example": "open"})
        counts: dict[Annotated[str, StringConstraints(max_length=3)], int]

    openapi_ref = {"$defs": {"C": {"type": "object", "properties": {"a": {"type": "integer"}}}},
                   "type": "object", "properties": {"c": {"type": "object", "$ref": "#/$defs/C"},
                                                    "d": {"type": "object", "allOf": [{"$ref": "#/$defs/C"}]}}}
    for schema in (Order.model_json_schema(), pydantic_1, pydantic_2_9, openapi, weather, Account.model_json_schema(),
                   {"type": "number", "anyOf": [{"type": "integer"}, {"const": 2.5}]}, one_of_the_calls, typed_refs,
                   Notes.model_json_schema(), openapi_ref,
                   {"type": "object", "propertyNames": {"pattern": "^[A-Za-z_][A-Za-z0-9_]*$"}}):
        assert structured.unenforced(schema) is None, schema
        SamplingParams(structured_outputs={"json": schema})


@pytest.mark.parametrize("value, message", SHAPE_ERRORS, ids=[m[:60] for _, m in SHAPE_ERRORS])
def test_malformed_constraints_are_refused_at_construction(value, message):
    with pytest.raises(ValueError) as info:
        SamplingParams(structured_outputs=value)
    assert message in str(info.value)


def test_min_tokens_cannot_be_combined_with_a_constraint():
    with pytest.raises(ValueError, match="'min_tokens' cannot be combined with 'structured_outputs'"):
        SamplingParams(min_tokens=3, structured_outputs={"regex": "a+"})


COMPILE_ERRORS = [
    ({"json": {"type": "foo"}}, "'structured_outputs.json' is not a valid JSON schema: Unsupported type \"foo\""),
    ({"json": {"type": "array", "minItems": 3, "maxItems": 1}},
     "'structured_outputs.json' is not a valid JSON schema: minItems is greater than maxItems: 3 > 1"),
    ({"regex": "(ab"}, "'structured_outputs.regex' is not a valid regex: Regex parsing error at position"),
    ({"grammar": "root ::= foo"}, "'structured_outputs.grammar' is not a valid grammar: EBNF parser error at line 1, column 10: Rule \"foo\" is not defined"),
    ({"grammar": "start: foo"}, "'structured_outputs.grammar' is not a valid grammar: Lark error at line 1"),
    ({"structural_tag": "{}"}, "'structured_outputs.structural_tag' is not a valid structural tag: Invalid structural "
                               "tag error: Structural tag must have a format field"),
]


@pytest.mark.parametrize("spec, message", COMPILE_ERRORS, ids=[m[:50] for _, m in COMPILE_ERRORS])
def test_invalid_grammars_are_refused_at_submission_with_xgrammars_message(reference_engine, spec, message):
    with pytest.raises(ValueError) as info:
        reference_engine.add_request("bad-grammar", [1, 5, 6], SamplingParams(structured_outputs=spec))
    assert message in str(info.value) and "/project/" not in str(info.value)
    assert "bad-grammar" not in reference_engine.requests and reference_engine.num_constrained == 0


def test_a_model_without_a_tokenizer_refuses_constraints_clearly(tiny_checkpoint):
    engine = LLMEngine.from_pretrained(tiny_checkpoint, EngineConfig(num_kv_blocks=64))
    with pytest.raises(ValueError, match="'structured_outputs' needs the model's tokenizer, and this engine has none$"):
        engine.add_request("r", [1, 2, 3], SamplingParams(structured_outputs={"regex": "a+"}))
    assert not engine.requests


@pytest.mark.parametrize("policy", ["continuous", "static"])
def test_a_grammar_whose_every_token_is_banned_ends_with_an_error(policy, reference_engine, tokenizer):
    """bad_words can ban every token the grammar allows: the request fails with a clear message
    instead of emitting text outside its grammar, and keeps no trace of the refused token (its
    output and log-probabilities are what was streamed: nothing), also where static batching holds
    its row until the batch's other request ends."""
    vocab = tokenizer.get_vocab()
    starts = [[i] for i in vocab.values() if decode(tokenizer, [i]) and "yes".startswith(decode(tokenizer, [i]))]
    engine = reference_engine if policy == "continuous" else LLMEngine.from_pretrained(
        DEFAULT_MODEL, EngineConfig(dtype="float32", policy="static", num_kv_blocks=64, cpu_threads=1))
    req = engine.add_request("all-banned", prompt_ids(tokenizer, 0), SamplingParams(
        max_tokens=8, structured_outputs={"choice": ["yes"]}, bad_words_ids=starts, logprobs=2))
    engine.add_request("beside", prompt_ids(tokenizer, 1), SamplingParams(max_tokens=4, ignore_eos=True))
    emitted, finished, errors = [], {}, {}
    while engine.has_unfinished():
        out = engine.step()
        emitted += [t for r, t in zip(out.request_ids, out.token_ids) if r == "all-banned"]
        finished.update(out.finished)
        errors.update(out.errors)
    assert emitted == [] and finished["all-banned"] == req.finish_reason == "error"
    assert "no token allowed by the grammar" in errors["all-banned"] == req.error
    assert req.output_token_ids == [] and req.logprobs == []
    assert engine.kv.num_used_blocks == 0 and engine.num_constrained == 0


def test_allowed_token_ids_and_a_grammar_both_apply_and_the_grammar_decides_where_they_leave_nothing(
        reference_engine, tokenizer):
    """Both masks apply: a choice whose allowed tokens spell the other option gives that option.
    Once it is complete the grammar allows only EOS, which allowed_token_ids leaves out: rather than
    sample from nothing (vLLM's token 0, or NaN), the row samples within its grammar, and the output
    ends. Allowed tokens that the grammar never allows leave the choice to the grammar alone."""
    prompt = prompt_ids(tokenizer, 0)
    choice = {"choice": ["yes", "no"]}
    params = dict(max_tokens=8, temperature=0)
    free = text_of(tokenizer, reference_engine.generate([prompt], SamplingParams(**params, structured_outputs=choice))[0])
    other = "no" if free == "yes" else "yes"
    allowed = tokenizer(other, add_special_tokens=False)["input_ids"]
    out = reference_engine.generate([prompt], SamplingParams(**params, structured_outputs=choice,
                                                             allowed_token_ids=allowed))[0]
    assert text_of(tokenizer, out) == other and out.finish_reason == "stop"
    assert out.token_ids[:-1] == allowed and out.token_ids[-1] == tokenizer.eos_token_id
    outside = tokenizer("{", add_special_tokens=False)["input_ids"]
    alone = reference_engine.generate([prompt], SamplingParams(**params, structured_outputs=choice,
                                                               allowed_token_ids=outside))[0]
    assert text_of(tokenizer, alone) == free and alone.finish_reason == "stop"


constraint_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=6),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=6)
constraint_keys = st.sampled_from(["json", "regex", "choice", "grammar", "json_object", "backend",
                                   "disable_any_whitespace", "structural_tag", "other"])


@settings(max_examples=300, deadline=None)
@given(value=st.one_of(st.dictionaries(constraint_keys, constraint_values, max_size=3), constraint_values,
                       st.text(max_size=12)))
def test_fuzzed_constraints_parse_or_fail_naming_the_field(value):
    try:
        spec = parse_spec(value, "guided_decoding")
    except ValueError as exc:
        assert str(exc).startswith("'guided_decoding"), str(exc)
        return
    assert spec.kind in structured.KINDS and spec.param == "guided_decoding"


def test_sampling_parameters_take_the_constraint_as_an_object_or_its_json_text():
    import numpy as np

    from inflight.serving.protocol import RequestError, parse_request

    def parse(sampling: dict):
        return parse_request({"text_input": np.array([b"hi"], dtype=object),
                              "sampling_parameters": np.array([json.dumps(sampling).encode()], dtype=object)}, {})

    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    as_object = parse({"structured_outputs": {"json": schema}}).params.structured_outputs
    as_text = parse({"structured_outputs": json.dumps({"json": json.dumps(schema, indent=2)})}).params.structured_outputs
    alias = parse({"guided_decoding": {"json": schema, "backend": "xgrammar"}}).params.structured_outputs
    assert as_object == as_text == alias and as_object.kind == "json"
    assert list(json.loads(as_object.text)["properties"]) == ["b", "a"], "key order is kept: it orders the output"
    assert not parse({"guided_decoding": {"regex": "a+", "disable_any_whitespace": True}}).params.structured_outputs.any_whitespace
    with pytest.raises(RequestError, match="'guided_decoding.choice' is empty"):
        parse({"guided_decoding": {"choice": []}})


def test_log_probabilities_of_a_constrained_request_are_those_within_its_grammar(reference_engine, tokenizer):
    """vLLM masks the logits with the grammar before its sampler takes raw_logprobs: the reported
    log-probabilities are the model's distribution over what the grammar allows (a choice's
    confidence; a forced token's 0), not over the whole vocabulary. Checked against transformers'
    logits, masked here by decoding every token."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float64)
    choices = ("yes", "no")
    prompt = tokenizer("Is a dict ordered? Answer:")["input_ids"]
    out = reference_engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0, logprobs=3,
                                                             structured_outputs={"choice": list(choices)}))[0]
    assert out.finish_reason == "stop" and decode(tokenizer, out.token_ids) in choices
    eos = set(reference_engine.eos_token_ids)
    for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        done = out.token_ids[:i]
        text = decode(tokenizer, done)
        allowed = [t for t in range(len(tokenizer)) if t in eos and text in choices or t not in eos and (
            grown := decode(tokenizer, done + [t])) != text and any(c.startswith(grown) for c in choices)]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + done])).logits[0, -1, :len(tokenizer)]
        expected = logits[allowed] - torch.logsumexp(logits[allowed], dim=0)
        assert token in allowed and entry[token].logprob == pytest.approx(
            expected[allowed.index(token)].item(), abs=1e-9)
        finite = {t: e.logprob for t, e in entry.items() if e.logprob > -math.inf}
        assert set(finite) <= set(allowed), "a token outside the grammar among the top log-probabilities"
    assert out.logprobs[-1][out.token_ids[-1]].logprob == pytest.approx(0.0), "the forced end"

"""tool_choice "auto"'s parsers (the OpenAI server's tool_parsers.py) on the text a model writes:
the content and calls of a whole reply, and the same from a stream cut anywhere."""
import json
import random

import pytest

from inflight_client.openai_server.schemas import ChatCompletionRequest
from inflight_client.openai_server.tool_parsers import AutoToolText, call_envelope, call_id_of
from inflight_client.openai_server.tools import ToolCallText, tool_message

from .helpers import mistral_checkpoint

WEATHER = ("get_weather", '{"city": "Oslo"}')
ADD = ("add", '{"a": 1, "b": 2}')
CASES = [  # parser, the model's text -> content, calls, finish_reason
    ("hermes", 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
               '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\nDone.',
     "Let me check.\n", [WEATHER, ADD], "tool_calls"),
    ("hermes", "Plain text < with a <tool but no call", "Plain text < with a <tool but no call", [], "stop"),
    ("hermes", 'x<tool_call>{"name": 3}</tool_call>', 'x<tool_call>{"name": 3}</tool_call>', [], "stop"),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}', None, [ADD], "tool_calls"),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1,', '<tool_call>{"name": "add", "arguments": {"a": 1,',
     [], "stop"),
    ("llama3_json", ' {"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "add", "arguments": '
                    '{"a": 1, "b": 2}}', None, [WEATHER, ADD], "tool_calls"),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}', None, [ADD], "tool_calls"),
    ("llama3_json", 'The answer: {"name": "add"}', 'The answer: {"name": "add"}', [], "stop"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}} {"other": 1} and text', None, [ADD], "tool_calls"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}, then {"name": "get_weather", "parameters": '
                    '{"city": "Oslo"}} and {} {"name": "x"', None, [ADD, WEATHER], "tool_calls"),
    ("llama3_json", '{"name": "add", "parameters": {', '{"name": "add", "parameters": {', [], "stop"),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}; {"name": "get', None, [ADD], "tool_calls"),
    ("llama3_json", '  {"answer": 42} is my reply', '  {"answer": 42} is my reply', [], "stop"),
    ("llama3_json", "", "", [], "stop"),
    ("hermes", '\n\n<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>', None, [ADD], "tool_calls"),
    ("hermes", "  \n ", "  \n ", [], "stop"),
    # nested past what Python's JSON decoder takes: content, not a 500
    ("hermes", "<tool_call>" + "[" * 1200 + "</tool_call>", "<tool_call>" + "[" * 1200 + "</tool_call>", [], "stop"),
    ("llama3_json", '{"name": "f", "parameters": ' + "[" * 1200, '{"name": "f", "parameters": ' + "[" * 1200, [],
     "stop"),
    # pythonic: all or nothing, as vLLM 0.32 reads a whole reply (each case checked against its parser: the
    # same but for 1e999, which it writes as Infinity)
    ("pythonic", '[get_weather(city="Oslo"), add(a=1, b=2)]', None, [WEATHER, ADD], "tool_calls"),
    ("pythonic", "[f(a=-2.5, b=[1, (2, 3)], c={'k': null, 1: true}, d=f'x', e={4}, g=+3, h=None, i='é )]\\'')]\n",
     None, [("f", '{"a": -2.5, "b": [1, [2, 3]], "c": {"k": null, "1": true}, "d": "x", "e": [4], "g": 3, "h": null, '
                  "\"i\": \"é )]'\"}")], "tool_calls"),
    ("pythonic", "[get_weather(city='Oslo')]\n\nDone", None, [WEATHER], "tool_calls"),   # a module: Done is Python
    ("pythonic", "[f()]", None, [("f", "{}")], "tool_calls"),
    ("pythonic", 'Sure: [get_weather(city="Oslo")]', 'Sure: [get_weather(city="Oslo")]', [], "stop"),
    ("pythonic", ' [add(a=1, b=2)]', ' [add(a=1, b=2)]', [], "stop"),
    ("pythonic", '[get_weather(city="Oslo"), 42]', '[get_weather(city="Oslo"), 42]', [], "stop"),
    ("pythonic", '[get_weather(city="Oslo")] and then text', '[get_weather(city="Oslo")] and then text', [], "stop"),
    ("pythonic", "[get_weather(city=oslo)]", "[get_weather(city=oslo)]", [], "stop"),
    ("pythonic", "[add(1, b=2)]", "[add(1, b=2)]", [], "stop"),
    ("pythonic", "[maps.get(x=1)]", "[maps.get(x=1)]", [], "stop"),
    ("pythonic", "[f(**k)]", "[f(**k)]", [], "stop"),
    ("pythonic", "[f(a=b'x')]", "[f(a=b'x')]", [], "stop"),
    ("pythonic", "[f(a=1e999)]", "[f(a=1e999)]", [], "stop"),
    ("pythonic", '[get_weather(city="Oslo"', '[get_weather(city="Oslo"', [], "stop"),
    ("pythonic", "[1] First, [2] second", "[1] First, [2] second", [], "stop"),
    ("pythonic", "[]", "[]", [], "stop"),
    ("pythonic", "", "", [], "stop"),
    ("pythonic", "[f(a=" + "[" * 1200 + "]" * 1200 + ")]", "[f(a=" + "[" * 1200 + "]" * 1200 + ")]", [], "stop"),
    ("llama4_pythonic", '<|python_start|>[get_weather(city="Oslo")]<|python_end|>', None, [WEATHER], "tool_calls"),
    ("llama4_pythonic", '[add(a=1, b=2)]', None, [ADD], "tool_calls"),
    ("llama4_pythonic", "<|python_start|>hello", "hello", [], "stop"),
    ("llama4_pythonic", "<|python_start|>[add(a=1, b=2)", "[add(a=1, b=2)", [], "stop"),
    ("llama4_pythonic", "<|python", "<|python", [], "stop"),
    # the closing tag is dropped after an opening one only (special tokens kept: skip_special_tokens false)
    ("llama4_pythonic", "<|python_start|>hello<|python_end|> and <|python_e", "hello and <|python_e", [], "stop"),
    ("llama4_pythonic", '[f(a="<|python_end|>")]', None, [("f", '{"a": "<|python_end|>"}')], "tool_calls"),
    ("llama4_pythonic", "[add(a=1, b=2)]<|python_end|>", "[add(a=1, b=2)]<|python_end|>", [], "stop"),
]


def streamed_reader(reader: AutoToolText, text: str, cuts: list[int]):
    content, calls = "", []
    for start, end in zip([0] + cuts, cuts + [len(text)]):
        more_content, more_calls = reader.feed(text[start:end])
        content, calls = content + more_content, calls + more_calls
    rest, more_calls = reader.close()
    calls += more_calls
    content = content + (rest or "") or (None if calls else reader.empty_content)      # the role chunk's ""
    return content, [(c["function"]["name"], c["function"]["arguments"]) for c in calls], reader.finish_reason("stop")


@pytest.mark.parametrize("parser, text, content, calls, reason", CASES)
def test_a_reply_reads_as_its_content_and_calls_whole_or_streamed_in_any_pieces(parser, text, content, calls, reason):
    assert_reads(lambda: AutoToolText(parser), text, content, calls, reason)


def assert_reads(reader, text: str, content, calls, reason) -> list[str]:
    """The reply's content, calls and finish_reason from a new reader(), whole and cut anywhere; the
    calls' ids."""
    message, finish_reason = tool_message(reader(), text, "stop")
    assert tool_message(reader(), text, "length")[1] == "length", "a reply cut short says so"
    assert message["content"] == content and finish_reason == reason
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    ids = [c["id"] for c in message.get("tool_calls", [])]
    assert len(set(ids)) == len(calls)
    rng = random.Random(0)
    for _ in range(0 if len(text) < 2 else 200 if len(text) < 500 else 5):
        cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(12, len(text) - 1))))
        assert streamed_reader(reader(), text, cuts) == (content, calls, reason), cuts
    if len(text) < 500:
        assert streamed_reader(reader(), text, list(range(1, len(text)))) == (content, calls, reason), \
            "a character at a time"
    return ids


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = CASES[0][1]
    message, reason = tool_message(AutoToolText("hermes", parallel=False), text, "stop")
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather"] and reason == "tool_calls"
    assert streamed_reader(AutoToolText("hermes", parallel=False), text, [20, 90]) == ("Let me check.\n", [WEATHER],
                                                                                       "tool_calls")
    assert tool_message(AutoToolText("pythonic", parallel=False), '[add(a=1, b=2), get_weather(city="Oslo")]',
                        "stop")[0]["tool_calls"][0]["function"]["name"] == "add"


# mistral, in the form its tokenizer tells: a JSON list before v11 (no [ARGS] token), name[ARGS]{...} after
ADD_LIST = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2}}]'
WEATHER_V11, ADD_V11 = '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}'
MISTRAL_CASES = [  # tokenizer, the model's text -> content, calls, finish_reason (as vLLM 0.32 reads them, but where
    # the README says otherwise: checked against its parser on these texts)
    ("v3", 'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "add", '
           '"arguments": {"a": 1, "b": 2}}]', "Let me check.", [WEATHER, ADD], "tool_calls"),
    ("v3", ' \n[TOOL_CALLS] {"name": "add", "arguments": {"a": 1, "b": 2}}', None, [ADD], "tool_calls"),
    ("v3", ADD_LIST + " Done.", None, [ADD], "tool_calls"),
    ("v3", ADD_LIST + '\n[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}]', None, [ADD, WEATHER],
     "tool_calls"),
    ("v3", '[TOOL_CALLS][{"name": "f"}, 5, {"name": ""}, {"name": "g", "arguments": "{\\"x\\": 1}"}]', None,
     [("f", "{}"), ("g", '{"x": 1}')], "tool_calls"),
    ("v3", "[TOOL_CALLS][TOOL_CALLS]" + ADD_LIST[12:], None, [ADD], "tool_calls"),
    ("v3", "[TOOL_CALLS]junk " + ADD_LIST, None, [ADD], "tool_calls"),
    ("v3", 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {"a": 1,', 'Sure.[TOOL_CALLS][{"name": "add", "arguments": '
           '{"a": 1,', [], "stop"),
    ("v3", "[TOOL_CALLS]not json", "[TOOL_CALLS]not json", [], "stop"),
    ("v3", '[TOOL_CALLS][{"arguments": {}}]', '[TOOL_CALLS][{"arguments": {}}]', [], "stop"),
    ("v3", ADD_LIST[12:], ADD_LIST[12:], [], "stop"),                    # no marker: content
    ("v3", ADD_V11, ADD_V11, [], "stop"),                                # not this tokenizer's form
    ("v3", "Plain text, [TOOL_CALL but no call [TOOL_CAL", "Plain text, [TOOL_CALL but no call [TOOL_CAL", [], "stop"),
    ("v3", "", "", [], "stop"),
    ("v3", "[TOOL_CALLS]" + "[" * 1200, "[TOOL_CALLS]" + "[" * 1200, [], "stop"),
    ("v11", "Let me check." + WEATHER_V11 + ADD_V11, "Let me check.", [WEATHER, ADD], "tool_calls"),
    ("v11", '[TOOL_CALLS]add{"a": 1, "b": 2}', None, [ADD], "tool_calls"),
    ("v11", '  [TOOL_CALLS] add [ARGS] {"a":1,\n"b":2} and text', None, [("add", '{"a":1,\n"b":2}')], "tool_calls"),
    ("v11", ADD_V11 + " Done." + WEATHER_V11 + "\n", None, [ADD, WEATHER], "tool_calls"),
    ("v11", ADD_V11[:-8], ADD_V11[:-8], [], "stop"),                     # cut short
    ("v11", ADD_V11[:-8] + WEATHER_V11, None, [WEATHER], "tool_calls"),  # a marker ends the call before it
    ("v11", '[TOOL_CALLS][ARGS]{"a": 1}', '[TOOL_CALLS][ARGS]{"a": 1}', [], "stop"),
    ("v11", "[TOOL_CALLS]add[ARGS][1, 2]", "[TOOL_CALLS]add[ARGS][1, 2]", [], "stop"),
    ("v11", "Sure.[TOOL_CALLS]add", "Sure.[TOOL_CALLS]add", [], "stop"),
    ("v11", "[TOOL_CALLS]" + ADD_V11, None, [ADD], "tool_calls"),
    ("v11", "No call, [ARGS]{} here", "No call, [ARGS]{} here", [], "stop"),
]


@pytest.fixture(scope="module")
def mistral_tokenizers(tmp_path_factory):
    from transformers import AutoTokenizer
    root = tmp_path_factory.mktemp("mistral")
    return {version: AutoTokenizer.from_pretrained(mistral_checkpoint(str(root / version), args=version == "v11"))
            for version in ("v3", "v11")}


@pytest.mark.parametrize("version, text, content, calls, reason", MISTRAL_CASES)
def test_a_mistral_reply_reads_in_its_tokenizers_form_whole_or_streamed(mistral_tokenizers, version, text, content,
                                                                         calls, reason):
    """What does not read as a call is skipped, and a reply in which none reads is content as written;
    the calls' ids are Mistral's 9 letters and digits."""
    ids = assert_reads(lambda: AutoToolText("mistral", tokenizer=mistral_tokenizers[version]), text, content, calls,
                       reason)
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids), ids


def test_mistral_calls_keep_the_first_with_parallel_tool_calls_false_and_forced_ones_have_its_ids(mistral_tokenizers):
    for version in ("v3", "v11"):
        text = next(case[1] for case in MISTRAL_CASES if case[0] == version)     # a text, then two calls
        reader = AutoToolText("mistral", parallel=False, tokenizer=mistral_tokenizers[version])
        assert streamed_reader(reader, text, [20, 60]) == ("Let me check.", [WEATHER], "tool_calls")
    # "required" and named (tools.py's JSON forms, with this parser) make Mistral's ids too
    _, calls = ToolCallText(None, call_id_of("mistral")).feed('[{"name": "add", "parameters": {"a": 1}}]')
    _, named = ToolCallText("add", call_id_of("mistral")).feed('{"a": 1}')
    assert [len(c["id"]) for c in calls + named] == [9, 9] and ToolCallText("add").feed("{}")[1][0]["id"][:5] == "call_"


def test_a_pythonic_reply_streams_as_content_once_it_cannot_be_a_list_of_calls():
    """Only a reply that starts like a list of calls (`[name(`) is held to its end."""
    reader = AutoToolText("pythonic")
    assert reader.feed("[") == ("", []) and reader.feed("1") == ("[1", []) and reader.feed("] x") == ("] x", [])
    reader = AutoToolText("pythonic")
    assert reader.feed("[get_weather(") == ("", []) and reader.feed('city="Oslo")]') == ("", [])
    assert [c["function"]["name"] for c in reader.close()[1]] == ["get_weather"]


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
HERMES_CALL = '<tool_call>\n{{"name": "{}", "arguments": {}}}\n</tool_call>'
LLAMA_CALL = '{{"name": "{}", "parameters": {}}}'


def request(*strict: bool, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": strict[0]}},
        {"type": "function", "function": {"name": "add", "parameters": CITY, "strict": strict[1]}}], **fields})


def grammar_of(parser: str, body: ChatCompletionRequest, own: dict | None = None):
    from xgrammar import Grammar
    return Grammar.from_structural_tag(json.dumps(call_envelope(parser, body, own)))


def accepts(grammar, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string
    return _is_grammar_accept_string(grammar, text)


@pytest.mark.parametrize("parser, call", [("hermes", HERMES_CALL), ("llama3_json", LLAMA_CALL)])
def test_the_call_envelope_vllm_puts_on_an_auto_reply(parser, call):
    """vLLM 0.32's structural tag for tool_choice "auto" (its tags, compared field by field when
    written): only with a strict tool or parallel_tool_calls false; then a call names a tool, a
    strict tool's arguments follow its parameters and another's are any JSON, and the text
    around the calls is free."""
    assert call_envelope(parser, request(False, False)) is None
    assert call_envelope("pythonic", request(True, True, parallel_tool_calls=False)) is None   # vLLM has none
    grammar = grammar_of(parser, request(True, False))
    weather, loose = call.format("get_weather", '{"city": "Oslo"}'), call.format("add", '{"n": [1]}')
    assert accepts(grammar, "Just text.") and accepts(grammar, weather) and accepts(grammar, loose)
    assert accepts(grammar, weather + "\n" + loose), "parallel calls"
    assert not accepts(grammar, call.format("get_weather", '{"town": "Oslo"}')), "a strict tool's parameters"
    assert not accepts(grammar, call.format("unknown", "{}")), "a tool that is not given"
    single = grammar_of(parser, request(False, False, parallel_tool_calls=False))
    assert accepts(single, loose) and not accepts(single, weather + "\n" + loose), "at most one call"


@pytest.mark.parametrize("parser, call", [("hermes", HERMES_CALL), ("llama3_json", LLAMA_CALL)])
def test_a_forced_call_is_written_in_the_models_format_under_vllms_tag(parser, call):
    """vLLM 0.32 has a model with a structural tag write "required" and named calls in its own
    format: "required" one call or more and no text (at most one with parallel_tool_calls false), a
    named tool_choice that tool's one call; a strict tool's arguments follow its parameters."""
    weather, loose = call.format("get_weather", '{"city": "Oslo"}'), call.format("add", '{"n": [1]}')
    required = grammar_of(parser, request(True, False, tool_choice="required"))
    assert accepts(required, weather) and accepts(required, loose) and accepts(required, weather + loose)
    assert not accepts(required, "Just text.") and not accepts(required, ""), "a call must come"
    assert not accepts(required, call.format("get_weather", '{"town": "Oslo"}'))
    single = grammar_of(parser, request(False, False, tool_choice="required", parallel_tool_calls=False))
    assert accepts(single, loose) and not accepts(single, loose + loose)
    named = grammar_of(parser, request(True, False, tool_choice={"type": "function", "function": {"name": "add"}}))
    assert accepts(named, loose) and not accepts(named, weather) and not accepts(named, loose + loose)
    assert call_envelope("pythonic", request(True, True, tool_choice="required")) is None     # tools.py's JSON forms


@pytest.mark.parametrize("parser, call", [("hermes", HERMES_CALL), ("llama3_json", LLAMA_CALL)])
def test_auto_with_a_constraint_of_its_own_is_calls_or_that(parser, call):
    """vLLM 0.32 joins "auto"'s envelope with the request's own constraint where a tool is strict:
    the reply is calls (as "required" has them) or what the constraint allows, nothing else;
    without a strict tool the request's constraint stays alone."""
    weather = call.format("get_weather", '{"city": "Oslo"}')
    for own, fits, breaks in (({"json": CITY}, '{"city": "Rome"}', '{"town": "Rome"}'),
                              ({"json_object": True}, '{"any": 1}', "[1]"),
                              ({"regex": "[a-z]+"}, "hello", "Hello"),
                              ({"choice": ["yes", "no"]}, "no", "maybe"),
                              ({"grammar": 'root ::= "a" | "b"'}, "b", "c"),
                              ({"structural_tag": json.dumps({"type": "structural_tag", "format": {
                                  "type": "const_string", "value": "done"}})}, "done", "do")):
        grammar = grammar_of(parser, request(True, False), own)
        assert accepts(grammar, weather) and accepts(grammar, fits), own
        assert not accepts(grammar, breaks) and not accepts(grammar, fits + weather), own
        assert call_envelope(parser, request(False, False, parallel_tool_calls=False), own) is None
    assert call_envelope(parser, request(True, False), {"json": "{not json"}) is None     # llm names the field


def test_the_llama3_json_envelope_is_xgrammars_llama_template():
    """Written out in the OpenAI server (which carries no xgrammar), the tag is the one xgrammar's
    get_model_structural_tag("llama") builds for vLLM, for any strictness, names and tool_choice."""
    import xgrammar as xgr
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": True}},
             {"type": "function", "function": {"name": "add", "parameters": CITY}},
             {"type": "function", "function": {"name": "wait", "strict": True}},
             {"type": "function", "function": {"name": "sag_hallo_✓", "parameters": {}, "strict": False}}]
    for choice in ("auto", "required", *({"type": "function", "function": {"name": t["function"]["name"]}}
                                         for t in tools)):
        for parallel in (True, False):
            body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": tools,
                                                         "tool_choice": choice, "parallel_tool_calls": parallel})
            ours = xgr.StructuralTag.model_validate(call_envelope("llama3_json", body))
            theirs = xgr.get_model_structural_tag(model="llama", reasoning=False, tool_choice=choice, tools=[
                # with each tool's strict pinned, as vLLM passes them (absent is not strict)
                {"type": "function", "function": {**tool.function.model_dump(exclude_none=True),
                                                  "strict": tool.function.strict is True}} for tool in body.tools],
                parallel_tool_calls=parallel)
            assert ours.model_dump() == theirs.model_dump(), (choice, parallel)


@pytest.mark.parametrize("parser, call", [("hermes", HERMES_CALL), ("llama3_json", LLAMA_CALL)])
def test_a_tool_name_a_json_string_must_escape_reads_back_as_itself(parser, call):
    """The tags write a name with '"' or '\\' as a JSON string holds it (vLLM's put it in raw, and
    the call the model then wrote read back as text): the call the tag allows is that tool's."""
    for name in ('say "hi"', "back\\slash"):
        body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": name, "parameters": CITY}}],
            "tool_choice": {"type": "function", "function": {"name": name}}})
        text = call.format(json.dumps(name)[1:-1], '{"city": "Oslo"}')
        assert accepts(grammar_of(parser, body), text)
        message, _ = tool_message(AutoToolText(parser, named=True), text, "stop")
        assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == \
            [(name, '{"city": "Oslo"}')]


def test_disable_any_whitespace_bounds_a_tags_json_at_the_server_too():
    """So that a Triton vLLM backend, which leaves a tag's whitespace free, gets it as `llm` does;
    a request's own disable_any_whitespace false keeps the tag as it is."""
    from inflight_client.openai_server.structured import Constraint, single
    tag = call_envelope("hermes", request(True, False, tool_choice="required"))
    sent = single([Constraint({"structural_tag": json.dumps(tag)}, "tool_choice")], disable_any_whitespace=True)
    contents = [t["content"] for t in json.loads(sent.structured_outputs["structural_tag"])["format"]["tags"]]
    assert contents and all(c["max_whitespace_cnt"] == 1 for c in contents)
    kept = single([Constraint({"structural_tag": json.dumps(tag), "disable_any_whitespace": False}, "tool_choice")],
                  disable_any_whitespace=True)
    assert json.loads(kept.structured_outputs["structural_tag"]) == tag

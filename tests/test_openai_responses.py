"""OpenAI's Responses API (POST /v1/responses) with the official `openai` SDK, against the OpenAI
server in front of a real tritonserver: a response is the chat completion of the same messages
(greedy: the same tokens), streamed as Responses events that add up to it, with function calls,
text formats, reasoning items, usage and the errors, each naming the field."""
import json

import httpx
import jsonschema
import openai
import pytest

from inflight.serving.launch import ServerProcess, make_repository
from inflight_client.openai_server.process import OpenAIServerProcess
from inflight_client.openai_server.schemas import ResponsesRequest

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import (SOURCE_PATH_ENV, assert_left_stream_cancelled, computed_tokens, openai_server,
                      reasoning_checkpoint, wait_for_metric)
from .test_openai import COLOR, MODEL, TOOLS, exact_regex

pytestmark = pytest.mark.server

# the test model's template, rendering what the Responses items become: an assistant's reasoning and
# calls, and a tool's result with its call id
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] | capitalize }}: {% if m.reasoning_content %}"
            "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m['content'] }}{% for call in m.tool_calls or [] %}"
            "[call {{ call.id }} {{ call.function.name }} {{ call.function.arguments | tojson }}]{% endfor %}"
            "{% if m.tool_call_id %} (for {{ m.tool_call_id }}){% endif %}{{ '\\n' }}{% endfor %}"
            "{% if add_generation_prompt %}Assistant:{% endif %}")
FLAT_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]      # the Responses API's form
PARAMETERS = {tool["name"]: tool["parameters"] for tool in FLAT_TOOLS}
ASK = "What is the weather in Oslo?"


@pytest.fixture(scope="module")
def api(server, tmp_path_factory):
    path = tmp_path_factory.mktemp("responses") / "template.jinja"
    path.write_text(TEMPLATE)
    # constrained JSON without free whitespace: the tiny random test model would fill its tokens with it
    with openai_server(server.http_url, path.parent, "--disable-any-whitespace", "--chat-template", str(path)) as s:
        yield s


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0)


def chat(client, messages, **kwargs):
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs)


def events_of(client, **kwargs) -> list:
    return list(client.responses.create(model=MODEL, stream=True, **kwargs))


def final_of(client, **kwargs):
    """The SDK's own accumulation of a stream into the final response."""
    with client.responses.stream(model=MODEL, **kwargs) as stream:
        return stream.get_final_response()


def test_a_response_is_the_chat_completion_of_the_same_messages(client):
    """Greedy, the same tokens: a string input is a user message, instructions a system message
    before it, and a list of items the conversation, text parts joined as chat joins them."""
    cases = [
        (dict(input=ASK), [{"role": "user", "content": ASK}]),
        (dict(input=ASK, instructions="Answer in French."),
         [{"role": "system", "content": "Answer in French."}, {"role": "user", "content": ASK}]),
        (dict(input=[{"role": "developer", "content": "Be brief."},
                     {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"},
                                                                    {"type": "input_text", "text": ASK}]},
                     {"type": "message", "role": "assistant", "id": "msg_1", "status": "completed",
                      "content": [{"type": "output_text", "text": "Cold.", "annotations": []}]},
                     {"role": "user", "content": "And in Lima?"}]),
         [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": f"Hi\n{ASK}"},
          {"role": "assistant", "content": "Cold."}, {"role": "user", "content": "And in Lima?"}])]
    for request, messages in cases:
        response = client.responses.create(model=MODEL, max_output_tokens=12, temperature=0, **request)
        completion = chat(client, messages, max_completion_tokens=12)
        assert response.id.startswith("resp_") and response.object == "response" and response.model == MODEL
        (message,) = response.output
        assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
        assert [part.type for part in message.content] == ["output_text"]
        assert response.output_text == completion.choices[0].message.content and response.output_text
        usage = response.usage
        assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == \
            (completion.usage.prompt_tokens, completion.usage.completion_tokens, completion.usage.total_tokens)
        assert usage.output_tokens_details.reasoning_tokens == 0
        # the request's fields echoed, the sampling as it ran
        assert (response.instructions, response.temperature, response.top_p, response.max_output_tokens,
                response.tool_choice, response.tools, response.parallel_tool_calls) == \
            (request.get("instructions"), 0.0, 1.0, 12, "none", [], True)


def test_usage_counts_the_input_tokens_found_in_the_prefix_cache(client):
    """input_tokens_details.cached_tokens (as vLLM's Responses usage): none the first time an input is
    seen, its whole blocks but the last token's the second time (llm's num_cached_tokens), streamed too."""
    text = "A question asked twice: " + " ".join(f"again{i}" for i in range(30))
    first = client.responses.create(model=MODEL, input=text, max_output_tokens=2)
    second = client.responses.create(model=MODEL, input=text, max_output_tokens=2)
    streamed = [e for e in events_of(client, input=text, max_output_tokens=2) if e.type == "response.completed"]
    assert first.usage.input_tokens_details.cached_tokens == 0
    expected = (first.usage.input_tokens - 1) // 16 * 16         # 16: the engine's block size
    assert expected >= 16 and second.usage.input_tokens_details.cached_tokens == expected
    assert streamed[0].response.usage.input_tokens_details.cached_tokens == expected


def test_streamed_deltas_add_up_to_the_response_and_the_sdks_stream_ends_with_it(client):
    kwargs = dict(input=ASK, max_output_tokens=20, temperature=0, metadata={"run": "7"})
    whole = client.responses.create(model=MODEL, **kwargs)
    events = events_of(client, **kwargs)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas > 1 and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                    "response.content_part.added"] + ["response.output_text.delta"] * deltas + [
        "response.output_text.done", "response.content_part.done", "response.output_item.done", "response.completed"]
    assert events[0].response.status == "in_progress" and events[0].response.output == []
    assert events[0].response.id == events[-1].response.id and events[0].response.metadata == {"run": "7"}
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2]) and events[-2].item.id == item_id
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-3].part.text == events[-1].response.output_text
    assert events[-1].response.status == whole.status and events[-1].response.usage == whole.usage
    final = final_of(client, **kwargs)
    assert final.output_text == whole.output_text and final.usage == whole.usage


def test_logprobs_come_with_the_output_text_as_chats(client):
    """include's message.output_text.logprobs with top_logprobs: each token's, as the chat
    completion's; in a stream each delta carries its own tokens', and the done part all of them."""
    kwargs = dict(input=ASK, max_output_tokens=12, temperature=0, include=["message.output_text.logprobs"],
                  top_logprobs=2)
    whole = client.responses.create(model=MODEL, **kwargs)
    completion = chat(client, [{"role": "user", "content": ASK}], max_completion_tokens=12, logprobs=True,
                      top_logprobs=2)
    expected = [(t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs])
                for t in completion.choices[0].logprobs.content]
    logprobs = whole.output[0].content[0].logprobs
    assert [(t.token, t.logprob, [(top.token, top.logprob) for top in t.top_logprobs]) for t in logprobs] == expected
    assert len(expected) == whole.usage.output_tokens and all(len(t.top_logprobs) == 2 for t in logprobs)
    events = events_of(client, **kwargs)
    streamed = [t.token for e in events if e.type == "response.output_text.delta" for t in e.logprobs]
    done = [e for e in events if e.type == "response.content_part.done"][0].part.logprobs
    assert streamed == [t.token for t in done][:len(streamed)] and [t.token for t in done] == [t[0] for t in expected]
    assert client.responses.create(model=MODEL, input=ASK, max_output_tokens=4).output[0].content[0].logprobs == []


def test_max_output_tokens_leaves_the_response_incomplete(client):
    kwargs = dict(input=ASK, max_output_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    whole = client.responses.create(model=MODEL, **kwargs)
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert whole.usage.output_tokens == 3 and whole.output[0].status == "incomplete"
    events = events_of(client, **kwargs)
    # as vLLM 0.32 sends it: response.completed, whose status says it was cut short
    assert events[-1].type == "response.completed" and events[-1].response.status == "incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == whole.output_text and events[-2].item.status == "incomplete"
    complete = client.responses.create(model=MODEL, input=ASK, max_output_tokens=400, temperature=0)
    assert complete.status == "completed" and complete.incomplete_details is None
    assert complete.usage.output_tokens < 400


@pytest.mark.parametrize("tool_choice", [{"type": "function", "name": "get_weather"}, "required"])
def test_a_forced_call_is_a_function_call_item_with_valid_arguments(client, tool_choice):
    kwargs = dict(input=ASK, tools=FLAT_TOOLS, tool_choice=tool_choice, max_output_tokens=200, temperature=0)
    whole = client.responses.create(model=MODEL, **kwargs)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and len(calls) == len(whole.output) and whole.status == "completed"
    for call in calls:
        assert call.call_id.startswith("call_") and call.id.startswith("fc_") and call.status == "completed"
        jsonschema.validate(json.loads(call.arguments), PARAMETERS[call.name])
    assert isinstance(tool_choice, str) or [call.name for call in calls] == ["get_weather"]
    assert whole.tool_choice == tool_choice or whole.tool_choice.name == "get_weather"
    events = events_of(client, **kwargs)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(c.name, c.arguments) for c in done] == [(c.name, c.arguments) for c in calls]
    for call in done:
        deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta"
                         and e.item_id == call.id)
        (finished,) = [e for e in events if e.type == "response.function_call_arguments.done" and e.item_id == call.id]
        assert deltas == finished.arguments == call.arguments and finished.name == call.name
    final = final_of(client, **kwargs)
    assert [(c.name, c.arguments) for c in final.output] == [(c.name, c.arguments) for c in calls]


def test_a_json_schema_text_format_is_followed(client):
    fmt = {"type": "json_schema", "name": "shirt", "schema": COLOR, "strict": True}
    for seed in range(3):
        kwargs = dict(input="Which shirt?", text={"format": fmt}, max_output_tokens=100, temperature=1.0,
                      extra_body={"seed": seed})
        whole = client.responses.create(model=MODEL, **kwargs)
        jsonschema.validate(json.loads(whole.output_text), COLOR)
        assert whole.text.format.name == "shirt"
        streamed = "".join(e.delta for e in events_of(client, **kwargs) if e.type == "response.output_text.delta")
        assert streamed == whole.output_text, "same seed, same text"
    anything = client.responses.create(model=MODEL, input="Which shirt?", text={"format": {"type": "json_object"}},
                                       max_output_tokens=400, temperature=1.0, extra_body={"seed": 1})
    assert isinstance(json.loads(anything.output_text), dict)


def test_an_earlier_replys_items_reach_the_template_as_its_chat_messages(client):
    """A reasoning item, a function_call and its function_call_output: one assistant turn with its
    reasoning and tool_calls, then a tool message, rendered exactly as the chat messages are."""
    arguments = '{"city": "Oslo", "unit": "C"}'
    items = [{"role": "user", "content": ASK},
             {"type": "reasoning", "id": "rs_1", "summary": [],
              "content": [{"type": "reasoning_text", "text": "Call the tool."}]},
             {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
              "arguments": arguments, "status": "completed"},
             {"type": "function_call_output", "call_id": "call_1", "output": "12 C"}]
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": None, "reasoning": "Call the tool.", "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]},
                {"role": "tool", "content": "12 C", "tool_call_id": "call_1"}]
    completion = chat(client, messages, max_completion_tokens=12, tools=TOOLS, tool_choice="none",
                      extra_body={"return_prompt_text": True})
    prompt = completion.model_extra["prompt_text"]
    assert f'<think>Call the tool.</think>[call call_1 get_weather {arguments}]\nTool: 12 C (for call_1)' in prompt
    response = client.responses.create(model=MODEL, input=items, tools=FLAT_TOOLS, tool_choice="none",
                                       max_output_tokens=12, temperature=0)
    assert response.usage.input_tokens == completion.usage.prompt_tokens
    assert response.output_text == completion.choices[0].message.content
    # an unfinished reply sent last is continued (vLLM's), as chat's continue_final_message
    unfinished = client.responses.create(model=MODEL, max_output_tokens=6, temperature=0, input=[
        {"role": "user", "content": ASK},
        {"type": "message", "role": "assistant", "status": "incomplete",
         "content": [{"type": "output_text", "text": "It is"}]}])
    continued = chat(client, [{"role": "user", "content": ASK}, {"role": "assistant", "content": "It is"}],
                     max_completion_tokens=6, extra_body={"continue_final_message": True})
    assert unfinished.output_text == continued.choices[0].message.content


def test_auto_tool_choice_reads_the_calls_the_model_writes(server, tmp_path):
    """With --enable-auto-tool-choice --tool-call-parser (what agent frameworks send: tools, no
    tool_choice), a call the model writes is a function_call item after the text before it."""
    reply = 'Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>'
    with openai_server(server.http_url, tmp_path, "--enable-auto-tool-choice", "--tool-call-parser", "hermes") as auto:
        auto_client = openai.OpenAI(base_url=auto.base_url, api_key="-", max_retries=0)
        kwargs = dict(input=ASK, tools=FLAT_TOOLS, max_output_tokens=150, temperature=0,
                      extra_body={"structured_outputs": {"regex": exact_regex(reply)}})
        for response in (auto_client.responses.create(model=MODEL, **kwargs), final_of(auto_client, **kwargs)):
            message, call = response.output
            assert message.content[0].text == "Sure. " and call.type == "function_call"
            assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Oslo", "unit": "C"})


def test_a_client_that_leaves_a_stream_has_its_request_cancelled(api, client, server):
    cancelled = server.metric("inflight_requests_total", finish_reason="cancelled")
    start = computed_tokens(server)
    stream = client.responses.create(model=MODEL, input=ASK, max_output_tokens=900, stream=True,
                                     extra_body={"ignore_eos": True})
    events = iter(stream)
    while next(events).type != "response.output_text.delta":
        pass
    assert_left_stream_cancelled(server, stream, cancelled, start)


BAD = [
    ({"model": "gpt-4", "input": "x"}, 404, "'gpt-4' does not exist", "model"),
    ({"input": "x", "temprature": 0}, 400, "'temprature': unknown parameter", "temprature"),
    ({"input": "x", "temperature": -1}, 400, "'temperature'", "temperature"),
    ({"input": []}, 400, "'input' must not be empty", "input"),
    ({"input": "x", "previous_response_id": "resp_1"}, 400, "'previous_response_id' is not supported (responses are "
     "not stored here, as in vLLM by default: send the conversation in 'input')", "previous_response_id"),
    ({"input": "x", "background": True}, 400, "'background' is not supported", "background"),
    ({"input": "x", "conversation": "conv_1"}, 400, "'conversation' is not supported", "conversation"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "'input[0].content[0]': Input tag 'input_image' found using 'type' does not match any of the expected tags: "
     "'input_text', 'output_text', 'refusal'", "input"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "web_search_call", "id": "ws_1"}]}, 400,
     "'input[1]': Input tag 'web_search_call'", "input"),
    ({"input": [{"role": "tool", "content": "x"}]}, 400, "'input[0].role': Input should be", "input"),
    ({"input": [{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "add",
                                                   "arguments": "{oops"}]}, 400,
     "'input[1].arguments' is not valid JSON", "input"),
    ({"input": [{"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}]}, 400,
     "'input[0].encrypted_content': this server makes no encrypted reasoning", "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, 400, "'tools[0].type': Input should be 'function'", "tools"),
    # no --tool-call-parser: "auto" (the default with tools) cannot find calls, as in chat
    ({"input": "x", "tools": FLAT_TOOLS}, 400, "needs a tool-call parser to find calls in free text: start this "
     "server with --enable-auto-tool-choice", "tool_choice"),
    ({"input": "x", "tools": FLAT_TOOLS, "tool_choice": "auto"}, 400,
     'or give \'tool_choice\' "required" or {"type": "function", "name": ...}', "tool_choice"),
    ({"input": "x", "tools": FLAT_TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, 400,
     "'tool_choice' names the function 'nope', which is not in 'tools' (get_weather, add)", "tool_choice"),
    ({"input": "x", "tool_choice": "required"}, 400, "'tool_choice' needs 'tools'", "tool_choice"),
    ({"input": "x", "tools": [*FLAT_TOOLS, {"type": "function", "name": "bad", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}], "tool_choice": {"type": "function",
                                                                                        "name": "bad"}}, 400,
     f"'tools[{len(FLAT_TOOLS)}].parameters' is not a valid JSON schema", "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, 400,
     "'text.format' of type 'json_schema' needs 'schema'", "text"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "foo"}}}}, 400,
     "'text.format.schema' is not a valid JSON schema", "text"),
    ({"input": "x", "text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a"}}, 400,
     "give at most one output constraint; got 'text.format', 'structured_outputs'", "structured_outputs"),
    ({"input": "x", "max_output_tokens": 0}, 400, "'max_output_tokens' must be", "max_output_tokens"),
    ({"input": "Lists " * 1100}, 400, "This model's maximum context length is 1024 tokens", "input"),
    ({"input": "x", "reasoning": {"effort": "huge"}}, 400, "'reasoning.effort': Input should be", "reasoning"),
    ({"input": "x", "include": ["everything"]}, 400, "'include[0]': Input should be", "include"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, 400,
     "'stream_options' can only be used when 'stream' is true", "stream_options"),
]


@pytest.mark.parametrize("body, status, message, param", BAD, ids=[b[2] for b in BAD])
def test_errors_name_the_field_as_the_request_wrote_it(api, body, status, message, param):
    reply = httpx.post(f"{api.base_url}/responses", json={"model": MODEL, **body}, timeout=60)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param, error


def test_every_field_with_a_wrong_value_is_answered_and_an_error_names_it(api, server):
    """As test_openai's for chat: never a 5xx, and an error naming the field."""
    fields = sorted({*ResponsesRequest.model_fields, *ResponsesRequest.UNSERVED} - {"stream"})
    with httpx.Client(timeout=120) as http:
        for field, value in ((f, v) for f in fields for v in ({"x": 1}, [[1]], "?", -1e30)):
            reply = http.post(f"{api.base_url}/responses", json={"model": MODEL, "input": "x",
                                                                 "max_output_tokens": 1, field: value})
            assert reply.status_code in (200, 400, 404), (field, value, reply.text)
            if reply.status_code != 200:
                error = reply.json()["error"]
                assert field == error["param"] or field in error["message"], (field, value, error)
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0


def test_a_stream_that_fails_after_its_first_event_ends_with_an_error_event():
    """A failure in mid-stream (a constraint `llm` finds no token for): an `error` event in the
    Responses shape, in sequence, naming the field as this request wrote it; a bug likewise, as an
    internal error without its traceback."""
    import asyncio

    from inflight_client.openai_server import responses
    from inflight_client.openai_server.chat_completions import ChatRun
    from inflight_client.openai_server.errors import APIError

    async def chunks(error: Exception):
        yield {"choices": [{"index": 0, "delta": {"content": "a"}, "logprobs": None, "finish_reason": None}]}
        raise error

    async def read(error: Exception) -> list[tuple[str, dict]]:
        run = ChatRun(None, chunks(error), {}, lambda e: e)
        parts = [part async for part in responses._stream({"id": "resp_1"}, run)]
        return [(part.split(b"\n")[0].decode(), json.loads(part.split(b"\n")[1][6:])) for part in parts]

    events = asyncio.run(read(APIError(400, "'response_format.json_schema.schema': no token allowed by the grammar",
                                       "response_format")))
    assert [name for name, _ in events] == ["event: response.created", "event: response.in_progress",
                                            "event: response.output_item.added", "event: response.content_part.added",
                                            "event: response.output_text.delta", "event: error"]
    assert events[-1][1] == {"type": "error", "code": 400, "param": "text", "sequence_number": 5,
                             "message": "'text.format.schema': no token allowed by the grammar"}
    bug = asyncio.run(read(TypeError("a bug")))[-1][1]
    assert (bug["code"], bug["message"]) == (500, "internal error: TypeError")


@pytest.fixture(scope="module")
def think_client(tmp_path_factory):
    """tritonserver with the reasoning model and the engine's reasoning_parser (which counts the
    reasoning tokens), and the OpenAI server with --reasoning-parser in front of it."""
    root = tmp_path_factory.mktemp("responses-reasoning")
    model = reasoning_checkpoint(str(root / "think-tiny"))
    repo = make_repository(str(root / "repository"), model, {**TEST_ENGINE, "reasoning_parser": "deepseek_r1"})
    with ServerProcess(repo) as server, OpenAIServerProcess(
            server.http_url, model, extra=["--reasoning-parser", "deepseek_r1"], env=SOURCE_PATH_ENV,
            log_path=str(root / "openai.log")) as api:
        yield openai.OpenAI(base_url=api.base_url, api_key="-", max_retries=0), model


def test_reasoning_comes_as_a_reasoning_item_before_the_message(think_client):
    """--reasoning-parser: the reply's reasoning is a reasoning item (its text as content), the
    answer after </think> the message; streamed as reasoning_text deltas, then the message's; the
    usage counts the reasoning tokens as chat's does. include_reasoning false leaves it out."""
    from transformers import AutoTokenizer
    client, model = think_client
    end = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("</think>")
    split = 0
    for seed in range(6):
        kwargs = dict(model="think-tiny", input="Which size?", max_output_tokens=40, temperature=1.0,
                      extra_body={"seed": seed, "logit_bias": {str(end): 8}})
        whole = client.responses.create(**kwargs)
        completion = client.chat.completions.create(model="think-tiny", messages=[
            {"role": "user", "content": "Which size?"}], max_completion_tokens=40, temperature=1.0, seed=seed,
            logit_bias={str(end): 8})
        message = completion.choices[0].message
        kinds = [item.type for item in whole.output]
        reasoning = message.model_extra["reasoning"]
        # a reply of nothing (the reasoning ended at once, then EOS) is an empty message
        assert kinds == ["reasoning"] * bool(reasoning) + ["message"] * bool(message.content) or ["message"]
        if reasoning:
            assert whole.output[0].content[0].text == reasoning and whole.output[0].id.startswith("rs_")
        assert whole.output_text == (message.content or "")
        assert whole.usage.output_tokens_details.reasoning_tokens == \
            completion.usage.completion_tokens_details.reasoning_tokens
        split += bool(reasoning and message.content)
        events = list(client.responses.create(stream=True, **kwargs))
        streamed = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
        assert streamed == (reasoning or "")
        assert events[-1].response.output_text == whole.output_text
        assert [item.type for item in events[-1].response.output] == kinds
        hidden = client.responses.create(**{**kwargs, "extra_body": {**kwargs["extra_body"],
                                                                     "include_reasoning": False}})
        assert [item.type for item in hidden.output] == ["message"] and hidden.output_text == whole.output_text
    assert split, "some replies reason, then answer"


def test_a_named_call_after_reasoning_streams_to_the_response_it_is_whole(think_client):
    """A named tool_choice with --reasoning-parser: the reasoning item comes first and the call after
    it, streamed as whole (the SDK's final response equal to it), though the chat stream names the
    call before the reasoning; where the reply was cut short the call is incomplete."""
    from transformers import AutoTokenizer
    client, model = think_client
    end = AutoTokenizer.from_pretrained(model).convert_tokens_to_ids("</think>")
    tools = [{"type": "function", "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}}, "required": ["city"]}}]
    answered = 0
    for seed, bias in [(0, 0), (1, 8), (2, 8)]:
        kwargs = dict(model="think-tiny", input="Weather in Oslo?", tools=tools, max_output_tokens=40,
                      tool_choice={"type": "function", "name": "get_weather"}, temperature=1.0,
                      extra_body={"seed": seed, "logit_bias": {str(end): bias}})
        whole = client.responses.create(**kwargs)
        with client.responses.stream(**kwargs) as stream:
            final = stream.get_final_response()
        assert items_of(final) == items_of(whole)
        assert [kind for kind, _, _ in items_of(whole)] in (["reasoning", "function_call"], ["function_call"])
        answered += whole.output[0].type == "reasoning" and bool(whole.output[-1].arguments)
    assert answered, "some replies reason, then call"


def test_a_required_array_cut_short_streams_to_the_response_it_is_whole(client):
    """"required" cut short by max_output_tokens after a complete call: the calls come first, then
    the text of the next call, not a call, as a message (chat's content), incomplete; streamed as whole."""
    from transformers import AutoTokenizer
    vocab = AutoTokenizer.from_pretrained(DEFAULT_MODEL).get_vocab()
    unclosed = {str(i): -100 for token, i in vocab.items() if "]" in token}       # a second call begins
    kwargs = dict(model=MODEL, input=ASK, tools=FLAT_TOOLS, tool_choice="required", max_output_tokens=60,
                  temperature=1.0, extra_body={"seed": 0, "logit_bias": unclosed})
    whole = client.responses.create(**kwargs)
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert items_of(final) == items_of(whole)
    assert [(kind, status) for kind, status, _ in items_of(whole)] == [("function_call", "completed"),
                                                                       ("message", "incomplete")]
    completion = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}], tools=TOOLS,
                                                tool_choice="required", max_completion_tokens=60, temperature=1.0,
                                                seed=0, logit_bias=unclosed)
    assert whole.output_text.startswith(",") and whole.output_text == completion.choices[0].message.content


def items_of(response) -> list[tuple]:
    return [(item.type, item.status, getattr(item, "arguments", None)) for item in response.output]

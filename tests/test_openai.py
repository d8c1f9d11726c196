"""The official `openai` SDK against the OpenAI-compatible server (a subprocess) in front of a real
tritonserver: completions and chat, streamed and not, token-array prompts, n > 1, stop strings,
seeds, logprobs, usage, 50 concurrent streams, a dropped stream's KV blocks, structured outputs
and tool calls, and every error status with its message."""
import asyncio
import concurrent.futures
import importlib.metadata
import json
import os
import re
import shutil
import socket
import time

import httpx
import jsonschema
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inflight import SamplingParams
from inflight.detokenizer import decode
from inflight.serving.launch import ServerProcess, make_repository
from inflight_client.openai_server.schemas import ChatCompletionRequest, CompletionRequest

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import (SOURCE_PATH_ENV, assert_left_stream_cancelled, computed_tokens, mistral_checkpoint, openai_server,
                      wait_for_metric)

pytestmark = pytest.mark.server

MODEL = os.path.basename(DEFAULT_MODEL)
ADAPTER = "pydoc-json"      # the demo LoRA adapter of the shipped repository (the session server serves it)
PROMPTS = ["The assert statement", "A class definition defines a class object", "Boolean operations",
           "The import system", "Exceptions can be raised", "The with statement is used"]


@pytest.fixture(scope="module")
def api(server, tmp_path_factory):
    # constrained JSON without free whitespace: the tiny random test model would fill max_tokens with it
    with openai_server(server.http_url, tmp_path_factory.mktemp("openai"), "--disable-any-whitespace",
                       "--lora-modules", ADAPTER, "--triton-metrics-url", server.metrics_url) as process:
        yield process


@pytest.fixture(scope="module")
def client(api):
    return openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0)


def reference(engine, tokenizer, prompts, max_tokens, **params) -> list[str]:
    ids = [p if isinstance(p, list) else tokenizer(p)["input_ids"] for p in prompts]
    outs = engine.generate(ids, SamplingParams(max_tokens=max_tokens, temperature=0, **params))
    return [decode(tokenizer, out.token_ids) for out in outs]


def chat_ids(tokenizer, messages) -> list[int]:
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(prompt, add_special_tokens=False)["input_ids"]


def test_models_and_health(api, client):
    listed = client.models.list().data
    assert [m.id for m in listed] == [MODEL, ADAPTER]
    with open(os.path.join(DEFAULT_MODEL, "config.json")) as f:
        context = json.load(f)["max_position_embeddings"]
    # vLLM's model card fields: the base's context length; an adapter names its parent and has none
    assert [(m.model_extra["max_model_len"], m.model_extra["parent"]) for m in listed] == [(context, None),
                                                                                          (None, MODEL)]
    assert client.models.retrieve(ADAPTER).model_dump() == listed[1].model_dump()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.models.retrieve("no-such-model")
    root = api.base_url.removesuffix("/v1")
    assert httpx.get(root + "/health").status_code == 200
    assert httpx.get(root + "/ping").status_code == httpx.post(root + "/ping").status_code == 200      # as vLLM's
    assert httpx.get(root + "/version").json() == {"version": importlib.metadata.version("inflight")}


def test_completions_streamed_and_not_equal_the_engine(client, reference_engine, tokenizer):
    expected = reference(reference_engine, tokenizer, PROMPTS[:1], 24)[0]
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0)
    assert whole.choices[0].text == expected and whole.choices[0].finish_reason == "length"
    n_prompt = len(tokenizer(PROMPTS[0])["input_ids"])
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (n_prompt, 24)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
    assert len([c for c in chunks if c.choices]) > 1, "one chunk per delta"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == n_prompt
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, echo=True)
    assert echoed.choices[0].text == PROMPTS[0] + expected


def test_a_stream_has_a_chunk_per_token_even_inside_a_character(client, tokenizer):
    """As vLLM's server: every generated token gets its chunk, with empty text while a multi-byte
    character is incomplete, so a client timing chunks sees the engine's pace. "你好" is six byte
    tokens in the shipped vocabulary. With vLLM's `continuous_usage_stats` each chunk says its
    choice's usage so far."""
    constraint = {"structured_outputs": {"choice": ["你好"]}}
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=16, temperature=0,
                                            stream=True, stream_options=options, extra_body=constraint))
    texts = [c.choices[0].text for c in chunks if c.choices]
    assert "".join(texts) == "你好" and "" in texts
    assert len(texts) == chunks[-1].usage.completion_tokens
    assert [c.usage.completion_tokens for c in chunks if c.choices] == list(range(1, len(texts) + 1))
    assert {c.usage.prompt_tokens for c in chunks} == {len(tokenizer(PROMPTS[2])["input_ids"])}
    chat = list(client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=16, stream=True,
                                               stream_options=options, extra_body=constraint))
    deltas = [c.choices[0].delta.content for c in chat if c.choices][1:]      # after the role's chunk
    assert "".join(deltas) == "你好" and "" in deltas
    assert len(deltas) == chat[-1].usage.completion_tokens
    assert [c.usage.completion_tokens for c in chat if c.choices] == list(range(len(deltas) + 1))
    plain = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=4, stream=True,
                                           stream_options={"include_usage": True}))
    assert [c.usage for c in plain[:-1]] == [None] * (len(plain) - 1), "usage only at the end by default"


def test_penalties_logit_bias_and_min_p_reach_the_engine(client, reference_engine, tokenizer):
    penalties = {"repetition_penalty": 1.8, "frequency_penalty": 0.5, "presence_penalty": 0.3}
    expected = reference(reference_engine, tokenizer, PROMPTS[3:4], 24, **penalties)[0]
    assert expected != reference(reference_engine, tokenizer, PROMPTS[3:4], 24)[0]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=24, temperature=0,
                                    frequency_penalty=0.5, presence_penalty=0.3,
                                    extra_body={"repetition_penalty": 1.8})
    assert got.choices[0].text == expected
    forced = tokenizer(" class", add_special_tokens=False)["input_ids"]
    assert len(forced) == 1
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_completion_tokens=5, temperature=0,
                                          logit_bias={str(forced[0]): 100})
    assert chat.choices[0].message.content == " class" * 5
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=0)
    certain = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=16, temperature=1, seed=3,
                                        extra_body={"min_p": 1.0})
    assert certain.choices[0].text == greedy.choices[0].text


def test_token_array_prompts_and_lists_of_prompts(client, reference_engine, tokenizer):
    ids = [tokenizer(p)["input_ids"] for p in PROMPTS[:3]]
    expected = reference(reference_engine, tokenizer, ids, 12)
    one = client.completions.create(model=MODEL, prompt=ids[0], max_tokens=12, temperature=0)
    assert one.choices[0].text == expected[0]
    many = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(many.choices, key=lambda c: c.index)] == expected
    texts = client.completions.create(model=MODEL, prompt=PROMPTS[:3], max_tokens=12, temperature=0, stream=True)
    streamed = [""] * 3
    for chunk in texts:
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == expected
    assert many.usage.prompt_tokens == sum(map(len, ids)) and many.usage.completion_tokens == 36


def test_chat_streamed_and_not_with_the_checkpoints_template(client, reference_engine, tokenizer):
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is a tuple?"}]
    expected = reference(reference_engine, tokenizer, [chat_ids(tokenizer, messages)], 20)[0]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=20, temperature=0)
    assert whole.choices[0].message.role == "assistant" and whole.choices[0].message.content == expected
    assert whole.usage.completion_tokens == 20
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content == ""
    content = [c.choices[0].delta.content for c in chunks[1:] if c.choices]
    assert "".join(content) == expected and len(content) > 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens


def test_json_null_is_a_fields_default(api, client):
    """Clients that serialize every field send null for the ones they leave unset (OpenAI's types
    are "boolean or null", "integer or null")."""
    messages = [{"role": "user", "content": "What is a tuple?"}]
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    nulls = {"logprobs": None, "top_logprobs": None, "stream": None, "n": None, "echo": None, "stop": None,
             "add_generation_prompt": None, "tools": None, "stream_options": None, "user": None}
    reply = httpx.post(f"{api.base_url}/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 6, "temperature": 0, **nulls}).json()
    assert [c["message"]["content"] for c in reply["choices"]] == [plain.choices[0].message.content]
    assert reply["choices"][0]["logprobs"] is None
    assert reply["choices"][0]["message"]["refusal"] is None, "a field of every message in OpenAI's schema"
    prompt = httpx.post(f"{api.base_url}/completions", timeout=60, json={
        "model": MODEL, "prompt": "x", "max_tokens": 2, "echo": None, "logprobs": None, "n": None}).json()
    assert len(prompt["choices"]) == 1 and prompt["choices"][0]["logprobs"] is None


def test_chat_top_logprobs_are_the_most_likely_at_a_tie():
    """The sampled token's rank counts the tokens tied with it (vLLM's rule), so at a tie for first
    it is 2; top_logprobs 1 still lists it (the N most likely, as OpenAI defines them)."""
    from inflight_client.openai_server.logprobs import chat_logprobs
    tied = {"5": {"logprob": -0.69, "rank": 2, "decoded_token": "a"},
            "9": {"logprob": -0.69, "rank": 2, "decoded_token": "b"},
            "7": {"logprob": -3.0, "rank": 3, "decoded_token": "c"}}
    (content,) = chat_logprobs([tied], 1)["content"]
    assert content["token"] == "a" and [t["token"] for t in content["top_logprobs"]] == ["a"]
    assert [t["token"] for t in chat_logprobs([tied], 3)["content"][0]["top_logprobs"]] == ["a", "b", "c"]
    unlikely = {"7": {"logprob": -3.0, "rank": 3, "decoded_token": "c"},
                "5": {"logprob": -0.5, "rank": 1, "decoded_token": "a"},
                "9": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}}
    (content,) = chat_logprobs([unlikely], 2)["content"]
    assert content["token"] == "c" and [t["token"] for t in content["top_logprobs"]] == ["a", "b"]


def test_vllm_chat_template_fields(api, client, reference_engine, tokenizer):
    """continue_final_message (an assistant prefill the model continues), add_generation_prompt,
    add_special_tokens, and chat_template_kwargs, as vLLM passes them to the template."""
    messages = [{"role": "user", "content": "What is a tuple?"}, {"role": "assistant", "content": "A tuple is"}]
    open_ended = tokenizer.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert open_ended.endswith("Assistant: A tuple is")
    ids = tokenizer(open_ended, add_special_tokens=False)["input_ids"]
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                           extra_body={"continue_final_message": True, "return_token_ids": True})
    assert reply.model_extra["prompt_token_ids"] == ids
    assert reply.choices[0].message.content == reference(reference_engine, tokenizer, [ids], 8)[0]
    continued = "A tuple is" + reply.choices[0].message.content
    echoed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, n=2,
                                            extra_body={"continue_final_message": True, "echo": True})
    assert [c.message.content for c in echoed.choices] == [continued] * 2, "echo: the prefill, then its continuation"
    streamed = ["", ""]
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0, n=2,
                                                stream=True, extra_body={"continue_final_message": True, "echo": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == [continued] * 2
    counted = httpx.post(api.base_url.removesuffix("/v1") + "/tokenize",
                         json={"messages": messages, "continue_final_message": True,
                               "add_generation_prompt": False}).json()
    assert counted["tokens"] == ids
    plain = [{"role": "user", "content": "What is a tuple?"}]
    bare = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=1, extra_body={
        "add_generation_prompt": False, "add_special_tokens": True, "chat_template_kwargs": {"unused_flag": 1},
        "return_token_ids": True})
    rendered = tokenizer.apply_chat_template(plain, tokenize=False, add_generation_prompt=False)
    assert bare.model_extra["prompt_token_ids"] == tokenizer(rendered)["input_ids"], "the BOS added once more"
    # no generation prompt: the reply continues the last turn, in its role (vLLM's), and echo repeats it
    assert bare.choices[0].message.role == "user"
    kept = client.chat.completions.create(model=MODEL, messages=plain, max_tokens=4, temperature=0, extra_body={
        "add_generation_prompt": False, "echo": True})
    assert kept.choices[0].message.role == "user" and kept.choices[0].message.content.startswith("What is a tuple?")
    # text parts of every kind OpenAI's messages carry (a refusal in an assistant's history, the
    # Responses API's input_text / output_text, a bare string) render as the same text joined
    parts = [{"role": "user", "content": [{"type": "input_text", "text": "What is"}, "a tuple?"]},
             {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't"},
                                               {"type": "output_text", "text": "say."}]}]
    joined = [{"role": "user", "content": "What is\na tuple?"}, {"role": "assistant", "content": "I can't\nsay."}]
    as_parts, as_text = (client.chat.completions.create(model=MODEL, messages=m, max_tokens=1, extra_body={
        "return_token_ids": True}).model_extra["prompt_token_ids"] for m in (parts, joined))
    assert as_parts == as_text
    for extra, field in [({"continue_final_message": True, "add_generation_prompt": True}, "continue_final_message"),
                         ({"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs")]:
        with pytest.raises(openai.BadRequestError) as error:
            client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body=extra)
        assert error.value.body["param"] == field
    wrong_form = httpx.post(api.base_url.removesuffix("/v1") + "/tokenize",
                            json={"prompt": "x", "continue_final_message": True})
    assert wrong_form.status_code == 400 and wrong_form.json()["error"]["param"] == "continue_final_message"


def test_enable_prompt_tokens_details_reports_the_prompts_cached_tokens(server, client, tmp_path):
    """vLLM's --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens, the prompt
    tokens `llm` found in its prefix cache (whole blocks; none the first time), whole and streamed,
    chat and completions; without the flag the usage has no such field."""
    words = " ".join(f"seen{i}" for i in range(30))
    messages = [{"role": "user", "content": f"Twice: {words}"}]
    with openai_server(server.http_url, tmp_path, "--enable-prompt-tokens-details") as other:
        detailed = openai.OpenAI(base_url=other.base_url, api_key="-")
        first = detailed.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        second = detailed.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        chunks = list(detailed.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                       stream_options={"include_usage": True}))
        text = detailed.completions.create(model=MODEL, prompt=f"Twice too: {words}", max_tokens=2)
        again = list(detailed.completions.create(model=MODEL, prompt=f"Twice too: {words}", max_tokens=2,
                                                 stream=True, stream_options={"include_usage": True}))
    expected = (first.usage.prompt_tokens - 1) // 16 * 16        # 16: the engine's block size
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and expected >= 16
    assert second.usage.prompt_tokens_details.cached_tokens == chunks[-1].usage.prompt_tokens_details.cached_tokens \
        == expected
    assert text.usage.prompt_tokens_details.cached_tokens == 0
    assert again[-1].usage.prompt_tokens_details.cached_tokens == (text.usage.prompt_tokens - 1) // 16 * 16
    assert client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2).usage.prompt_tokens_details \
        is None


def test_a_chat_template_file_overrides_the_checkpoints(server, tmp_path, reference_engine, tokenizer):
    template = tmp_path / "chat.jinja"
    template.write_text("{{ bos_token }}{% for t in tools or [] %}[{{ t['function']['name'] }}]{% endfor %}"
                        "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }} "
                        "{% for c in m.get('tool_calls', []) %}{{ c['function']['arguments'] | tojson }} {% endfor %}"
                        "{% endfor %}{% if brief %}(brief) {% endif %}"
                        "{% if reasoning_effort %}[{{ reasoning_effort }} {{ enable_thinking }}]{% endif %}")
    messages = [{"role": "user", "content": "Lists"}]
    ids = tokenizer("<s><user> Lists ", add_special_tokens=False)["input_ids"]
    with_tools = tokenizer("<s>[get_weather][add]<user> Lists ", add_special_tokens=False)["input_ids"]
    with openai_server(server.http_url, tmp_path, "--chat-template", str(template),
                       "--trust-request-chat-template") as other:
        other_client = openai.OpenAI(base_url=other.base_url, api_key="-")
        reply = other_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        # a request's own template, which this server trusts
        own = other_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, extra_body={
            "chat_template": "{{ bos_token }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}",
            "return_token_ids": True})
        # tool_choice "none": the tools only reach the template
        tooled = other_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                      tools=TOOLS, tool_choice="none")
        # an explicit null with tools: vLLM generates text, as "none" does (not "auto"'s 400)
        nulled = other_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                      tools=TOOLS, extra_body={"tool_choice": None})
        brief = other_client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                     extra_body={"chat_template_kwargs": {"brief": True}})
        # an assistant's tool call as OpenAI sends it back (arguments a JSON string): the template
        # gets the arguments as an object (vLLM's way), so `tojson` writes them once, not as a string
        call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
        history = [*messages, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "call_1", "content": "3"}]
        called = other_client.chat.completions.create(model=MODEL, messages=history, max_tokens=1,
                                                      extra_body={"return_token_ids": True})
        root = other.base_url.removesuffix("/v1")
        # a template that knows no 'developer' role gets it as 'system', as vLLM hands it over;
        # reasoning_effort is a template variable, with enable_thinking = (effort != "none")
        developer = httpx.post(f"{root}/tokenize", json={"messages": [{"role": "developer", "content": "Be brief"},
                                                                      *messages]}).json()["tokens"]
        efforts = [httpx.post(f"{root}/tokenize", json={"messages": messages, "reasoning_effort": effort}).json()
                   ["tokens"] for effort in ("low", "none")]
        broken = {**call, "function": {"name": "add", "arguments": "{a: 1"}}
        with pytest.raises(openai.BadRequestError, match=r"'messages\[1\].tool_calls\[0\].function.arguments' is "
                                                         "not valid JSON"):
            other_client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
                *messages, {"role": "assistant", "content": None, "tool_calls": [broken]}])
    rendered = tokenizer('<s><user> Lists <assistant>  {"a": 1, "b": 2} <tool> 3 ', add_special_tokens=False)
    assert called.model_extra["prompt_token_ids"] == rendered["input_ids"]
    assert own.model_extra["prompt_token_ids"] == tokenizer("<s>[Lists]", add_special_tokens=False)["input_ids"]
    assert reply.choices[0].message.content == reference(reference_engine, tokenizer, [ids], 8)[0]
    briefly = tokenizer("<s><user> Lists (brief) ", add_special_tokens=False)["input_ids"]
    assert brief.choices[0].message.content == reference(reference_engine, tokenizer, [briefly], 8)[0]
    assert tooled.choices[0].message.content == reference(reference_engine, tokenizer, [with_tools], 8)[0]
    assert tooled.choices[0].message.tool_calls is None
    assert (nulled.choices[0].message.content, nulled.choices[0].message.tool_calls) == (
        tooled.choices[0].message.content, None)
    assert developer == tokenizer("<s><system> Be brief <user> Lists ", add_special_tokens=False)["input_ids"]
    assert efforts == [tokenizer(f"<s><user> Lists [{effort}]", add_special_tokens=False)["input_ids"]
                       for effort in ("low True", "none False")]


def test_the_checkpoints_generation_config_sets_the_defaults_of_fields_a_request_leaves_out(
        server, tmp_path, reference_engine, tokenizer, caplog):
    """vLLM's --generation-config auto (its default): generation_config.json's sampling keys are the
    defaults of requests that leave them out, and its max_new_tokens a chat's default max_tokens (a
    completion's stays 16, as in vLLM); a request's own value wins. --generation-config vllm
    ignores them. (The shipped model's generation_config.json sets none: only its token ids.)"""
    from inflight_client.openai_server.cli import parse_args
    from inflight_client.openai_server.generation_config import diff_sampling_params, sampling_defaults
    checkpoint = tmp_path / "checkpoint"        # the tokenizer and config, with sampling defaults
    checkpoint.mkdir()
    for name in os.listdir(DEFAULT_MODEL):
        if name.endswith(".json"):
            shutil.copy(os.path.join(DEFAULT_MODEL, name), checkpoint)
    config = json.loads((checkpoint / "generation_config.json").read_text())
    assert not diff_sampling_params(config), "the shipped model sets no sampling defaults"
    (checkpoint / "generation_config.json").write_text(json.dumps(
        {**config, "do_sample": True, "temperature": 0.0, "repetition_penalty": 1.8, "max_new_tokens": 5}))
    with caplog.at_level("WARNING", logger="inflight.openai"):
        assert sampling_defaults(str(checkpoint)) == {"temperature": 0.0, "repetition_penalty": 1.8, "max_tokens": 5}
    assert "generation_config.json" in caplog.text and "--generation-config vllm" in caplog.text
    assert sampling_defaults(str(checkpoint), "vllm") == {}
    assert parse_args(["--model-dir", str(checkpoint), "--generation-config", "vllm"])[0].generation_config == "vllm"
    assert diff_sampling_params({"top_k": 20, "min_p": None, "do_sample": True, "eos_token_id": 2}) == {"top_k": 20}
    messages = [{"role": "user", "content": PROMPTS[4]}]
    ids = chat_ids(tokenizer, messages)
    with openai_server(server.http_url, tmp_path, "--model-dir", str(checkpoint), "--served-model-name",
                       MODEL) as other:
        other_client = openai.OpenAI(base_url=other.base_url, api_key="-")
        chat = other_client.chat.completions.create(model=MODEL, messages=messages)
        own = other_client.completions.create(model=MODEL, prompt=PROMPTS[4], extra_body={"repetition_penalty": 1.0})
        completion = other_client.completions.create(model=MODEL, prompt=PROMPTS[4])
    assert chat.choices[0].message.content == reference(reference_engine, tokenizer, [ids], 5,
                                                        repetition_penalty=1.8)[0]
    assert chat.usage.completion_tokens <= 5
    penalized, plain = (reference(reference_engine, tokenizer, PROMPTS[4:5], 16, repetition_penalty=penalty)[0]
                        for penalty in (1.8, 1.0))
    assert penalized != plain, "the penalty changes this output"
    assert (completion.choices[0].text, own.choices[0].text) == (penalized, plain)


def test_api_keys_guard_every_route_but_the_probes_and_priority_can_be_refused(server, tmp_path, monkeypatch):
    """vLLM's --api-key: any of the keys, as a Bearer token; a wrong or missing one is a 401 the
    SDK raises as AuthenticationError; probes answer without one; INFLIGHT_API_KEY when no flag.
    --no-request-priority: a priority other than normal is a 400 naming it, as vLLM's server
    without priority scheduling answers, so clients cannot preempt each other."""
    from inflight_client.openai_server.cli import parse_args
    monkeypatch.setenv("INFLIGHT_API_KEY", "from-env")
    assert parse_args(["--model-dir", DEFAULT_MODEL])[0].api_keys == ("from-env",)
    assert parse_args(["--model-dir", DEFAULT_MODEL, "--api-key", "a"])[0].api_keys == ("a",)
    monkeypatch.delenv("INFLIGHT_API_KEY")
    assert parse_args(["--model-dir", DEFAULT_MODEL])[0].api_keys == ()
    with openai_server(server.http_url, tmp_path, "--api-key", "first-key", "--api-key", "second-key",
                       "--no-request-priority", "--triton-metrics-url", "http://127.0.0.1:9/metrics") as keyed:
        for key in ("first-key", "second-key"):
            keyed_client = openai.OpenAI(base_url=keyed.base_url, api_key=key, max_retries=0)
            assert keyed_client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2).usage.completion_tokens
            assert "".join(c.choices[0].text for c in keyed_client.completions.create(
                model=MODEL, prompt=PROMPTS[0], max_tokens=2, stream=True))
        for key in ("wrong", "first-keyx", ""):
            with pytest.raises(openai.AuthenticationError, match="Incorrect API key provided"):
                openai.OpenAI(base_url=keyed.base_url, api_key=key or "-", max_retries=0).models.list()
        root = keyed.base_url.removesuffix("/v1")
        assert httpx.post(root + "/tokenize", json={"prompt": "x"}).status_code == 401
        assert httpx.get(keyed.base_url + "/models", headers={"Authorization": "Basic first-key"}).status_code == 401
        assert [httpx.get(root + path).status_code for path in ("/health", "/ping", "/version")] == [200] * 3
        # /metrics is open too, as vLLM leaves it for scrapers; Triton's metrics unreadable: a 503 naming them
        metrics = httpx.get(root + "/metrics")
        assert metrics.status_code == 503 and "Triton's metrics at http://127.0.0.1:9/metrics cannot be read" \
            in metrics.json()["error"]["message"]
        keyed_client = openai.OpenAI(base_url=keyed.base_url, api_key="first-key", max_retries=0)
        for priority in ("normal", 0):
            assert keyed_client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1,
                                                   extra_body={"priority": priority}).choices
        for priority in ("high", -5):
            with pytest.raises(openai.BadRequestError, match="this server runs every request at normal priority"):
                keyed_client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}],
                                                     max_tokens=1, extra_body={"priority": priority})


def test_n_seeds_and_stop_strings(client, reference_engine, tokenizer):
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=16, temperature=1.0, seed=7)
    first = client.completions.create(n=3, **kwargs)
    again = client.completions.create(n=3, **kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)], "same seed, same texts"
    assert len(set(texts)) > 1, "the n outputs differ (seed + index)"
    assert first.usage.completion_tokens == 48
    streamed = ["", "", ""]
    for chunk in client.completions.create(n=3, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    assert streamed == texts
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], n=2,
                                          max_tokens=8, seed=3)
    assert len(chat.choices) == 2 and chat.usage.completion_tokens == 16
    full = reference(reference_engine, tokenizer, PROMPTS[2:3], 30)[0]
    stop = full[10:13]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=[stop])
    assert cut.choices[0].text == full[:full.index(stop)] and cut.choices[0].finish_reason == "stop"
    kept = list(client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=30, temperature=0, stop=stop,
                                          stream=True, extra_body={"include_stop_str_in_output": True}))
    assert "".join(c.choices[0].text for c in kept) == full[:full.index(stop) + len(stop)]
    # vLLM's stop_reason: the stop string, or the stop token's id; null for a length limit
    assert cut.choices[0].model_extra["stop_reason"] == stop
    assert [c.choices[0].model_extra.get("stop_reason") for c in kept if c.choices[0].finish_reason] == [stop]
    assert chat.choices[0].model_extra["stop_reason"] is None
    ask = [{"role": "user", "content": PROMPTS[2]}]
    ids = reference_engine.generate([chat_ids(tokenizer, ask)], SamplingParams(max_tokens=8, temperature=0,
                                                                               ignore_eos=True))[0].token_ids
    token = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    for stream in (False, True):
        reply = client.chat.completions.create(model=MODEL, messages=ask, max_tokens=30, temperature=0, stream=stream,
                                               extra_body={"stop_token_ids": [token], "ignore_eos": True})
        ends = [c.choices[0] for c in reply if c.choices and c.choices[0].finish_reason] if stream else reply.choices
        assert [(c.finish_reason, c.model_extra["stop_reason"]) for c in ends] == [("stop", token)]


def test_with_n_each_streamed_choice_ends_once(client):
    """Outputs of one request that end at different steps: each choice's finish_reason comes in
    exactly one chunk, its last (`llm` repeats an ended output's reason in later responses)."""
    kwargs = dict(model=MODEL, n=3, max_tokens=40, temperature=1.0, seed=5, stop=[" "], stream=True)
    for chunks in (list(client.completions.create(prompt=PROMPTS[0], **kwargs)),
                   list(client.chat.completions.create(messages=[{"role": "user", "content": PROMPTS[0]}], **kwargs))):
        ends = {}
        for position, chunk in enumerate(chunks):
            for choice in chunk.choices:
                assert choice.index not in ends, "a chunk after the choice's end"
                if choice.finish_reason is not None:
                    ends[choice.index] = position
        assert sorted(ends) == [0, 1, 2] and len(set(ends.values())) > 1, ends
    usage = [c.usage for c in client.completions.create(prompt=PROMPTS[0], stream_options={
        "continuous_usage_stats": True}, **{**kwargs, "n": 1})]
    # vLLM 0.32: include_usage defaults to false, and continuous usage needs it, so none at all
    assert usage and all(u is None for u in usage), "continuous_usage_stats alone gives no usage"


def test_logprobs_in_both_shapes(client, reference_engine, tokenizer):
    ids = tokenizer(PROMPTS[3])["input_ids"]
    ref = reference_engine.generate([ids], SamplingParams(max_tokens=6, temperature=0, logprobs=3))[0]
    sampled = [entry[t].logprob for t, entry in zip(ref.token_ids, ref.logprobs)]
    tokens = [tokenizer.decode([t]) for t in ref.token_ids]
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=3)
    lp = whole.choices[0].logprobs
    assert lp.tokens == tokens and lp.token_logprobs == pytest.approx(sampled, abs=1e-9)
    assert [len(top) for top in lp.top_logprobs] == [3] * 6       # greedy: the sampled token is the top one
    assert lp.text_offset == [sum(map(len, tokens[:i])) for i in range(6)]
    streamed = [c.choices[0].logprobs for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=3, stream=True)]
    assert sum((s.token_logprobs for s in streamed), []) == lp.token_logprobs
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    messages = [{"role": "user", "content": PROMPTS[3]}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                          logprobs=True, top_logprobs=2)
    content = chat.choices[0].logprobs.content
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob and c.bytes == list(c.token.encode())
    plain = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0)
    assert plain.choices[0].logprobs is None
    # vLLM's return_tokens_as_token_ids: the same tokens, named by id
    ids_shown = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=6, temperature=0, logprobs=3,
                                          extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert ids_shown.tokens == [f"token_id:{t}" for t in ref.token_ids]
    assert ids_shown.token_logprobs == lp.token_logprobs
    assert all(len(top) == 3 and all(key.startswith("token_id:") for key in top) for top in ids_shown.top_logprobs)
    chat_ids_shown = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0,
                                                    logprobs=True, extra_body={"return_tokens_as_token_ids": True})
    shown = chat_ids_shown.choices[0].logprobs.content
    assert all(c.token.startswith("token_id:") for c in shown)
    assert [tokenizer.decode([int(c.token.removeprefix("token_id:"))]) for c in shown] == [c.token for c in content]
    # as vLLM's: a sampled token's bytes are those of its text, not of "token_id:<id>"
    assert [c.bytes for c in shown] == [c.bytes for c in content]


def test_echo_with_logprobs_scores_the_prompt_as_lm_eval_reads_it(client, reference_engine, tokenizer):
    """lm-evaluation-harness's loglikelihood request (local-completions: token ids, echo, logprobs
    1, max_tokens 1, temperature 0) reads token_logprobs[ctxlen:-1] and top_logprobs for each
    continuation token: the prompt's own log-probabilities, the first null (no context)."""
    ids = tokenizer(PROMPTS[1])["input_ids"]
    ref = reference_engine.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=1,
                                                          prompt_logprobs=1))[0]
    prompt_values = [entry[t].logprob for t, entry in zip(ids[1:], ref.prompt_logprobs[1:])]
    greedy = [entry[t].rank == 1 for t, entry in zip(ids[1:], ref.prompt_logprobs[1:])]
    assert sum(greedy) < len(greedy), "some prompt token is not the model's first choice"
    tokens = [tokenizer.decode([t]) for t in ids + ref.token_ids]
    for prompt in (ids, PROMPTS[1]):
        whole = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=1, max_tokens=1,
                                          temperature=0)
        choice = whole.choices[0]
        lp = choice.logprobs
        # a token prompt is echoed with its special tokens, as vLLM echoes it (and as its tokens read)
        assert choice.text == ("<s>" if prompt is ids else "") + PROMPTS[1] + tokenizer.decode(ref.token_ids)
        assert lp.tokens == tokens and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:-1] == pytest.approx(prompt_values, abs=1e-9)
        assert lp.token_logprobs[-1] == pytest.approx(ref.logprobs[0][ref.token_ids[0]].logprob, abs=1e-9)
        assert lp.text_offset == [sum(map(len, tokens[:i])) for i in range(len(tokens))]
        # lm-eval's is_greedy: each token is its position's most likely one
        assert [tokens[i] == max(lp.top_logprobs[i], key=lp.top_logprobs[i].get)
                for i in range(1, len(ids))] == greedy
    only = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=0, max_tokens=0, temperature=0)
    assert only.choices[0].text == "<s>" + PROMPTS[1] and only.choices[0].logprobs.tokens == tokens[:-1]
    assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(prompt_values, abs=1e-9)
    # vLLM's rule: the prompt is scored at a request's own prompt_logprobs, and each echoed position
    # keeps at most logprobs + 1 entries (the prompt token first), wider or narrower
    for asked, logprobs, most in ((5, 1, 2), (0, 3, 1)):
        scored = client.completions.create(model=MODEL, prompt=ids, echo=True, logprobs=logprobs, max_tokens=1,
                                           temperature=0, extra_body={"prompt_logprobs": asked}).choices[0]
        tops = scored.logprobs.top_logprobs[1:len(ids)]
        assert all(next(iter(top)) == tokens[i] for i, top in enumerate(tops, start=1))
        assert max(map(len, tops)) == most and len(scored.logprobs.top_logprobs[-1]) <= logprobs + 1
        assert scored.logprobs.token_logprobs[1:len(ids)] == pytest.approx(prompt_values, abs=1e-9)
        assert {len(entry) for entry in scored.model_extra["prompt_logprobs"][1:]} <= {asked, asked + 1}
    streamed = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[1], echo=True, logprobs=1, max_tokens=4, temperature=0, stream=True)]
    assert sum((c.logprobs.tokens for c in streamed), [])[:len(ids)] == tokens[:-1]
    streamed_tokens = sum((c.logprobs.tokens for c in streamed), [])
    assert sum((c.logprobs.text_offset for c in streamed), []) == [sum(map(len, streamed_tokens[:i]))
                                                                   for i in range(len(streamed_tokens))]
    assert sum((c.logprobs.token_logprobs for c in streamed), [])[1:len(ids)] == pytest.approx(prompt_values,
                                                                                              abs=1e-9)
    # n > 1: a choice's first chunk can come in a later response than its prompt's scores (more
    # outputs than max_num_seqs start in a later step, and an empty prompt echoes no text to send
    # before them); each is still echoed with them
    n = TEST_ENGINE["max_num_seqs"] + 2
    chunks = list(client.completions.create(model=MODEL, prompt="", echo=True, logprobs=1, max_tokens=2, n=n,
                                            temperature=0, stream=True))
    firsts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.logprobs.tokens)
    assert sorted(firsts) == list(range(n)) and all(tokens[0] == "<s>" for tokens in firsts.values())
    vllm_field = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=2, temperature=0, n=2,
                                           extra_body={"prompt_logprobs": 2})
    for choice in vllm_field.choices:
        got = choice.model_extra["prompt_logprobs"]
        assert got[0] is None and len(got) == len(ids) and choice.logprobs is None
        assert [entry[str(t)]["logprob"] for t, entry in zip(ids[1:], got[1:])] == pytest.approx(prompt_values,
                                                                                                  abs=1e-9)
        assert all(next(iter(entry)) == str(t) and len(entry) in (2, 3) for t, entry in zip(ids[1:], got[1:]))
    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          extra_body={"prompt_logprobs": 0})
    chat_prompt = chat_ids(tokenizer, messages)
    ref = reference_engine.generate([chat_prompt], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    got = chat.model_extra["prompt_logprobs"]
    assert got[0] is None and len(got) == len(chat_prompt)
    assert [entry[str(t)]["logprob"] for t, entry in zip(chat_prompt[1:], got[1:])] == pytest.approx(
        [entry[t].logprob for t, entry in zip(chat_prompt[1:], ref.prompt_logprobs[1:])], abs=1e-9)


def test_return_token_ids_as_vllm(client, reference_engine, tokenizer):
    """vLLM's `return_token_ids`: each choice's prompt_token_ids and token_ids (a stream: the prompt's
    in a choice's first chunk, each delta's own), with or without logprobs, n > 1, and chat."""
    ids = tokenizer(PROMPTS[4])["input_ids"]
    ref = reference_engine.generate([ids], SamplingParams(max_tokens=10, temperature=0))[0]
    greedy = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=10, temperature=0,
                                       extra_body={"return_token_ids": True}).choices[0]
    assert greedy.model_extra["prompt_token_ids"] == ids and greedy.model_extra["token_ids"] == ref.token_ids
    assert greedy.logprobs is None, "asked for token ids, not log-probabilities"
    with_logprobs = client.completions.create(model=MODEL, prompt=ids, max_tokens=10, temperature=0, logprobs=2,
                                              extra_body={"return_token_ids": True}).choices[0]
    assert with_logprobs.model_extra["token_ids"] == ref.token_ids
    assert with_logprobs.logprobs.tokens == [tokenizer.decode([t]) for t in ref.token_ids]
    assert all(len(top) == 2 for top in with_logprobs.logprobs.top_logprobs), "greedy: the sampled token is in the top 2"

    kwargs = dict(model=MODEL, prompt=PROMPTS[4], max_tokens=12, temperature=1.0, seed=11, n=2,
                  extra_body={"return_token_ids": True})
    whole = client.completions.create(**kwargs)
    assert sum(len(c.model_extra["token_ids"]) for c in whole.choices) == whole.usage.completion_tokens == 24
    for choice in whole.choices:
        assert choice.text == decode(tokenizer, choice.model_extra["token_ids"])
    streamed = {0: [], 1: []}
    prompt_ids = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.model_extra["token_ids"]
            prompt_ids[choice.index].append(choice.model_extra["prompt_token_ids"])
    assert [streamed[c.index] for c in whole.choices] == [c.model_extra["token_ids"] for c in whole.choices]
    assert all(p[0] == ids and not any(p[1:]) for p in prompt_ids.values()), "the prompt in the first chunk only"

    # with echo the prompt comes back as its ids alone, not also as text (vLLM's rule)
    echo = dict(model=MODEL, prompt=PROMPTS[4], max_tokens=10, temperature=0, echo=True,
                extra_body={"return_token_ids": True})
    echoed = client.completions.create(**echo).choices[0]
    assert echoed.text == greedy.text and echoed.model_extra["prompt_token_ids"] == ids
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **echo)) == greedy.text

    messages = [{"role": "user", "content": PROMPTS[4]}]
    chat_prompt = chat_ids(tokenizer, messages)
    chat_ref = reference_engine.generate([chat_prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"return_token_ids": True})
    assert chat.model_extra["prompt_token_ids"] == chat_prompt
    assert chat.choices[0].model_extra["token_ids"] == chat_ref.token_ids and chat.choices[0].logprobs is None
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"return_token_ids": True}))
    assert chunks[0].model_extra["prompt_token_ids"] == chat_prompt
    assert sum((c.choices[0].model_extra["token_ids"] for c in chunks[1:]), []) == chat_ref.token_ids


def test_truncate_prompt_tokens_and_bad_words_as_vllm(client, reference_engine, tokenizer):
    """truncate_prompt_tokens keeps a prompt's last N tokens (-1: the context length less one; a
    text prompt keeps its BOS, as the tokenizer's truncation from the left that vLLM asks for keeps
    it), in completions and chat; bad_words never appear."""
    ids = tokenizer(PROMPTS[1])["input_ids"]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True}).choices[0]
    kept = [tokenizer.bos_token_id] + ids[-2:]
    assert cut.model_extra["prompt_token_ids"] == kept and ids[0] == tokenizer.bos_token_id
    assert cut.text == reference(reference_engine, tokenizer, [kept], 8)[0], "the prompt echoed as its ids alone"
    echoed = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, echo=True,
                                       extra_body={"truncate_prompt_tokens": 3}).choices[0]
    assert echoed.text == "<s>" + decode(tokenizer, kept) + cut.text
    cut_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, echo=True,
                                        extra_body={"truncate_prompt_tokens": 3, "return_token_ids": True})
    assert cut_ids.choices[0].model_extra["prompt_token_ids"] == ids[-3:], "a token prompt: its last 3"
    whole = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids), "-1: the context length, which the prompt is within"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[1]}], max_tokens=1,
                                          extra_body={"truncate_prompt_tokens": 4})
    assert chat.usage.prompt_tokens == 4
    with pytest.raises(openai.BadRequestError, match="'truncate_prompt_tokens' must be -1"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"truncate_prompt_tokens": 0})
    with pytest.raises(openai.BadRequestError, match=r"'truncate_prompt_tokens' 5000 cannot be greater than the "
                       r"context length \(max_model_len\) \d+"):
        client.completions.create(model=MODEL, prompt="x", extra_body={"truncate_prompt_tokens": 5000})

    first = reference_engine.generate([ids], SamplingParams(max_tokens=8, temperature=0))[0].token_ids[0]
    word = tokenizer.decode([first])
    assert tokenizer(word, add_special_tokens=False)["input_ids"] == [first], "the word is that one token"
    banned = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0,
                                       extra_body={"bad_words": [word], "return_token_ids": True}).choices[0]
    # vLLM bans the word as it starts a text and, with a space before it, as it reads mid-text
    forms = [tokenizer(form, add_special_tokens=False)["input_ids"] for form in (word.lstrip(), " " + word.lstrip())]
    assert len(forms[0]) == len(forms[1]) == 1 and first in sum(forms, [])
    assert banned.model_extra["token_ids"] == reference_engine.generate(
        [ids], SamplingParams(max_tokens=8, temperature=0, bad_words_ids=forms))[0].token_ids
    assert not set(sum(forms, [])) & set(banned.model_extra["token_ids"])


def test_a_long_prompt_is_tokenized_without_holding_up_other_requests(api, client, tokenizer):
    """Text longer than the context could hold is refused before it is tokenized (the BAD cases);
    what the server must tokenize however long (a prompt to truncate, /tokenize) is tokenized in
    a thread, so other requests are answered meanwhile (the event loop used to stop for seconds)."""
    root = api.base_url.removesuffix("/v1")
    sentence = "Lists of words. "
    cut = client.completions.create(model=MODEL, prompt=sentence * 8000, max_tokens=1,
                                    extra_body={"truncate_prompt_tokens": 5})
    assert cut.usage.prompt_tokens == 5, "a prompt past the bound may still be truncated"
    longest = max(tokenizer.get_vocab(), key=lambda token: len(tokenizer.convert_tokens_to_string([token]).encode()))
    dense = tokenizer.convert_tokens_to_string([longest]) * 400          # many bytes a token
    assert len(dense.encode()) > 32 * 1024
    assert client.completions.create(model=MODEL, prompt=dense, max_tokens=1).usage.prompt_tokens < 1024, \
        "the bound allows the vocabulary's longest token"

    def count(repeats: int) -> int:
        return len(tokenizer(sentence * repeats)["input_ids"])
    repeats = 125_000                           # 2 MB: seconds of tokenizing
    assert count(3) - count(2) == count(2) - count(1)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        began = time.monotonic()
        counted = pool.submit(httpx.post, f"{root}/tokenize", json={"model": MODEL, "prompt": sentence * repeats},
                              timeout=120)
        waits = []
        while not counted.done():
            start = time.monotonic()
            assert httpx.get(f"{root}/health", timeout=60).status_code == 200
            waits.append(time.monotonic() - start)
        took = time.monotonic() - began
    assert counted.result().json()["count"] == count(1) + (repeats - 1) * (count(2) - count(1))
    # bounded by the tokenizing's own time, which a busy machine stretches as it does the waits: a
    # loop blocked by it keeps a /health waiting for nearly all of it (2.1 s of 2.2), where a free
    # loop answers in hundredths of a second
    assert len(waits) > 3 and max(waits) < took / 2, (took, waits)


def test_huge_prompts_do_not_hold_up_the_prompts_of_other_requests(api, tokenizer):
    """As many 1 MB prompts at once as the event loop's default pool has threads (each takes the
    tokenizer a second or more) are tokenized on a pool of their own: small requests meanwhile
    still get a thread at once (before, one waited 6.2 s behind six 2 MB prompts)."""
    root = api.base_url.removesuffix("/v1")
    huge = "Lists of words. " * 65_000
    small = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 1}
    threads = min(32, (os.cpu_count() or 1) + 4)          # the size of asyncio's default pool
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        began = time.monotonic()
        counted = [pool.submit(httpx.post, f"{root}/tokenize", json={"model": MODEL, "prompt": huge}, timeout=300)
                   for _ in range(threads)]
        time.sleep(0.3)
        waits = []
        while not all(f.done() for f in counted):
            start = time.monotonic()
            assert httpx.post(f"{api.base_url}/completions", json=small, timeout=60).status_code == 200
            waits.append(time.monotonic() - start)
        took = time.monotonic() - began
    assert all(f.result().json()["count"] > 65_000 for f in counted)
    # bounded by the tokenizing's own time, as above: a small prompt left without a thread waits for
    # most of it (3.1 s of 4.3 with the default pool alone), where each takes about 0.25 s
    assert len(waits) > 3 and max(waits) < took / 2, (took, waits)


def test_max_tokens_is_fitted_to_the_context_as_vllm(api, client, tokenizer):
    """A prompt near the context length runs with max_tokens cut to the room left (the default's
    16, or a larger one asked for), and stops with "length"; a chat that gives none runs to the end
    of the context, as vLLM's; a prompt with no room is refused with OpenAI's code (the BAD cases
    check the message)."""
    with open(os.path.join(DEFAULT_MODEL, "config.json")) as f:
        context = json.load(f)["max_position_embeddings"]
    near = [1] + [100] * (context - 6)                  # room for 5 tokens
    default = client.completions.create(model=MODEL, prompt=near, temperature=0, extra_body={"ignore_eos": True})
    assert (default.usage.completion_tokens, default.choices[0].finish_reason) == (5, "length")
    chunks = list(client.completions.create(model=MODEL, prompt=near, max_tokens=500, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[-1].usage.completion_tokens == 5
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"

    def messages(words: int) -> list[dict]:
        return [{"role": "user", "content": "Lists " * words}]
    base, step = len(chat_ids(tokenizer, messages(0))), len(chat_ids(tokenizer, messages(101))) - len(
        chat_ids(tokenizer, messages(100)))
    room = context - len(chat_ids(tokenizer, messages((context - 4 - base) // step)))
    assert 0 < room <= 4 + step
    chat = client.chat.completions.create(model=MODEL, messages=messages((context - 4 - base) // step),
                                          max_completion_tokens=1000, extra_body={"ignore_eos": True})
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (room, "length")
    room = context - len(chat_ids(tokenizer, messages((context - 40 - base) // step)))
    assert 40 <= room <= 40 + step
    chat = client.chat.completions.create(model=MODEL, messages=messages((context - 40 - base) // step),
                                          extra_body={"ignore_eos": True})
    assert (chat.usage.completion_tokens, chat.choices[0].finish_reason) == (room, "length")
    full = httpx.post(f"{api.base_url}/completions", json={"model": MODEL, "prompt": [1] + [100] * (context - 1)})
    assert full.status_code == 400 and full.json()["error"]["code"] == "context_length_exceeded"


def test_openai_fields_for_other_services_are_accepted_and_the_model_may_be_left_out(api, client):
    """Clients that send every field of OpenAI's chat request (null where unset) get a reply, as
    from vLLM; fields for what a text model cannot do are refused only when set (BAD). A request
    without a model gets the served base model."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2, service_tier="auto",
        prompt_cache_key="k", safety_identifier="u", verbosity="low", modalities=["text"], store=False,
        metadata={"a": "b"}, logprobs=False, top_logprobs=0,
        extra_body={"audio": None, "prediction": None, "web_search_options": None, "functions": None,
                    "function_call": None})
    assert reply.choices[0].logprobs is None and reply.usage.completion_tokens == 2
    for path, body in (("completions", {"prompt": "x"}), ("chat/completions", {"messages": [{"role": "user",
                                                                                          "content": "x"}]})):
        unnamed = httpx.post(f"{api.base_url}/{path}", json={**body, "max_tokens": 1}, timeout=60)
        assert unnamed.status_code == 200 and unnamed.json()["model"] == MODEL
        assert httpx.post(f"{api.base_url}/{path}", json={**body, "model": None, "max_tokens": 1}).status_code == 200


# vLLM 0.32's request fields that OpenAI's API does not define, at vLLM's defaults: what a client
# that builds its requests from vLLM's own request models sends
VLLM_FIELDS = {"use_beam_search": False, "top_k": None, "min_p": None, "repetition_penalty": None,
               "watermarking": None, "length_penalty": 1.0, "stop_token_ids": [], "include_stop_str_in_output": False,
               "ignore_eos": False, "min_tokens": 0, "skip_special_tokens": True,
               "spaces_between_special_tokens": True, "truncate_prompt_tokens": None, "truncation_side": None,
               "allowed_token_ids": None, "prompt_logprobs": None, "logprob_token_ids": None, "bad_words": [],
               "structured_outputs": None, "priority": 0, "session_id": None, "return_tokens_as_token_ids": None,
               "return_token_ids": None, "routed_experts_prompt_start": 0, "return_token_offsets": False,
               "mm_payload": "tensors", "return_mm_kwargs": None, "cache_salt": None, "kv_transfer_params": None,
               "ec_transfer_params": None, "vllm_xargs": None, "repetition_detection": None,
               "thinking_token_budget": None, "stream_interval": None}
VLLM_COMPLETION_FIELDS = {**VLLM_FIELDS, "prompt_embeds": None, "add_special_tokens": True, "response_format": None}
VLLM_CHAT_FIELDS = {**VLLM_FIELDS, "include_reasoning": True, "echo": False, "add_generation_prompt": True,
                    "continue_final_message": False, "add_special_tokens": False, "documents": None,
                    "chat_template": None, "chat_template_kwargs": None, "media_io_kwargs": None,
                    "mm_processor_kwargs": None, "return_prompt_text": None}


def test_every_vllm_field_at_its_default_changes_nothing_and_request_id_names_the_response(api, client):
    """A request carrying every field of vLLM's request models at its default is served as
    without them; its `request_id` names the response, and an X-Request-Id header wins over it,
    as in vLLM."""
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0)
    full = client.completions.create(model=MODEL, prompt=PROMPTS[3], max_tokens=8, temperature=0,
                                     extra_body={**VLLM_COMPLETION_FIELDS, "request_id": "client-7"})
    assert (full.choices[0].text, full.id) == (plain.choices[0].text, "cmpl-client-7")
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)
    full = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0,
                                          extra_body={**VLLM_CHAT_FIELDS, "request_id": "client-8"})
    assert (full.choices[0].message.content, full.id) == (chat.choices[0].message.content, "chatcmpl-client-8")
    headed = httpx.post(f"{api.base_url}/completions", headers={"X-Request-Id": "trace-1"}, timeout=60,
                        json={"model": MODEL, "prompt": "x", "max_tokens": 1, "request_id": "body-1"})
    assert headed.json()["id"] == "cmpl-trace-1"
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, stream=True,
                                                 extra_headers={"X-Request-Id": "trace-2"}))
    assert {c.id for c in chunks} == {"chatcmpl-trace-2"}
    assert len({client.completions.create(model=MODEL, prompt="x", max_tokens=1).id for _ in range(2)}) == 2


def test_an_empty_prompt_starts_from_the_bos_as_in_vllm(client, reference_engine, tokenizer):
    empty = client.completions.create(model=MODEL, prompt="", max_tokens=6, temperature=0,
                                      extra_body={"return_token_ids": True})
    assert empty.choices[0].model_extra["prompt_token_ids"] == [tokenizer.bos_token_id]
    assert empty.choices[0].text == reference(reference_engine, tokenizer, [[tokenizer.bos_token_id]], 6)[0]
    assert empty.usage.prompt_tokens == 1


def test_vllm_tokenization_fields_and_the_rendered_prompt(client, reference_engine, tokenizer):
    """add_special_tokens false tokenizes a completion's text prompt without its BOS;
    truncation_side "right" keeps a prompt's first N tokens; a chat's return_prompt_text returns
    the rendered template (a stream: in its role chunk)."""
    ids = tokenizer(PROMPTS[1])["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    bare = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=8, temperature=0, echo=True,
                                     extra_body={"add_special_tokens": False, "return_token_ids": True})
    assert bare.choices[0].model_extra["prompt_token_ids"] == ids[1:] and bare.usage.prompt_tokens == len(ids) - 1
    assert bare.choices[0].text == reference(reference_engine, tokenizer, [ids[1:]], 8)[0], "echoed as ids alone"
    for prompt in (PROMPTS[1], ids):
        first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={
            "truncate_prompt_tokens": 3, "truncation_side": "right", "return_token_ids": True})
        assert first.choices[0].model_extra["prompt_token_ids"] == ids[:3]
    last_bare = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=1, extra_body={
        "truncate_prompt_tokens": 3, "add_special_tokens": False, "return_token_ids": True})
    assert last_bare.choices[0].model_extra["prompt_token_ids"] == ids[-3:]
    messages = [{"role": "user", "content": PROMPTS[1]}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, extra_body={
        "return_prompt_text": True, "truncate_prompt_tokens": 4, "truncation_side": "right", "return_token_ids": True})
    assert chat.model_extra["prompt_text"] == rendered
    assert chat.model_extra["prompt_token_ids"] == chat_ids(tokenizer, messages)[:4]
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, stream=True,
                                                 extra_body={"return_prompt_text": True}))
    assert [c.model_extra.get("prompt_text") for c in chunks] == [rendered] + [None] * (len(chunks) - 1)
    assert "prompt_text" not in client.chat.completions.create(model=MODEL, messages=messages,
                                                               max_tokens=1).model_extra


def test_allowed_token_ids_skip_special_tokens_and_stream_interval_reach_llm(client, reference_engine, tokenizer):
    """vLLM's decode, sampling and streaming fields pass through to `llm`: only the allowed tokens
    are generated (greedy: the engine's answer with the same set), stream_interval sends several
    tokens a chunk, and with skip_special_tokens false a generated special token is in the text."""
    allowed = tokenizer(" the a of and to in is", add_special_tokens=False)["input_ids"]
    limited = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=8, temperature=0, extra_body={
        "allowed_token_ids": allowed, "return_token_ids": True}).choices[0]
    assert set(limited.model_extra["token_ids"]) <= set(allowed)
    assert limited.text == reference(reference_engine, tokenizer, [PROMPTS[4]], 8, allowed_token_ids=allowed)[0]
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=8, temperature=0, stream=True,
                                            extra_body={"allowed_token_ids": allowed, "stream_interval": 3}))
    assert "".join(c.choices[0].text for c in chunks) == limited.text
    assert len(chunks) == 4, "stream_interval 3: the first token, then 3, 3, and the last"
    bos = {"allowed_token_ids": [tokenizer.bos_token_id], "ignore_eos": True}
    kept = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, extra_body={
        **bos, "skip_special_tokens": False})
    skipped = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=3, extra_body=bos)
    assert (kept.choices[0].message.content, skipped.choices[0].message.content) == (tokenizer.bos_token * 3, "")


def test_an_unknown_path_or_method_is_an_openai_error(api):
    for reply, status in ((httpx.get(f"{api.base_url}/nowhere"), 404), (httpx.get(f"{api.base_url}/completions"), 405)):
        assert reply.status_code == status
        assert reply.json()["error"]["type"] == "invalid_request_error" and reply.json()["error"]["code"] == status


def test_a_client_that_leaves_while_sending_its_body_is_not_logged_as_a_server_error(api):
    """Reading the body then raises Starlette's ClientDisconnect: nobody is left to answer, and a
    slow uploader giving up must not look like a crash in the log (it was logged as an unexpected
    error, with two tracebacks)."""
    log_before = len(open(api.log_path, encoding="utf-8", errors="replace").read())
    with socket.create_connection((api.host, api.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"hi\"")
        time.sleep(0.3)
    time.sleep(1)
    assert httpx.get(f"{api.base_url}/models", timeout=30).status_code == 200
    logged = open(api.log_path, encoding="utf-8", errors="replace").read()[log_before:]
    assert "Traceback" not in logged and "unexpected error" not in logged, logged


def test_echo_alone_streamed_as_vllm(client, tokenizer):
    """max_tokens 0 with echo in a stream: each choice's one chunk is the prompt (with its
    log-probabilities when asked), finish_reason "length", as the same request unstreamed."""
    kwargs = dict(model=MODEL, prompt=PROMPTS[5], echo=True, max_tokens=0, logprobs=1, n=2)
    whole = client.completions.create(**kwargs).choices
    chunks = [c for c in client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)]
    choices = sorted((c.choices[0] for c in chunks if c.choices), key=lambda c: c.index)
    assert [c.index for c in choices] == [0, 1]
    for got, expected in zip(choices, sorted(whole, key=lambda c: c.index)):
        assert got.text == expected.text == PROMPTS[5] and got.finish_reason == "length"
        assert got.logprobs.tokens == expected.logprobs.tokens == [tokenizer.decode([t]) for t in
                                                                   tokenizer(PROMPTS[5])["input_ids"]]
        assert got.logprobs.token_logprobs[1:] == pytest.approx(expected.logprobs.token_logprobs[1:], abs=1e-9)
    assert chunks[-1].usage.prompt_tokens == len(tokenizer(PROMPTS[5])["input_ids"])


def test_tokenize_and_detokenize_as_vllm(api, client, tokenizer):
    """vLLM's /tokenize (a prompt, or chat messages rendered as a chat completion renders them) and
    /detokenize, at the server's root."""
    root = api.base_url.removesuffix("/v1")
    with open(os.path.join(DEFAULT_MODEL, "config.json")) as f:
        context = json.load(f)["max_position_embeddings"]
    ids = tokenizer(PROMPTS[0])["input_ids"]
    got = httpx.post(f"{root}/tokenize", json={"model": MODEL, "prompt": PROMPTS[0]}).json()
    assert got == {"count": len(ids), "max_model_len": context, "tokens": ids, "token_strs": None}
    bare = httpx.post(f"{root}/tokenize", json={"prompt": PROMPTS[0], "add_special_tokens": False}).json()
    assert bare["tokens"] == tokenizer(PROMPTS[0], add_special_tokens=False)["input_ids"]
    messages = [{"role": "user", "content": PROMPTS[0]}]
    chat = httpx.post(f"{root}/tokenize", json={"messages": messages, "return_token_strs": True}).json()
    assert chat["tokens"] == chat_ids(tokenizer, messages)
    assert chat["token_strs"] == tokenizer.convert_ids_to_tokens(chat["tokens"])
    usage = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1).usage
    assert usage.prompt_tokens == chat["count"], "the count a chat completion's prompt has"
    back = httpx.post(f"{root}/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert back == {"prompt": tokenizer.decode(ids)}
    for path, body, status, message in [
            ("detokenize", {"tokens": [5, 99999]}, 400, "'tokens': token id 99999 at position 1 is outside"),
            ("detokenize", {"tokens": "abc"}, 400, "'tokens'"),
            ("tokenize", {"prompt": "x", "messages": messages}, 400, "exactly one of 'prompt' and 'messages'"),
            ("tokenize", {"prompt": "x", "add_generation_prompt": False}, 400, "'add_generation_prompt' goes with"),
            ("tokenize", {"model": "nope", "prompt": "x"}, 404, "The model 'nope' does not exist")]:
        reply = httpx.post(f"{root}/{path}", json=body)
        assert reply.status_code == status and message in reply.json()["error"]["message"], reply.text


def test_a_whole_output_with_top_20_logprobs_arrives_whole(client):
    """Triton sends a non-streamed output as one event; with 400 tokens of top-20 log-probabilities
    it is ~0.5 MB, far past an HTTP client's usual line limit."""
    whole = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=400, temperature=0, logprobs=20,
                                      extra_body={"ignore_eos": True})
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == 400 and whole.usage.completion_tokens == 400
    assert all(len(top) == 20 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == whole.choices[0].text


def test_50_concurrent_async_streams_are_all_correct(api, reference_engine, tokenizer):
    prompts = [f"{PROMPTS[i % len(PROMPTS)]}{' ' * (i // len(PROMPTS))}" for i in range(50)]
    lengths = [4 + (i * 7) % 29 for i in range(50)]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    refs = reference_engine.generate(ids, [SamplingParams(max_tokens=n, temperature=0) for n in lengths])
    expected = [decode(tokenizer, r.token_ids) for r in refs]

    async def one(client, prompt, n):
        text, usage = "", None
        stream = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        async for chunk in stream:
            text += "".join(c.text for c in chunk.choices)
            usage = chunk.usage or usage
        return text, usage.completion_tokens

    async def main():
        async with openai.AsyncOpenAI(base_url=api.base_url, api_key="-", max_retries=0) as client:
            return await asyncio.gather(*(one(client, p, n) for p, n in zip(prompts, lengths)))

    results = asyncio.run(main())
    assert [text for text, _ in results] == expected
    assert [count for _, count in results] == [len(r.token_ids) for r in refs]


def test_a_dropped_stream_frees_its_kv_blocks(api, client, server):
    """...because the engine stops the request soon after the client goes, not at its 900 tokens
    (which would also free its blocks, seconds later)."""
    cancelled = server.metric("inflight_requests_total", finish_reason="cancelled")
    start = computed_tokens(server)
    stream = client.completions.create(model=MODEL, prompt=PROMPTS[4], max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})
    chunks = [next(iter(stream)) for _ in range(3)]
    assert all(c.choices[0].text is not None for c in chunks)
    assert_left_stream_cancelled(server, stream, cancelled, start)
    assert client.completions.create(model=MODEL, prompt="The", max_tokens=2).choices[0].text


def vllm_metrics(api) -> dict:
    """The server's /metrics — Triton's page, then vLLM's families — as {(sample name, labels less
    model_name and engine): value} of vLLM's; every sample but lora_requests_info's is labelled as
    vLLM labels it for this model."""
    response = httpx.get(api.base_url.removesuffix("/v1") + "/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    families = list(text_string_to_metric_families(response.text))
    names = [family.name for family in families]
    assert "nv_inference_request_success" in names and len(set(names)) == len(names)
    samples = {}
    for family in families:
        if not family.name.startswith("vllm:"):
            continue
        for sample in family.samples:
            labels = dict(sample.labels)
            if family.name != "vllm:lora_requests_info":
                assert (labels.pop("model_name"), labels.pop("engine")) == (MODEL, "0"), sample
            samples[sample.name, tuple(sorted(labels.items()))] = sample.value
    return samples


def until(read, holds, timeout_s: float = 10.0):
    """read() until holds(value) (the engine publishes its metrics every 50 ms while it runs)."""
    deadline = time.monotonic() + timeout_s
    while not holds(value := read()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert holds(value), value
    return value


def test_metrics_as_vllms_server_names_them(api, client, server, tokenizer):
    """GET /metrics: what dashboards, autoscalers and gateways (Gateway API inference extension,
    llm-d) read from a vLLM server, under its names and labels, from the engine's own metrics."""
    def value(metrics, name, **labels):
        return metrics[name, tuple(sorted(labels.items()))]

    before = vllm_metrics(api)
    # at rest every counter is its inflight_ source, summed over the processes
    for name, source in (("vllm:num_preemptions_total", "inflight_preemptions_total"),
                         ("vllm:prefix_cache_queries_total", "inflight_prefix_cache_queries_total"),
                         ("vllm:generation_tokens_total", "inflight_generation_tokens_total"),
                         ("vllm:request_success_total", "inflight_requests_total")):
        assert sum(v for (n, _), v in before.items() if n == name) == server.metric(source), name
    assert {labels for (n, labels) in before if n == "vllm:request_success_total"} == \
        {(("finished_reason", r),) for r in ("stop", "length", "abort", "error", "repetition")}
    assert value(before, "vllm:num_requests_running") == value(before, "vllm:num_requests_waiting") == 0
    assert value(before, "vllm:kv_cache_usage_perc") == 0

    # a request to its length: its tokens, its end, its latencies
    client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, extra_body={"ignore_eos": True})
    length = value(before, "vllm:request_success_total", finished_reason="length")
    after = until(lambda: vllm_metrics(api), lambda m: value(m, "vllm:request_success_total",
                                                              finished_reason="length") == length + 1)
    after = until(lambda: vllm_metrics(api), lambda m: value(m, "vllm:generation_tokens_total") ==
                  value(before, "vllm:generation_tokens_total") + 5)
    prompt = len(tokenizer(PROMPTS[0]).input_ids)
    until(lambda: vllm_metrics(api), lambda m: value(m, "vllm:prompt_tokens_total") ==
          value(before, "vllm:prompt_tokens_total") + prompt)
    for name in ("vllm:time_to_first_token_seconds", "vllm:request_time_per_output_token_seconds",
                 "vllm:e2e_request_latency_seconds"):
        assert value(after, f"{name}_count") == value(before, f"{name}_count") + 1, name
        assert value(after, f"{name}_bucket", le="+Inf") == value(after, f"{name}_count"), name

    # a stream held open through the adapter: it runs, holds KV blocks, and its adapter is listed
    stream = client.completions.create(model=ADAPTER, prompt=PROMPTS[2], max_tokens=900, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    lora_labels = (("max_lora", str(int(server.metric("inflight_max_loras")))), ("running_lora_adapters", ADAPTER),
                   ("waiting_lora_adapters", ""))
    held = until(lambda: vllm_metrics(api), lambda m: ("vllm:lora_requests_info", lora_labels) in m)
    assert value(held, "vllm:num_requests_running") == 1 and 0 < value(held, "vllm:kv_cache_usage_perc") < 1
    assert abs(held["vllm:lora_requests_info", lora_labels] - time.time()) < 60     # vLLM's: the time it was set
    stream.close()      # the client leaves: the request is aborted, its blocks freed
    aborted = value(before, "vllm:request_success_total", finished_reason="abort")
    done = until(lambda: vllm_metrics(api), lambda m: value(m, "vllm:request_success_total",
                                                            finished_reason="abort") == aborted + 1)
    done = until(lambda: vllm_metrics(api), lambda m: value(m, "vllm:kv_cache_usage_perc") == 0)
    assert value(done, "vllm:num_requests_running") == 0
    assert ("vllm:lora_requests_info", lora_labels[:1] + (("running_lora_adapters", ""),) + lora_labels[2:]) in done


def test_metrics_sum_the_models_processes_and_list_waiting_adapters():
    """Two instances of `llm` (a series per process) and another model on the same Triton page; a
    vLLM family Triton's page has already (REPORT_CUSTOM_METRICS) stays as it is there."""
    from inflight_client.openai_server.metrics import combined
    page = "\n".join([
        "# TYPE vllm:generation_tokens_total counter", 'vllm:generation_tokens_total{model="llm",version="1"} 7',
        "# TYPE inflight_requests_waiting gauge",
        'inflight_requests_waiting{model="llm",pid="1"} 2', 'inflight_requests_waiting{model="llm",pid="2"} 3',
        'inflight_requests_waiting{model="other",pid="3"} 50',
        "# TYPE inflight_kv_blocks_used gauge",
        'inflight_kv_blocks_used{model="llm",pid="1"} 10', 'inflight_kv_blocks_used{model="llm",pid="2"} 30',
        "# TYPE inflight_kv_blocks_total gauge",
        'inflight_kv_blocks_total{model="llm",pid="1"} 100', 'inflight_kv_blocks_total{model="llm",pid="2"} 100',
        "# TYPE inflight_max_loras gauge",
        'inflight_max_loras{model="llm",pid="1"} 2', 'inflight_max_loras{model="llm",pid="2"} 2',
        "# TYPE inflight_lora_requests_running gauge",
        'inflight_lora_requests_running{lora_name="b",model="llm",pid="1"} 1',
        'inflight_lora_requests_running{lora_name="a",model="llm",pid="2"} 0',
        "# TYPE inflight_lora_requests_waiting gauge",
        'inflight_lora_requests_waiting{lora_name="a",model="llm",pid="1"} 0',
        'inflight_lora_requests_waiting{lora_name="a",model="llm",pid="2"} 4',
        'inflight_lora_requests_waiting{lora_name="c",model="llm",pid="2"} 1',
        "# TYPE inflight_e2e_request_latency_seconds histogram",
        *(f'inflight_e2e_request_latency_seconds_bucket{{le="{le}",model="llm",pid="{pid}"}} {n}'
          for pid in (1, 2) for le, n in (("0.5", pid), ("10", 2 * pid), ("+Inf", 3 * pid))),
        'inflight_e2e_request_latency_seconds_sum{model="llm",pid="1"} 4.5',
        'inflight_e2e_request_latency_seconds_sum{model="llm",pid="2"} 1.5', ""])
    out = combined(page, "llm", [MODEL, "0"]).decode()
    assert out.startswith(page)
    families = {f.name: f for f in text_string_to_metric_families(out)}
    [tokens] = families["vllm:generation_tokens"].samples
    assert tokens.labels == {"model": "llm", "version": "1"} and tokens.value == 7
    assert out.count("# TYPE vllm:generation_tokens") == 1 and "vllm:prompt_tokens_total{" in out
    assert families["vllm:num_requests_waiting"].samples[0].value == 5
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == 0.2
    [info] = families["vllm:lora_requests_info"].samples
    assert info.labels == {"max_lora": "2", "running_lora_adapters": "b", "waiting_lora_adapters": "a,c"}
    e2e = {(s.name, s.labels.get("le")): s.value for s in families["vllm:e2e_request_latency_seconds"].samples}
    assert [e2e["vllm:e2e_request_latency_seconds_bucket", le] for le in ("0.5", "10", "+Inf")] == [3, 6, 9]
    assert e2e["vllm:e2e_request_latency_seconds_count", None] == 9
    assert e2e["vllm:e2e_request_latency_seconds_sum", None] == 6
    other = page.replace('model="llm"', 'model="vllm_model"')
    assert combined(other, "llm", [MODEL, "0"]).decode() == other        # no inflight_ series of `llm`: none


def test_embeddings_from_a_generating_model_are_refused(client):
    """/v1/embeddings, /score and /rerank need `llm` run as an embedding model (tests/test_embeddings_server.py)."""
    with pytest.raises(openai.BadRequestError, match="embeddings need a model run as an embedding model"):
        client.embeddings.create(model=MODEL, input="The assert statement")
    base = str(client.base_url).removesuffix("v1/")
    for path, body in (("score", {"queries": "a", "documents": ["b"]}), ("rerank", {"query": "a", "documents": "b"})):
        reply = httpx.post(base + path, json=body)
        assert reply.status_code == 400 and "embeddings need a model run as an embedding model" in reply.text


def test_a_client_that_leaves_a_request_not_streamed_frees_its_kv_blocks(api, server):
    """Triton sees a closed connection only when it writes a response: the server asks `llm` for
    one per step even when its client does not stream, so the request is cancelled, not run to
    its 900 tokens for nobody."""
    cancelled = server.metric("inflight_requests_total", finish_reason="cancelled")
    start = computed_tokens(server)
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 900, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api.base_url}/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    left = server.metric("inflight_prompt_and_decode_tokens_total")
    assert wait_for_metric(server, "inflight_requests_total", cancelled + 1, timeout_s=5,
                           finish_reason="cancelled") == cancelled + 1
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0
    end = computed_tokens(server)
    # stopped a few steps after the client left, not run to its 900 tokens
    assert end - start < 900 and end - left < 300, f"{left - start} tokens before the client left, {end - left} after"


def test_a_client_that_leaves_while_its_request_is_queued_has_it_cancelled_in_the_queue(api, server):
    """Behind max_num_seqs running requests, a completion waits in the engine's queue; its client
    gives up after 1 s. `llm`'s queue heartbeat lets Triton see the closed connection, so the
    request is cancelled there while the others still run, never prefilled."""
    import threading

    import tritonclient.grpc.aio as grpcclient
    from inflight_client.streams import grpc_inputs, grpc_stream
    filling = TEST_ENGINE["max_num_seqs"]
    loop = asyncio.new_event_loop()
    tasks: list[asyncio.Task] = []

    async def fill():
        async with grpcclient.InferenceServerClient(server.grpc_url) as triton:
            for prompt in (PROMPTS * filling)[:filling]:
                inputs = grpc_inputs(prompt, True, {"max_tokens": 900, "ignore_eos": True})
                tasks.append(asyncio.ensure_future(grpc_stream(triton, "llm", inputs)))
            await asyncio.gather(*tasks, return_exceptions=True)
    filler = threading.Thread(target=loop.run_until_complete, args=(fill(),))
    filler.start()
    try:
        assert wait_for_metric(server, "inflight_requests_running", filling, timeout_s=30) == filling
        cancelled = server.metric("inflight_requests_total", finish_reason="cancelled")
        body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{api.base_url}/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
        assert wait_for_metric(server, "inflight_requests_total", cancelled + 1, timeout_s=3,
                               finish_reason="cancelled") == cancelled + 1
        assert server.metric("inflight_requests_running") == filling, "cancelled in the queue, not run"
        assert wait_for_metric(server, "inflight_requests_waiting", 0) == 0
    finally:
        for task in tasks:
            loop.call_soon_threadsafe(task.cancel)
        filler.join(30)
        loop.close()
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0


# bounded outputs: the tiny random test model must reach the end of the grammar within max_tokens
COLOR = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                          "size": {"type": "string", "enum": ["S", "M", "L"]}},
         "required": ["color", "size"]}
@pytest.fixture(scope="module")
def hf_model():
    """transformers' model of the checkpoint, in the server's float64 (TEST_ENGINE)."""
    import torch
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float64).eval()


def next_logprobs(model, ids: list[int]):
    """transformers' log-softmax over the whole vocabulary at each position of `ids`."""
    import torch
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0], dim=-1)


def vllm_beam_search(model, prompt_ids: list[int], width: int, max_tokens: int, eos: int,
                     length_penalty: float = 1.0) -> list[tuple[list, float]]:
    """vLLM 0.32's search, step by step on transformers' log-probabilities: each beam's 2 x width
    likeliest next tokens, an EOS among them an ended beam (the EOS kept here), the width likeliest
    others live; then ended and live ranked by cumulative log-probability over the length (prompt
    included, less an ending EOS) to the power length_penalty."""
    live, ended = [([], 0.0)], []
    for _ in range(max_tokens):
        candidates = []
        for tokens, total in live:
            top = next_logprobs(model, prompt_ids + tokens)[-1].topk(2 * width)
            for logprob, token in zip(top.values.tolist(), top.indices.tolist()):
                (ended if token == eos else candidates).append((tokens + [token], total + logprob))
        live = sorted(candidates, key=lambda beam: -beam[1])[:width]
    def score(beam):
        return beam[1] / (len(prompt_ids) + len(beam[0]) - (beam[0][-1] == eos)) ** length_penalty
    return sorted(ended + live, key=score, reverse=True)[:width]


@pytest.mark.parametrize("n", [2, 3])
def test_beam_search_keeps_the_beams_transformers_keeps(client, hf_model, tokenizer, n):
    """vLLM's `use_beam_search` with n the beam width. Without EOS (ignore_eos) vLLM's search (the n
    best of each beam's top 2n) and transformers' (the n best of all) keep the same beams: for each
    prompt of a completion (choice i * n + j) the same token ids, best first, with the same
    cumulative log-probabilities."""
    import torch
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[1:4], n=n, max_tokens=8, logprobs=5, extra_body={
        "use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5, "return_token_ids": True})
    for i, prompt in enumerate(PROMPTS[1:4]):
        ids = tokenizer(prompt)["input_ids"]
        beams = hf_model.generate(torch.tensor([ids]), num_beams=n, num_return_sequences=n, do_sample=False,
                                  max_new_tokens=8, eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                                  length_penalty=0.5, early_stopping=False)
        expected = [beam[len(ids):].tolist() for beam in beams]
        choices = reply.choices[i * n:(i + 1) * n]
        assert [c.index for c in choices] == list(range(i * n, (i + 1) * n))
        assert [c.model_extra["token_ids"] for c in choices] == expected, prompt
        for choice, tokens in zip(choices, expected):
            assert choice.text == decode(tokenizer, tokens) and choice.finish_reason == "length"
            logprobs = next_logprobs(hf_model, ids + tokens)
            want = [logprobs[len(ids) + k - 1, t].item() for k, t in enumerate(tokens)]
            assert choice.logprobs.token_logprobs == pytest.approx(want, abs=1e-6)
            # each token's own, then the step's top 5 (the token among them where it is one; more than 2n)
            assert all(len(top) == (5 if t in logprobs[len(ids) + k - 1].topk(5).indices.tolist() else 6)
                       for k, (t, top) in enumerate(zip(tokens, choice.logprobs.top_logprobs)))
    assert reply.usage.completion_tokens == 3 * n * 8
    assert reply.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS[1:4])


def test_beam_search_ends_a_beam_on_eos_as_vllm(client, hf_model, tokenizer):
    """A beam whose next candidate is EOS ends there (finish_reason "stop", vLLM's stop_reason the
    EOS id) and is ranked with the live beams at the end, by vLLM's score: a length_penalty of 8
    puts the longer beam first, as it does where the length counts the prompt (counting the
    generated tokens only, the ended beam would not be returned). The EOS is in its token ids (and
    usage) with include_stop_str_in_output, never in its text."""
    prompt, eos = "See The standard type hierarchy for more information", tokenizer.eos_token_id
    ids = tokenizer(prompt)["input_ids"]
    for kept, penalty, ending in ((False, 1.0, [True, False]), (True, 8.0, [False, True])):
        expected = vllm_beam_search(hf_model, ids, 2, 6, eos, penalty)
        assert [beam[-1] == eos for beam, _ in expected] == ending, "the case: an ended beam first, then second"
        reply = client.completions.create(model=MODEL, prompt=prompt, n=2, max_tokens=6, logprobs=0, extra_body={
            "use_beam_search": True, "include_stop_str_in_output": kept, "length_penalty": penalty,
            "return_token_ids": True})
        for choice, (tokens, total) in zip(reply.choices, expected):
            ended = tokens[-1] == eos
            assert choice.model_extra["token_ids"] == (tokens[:-1] if ended and not kept else tokens)
            assert choice.text == decode(tokenizer, tokens[:-1] if ended else tokens)
            assert (choice.finish_reason, choice.model_extra["stop_reason"]) == (("stop", eos) if ended
                                                                               else ("length", None))
            if kept or not ended:
                assert sum(choice.logprobs.token_logprobs) == pytest.approx(total, abs=1e-6)
        assert reply.choices[ending.index(True)].text == ".\n"
        assert reply.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in reply.choices)


def test_chat_with_beam_search_streamed_and_not_and_through_an_adapter(client, hf_model, tokenizer):
    """A chat's beam search (vLLM streams it: every choice's text at once, at the end); n 1 is
    greedy, through an adapter too (its lora_name reaches every step), and a completion's echo
    comes first; vLLM's fields at their defaults change nothing."""
    eos, messages = tokenizer.eos_token_id, [{"role": "user", "content": PROMPTS[5]}]
    expected = [t[:-1] if t[-1] == eos else t for t, _ in vllm_beam_search(hf_model, chat_ids(tokenizer, messages),
                                                                            3, 6, eos)]
    kwargs = dict(model=MODEL, messages=messages, n=3, max_completion_tokens=6,
                  extra_body={"use_beam_search": True, "return_token_ids": True})
    whole = client.chat.completions.create(**kwargs)
    assert [c.model_extra["token_ids"] for c in whole.choices] == expected
    assert [c.message.content for c in whole.choices] == [decode(tokenizer, t) for t in expected]
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    texts, reasons = ["", "", ""], [None, None, None]
    for chunk in chunks[:-1]:
        texts[chunk.choices[0].index] += chunk.choices[0].delta.content or ""
        reasons[chunk.choices[0].index] = reasons[chunk.choices[0].index] or chunk.choices[0].finish_reason
    assert texts == [c.message.content for c in whole.choices]
    assert reasons == [c.finish_reason for c in whole.choices]
    assert chunks[-1].usage == whole.usage and whole.usage.completion_tokens == sum(map(len, expected))
    greedy = {}
    for model in (MODEL, ADAPTER):
        greedy[model] = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                                  extra_body={"ignore_eos": True}).choices[0].text
        beam = client.completions.create(model=model, prompt=PROMPTS[0], max_tokens=8, echo=True, extra_body={
            **VLLM_COMPLETION_FIELDS, "use_beam_search": True, "ignore_eos": True})
        assert beam.choices[0].text == PROMPTS[0] + greedy[model]
    assert greedy[MODEL] != greedy[ADAPTER], "the adapter changes the text"


def test_a_client_that_leaves_a_beam_search_stops_it(api, server):
    """No step is sent after the client goes, and the steps in flight are cancelled."""
    before = server.metric("inflight_requests_total")
    body = {"model": MODEL, "prompt": PROMPTS[4], "max_tokens": 900, "n": 4, "ignore_eos": True,
            "use_beam_search": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{api.base_url}/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
    computed_tokens(server)         # idle: nothing running, no KV blocks held
    time.sleep(0.2)                 # the last cancelled step counted (metrics are published every 50 ms)
    after = server.metric("inflight_requests_total")
    assert after > before + 8, "the search ran a few steps"
    time.sleep(1)
    assert server.metric("inflight_requests_total") == after, "no step after the client left"


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"enum": ["Paris", "Oslo", "Lima"]},
                                               "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}},
         {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
             "a": {"type": "integer", "minimum": 0, "maximum": 99},
             "b": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a", "b"]}}}]
PARAMETERS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Oslo?"}]


def test_response_format_json_schema_and_json_object(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "shirt", "schema": COLOR}}
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=100, temperature=1.0, seed=1, response_format=fmt)
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole.choices[0].message.content), COLOR)
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs))
    assert streamed == whole.choices[0].message.content, "same seed, same text"
    # any object: compact, the random model's sampled one runs past 100 tokens before it closes
    anything = client.chat.completions.create(**{**kwargs, "max_tokens": 400,
                                                 "response_format": {"type": "json_object"}})
    assert anything.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    # /v1/completions takes response_format, and vLLM's extra fields, too
    done = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=200, temperature=1.0, seed=5,
                                     extra_body={"response_format": fmt})
    jsonschema.validate(json.loads(done.choices[0].text), COLOR)


def test_response_format_structural_tag(client):
    """vLLM's response_format of type structural_tag, in xgrammar's format or the older structures
    and triggers; a malformed one is a 400 naming response_format."""
    call = {"type": "tag", "begin": "<call>", "content": {"type": "regex", "pattern": '\\{"size":"(S|M|L)"\\}'},
            "end": "</call>"}
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<call>"], "tags": [call],
                                                "at_least_one": True, "stop_after_first": True}}
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=60, temperature=1.0, seed=3)
    reply = client.chat.completions.create(**kwargs, response_format=tag)
    assert re.fullmatch(r'<call>\{"size":"(S|M|L)"\}</call>', reply.choices[0].message.content)
    older = {"type": "structural_tag", "triggers": ["<call>"],
             "structures": [{"begin": "<call>", "schema": COLOR, "end": "</call>"}]}
    free = client.chat.completions.create(**{**kwargs, "temperature": 0, "max_tokens": 12})
    assert client.chat.completions.create(**{**kwargs, "temperature": 0, "max_tokens": 12}, response_format=older) \
        .choices[0].message.content == free.choices[0].message.content, "no trigger: the text is free"
    for bad, message in (({"type": "structural_tag"}, "needs 'format', or 'structures' and 'triggers'"),
                         ({"type": "structural_tag", "format": {"type": "nonsense"}},
                          "'response_format' is not a valid structural tag: Invalid structural tag error: Format "
                          "type not recognized: nonsense"),
                         ({"type": "structural_tag", "structures": [{"begin": "<a>"}], "triggers": ["<a>"]},
                          "'response_format.structures' must be a list of objects with 'begin' and 'end' strings")):
        with pytest.raises(openai.BadRequestError, match=re.escape(message)) as error:
            client.chat.completions.create(**kwargs, response_format=bad)
        assert error.value.body["param"] == "response_format"


def test_structural_tags_go_as_the_json_text_vllms_structured_outputs_take():
    """vLLM's StructuredOutputsParams.structural_tag is a string, so the vLLM backend refuses a tag
    sent as an object (every such request failed behind it): a response_format's tag and the
    auto call envelope go as JSON text (`llm` takes either)."""
    from types import SimpleNamespace

    from inflight_client.openai_server.chat_completions import _constraints
    from inflight_client.openai_server.sampling import chat_sampling
    from inflight_client.openai_server.schemas import ChatCompletionRequest
    tag = {"type": "structural_tag", "triggers": ["<a>"], "structures": [{"begin": "<a>", "schema": COLOR, "end": "</a>"}]}
    strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    for extra in ({"response_format": tag}, {"tools": strict}):
        body = ChatCompletionRequest.model_validate({"model": MODEL, "messages": ASK, **extra})
        constraint = _constraints(body, SimpleNamespace(tool_call_parser="hermes"))[0]
        sent = json.loads(chat_sampling(body, 16, constraint)["structured_outputs"])["structural_tag"]
        assert isinstance(sent, str) and json.loads(sent)["type"] == "structural_tag"
    assert json.loads(sent)["format"]["triggers"] == ["<tool_call>"]


def test_vllm_extra_constraint_fields(client):
    kwargs = dict(model=MODEL, prompt=PROMPTS[1], max_tokens=64, temperature=1.0, seed=2)
    choice = client.completions.create(**kwargs, extra_body={"guided_choice": ["yes", "no"]})
    assert choice.choices[0].text in ("yes", "no")
    regex = client.completions.create(**kwargs, stream=True, extra_body={"guided_regex": "[0-9]{3}-[A-Z]{2}"})
    assert re.fullmatch("[0-9]{3}-[A-Z]{2}", "".join(c.choices[0].text for c in regex))
    chat = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64,
                                          extra_body={"structured_outputs": {"json": COLOR}})
    jsonschema.validate(json.loads(chat.choices[0].message.content), COLOR)
    text = chat.choices[0].message.content
    assert text == json.dumps(json.loads(text), separators=(",", ":")), "--disable-any-whitespace: compact, as vLLM's"
    old = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=64, temperature=0,
                                         extra_body={"guided_json": COLOR})
    jsonschema.validate(json.loads(old.choices[0].message.content), COLOR)


def streamed_completion(client, **kwargs):
    """The SDK's own accumulation of a stream into a ChatCompletion."""
    with client.chat.completions.stream(**kwargs) as stream:
        for _ in stream:
            pass
        return stream.get_final_completion()


def calls_of(completion) -> list[tuple[str, str]]:
    return [(call.function.name, call.function.arguments) for call in completion.choices[0].message.tool_calls]


def test_named_tool_choice_gives_one_call_streamed_and_not(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content is None      # a forced call: as vLLM
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["get_weather"])
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices[0].delta.tool_calls]
    assert len(deltas) > 1, "the arguments come as deltas"
    assert deltas[0][0].id.startswith("call_") and deltas[0][0].function.name == "get_weather"
    assert all(d[0].id is None and d[0].function.name is None for d in deltas[1:])
    assert chunks[-1].choices[0].finish_reason == "stop"
    streamed = streamed_completion(client, **kwargs)
    assert calls_of(streamed) == calls_of(whole) and streamed.choices[0].finish_reason == "stop"


def test_required_tool_choice_gives_calls_of_known_tools(client):
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=150, temperature=0, tools=TOOLS, tool_choice="required")
    whole = client.chat.completions.create(**kwargs)
    assert whole.choices[0].finish_reason == "tool_calls" and whole.choices[0].message.content is None
    calls = calls_of(whole)
    assert len(calls) >= 1
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), PARAMETERS[name])
    assert len({call.id for call in whole.choices[0].message.tool_calls}) == len(calls)
    streamed = streamed_completion(client, **kwargs)
    assert calls_of(streamed) == calls and streamed.choices[0].finish_reason == "tool_calls"


def test_a_forced_tool_call_replaces_response_format(client):
    """A forced call has no content for response_format (or guided_*) to shape: the call is made
    (vLLM drops them too), where two constraints would otherwise be a 400."""
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    plain = client.chat.completions.create(**kwargs)
    formatted = client.chat.completions.create(**kwargs, response_format={"type": "json_schema", "json_schema": {
        "name": "color", "schema": COLOR}}, extra_body={"guided_regex": "[a-z]+"})
    assert calls_of(formatted)[0][1] == calls_of(plain)[0][1]
    jsonschema.validate(json.loads(calls_of(formatted)[0][1]), PARAMETERS["get_weather"])


def exact_regex(text: str) -> str:
    """A regex matching text alone (xgrammar's regex syntax: metacharacters escaped, newline as \\n)."""
    return re.sub(r"[.^$*+?{}\[\]\\|()]", r"\\\g<0>", text).replace("\n", "\\n")


# a reply in each parser's format, which a regex makes the tiny random model write
AUTO_REPLIES = {
    "hermes": ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>',
               "Sure. ", [("get_weather", '{"city": "Oslo", "unit": "C"}')]),
    "llama3_json": ('{"name": "add", "parameters": {"a": 1, "b": 2}}; '
                    '{"name": "get_weather", "parameters": {"city": "Lima", "unit": "F"}}',
                    None, [("add", '{"a": 1, "b": 2}'), ("get_weather", '{"city": "Lima", "unit": "F"}')]),
    "pythonic": ('[get_weather(city="Lima", unit="F"), add(a=1, b=2)]',
                 None, [("get_weather", '{"city": "Lima", "unit": "F"}'), ("add", '{"a": 1, "b": 2}')]),
}


@pytest.mark.parametrize("parser", sorted(AUTO_REPLIES))
def test_auto_tool_choice_reads_the_calls_a_model_writes_in_its_format(server, tmp_path, parser):
    """vLLM's --enable-auto-tool-choice --tool-call-parser: with tools and no tool_choice (what
    LangChain's and LlamaIndex's tool bindings send) the model decides; its calls come back as
    tool_calls, streamed or not, and a reply without one as content."""
    text, content, calls = AUTO_REPLIES[parser]
    with openai_server(server.http_url, tmp_path, "--enable-auto-tool-choice", "--tool-call-parser", parser) as auto:
        auto_client = openai.OpenAI(base_url=auto.base_url, api_key="-", max_retries=0)
        forced = dict(model=MODEL, messages=ASK, max_tokens=150, temperature=0, tools=TOOLS,
                      extra_body={"structured_outputs": {"regex": exact_regex(text)}})
        whole = auto_client.chat.completions.create(**forced)
        choice = whole.choices[0]
        assert (choice.message.content, calls_of(whole), choice.finish_reason) == (content, calls, "tool_calls")
        assert len({call.id for call in choice.message.tool_calls}) == len(calls)
        streamed = streamed_completion(auto_client, **forced)
        # a stream's role chunk has content "" (as vLLM's), so a call alone accumulates to ""
        assert (streamed.choices[0].message.content, calls_of(streamed)) == (content or "", calls)
        assert streamed.choices[0].finish_reason == "tool_calls"
        # no call: the reply is content, as with tool_choice "none" (hermes reads special tokens too)
        free = dict(model=MODEL, messages=ASK, max_tokens=12, temperature=0, tools=TOOLS)
        reply = auto_client.chat.completions.create(**free)
        plain = auto_client.chat.completions.create(**free, tool_choice="none",
                                                    extra_body={"skip_special_tokens": parser != "hermes"})
        assert reply.choices[0].message.tool_calls is None and reply.choices[0].message.content
        assert (reply.choices[0].message.content, reply.choices[0].finish_reason) == \
            (plain.choices[0].message.content, plain.choices[0].finish_reason)
        streamed = "".join(c.choices[0].delta.content or "" for c in auto_client.chat.completions.create(
            stream=True, **free))
        assert streamed == reply.choices[0].message.content
        # a strict tool (or parallel_tool_calls false) puts the call envelope on the reply where vLLM
        # 0.32 has one (hermes, llama3_json): text outside a call stays free, and the tag reaches llm
        strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
        enveloped = auto_client.chat.completions.create(**{**free, "tools": strict, "parallel_tool_calls": False})
        assert enveloped.choices[0].message.content == reply.choices[0].message.content
        broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}, "strict": True}}]
        if parser == "pythonic":
            auto_client.chat.completions.create(**{**free, "tools": broken})
        else:
            with pytest.raises(openai.BadRequestError, match="'tools' is not a valid structural tag") as error:
                auto_client.chat.completions.create(**{**free, "tools": broken})
            assert error.value.body["param"] == "tools"


@pytest.mark.parametrize("parser, opening", [("hermes", "<tool_call>"), ("llama3_json", '{"name": "')])
def test_with_a_tag_for_its_format_a_model_writes_forced_calls_in_it(server, tmp_path, parser, opening):
    """vLLM 0.32 with a parser that has a structural tag (hermes, llama3_json): "required" and
    named calls are written in the model's own format under the tag, and read back by the parser,
    streamed or not; "auto" with a response_format of its own and a strict tool is calls or that
    format's content."""
    strict = [{**tool, "function": {**tool["function"], "strict": True}} for tool in TOOLS]
    with openai_server(server.http_url, tmp_path, "--enable-auto-tool-choice", "--tool-call-parser", parser,
                       "--disable-any-whitespace") as auto:
        auto_client = openai.OpenAI(base_url=auto.base_url, api_key="-", max_retries=0)
        for choice, reason in (("required", "tool_calls"), ({"type": "function", "function": {"name": "add"}}, "stop")):
            kwargs = dict(model=MODEL, messages=ASK, max_tokens=200, temperature=0, tools=strict, tool_choice=choice,
                          parallel_tool_calls=False, logprobs=True)
            whole = auto_client.chat.completions.create(**kwargs)
            written = "".join(token.token for token in whole.choices[0].logprobs.content)
            assert written.startswith(opening), written
            calls = calls_of(whole)
            assert whole.choices[0].finish_reason == reason and len(calls) == 1
            assert isinstance(choice, str) or calls[0][0] == "add"
            jsonschema.validate(json.loads(calls[0][1]), PARAMETERS[calls[0][0]])
            streamed = streamed_completion(auto_client, **kwargs)
            assert calls_of(streamed) == calls and streamed.choices[0].finish_reason == reason
        fmt = {"type": "json_schema", "json_schema": {"name": "shirt", "schema": COLOR}}
        for seed in range(4):
            reply = auto_client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=200, temperature=1.0,
                                                        seed=seed, tools=strict, response_format=fmt)
            message = reply.choices[0].message
            for name, arguments in calls_of(reply) if message.tool_calls else ():
                jsonschema.validate(json.loads(arguments), PARAMETERS[name])
            if not message.tool_calls:
                jsonschema.validate(json.loads(message.content), COLOR)
        broken = [{"type": "function", "function": {"name": "f", "parameters": {"type": "foo"}, "strict": True}}]
        for choice, where in (("required", "tools"), ({"type": "function", "function": {"name": "f"}},
                                                        "tools[1].function.parameters")):
            with pytest.raises(openai.BadRequestError, match=re.escape(f"'{where}' is not a valid")) as error:
                auto_client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS[:1] + broken,
                                                    tool_choice=choice)
            assert error.value.body["param"] == "tool_choice"
        with pytest.raises(openai.BadRequestError, match="'response_format' or 'tools' is not a valid") as error:
            auto_client.chat.completions.create(model=MODEL, messages=ASK, tools=broken, response_format=fmt)
        assert error.value.body["param"] == "response_format"


def test_mistral_calls_read_from_its_special_tokens_go_back_with_its_ids(tmp_path):
    """--tool-call-parser mistral before a model whose tokenizer has Mistral's [TOOL_CALLS] and
    [ARGS] as special tokens (v11's form): the tokens the model writes stay in the text for the
    parser (vLLM keeps them too), its calls come back with Mistral's 9-character ids, streamed or
    not, and a conversation holding them renders with a template that refuses other ids, as
    Mistral's do. With --reasoning-parser mistral (and `llm`'s) Magistral's [THINK] ... [/THINK],
    special tokens too, come as `reasoning`, counted in usage, beside the calls; the prompt's
    [/THINK] (Magistral's system prompt has one) has the constraint hold from the first token, and a
    prompt without markers has a response_format wait for [/THINK], as in vLLM. A tokenizer without
    [TOOL_CALLS] is refused at start, as by vLLM."""
    import subprocess
    import sys

    from inflight_client.openai_server.process import OpenAIServerProcess
    from transformers import AutoTokenizer
    checkpoint = mistral_checkpoint(str(tmp_path / "mistral-tiny"), think=True)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    marker, args, think, unthink = tokenizer.convert_tokens_to_ids(["[TOOL_CALLS]", "[ARGS]", "[THINK]", "[/THINK]"])
    text = ('[THINK]Oslo, in C. [/THINK]Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo", "unit": "C"}'
            '[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2}')
    calls = [("get_weather", '{"city": "Oslo", "unit": "C"}'), ("add", '{"a": 1, "b": 2}')]
    repository = make_repository(str(tmp_path / "repository"), checkpoint,
                                 {**TEST_ENGINE, "reasoning_parser": "mistral"})
    with ServerProcess(repository) as triton, OpenAIServerProcess(
            triton.http_url, checkpoint, extra=["--enable-auto-tool-choice", "--tool-call-parser", "mistral",
                                                "--reasoning-parser", "mistral"],
            env=SOURCE_PATH_ENV, log_path=str(tmp_path / "openai.log")) as auto:
        client = openai.OpenAI(base_url=auto.base_url, api_key="-", max_retries=0)
        # the regex lets the model write each marker as its special token or as plain text: the bias picks the token
        system = [{"role": "system", "content": "Think first, in [THINK] ... [/THINK]."}]
        kwargs = dict(model="mistral-tiny", messages=system + ASK, max_tokens=80, temperature=0, tools=TOOLS,
                      logit_bias={str(token): 30 for token in (marker, args, think, unthink)},
                      extra_body={"structured_outputs": {"regex": exact_regex(text)}, "return_token_ids": True})
        whole = client.chat.completions.create(**kwargs)
        choice = whole.choices[0]
        ids = choice.model_extra["token_ids"]
        assert ids.count(marker) == 2 and args in ids and ids[0] == think and unthink in ids
        assert (choice.message.content, calls_of(whole), choice.finish_reason) == ("Sure.", calls, "tool_calls")
        assert choice.message.model_extra["reasoning"] == "Oslo, in C."       # its trailing space dropped
        assert whole.usage.completion_tokens_details.reasoning_tokens == ids.index(unthink) - 1
        ids = [call.id for call in choice.message.tool_calls]
        assert all(len(i) == 9 and i.isalnum() for i in ids) and len(set(ids)) == 2, ids
        streamed = streamed_completion(client, **kwargs)
        assert (streamed.choices[0].message.content, calls_of(streamed)) == ("Sure.", calls)
        assert all(len(call.id) == 9 for call in streamed.choices[0].message.tool_calls)
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        assert "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in chunks) == "Oslo, in C."
        history = ASK + [choice.message.model_dump(include={"role", "content", "tool_calls"})] + [
            {"role": "tool", "tool_call_id": i, "content": "done"} for i in ids]
        assert client.chat.completions.create(model="mistral-tiny", messages=history, max_tokens=2).choices
        history[1]["tool_calls"][0]["id"] = "call_" + ids[0]
        with pytest.raises(openai.BadRequestError, match="Tool call IDs should be alphanumeric strings with length 9"):
            client.chat.completions.create(model="mistral-tiny", messages=history, max_tokens=2)
        answered = 0
        for seed in range(4):       # no marker in the prompt: the JSON waits for the [/THINK] the bias brings
            response = client.chat.completions.create(
                model="mistral-tiny", messages=ASK, max_tokens=40, temperature=1.0, seed=seed,
                logit_bias={str(unthink): 8}, extra_body={"return_token_ids": True}, response_format={
                    "type": "json_schema", "json_schema": {"name": "size", "schema": {"enum": ["S", "M", "L"]}}})
            reply, ids = response.choices[0], response.choices[0].model_extra["token_ids"]
            # the engine waits as if reasoning, but the reply is read from its content on, as vLLM reads it
            assert response.usage.completion_tokens_details.reasoning_tokens == 0
            if unthink in ids and reply.finish_reason == "stop":
                after = ids.index(unthink) + 1
                assert unthink not in ids[after:] and think not in ids       # no reasoning: all content
                assert json.loads(tokenizer.decode(ids[after:], skip_special_tokens=True)) in ("S", "M", "L")
                answered += after > 1
                assert reply.message.model_extra["reasoning"] is None
                # the text as written, special tokens kept, less the stray [/THINK] (and others, which vLLM drops)
                assert reply.message.content == re.sub(r"\[/THINK\]|</?s>|<unk>|<pad>", "", tokenizer.decode(ids))
        assert answered, "some replies write free text, [/THINK], then the JSON"
    run = subprocess.run([sys.executable, "-m", "inflight_client.openai_server", "--model-dir", DEFAULT_MODEL,
                          "--enable-auto-tool-choice", "--tool-call-parser", "mistral", "--port", "1"],
                         capture_output=True, text=True, env={**os.environ, **SOURCE_PATH_ENV}, timeout=120)
    assert run.returncode != 0 and "--tool-call-parser mistral: the tokenizer has no '[TOOL_CALLS]' token" in run.stderr


def test_auto_tool_choice_needs_the_models_format():
    from inflight_client.openai_server.cli import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--model-dir", DEFAULT_MODEL, "--enable-auto-tool-choice"])
    settings, _ = parse_args(["--model-dir", DEFAULT_MODEL, "--enable-auto-tool-choice",
                              "--tool-call-parser", "hermes"])
    assert settings.tool_call_parser == "hermes"
    assert parse_args(["--model-dir", DEFAULT_MODEL, "--tool-call-parser", "hermes"])[0].tool_call_parser is None


def test_required_tool_calls_cut_short_or_single_read_the_same_streamed_and_not(client):
    """A "required" array cut short (a stop string, max_tokens) gives its complete calls as calls
    and the unfinished rest as content, streamed or not; parallel_tool_calls false asks for one
    call, as vLLM keeps one."""
    def reply(completion):
        choice = completion.choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason

    def streamed_reply(**kwargs):      # the SDK's own accumulation refuses a finish_reason "length"
        content, calls, reason = None, {}, None
        for chunk in client.chat.completions.create(stream=True, **kwargs):
            delta = chunk.choices[0].delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                name, arguments = calls.get(call.index, (call.function.name, ""))
                calls[call.index] = (name, arguments + (call.function.arguments or ""))
            reason = chunk.choices[0].finish_reason or reason
        return content, [calls[i] for i in sorted(calls)], reason

    base = dict(model=MODEL, messages=ASK, temperature=0.9, tools=TOOLS, tool_choice="required")
    seen_rest = False
    for seed in range(4):
        for cut in ({"stop": ['"parameters"']}, {"stop": ["}, {"]}, {"max_tokens": 30}):
            kwargs = {"max_tokens": 150, **base, "seed": seed, **cut}
            whole = reply(client.chat.completions.create(**kwargs))
            assert streamed_reply(**kwargs) == whole, (seed, cut)
            if whole[0] is not None:
                seen_rest = True
                assert whole[2] != "tool_calls"
        single = client.chat.completions.create(**base, max_tokens=150, seed=seed, parallel_tool_calls=False)
        assert len(single.choices[0].message.tool_calls) == 1
    assert seen_rest, "some cut left text that is not a call"


ONE_USER = [{"role": "user", "content": "x"}]
BAD = [
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "'gpt-4' does not exist", "model"),
    ("chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "'gpt-4'", "model"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -1}, 400, "'temperature'", "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "'top_p' must be in (0, 1]", "top_p"),
    ("completions", {"model": MODEL, "prompt": [1] + [100] * 1024}, 400,
     "This model's maximum context length is 1024 tokens. However, your prompt contains 1025 input tokens", "prompt"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Lists " * 1100}]}, 400,
     "This model's maximum context length is 1024 tokens", "messages"),
    ("completions", {"model": MODEL, "prompt": "x" * 110000}, 400,       # refused before tokenizing
     "'prompt' is 110000 bytes, more than the context of 1024 tokens can hold (the limit is 104448: 102 bytes a token at most)", "prompt"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 110000}]}, 400,
     "'messages' is 110000 bytes, more than", "messages"),
    ("completions", {"model": MODEL, "prompt": "A \ud800"}, 400, "'prompt' holds a lone UTF-16 surrogate", "prompt"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "\udfff"}]}, 400,
     "'messages' holds a lone UTF-16 surrogate", "messages"),
    ("completions", {"model": MODEL, "prompt": "x", "\ud800": 1}, 400,      # pydantic's error named nothing
     "'\\ud800' holds a lone UTF-16 surrogate", "\\ud800"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": ["text"], "text": "a"}]}]},
     400, "'messages[0].content': only text parts are supported, got ['text']", "messages"),     # it was a 500
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "audio": {"voice": "alloy", "format": "wav"}}, 400,
     "'audio' is not supported", "audio"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "functions": [{"name": "f"}]}, 400,
     "'functions' is not supported (give 'tools')", "functions"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "'n'", "n"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": True}, 400,        # not read as 1
     "'max_tokens': Input should be a number, not a boolean", "max_tokens"),
    ("completions", {"model": MODEL, "prompt": [1, True]}, 400, "'prompt[1]': Input should be a number", "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "priority": 1.5}, 400,      # each member of the union says its kind
     "'priority': Input should be 'high', 'normal' or 'low'; or input should be a valid integer", "priority"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 21}, 400, "'logprobs'", "logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "temprature": 0}, 400, "'temprature': unknown parameter",
     "temprature"),
    ("completions", {"model": MODEL, "prompt": []}, 400, "'prompt' must not be empty", "prompt"),
    ("completions", {"model": MODEL, "prompt": ["x", ""], "add_special_tokens": False}, 400,
     "'prompt' is empty, and without a BOS", "prompt"),
    ("completions", {"model": MODEL, "prompt": [1, 99999]}, 400, "'prompt': token id 99999", "prompt"),
    ("completions", {"model": MODEL, "prompt": [[1], [2, 10**12]]}, 400,
     "'prompt': token id 1000000000000 at position 1 is outside the vocabulary", "prompt"),
    ("completions", {"model": MODEL, "prompt": [1, -4294967291]}, 400,       # would wrap into token 5 as INT32
     "'prompt': token id -4294967291 at position 1 is outside the vocabulary", "prompt"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "$defs": 5}}}]}, 400,
     "'tools': the $defs of 'f' must be an object", "tools"),
    ("completions", {"model": MODEL, "prompt": "x", "seed": 2**64}, 400, "'seed' must be an integer in", "seed"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"spam": 3}}, 400,
     "'logit_bias' key 'spam' must be an integer", "logit_bias"),
    ("completions", {"model": MODEL, "prompt": "x", "logit_bias": {"99999": 3}}, 400,
     "'logit_bias': token id 99999 is outside the vocabulary", "logit_bias"),
    ("completions", {"model": MODEL, "prompt": "x", "min_p": 2}, 400, "'min_p' must be in [0, 1]", "min_p"),
    ("completions", {"model": MODEL, "prompt": "x", "presence_penalty": 3}, 400,
     "'presence_penalty' must be a number in [-2, 2], got 3.0", "presence_penalty"),
    ("completions", {"model": MODEL, "prompt": "x", "prompt_logprobs": 1, "stream": True}, 400,
     "'prompt_logprobs' is not available when 'stream' is true", "prompt_logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": 0, "stream": True}, 400,
     "'max_tokens' may be 0 only with 'echo'", "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "'stream_options'", "stream_options"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "'messages'", "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400,
     "'top_logprobs' needs 'logprobs'", "top_logprobs"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "response_format": {"type": "xml"}}, 400,
     "'response_format.type': Input should be", "response_format"),
    # a wrong value inside an object: the message has the path of field names down to it
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": "f", "parameters": 5}}]}, 400,
     "'tools[0].function.parameters': Input should be a valid dictionary", "tools"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": 5, "schema": {}}}}, 400,
     "'response_format.json_schema.name': Input should be a valid string", "response_format"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "stream": True,
                          "stream_options": {"include_usage": "maybe"}}, 400,
     "'stream_options.include_usage': Input should be a valid boolean", "stream_options"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "response_format": {"type": "json_schema"}}, 400,
     "needs 'json_schema.schema'", "response_format"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}}, 400,
     "'response_format.json_schema.schema' is not a valid JSON schema", "response_format"),
    ("completions", {"model": MODEL, "prompt": "x", "guided_regex": "(ab"}, 400,
     "'guided_regex' is not a valid regex", "guided_regex"),
    # xgrammar's message ends '"root" is not found', which is no missing model (it was a 503)
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "guided_grammar": 'main ::= "yes" | "no"'}, 400,
     "'guided_grammar' is not a valid grammar", "guided_grammar"),
    # another field's error names the constraint as the request sent it, and stays that field's
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "min_tokens": 2,
                          "response_format": {"type": "json_object"}}, 400,
     "'min_tokens' cannot be combined with 'response_format'", "min_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "min_tokens": 2, "guided_choice": ["a", "b"]}, 400,
     "'min_tokens' cannot be combined with 'guided_choice'", "min_tokens"),
    # a tool's schema: the message names the tool, not llm's field
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tools": [*TOOLS, {"type": "function", "function": {
        "name": "bad", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}],
        "tool_choice": {"type": "function", "function": {"name": "bad"}}}, 400,
     f"'tools[{len(TOOLS)}].function.parameters' is not a valid JSON schema", "tool_choice"),
    ("completions", {"model": MODEL, "prompt": "x", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "at most one output constraint; got 'guided_regex', 'guided_choice'", "guided_choice"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tools": TOOLS}, 400,
     "'tool_choice' \"auto\" (the default when 'tools' are given) needs a tool-call parser", "tool_choice"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tools": TOOLS, "tool_choice": "auto"}, 400,
     "start this server with --enable-auto-tool-choice and --tool-call-parser", "tool_choice"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tools": TOOLS,
                          "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
     "'tool_choice' names the function 'nope', which is not in 'tools' (get_weather, add)", "tool_choice"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tool_choice": "required"}, 400,
     "'tool_choice' needs 'tools'", "tool_choice"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tool_choice": "required", "tools": [
        {"type": "function", "function": {"name": f, "parameters": {"$defs": {"Item": {"type": t}}, "type": "object",
                                                                   "properties": {"q": {"$ref": "#/$defs/Item"}}}}}
        for f, t in (("a", "integer"), ("b", "string"))]}, 400, "the definition 'Item' ($defs) differs between tools",
     "tools"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tools": []}, 400,
     "'tools': List should have at least 1 item", "tools"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tools": [
        {"type": "function", "function": {"name": "f", "params": {}}}]}, 400,
     "'tools[0].function.params': unknown parameter", "tools"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "stream": True,
                          "stream_options": {"include_usage": True, "usage": True}}, 400,
     "'stream_options.usage': unknown parameter", "stream_options"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "max_completion_tokens": 0}, 400,
     "'max_completion_tokens' must be", "max_completion_tokens"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "tools": TOOLS, "tool_choice": {
        "type": "function", "function": {"name": "add"}, "strict": True}}, 400,
     "'tool_choice.strict': unknown parameter", "tool_choice"),
    ("chat/completions", {"model": MODEL, "messages": [*ONE_USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "[" * 100000}}]}]}, 400,
     "'messages[1].tool_calls[0].function.arguments' is nested too deeply", "messages"),
    ("chat/completions", {"model": MODEL, "messages": [*ONE_USER, {"role": "assistant", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "add", "arguments": "9" * 5000}}]}]}, 400,
     "'messages[1].tool_calls[0].function.arguments' is not valid JSON: Exceeds the limit", "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "only text parts", "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400,
     "'messages[0].content[0].text' must be a string", "messages"),
    ("completions", {"model": MODEL, "prompt": "x", "use_beam_search": True, "stream": True}, 400,
     "'use_beam_search': a completion with beam search cannot be streamed (as in vLLM)", "use_beam_search"),
    ("completions", {"model": MODEL, "prompt": "x", "use_beam_search": True, "echo": True, "logprobs": 1}, 400,
     "'echo' with 'logprobs' is not served with beam search", "echo"),
    ("completions", {"model": MODEL, "prompt": "x", "use_beam_search": True, "n": 11}, 400,
     "'n' is the beam width with 'use_beam_search', at most 10", "n"),
    ("completions", {"model": MODEL, "prompt": "x", "use_beam_search": True, "stop": ["."]}, 400,
     "'stop' is not served with 'use_beam_search'", "stop"),
    ("completions", {"model": MODEL, "prompt": "x", "use_beam_search": True, "max_tokens": -1}, 400,
     "'max_tokens' must be an integer >= 1, got -1", "max_tokens"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "use_beam_search": True,
                          "max_completion_tokens": 0}, 400, "'max_completion_tokens' must be an integer >= 1, got 0",
     "max_completion_tokens"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "use_beam_search": True,
                          "response_format": {"type": "json_object"}}, 400,
     "'response_format': output constraints are not served with 'use_beam_search'", "response_format"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "use_beam_search": True, "tools": TOOLS,
                          "tool_choice": "required"}, 400, "'tool_choice': output constraints are not served",
     "tool_choice"),
    ("completions", {"model": MODEL, "prompt": "x", "stream_interval": 0}, 400,
     "'stream_interval': Input should be greater than or equal to 1", "stream_interval"),
    ("completions", {"model": MODEL, "prompt": "x", "truncation_side": "middle"}, 400, "'truncation_side'",
     "truncation_side"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "moderation": {"policy": {}}}, 400,
     "'moderation' is not supported", "moderation"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "chat_template": "{{ messages }}"}, 400,
     "'chat_template': this server does not render templates sent with requests", "chat_template"),
    ("chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400,
     "'messages[0].role': Field required", "messages"),
    # a misspelt key inside an object: a user turn rendered empty, a schema option lost
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "contnet": "What is a list?"}]}, 400,
     "'messages': a 'user' message needs 'content' (this one has 'role', 'contnet')", "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "system", "content": None}, *ONE_USER]}, 400,
     "'messages': a 'system' message needs 'content'", "messages"),
    ("chat/completions", {"model": MODEL, "messages": ONE_USER, "response_format": {
        "type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "object"}, "strcit": True}}}, 400,
     "'response_format.json_schema.strcit': unknown parameter", "response_format"),
]


@pytest.mark.parametrize("path, body, status, message, param", BAD, ids=[b[3] for b in BAD])
def test_errors_have_the_openai_shape_status_and_a_message_naming_the_parameter(api, path, body, status, message,
                                                                                 param):
    # JSON escapes, as clients write them (a lone surrogate has no UTF-8 form to send otherwise)
    reply = httpx.post(f"{api.base_url}/{path}", content=json.dumps(body), timeout=60,
                       headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param
    assert "Traceback" not in reply.text and "At:" not in reply.text
    assert httpx.post(f"{api.base_url}/completions", content=b"{nope", timeout=60).status_code == 400
    deep = httpx.post(f"{api.base_url}/completions", content=b'{"prompt": ' + b"[" * 100000, timeout=60)
    assert deep.status_code == 400 and "nested too deeply" in deep.json()["error"]["message"]


WRONG_VALUES = [{"x": 1}, [[1]], "?", -1e30]        # wrong types and an absurd number, for every field


@pytest.mark.parametrize("path, schema, base", [
    ("completions", CompletionRequest, {"model": MODEL, "prompt": "x", "max_tokens": 1}),
    ("chat/completions", ChatCompletionRequest, {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                 "max_completion_tokens": 1})])
def test_every_field_with_a_wrong_value_is_answered_and_an_error_names_it(api, server, path, schema, base):
    """Each field the server reads (and each it refuses by name) set to each of WRONG_VALUES: an
    answer, never a 5xx, and an error in OpenAI's shape whose param or message names the field;
    nothing stays allocated."""
    fields = sorted({*schema.model_fields, *schema.UNSERVED} - {"stream"})
    with httpx.Client(timeout=120) as http:
        for field, value in ((f, v) for f in fields for v in WRONG_VALUES):
            reply = http.post(f"{api.base_url}/{path}", json={**base, field: value})
            assert reply.status_code in (200, 400, 404), (field, value, reply.text)
            if reply.status_code != 200:
                error = reply.json()["error"]
                assert field == error["param"] or field in error["message"], (field, value, error)
    assert wait_for_metric(server, "inflight_kv_blocks_used", 0) == 0


def test_bodies_json_reads_but_python_cannot_use_are_400s(api):
    """A surrogate as raw bytes (json decodes them with surrogatepass) in any string, and an
    integer longer than Python converts: a 400 naming the field, not a 500 and a closed connection."""
    root = api.base_url.removesuffix("/v1")
    prompt = b'{"model": "%s", "prompt": "A \xed\xa0\x80", "max_tokens": 1}' % MODEL.encode()
    for path, body, param in [("/v1/completions", prompt, "prompt"),
                              ("/v1/completions", b'{"model": "\xed\xb0\x80", "prompt": "x"}', "model"),
                              ("/tokenize", b'{"prompt": "\xed\xa0\x80"}', "prompt")]:
        reply = httpx.post(root + path, content=body, timeout=60)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == param, reply.text
    reply = httpx.post(f"{api.base_url}/completions", content=b'{"prompt": "x", "seed": ' + b"9" * 5000 + b"}",
                       timeout=60)
    assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"], reply.text
    # JSON in UTF-16 or UTF-32, which json.loads would decode (lone surrogates and all): UTF-8 only
    for encoding in ("utf-16-le", "utf-16", "utf-32"):
        body = json.dumps({"model": MODEL, "prompt": "\ud800 hi", "max_tokens": 1}).encode(encoding)
        reply = httpx.post(f"{api.base_url}/completions", content=body, timeout=60)
        assert reply.status_code == 400 and "not valid JSON" in reply.json()["error"]["message"], reply.text


def test_a_constraint_error_in_mid_stream_names_the_field_the_request_used(api):
    """The regex "ab" with its "b" tokens banned: "a" streams, then no token is left to sample, and
    the error event names 'guided_regex', as the same error before the first chunk would (it said
    'structured_outputs', llm's name)."""
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True,
            "guided_regex": "ab", "bad_words": ["ab", "b"]}
    reply = httpx.post(f"{api.base_url}/completions", json=body, timeout=60)
    events = [json.loads(line[5:]) for line in reply.text.splitlines() if line.startswith("data: {")]
    assert reply.status_code == 200 and events[0]["choices"][0]["text"] == "a", reply.text
    error = events[-1]["error"]
    assert error["message"].startswith("'guided_regex': no token allowed by the grammar") and \
        error["param"] == "guided_regex", error


def test_a_stream_that_fails_unexpectedly_ends_with_an_error_event_and_done():
    """A bug after the first chunk (not an APIError): the client gets an error event in OpenAI's
    shape and [DONE], not a connection cut mid-stream; several prompts' pumps raise it too."""
    from inflight_client.openai_server import generation, sse

    async def chunks():
        yield b"data: {}\n\n"
        raise TypeError("a bug")

    async def read(stream):
        return [part async for part in stream]
    parts = asyncio.run(read(sse.with_errors(chunks(), lambda error: error)))
    assert parts[0] == b"data: {}\n\n" and parts[-1] == sse.DONE
    assert json.loads(parts[1][5:]) == {"error": {"message": "internal error: TypeError", "type": "internal_error",
                                                  "param": None, "code": 500}}

    async def call(fails: bool):
        yield "response"
        if fails:
            raise KeyError("a bug")

    async def merged():
        responses = await generation.stream([call(False), call(True)])
        return [item async for item in responses]
    with pytest.raises(KeyError):            # raised to the reader, not left waiting forever
        asyncio.run(asyncio.wait_for(merged(), 10))


def test_a_schema_too_deep_once_wrapped_and_odd_tool_arguments_are_not_500s():
    """A schema the body parser took (under its depth limit) is wrapped in the constraint, which
    json.dumps then finds too deep: a 400 naming the field. A "required" tool call whose parameters
    hold a lone surrogate (the grammar allows any \\u escape): valid JSON the reply can encode."""
    from inflight_client.openai_server.errors import APIError
    from inflight_client.openai_server.sampling import completion_sampling
    from inflight_client.openai_server.structured import Constraint
    from inflight_client.openai_server.tools import ToolCallText, arguments_json
    deep: dict = {}
    for _ in range(5000):
        deep = {"a": deep}
    with pytest.raises(APIError) as error:
        completion_sampling(CompletionRequest(model=MODEL, prompt="x"), 16, Constraint({"json": deep}, "response_format"))
    assert (error.value.status, error.value.param) == (400, "response_format")
    assert "nested too deeply" in error.value.message
    arguments = arguments_json({"s": "\ud800 é"})
    assert json.loads(arguments) == {"s": "\ud800 é"} and arguments.encode("utf-8")
    assert arguments_json({"s": "é"}) == '{"s": "é"}'          # otherwise as vLLM writes them
    # numbers Python cannot hold (the grammar allows them) stay as written, not Infinity or a ValueError
    digits = "9" * 5000
    _, (call,) = ToolCallText(None).feed(f'[{{"name": "f", "parameters": {{"x": -1e999, "n": {digits}, "y": 0.5}}}}]')
    assert call["function"]["arguments"] == f'{{"x": -1e999, "n": {digits}, "y": 0.5}}'


def test_minus_infinity_in_prompt_logprobs_is_sent_as_minus_9999():
    """vLLM's clamp_prompt_logprobs: `llm` writes -inf as json's -Infinity, which a JSON response
    cannot hold (a 500): it is read as -9999.0, as the generated tokens' log-probabilities are sent."""
    from inflight_client.openai_server.triton import parse_event
    scored = [None, {"5": {"logprob": float("-inf"), "rank": 7, "decoded_token": "a"},
                     "6": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]
    event = {"text_output": "x", "finish_reason": "None", "num_output_tokens": 1, "num_input_tokens": 2,
             "prompt_logprobs": json.dumps(scored)}
    assert parse_event(event).prompt_logprobs == [None, {"5": {"logprob": -9999.0, "rank": 7, "decoded_token": "a"},
                                                         "6": {"logprob": -0.5, "rank": 1, "decoded_token": "b"}}]


def test_output_slots_are_taken_whole_in_order_and_given_back_on_cancel():
    """The server's bound on outputs in flight to Triton: a request of n outputs takes n at once
    (never part of them), later ones wait behind it, and one cancelled while waiting leaks nothing,
    also when slots come back before its task runs again."""
    from inflight_client.openai_server.triton import OutputSlots

    async def main():
        slots = OutputSlots(3)
        assert await slots.take(2) == 2
        big = asyncio.ensure_future(slots.take(2))       # needs 2, 1 free: waits
        small = asyncio.ensure_future(slots.take(1))     # would fit, but waits its turn
        await asyncio.sleep(0)
        assert not big.done() and not small.done()
        slots.give(2)
        assert await big == 2 and await small == 1 and slots.free == 0
        waiting = asyncio.ensure_future(slots.take(1))
        await asyncio.sleep(0)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        slots.give(2)
        # cancelled (its client left), and slots given back before the waiter runs again: before,
        # the give raised InvalidStateError in another request and the slot was lost
        assert await slots.take(2) == 2 and slots.free == 0
        waiting, behind = asyncio.ensure_future(slots.take(1)), asyncio.ensure_future(slots.take(1))
        await asyncio.sleep(0)
        waiting.cancel()
        slots.give(1)
        await asyncio.gather(waiting, return_exceptions=True)
        assert waiting.cancelled() and await behind == 1 and slots.free == 0
        slots.give(2)
        slots.give(1)
        assert slots.free == 3 and await slots.take(5) == 3, "more than all of them takes all"
    asyncio.run(asyncio.wait_for(main(), 5))


def test_output_slots_go_by_priority_then_arrival():
    """A high-priority request that arrives behind a completion of many low-priority prompts reaches
    the engine next, as vLLM's server (no queue before its engine's priority queue) lets it: it
    waited here behind all of them (7.8 s against 0.06 s in a helper's run)."""
    from inflight.config import parse_priority as priority_class
    from inflight_client.openai_server.triton import OutputSlots

    assert [priority_class(p) for p in ("normal", 0, "high", -5, "low", 3)] == [1, 1, 0, 0, 2, 2]

    async def main():
        slots = OutputSlots(2)
        assert await slots.take(2, priority_class("low")) == 2
        order = []

        async def request(name, priority, n=1):
            await slots.take(n, priority_class(priority))
            order.append(name)
        tasks = [asyncio.ensure_future(request(f"low{i}", "low")) for i in range(3)]
        tasks.append(asyncio.ensure_future(request("normal", "normal")))
        tasks.append(asyncio.ensure_future(request("high", -1, n=2)))
        await asyncio.sleep(0)
        slots.give(1)                # the first in line needs 2: nobody passes it for the free one
        await asyncio.sleep(0)
        assert order == []
        slots.give(1)
        await asyncio.sleep(0)
        assert order == ["high"]
        slots.give(2)
        await asyncio.sleep(0)
        assert order == ["high", "normal", "low0"]
        slots.give(2)
        await asyncio.gather(*tasks)
        assert order == ["high", "normal", "low0", "low1", "low2"]
    asyncio.run(asyncio.wait_for(main(), 5))


def test_llm_errors_that_are_the_servers_fault_are_5xx_not_a_bad_request():
    """Every error `llm` reports as Triton's INTERNAL (a failed engine or response thread, a request
    it could not read, a grammar compile that raised) is a 5xx, which the SDK retries, not a 400
    blaming the request (before: 400 invalid_request_error for all but "the engine failed")."""
    from inflight.serving.triton_models import INTERNAL_ERRORS
    from inflight_client.openai_server.errors import from_triton
    for marker in INTERNAL_ERRORS:
        error = from_triton(f"{marker}: KeyError: 'x'")
        assert error.status >= 500 and error.body()["error"]["type"] != "invalid_request_error", marker
    assert from_triton("'top_p' must be in (0, 1]").status == 400


def test_the_sdk_raises_its_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=2)


def test_queue_full_is_429_and_triton_gone_is_503(tmp_path):
    """One seat and one waiting place: with one request running and one waiting, the next is
    refused at once, and so is one request of more prompts than that, unless the server keeps
    fewer in flight. Then tritonserver goes away under the OpenAI server."""
    repo = make_repository(str(tmp_path / "repo"), DEFAULT_MODEL,
                           {**TEST_ENGINE, "max_num_seqs": 1, "max_queue_size": 1})
    triton = ServerProcess(repo).start()
    try:
        with openai_server(triton.http_url, tmp_path) as api:
            async def main():
                body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 500, "ignore_eos": True, "stream": True}
                async with httpx.AsyncClient(base_url=api.base_url, timeout=120) as http:
                    async with http.stream("POST", "/completions", json=body) as running:
                        lines = running.aiter_lines()       # kept: dropping it would close the stream
                        assert (await anext(lines)).startswith("data:"), "it has a seat"
                        waiting = asyncio.create_task(http.post("/completions", json=body))
                        assert await asyncio.to_thread(wait_for_metric, triton, "inflight_requests_waiting", 1) == 1
                        refused = await http.post("/completions", json={**body, "stream": False})
                        waiting.cancel()          # both clients leave: both requests are aborted
                return refused

            refused = asyncio.run(main())
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["message"].startswith("queue full: 1 requests are already waiting")
            assert wait_for_metric(triton, "inflight_requests_waiting", 0) == 0
            assert wait_for_metric(triton, "inflight_kv_blocks_used", 0) == 0
            # five prompts in one request: all at once they overflow the queue by themselves; with
            # at most max_queue_size in flight (what `make serve` passes) they run in turn
            many = {"model": MODEL, "prompt": PROMPTS[:5], "max_tokens": 3, "temperature": 0}
            assert httpx.post(f"{api.base_url}/completions", json=many, timeout=60).status_code == 429
            # so do a beam search's 10 beams, whose steps go at once: the step's 429, its other steps cancelled
            beams = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 3, "n": 10, "use_beam_search": True}
            refused = httpx.post(f"{api.base_url}/completions", json=beams, timeout=60)
            assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full", refused.text
            assert wait_for_metric(triton, "inflight_kv_blocks_used", 0) == 0
            with openai_server(triton.http_url, tmp_path, "--max-triton-requests", "1") as paced:
                for stream in (False, True):
                    reply = httpx.post(f"{paced.base_url}/completions", json={**many, "stream": stream}, timeout=60)
                    assert reply.status_code == 200, reply.text
                    indices = re.findall(r'"index":(\d+)', reply.text)
                    assert sorted(set(map(int, indices))) == [0, 1, 2, 3, 4]
                reply = httpx.post(f"{paced.base_url}/completions", json=beams, timeout=60)
                assert reply.status_code == 200 and len(reply.json()["choices"]) == 10, reply.text
                with httpx.stream("POST", f"{paced.base_url}/completions", timeout=60, json={
                        "model": MODEL, "prompt": PROMPTS[0], "max_tokens": 900, "ignore_eos": True, "stream": True}) as busy:
                    next(busy.iter_lines())             # it holds the one slot
                    health = httpx.get(paced.base_url.removesuffix("/v1") + "/health", timeout=5)
                    assert health.status_code == 200, "a health check never waits behind the requests"
                # a client that left gave its slot back at once, streamed or not: the next request is
                # served well before the 900 tokens it had asked for could have been generated (~8 s)
                small = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 2}
                assert httpx.post(f"{paced.base_url}/completions", json=small, timeout=4).status_code == 200
                with pytest.raises(httpx.ReadTimeout):
                    httpx.post(f"{paced.base_url}/completions", json={**small, "max_tokens": 900, "ignore_eos": True},
                               timeout=httpx.Timeout(60, read=0.5))
                assert httpx.post(f"{paced.base_url}/completions", json=small, timeout=4).status_code == 200
            assert wait_for_metric(triton, "inflight_kv_blocks_used", 0) == 0
            triton.stop()
            health = httpx.get(api.base_url.removesuffix("/v1") + "/health")
            assert health.status_code == 503 and "not ready" in health.json()["error"]["message"]
            gone = httpx.post(f"{api.base_url}/chat/completions",
                              json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": True})
            assert gone.status_code == 503 and gone.json()["error"]["type"] == "service_unavailable"
            assert "not reachable" in gone.json()["error"]["message"]
    finally:
        triton.stop()


def test_a_stopping_triton_is_unhealthy_at_once_and_not_held_up_by_this_server(tmp_path):
    """While tritonserver stops it still answers ready on the connections it had, and waits for
    them to close: the health probe takes a connection of its own, so under traffic /health turns
    503 at once (it said 200 for 14 s); and the pool keeps an idle connection 2 s, not aiohttp's
    15 s, so a stop after traffic is not held up by it."""
    import threading
    repo = make_repository(str(tmp_path / "repo"), DEFAULT_MODEL, TEST_ENGINE)
    triton = ServerProcess(repo, extra=["--exit-timeout-secs=30"]).start()
    try:
        with openai_server(triton.http_url, tmp_path) as api:
            root = api.base_url.removesuffix("/v1")
            body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 4}
            with concurrent.futures.ThreadPoolExecutor(4) as pool:      # four pooled connections
                assert all(r.status_code == 200 for r in pool.map(
                    lambda _: httpx.post(f"{api.base_url}/completions", json=body, timeout=30), range(8)))
            started = time.monotonic()
            stopping = threading.Thread(target=triton.stop)
            stopping.start()
            while httpx.get(root + "/health").status_code == 200 and time.monotonic() - started < 10:
                time.sleep(0.1)
            unhealthy_after = time.monotonic() - started
            stopping.join(60)
            stopped_after = time.monotonic() - started
        assert unhealthy_after < 3, f"/health said 200 for {unhealthy_after:.1f} s of the stop"
        assert triton.process.returncode == 0 and stopped_after < 10, (triton.process.returncode, stopped_after)
    finally:
        triton.stop()


def test_a_stream_of_several_prompts_holds_back_what_nobody_reads():
    """Each prompt's call is pumped into a bounded queue: a client that stops reading stops the
    calls (and so Triton) instead of this server holding every prompt's whole output (+104 MB in
    16 s for 24 prompts); leaving closes every call at once, which cancels its request."""
    from inflight_client.openai_server.generation import stream
    produced, closed = [0, 0, 0], []

    async def call(i):
        try:
            for k in range(10_000):
                await asyncio.sleep(0)          # as a call awaits its next event from Triton
                produced[i] += 1
                yield (i, k)
        finally:
            closed.append(i)

    async def main():
        merged = await stream([call(i) for i in range(3)])
        got = [await anext(merged) for _ in range(2)]
        await asyncio.sleep(0.1)            # the reader stalls
        held = sum(produced)
        await merged.aclose()
        await asyncio.sleep(0.01)
        return got, held

    got, held = asyncio.run(main())
    assert len(got) == 2 and held <= 12, f"{held} responses produced for 2 read"
    assert sorted(closed) == [0, 1, 2]


def test_a_body_over_64_mib_is_a_413_before_it_is_read(api):
    """Triton's frontend's cap: a body is parsed on the event loop, ~4 ms a MB every stream waits."""
    url = f"{api.base_url}/completions"
    huge = b'{"model": "x", "prompt": "' + b"a" * (64 * 2**20) + b'"}'
    for content in (huge, iter([huge[:2**20], huge[2**20:]])):          # with a Content-Length, and chunked
        reply = httpx.post(url, content=content, headers={"Content-Type": "application/json"}, timeout=60)
        assert reply.status_code == 413, reply.text
        assert reply.json()["error"]["message"] == "the request body is larger than 64 MiB"
    assert httpx.post(url, json={"model": MODEL, "prompt": "a" * 2**20, "max_tokens": 1}, timeout=60).status_code == 400


def test_a_lora_adapter_is_a_model_id_routed_to_lora_name(server, client):
    """model=<adapter> runs the base model with that adapter: the text `llm` gives for the same
    lora_name, not the base model's."""
    from inflight_client.streams import http_generate
    params = {"max_tokens": 16, "temperature": 0}
    adapted = client.completions.create(model=ADAPTER, prompt=PROMPTS[0], **params)
    assert adapted.model == ADAPTER
    llm = http_generate(server.http_url, "llm", {"text_input": PROMPTS[0], "exclude_input_in_output": True,
                                                 "sampling_parameters": json.dumps({**params, "lora_name": ADAPTER})})
    assert adapted.choices[0].text == llm["text_output"]
    base = client.completions.create(model=MODEL, prompt=PROMPTS[0], **params)
    assert base.choices[0].text != adapted.choices[0].text
    streamed = client.chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": PROMPTS[1]}],
                                              stream=True, **params)
    whole = client.chat.completions.create(model=ADAPTER, messages=[{"role": "user", "content": PROMPTS[1]}],
                                           **params)
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == whole.choices[0].message.content


def test_vllms_name_path_form_of_lora_modules_is_refused_with_the_reason(capsys):
    """vLLM's `--lora-modules name=path` would otherwise become a model id no request could match."""
    from inflight_client.openai_server.cli import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--model-dir", DEFAULT_MODEL, "--lora-modules", "sql-lora=/adapters/sql"])
    assert "'sql-lora=/adapters/sql' is vLLM's name=path form; give the names alone" in capsys.readouterr().err
    settings, _ = parse_args(["--model-dir", DEFAULT_MODEL, "--lora-modules", "sql-lora"])
    assert "sql-lora" in settings.lora_names


def test_a_tokenizer_directory_without_a_config_needs_the_context_length(tmp_path, capsys):
    """Without a context length nothing would bound a text prompt before it is tokenized, nor cut
    max_tokens to the room the prompt leaves: the server refuses to start rather than guess."""
    from inflight_client.openai_server.cli import parse_args
    for name in os.listdir(DEFAULT_MODEL):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(DEFAULT_MODEL, name), tmp_path)
    with pytest.raises(SystemExit):
        parse_args(["--tokenizer", str(tmp_path)])
    err = capsys.readouterr().err
    assert "the context length is unknown" in err and "give --max-model-len" in err
    settings, _ = parse_args(["--tokenizer", str(tmp_path), "--max-model-len", "512"])
    assert settings.max_model_len == 512


@pytest.mark.parametrize("flag", ["--default-max-tokens", "--max-triton-requests"])
def test_a_limit_below_one_is_refused(capsys, flag):
    from inflight_client.openai_server.cli import parse_args
    with pytest.raises(SystemExit):
        parse_args(["--model-dir", DEFAULT_MODEL, flag, "0"])
    assert f"{flag} must be at least 1, got 0" in capsys.readouterr().err

